"""Batched on-device sampling with no host sync.

The function computed for each row (`sample_reference` is its definition, in torch; on CUDA
the Triton kernels of `sampling_kernels.py` compute the same function without sorting):

    greedy rows (temperature 0): argmax of the (masked, penalized) logits
    other rows: z = logits / temperature
                kept = min_p, then top-k, then top-p (top-p's mass taken over what min_p and
                       top-k kept: vLLM's order; with min_p off this is HF's TopK -> TopP)
                token = argmax over kept of z + gumbel(seed, position, vocab index)

Gumbel-max over the kept set is an exact sample of softmax(z) renormalized to the kept set.
The noise is a counter-based 32-bit hash of (per-row key, vocab index), computed where it is
used, and the per-row key is a hash of (request seed, token position): a request's samples
depend only on its own seed and position, so they are reproducible whatever the batch and
identical between the synchronous and the asynchronous paths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

_MASK32 = 0xFFFFFFFF
# The uniform takes 23 hash bits: (m + 0.5) / 2**23 is exact in float32 (so torch and the
# Triton kernel agree bit for bit) and never 0 or 1.
_U_SHIFT = 9
_U_SCALE = 1.0 / (1 << 23)


@dataclass
class SamplingTensors:
    """Per-row sampling state for one step, gathered on the device from per-slot tables."""
    temperature: torch.Tensor   # [S] f32 (0 = greedy)
    top_k: torch.Tensor         # [S] int64 (<= 0: off)
    top_p: torch.Tensor         # [S] f32 (1: off)
    seed: torch.Tensor          # [S] int64
    position: torch.Tensor      # [S] int64: index the sampled token will take in its sequence
    banned_ids: torch.Tensor    # [S, K] int64, -1 padded (left-packed): never sampled
    min_stop_ids: torch.Tensor  # [S, K] int64, -1 padded (left-packed): masked while gen count < min_tokens
    min_tokens_left: torch.Tensor  # [S] int64: > 0 while the stop ids must stay masked
    min_p: Optional[torch.Tensor] = None  # [S] f32 (0: off)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 (Chris Wellons); int64 arithmetic masked to 32 bits.
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[S] int64 in [0, 2**32): the noise key of each row, a hash of (seed, position)."""
    return _hash32(_hash32(seed & _MASK32) ^ (seed >> 32) ^ _hash32(position + 0x9E3779B9))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] float32 Gumbel(0, 1) noise, a pure function of (row key, vocab index)."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = _hash32(keys.unsqueeze(1) * 0x01000193 + idx.unsqueeze(0))
    u = ((h >> _U_SHIFT).to(torch.float32) + 0.5) * _U_SCALE
    return -torch.log(-torch.log(u))


def mask_ids_(logits: torch.Tensor, ids: torch.Tensor, active: Optional[torch.Tensor] = None) -> torch.Tensor:
    """In place: logits[r, ids[r, j]] = -inf for the valid (>= 0) ids of active rows.
    Lists are left-packed, so padding is pointed at the row's first id: every write to one
    position then carries the same value (no scatter race, no copy of the logits)."""
    valid = ids >= 0
    if active is not None:
        valid = valid & active.unsqueeze(1)
    first = ids[:, :1].clamp(min=0)
    target = torch.where(ids >= 0, ids, first)
    current = logits.gather(1, target)
    first_valid = valid[:, :1]
    # A padding entry writes -inf only when its target (the first id) is itself masked.
    write_inf = valid | ((ids < 0) & first_valid)
    logits.scatter_(1, target, torch.where(write_inf, torch.full_like(current, float("-inf")), current))
    return logits


