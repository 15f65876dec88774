"""Batched on-device sampling with no host sync.

Randomness is a counter-based hash of (request seed, token position, vocab index), so a
request's samples depend only on its own seed and position: reproducible whatever the batch
composition, and identical between the synchronous and the asynchronous paths. Sampling is
an exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    """Per-row sampling state for one step, gathered on the device from per-slot tables."""
    temperature: torch.Tensor   # [S] f32 (0 = greedy)
    top_k: torch.Tensor         # [S] int64 (<= 0: off)
    top_p: torch.Tensor         # [S] f32
    seed: torch.Tensor          # [S] int64
    position: torch.Tensor      # [S] int64: index the sampled token will take in its sequence
    banned_ids: torch.Tensor    # [S, K] int64, -1 padded: never sampled
    min_stop_ids: torch.Tensor  # [S, K] int64, -1 padded: masked while gen count < min_tokens
    min_tokens_left: torch.Tensor  # [S] int64: > 0 while the stop ids must stay masked


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 (Chris Wellons); int64 arithmetic masked to 32 bits.
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] uniforms in (0, 1], a pure function of (seed, position, vocab index)."""
    s = _hash32(_hash32(seed & _MASK32) ^ (seed >> 32) ^ _hash32(position + 0x9E3779B9))
    idx = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    h = _hash32(s.unsqueeze(1) * 0x01000193 + idx.unsqueeze(0))
    return (h.float() + 1.0) / 4294967296.0


def _mask_ids(logits: torch.Tensor, ids: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    vocab = logits.shape[1]
    valid = ids >= 0
    if active is not None:
        valid = valid & active.unsqueeze(1)
    # Route padding (-1) to an extra column so scatter never writes a real id twice.
    ext = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)
    ext.scatter_(1, torch.where(valid, ids, vocab), float("-inf"))
    return ext[:, :vocab]


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = rank >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    # top_p == 1 keeps everything: the float32 cumsum reaches 1.0 before the tail does, which
    # would otherwise drop the least likely tokens.
    cum_before = probs.cumsum(-1) - probs
    drop = drop | ((cum_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, st: SamplingTensors, all_greedy: bool, use_masks: bool) -> torch.Tensor:
    """logits [S, V] float32 -> token ids [S] int64. `all_greedy`/`use_masks` are host flags
    known at scheduling time; they pick a cheaper program, never change the result.
    `use_masks` covers every per-row filter: banned ids, min_tokens, top-k and top-p (the
    vocabulary sort is skipped when no row of the step needs it)."""
    if use_masks:
        logits = _mask_ids(logits, st.banned_ids)
        logits = _mask_ids(logits, st.min_stop_ids, st.min_tokens_left > 0)
    greedy = logits.argmax(dim=-1)
    if all_greedy:
        return greedy
    temp = st.temperature.clamp(min=1e-5).unsqueeze(1)
    scaled = logits / temp
    if use_masks:
        scaled = _top_k_top_p(scaled, st.top_k, st.top_p)
    probs = scaled.softmax(-1)
    noise = (-torch.log(uniform_noise(st.seed, st.position, logits.shape[1]))).clamp(min=1e-12)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(st.temperature > 0, sampled, greedy)
