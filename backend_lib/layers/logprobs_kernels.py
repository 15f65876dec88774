"""logprobs.pack_tokens_and_logprobs as two Triton kernels, each row split across programs.

pass (grid blocks x rows): per block of the raw logits its max, its softmax sum relative to
    that max and its top-K entries, as int64 keys that order by value, then by the lower index
    (float bits made monotonic in the high half, V-1-index in the low half): the max key is
    torch's argmax, and K rounds of "take the max key" are an exact top-K.
merge (one program per row): logsumexp from the blocks' (max, sum), the top-K of the blocks'
    candidates, the sampled token's logprob, written as the packed row logprobs.py describes.
"""
from __future__ import annotations

import torch

from .logprobs import MAX_LOGPROBS, packed_width
from .sampling_kernels import triton

INT64_MIN = -(1 << 63)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _keys(x, idx, V):
        b = x.to(tl.int32, bitcast=True)
        ordered = b ^ ((b >> 31) & 0x7FFFFFFF)   # negative floats: flip the magnitude bits
        return (ordered.to(tl.int64) << 32) | (V - 1 - idx).to(tl.int64)

    @triton.jit
    def _lp_pass(logits_ptr, stride, V, part_m, part_s, part_k, NB,
                 K: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        row = tl.program_id(1)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        inb = offs < V
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=inb, other=float("-inf"))
        m = tl.max(x, axis=0)
        m_safe = tl.where(m > float("-inf"), m, 0.0)
        s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m_safe), 0.0), axis=0)
        at = row * NB + b
        tl.store(part_m + at, m)
        tl.store(part_s + at, s)
        keys = tl.where(inb, _keys(x, offs, V), INT64_MIN)
        for r in tl.static_range(K):
            top = tl.max(keys, axis=0)
            tl.store(part_k + at * K + r, top)
            keys = tl.where(keys == top, INT64_MIN, keys)

    @triton.jit
    def _lp_merge(logits_ptr, stride, V, tokens_ptr, part_m, part_s, part_k, NB, out_ptr,
                  K: tl.constexpr, NBMAX: tl.constexpr, NCAND: tl.constexpr):
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        o = tl.arange(0, NBMAX)
        pm = tl.load(part_m + row * NB + o, mask=o < NB, other=float("-inf"))
        ps = tl.load(part_s + row * NB + o, mask=o < NB, other=0.0)
        M = tl.max(pm, axis=0)
        lse = M + tl.log(tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - M), 0.0), axis=0))
        out = out_ptr + row.to(tl.int64) * (2 + 2 * K)
        tok = tl.load(tokens_ptr + row)
        tl.store(out, tok)
        lp = tl.load(row_ptr + tok) - lse
        tl.store(out + 1 + K, lp.to(tl.float64).to(tl.int64, bitcast=True))
        c = tl.arange(0, NCAND)
        keys = tl.load(part_k + row * NB * K + c, mask=c < NB * K, other=INT64_MIN)
        for r in tl.static_range(K):
            top = tl.max(keys, axis=0)
            keys = tl.where(keys == top, INT64_MIN, keys)
            idx = (V - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
            tl.store(out + 1 + r, idx.to(tl.int64))
            v = tl.load(row_ptr + idx) - lse
            tl.store(out + 2 + K + r, v.to(tl.float64).to(tl.int64, bitcast=True))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pack_tokens_and_logprobs_kernel(raw_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logprobs.pack_tokens_and_logprobs(raw_logits, tokens, MAX_LOGPROBS) for vocab >= MAX_LOGPROBS."""
    s, v = raw_logits.shape
    k = MAX_LOGPROBS
    assert v >= k, v
    raw_logits = raw_logits.contiguous()
    block = 1024 if s <= 8 else 2048   # batch 1: more, smaller programs
    nb = -(-v // block)
    dev = raw_logits.device
    part_m = torch.empty(s * nb, dtype=torch.float32, device=dev)
    part_s = torch.empty(s * nb, dtype=torch.float32, device=dev)
    part_k = torch.empty(s * nb * k, dtype=torch.int64, device=dev)
    out = torch.empty(s, packed_width(k), dtype=torch.int64, device=dev)
    _lp_pass[(nb, s)](raw_logits, raw_logits.stride(0), v, part_m, part_s, part_k, nb,
                      K=k, BLOCK=block, num_warps=4)
    _lp_merge[(s,)](raw_logits, raw_logits.stride(0), v, tokens.contiguous(), part_m, part_s, part_k, nb, out,
                    K=k, NBMAX=_pow2(nb), NCAND=_pow2(nb * k), num_warps=8)
    return out