def kept_mask(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[S, V] bool: the tokens min_p, then top-k, then top-p keep (z = logits / temperature).
    The reference definition (sorts the vocabulary); HF's warpers keep the same sets."""
    vocab = z.shape[1]
    sorted_z, order = z.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=z.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_z, dtype=torch.bool)
    if min_p is not None:
        # HF MinPLogitsWarper / vLLM: keep probs >= min_p * max prob, i.e. z >= max z + log(min_p).
        thr = sorted_z[:, :1] + torch.log(min_p.clamp(min=1e-30)).unsqueeze(1)
        drop |= (sorted_z < thr) & (min_p > 0).unsqueeze(1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    drop |= rank >= k.unsqueeze(1)
    probs = sorted_z.masked_fill(drop, float("-inf")).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    # top_p == 1 keeps everything: the float32 cumsum reaches 1.0 before the tail does, which
    # would otherwise drop the least likely tokens.
    cum_before = probs.cumsum(-1) - probs
    drop |= (cum_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    return torch.empty_like(drop).scatter_(1, order, ~drop)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits with the tokens top-k / top-p drop set to -inf (the kept-set test's view)."""
    return logits.masked_fill(~kept_mask(logits, top_k, top_p), float("-inf"))


def apply_masks_(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Banned ids and (while min_tokens is not reached) the stop ids, in place."""
    mask_ids_(logits, st.banned_ids)
    mask_ids_(logits, st.min_stop_ids, st.min_tokens_left > 0)
    return logits


def sample_reference(logits: torch.Tensor, st: SamplingTensors, use_filters: bool = True) -> torch.Tensor:
    """The definition (torch, any device): masked logits [S, V] float32 -> token ids [S]."""
    greedy = logits.argmax(dim=-1)
    temp = st.temperature
    z = logits / torch.where(temp > 0, temp, 1.0).unsqueeze(1)
    score = z + gumbel_noise(row_keys(st.seed, st.position), logits.shape[1])
    if use_filters:
        score = score.masked_fill(~kept_mask(z, st.top_k, st.top_p, st.min_p), float("-inf"))
    return torch.where(temp > 0, score.argmax(dim=-1), greedy)


def _use_kernels(logits: torch.Tensor) -> bool:
    if logits.device.type != "cuda":
        return False
    from . import sampling_kernels
    return sampling_kernels.available()


def sample(logits: torch.Tensor, st: Optional[SamplingTensors], all_greedy: bool, use_masks: bool,
           clean_rows: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """logits [S, V] float32 (or the model's dtype, where native_logits_ok) -> token ids [S]
    int64. `all_greedy`/`use_masks` are host flags
    known at scheduling time; they pick a cheaper program, never change the result (`st`
    may be None when all_greedy and not use_masks: nothing reads it then).
    `use_masks` covers every per-row filter: banned ids, min_tokens, top-k, top-p and min_p.
    Modifies `logits` in place when `use_masks` (callers that still need the raw logits,
    for logprobs, pass a copy). clean_rows=(raw, written) (CUDA split kernels, not all
    greedy): `logits` holds only the rows `written` marks, the others are read from raw."""
    kernels = _use_kernels(logits)
    if use_masks:
        if kernels and logits.stride(1) == 1 and _split():
            from .sampling_split import apply_masks_kernel
            apply_masks_kernel(logits, st)   # one launch instead of a dozen small torch ops
        else:
            apply_masks_(logits, st)
    if all_greedy:
        assert clean_rows is None, "argmax reads one tensor"
        if kernels and _split() and _greedy_argmax_split():
            from . import greedy_argmax
            if greedy_argmax.pays(logits):
                return greedy_argmax.argmax_rows(logits)
        return logits.argmax(dim=-1)
    if kernels:
        from .sampling_kernels import sample_rows_kernel
        return sample_rows_kernel(logits, st, use_filters=use_masks, clean_rows=clean_rows)
    assert clean_rows is None, "the torch sampler reads one tensor"
    return sample_reference(logits, st, use_filters=use_masks)


def native_logits_ok(logits: torch.Tensor) -> bool:
    """The split kernels (sampling, masks, penalties, logprobs) read logits in the model's
    dtype and upcast in registers, which gives the values `.float()` gives: on CUDA with
    them, the sampler skips the float32 copy of [rows x vocab] (a full extra pass) unless a
    filter must write into the logits (penalties.upcast_apply makes that copy then)."""
    return _use_kernels(logits) and _split()


def _greedy_argmax_split() -> bool:
    from .. import envs
    return envs.greedy_argmax() == "on"


def _split() -> bool:
    from . import sampling_kernels
    return sampling_kernels.IMPL == "split"


def log_min_p(min_p: float) -> float:
    """log(min_p), the min_p threshold's offset from the row's max scaled logit."""
    return math.log(min_p) if min_p > 0 else float("-inf")
