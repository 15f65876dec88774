"""Logprobs of the generated tokens, computed in the step and packed with the token ids.

vLLM V1's default (`logprobs_mode="raw_logprobs"`): log_softmax of the model's raw logits,
before penalties, bans, temperature and the top-k/top-p/min-p filters. Every row gets the
engine-wide top MAX_LOGPROBS; the host keeps each request's own top-N (N <= MAX_LOGPROBS).

Packed row layout ([S, packed_width()] int64, one D2H copy with the ids):
    [0]               sampled token id
    [1 : 1+K]         top-K token ids
    [1+K]             sampled token's logprob   (float64 bits)
    [2+K : 2+2K]      top-K logprobs            (float64 bits)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import MAX_LOGPROBS


def packed_width(k: int = MAX_LOGPROBS) -> int:
    return 2 + 2 * k


def pack_tokens_and_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, k: int = MAX_LOGPROBS) -> torch.Tensor:
    if raw_logits.device.type == "cuda" and k == MAX_LOGPROBS <= raw_logits.shape[1]:
        from . import sampling_kernels
        if sampling_kernels.available() and sampling_kernels.IMPL == "split":
            from .logprobs_kernels import pack_tokens_and_logprobs_kernel
            return pack_tokens_and_logprobs_kernel(raw_logits, tokens)
    k = min(k, raw_logits.shape[1])
    lse = torch.logsumexp(raw_logits, dim=-1, keepdim=True)
    top_v, top_i = raw_logits.topk(k, dim=-1)
    sampled = raw_logits.gather(1, tokens.unsqueeze(1))
    values = (torch.cat([sampled, top_v], dim=1) - lse).double().view(torch.int64)
    out = torch.cat([tokens.unsqueeze(1), top_i, values], dim=1)
    if k < MAX_LOGPROBS:  # a vocabulary smaller than MAX_LOGPROBS: pad to the fixed width
        pad = torch.zeros(out.shape[0], packed_width() - out.shape[1], dtype=out.dtype, device=out.device)
        out = torch.cat([out[:, :1 + k], pad[:, :MAX_LOGPROBS - k], out[:, 1 + k:], pad[:, MAX_LOGPROBS - k:]], 1)
    return out


@dataclass
class TokenLogprobs:
    """One generated token's logprobs as the host reads them."""
    logprob: float            # of the sampled token
    top_ids: list[int]        # the engine-wide top MAX_LOGPROBS, best first
    top_logprobs: list[float]

    def as_dict(self, token: int, n: int) -> dict[int, float]:
        """vLLM's shape: the sampled token plus the top-n (n + 1 entries, or n when the sampled
        token is among the top-n)."""
        out = {token: self.logprob}
        for tid, lp in zip(self.top_ids[:n], self.top_logprobs[:n]):
            out.setdefault(tid, lp)
        return out


def unpack_logprobs(host: torch.Tensor, vocab: int) -> list[TokenLogprobs]:
    """host [n, packed_width()] int64 (CPU) -> one TokenLogprobs per row."""
    k = MAX_LOGPROBS
    n_top = min(k, vocab)
    ids = host[:, 1:1 + n_top].tolist()
    vals = host[:, 1 + k:].contiguous().view(torch.float64).tolist()
    return [TokenLogprobs(v[0], i, v[1:1 + n_top]) for i, v in zip(ids, vals)]
