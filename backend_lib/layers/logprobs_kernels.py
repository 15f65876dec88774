"""logprobs.pack_tokens_and_logprobs as four Triton kernels, each row split across programs.

stats (grid blocks x rows): per block of the raw logits its max and its softmax sum relative
    to that max.
threshold (per row): logsumexp; the floor = the K-th largest block max (the top K are >= it).
candidates (grid blocks x rows): blocks whose max reaches the floor give their top entries
    >= the floor (usually one or two rounds, at most K), as int64 keys that order by value,
    then by the lower index (float bits made monotonic in the high half, V-1-index in the low
    half): the max key is torch's argmax, and rounds of "take the max key" are an exact top-K.
merge (per row): the top K of the candidates, the sampled token's logprob, written as the
    packed row logprobs.py describes.
"""
from __future__ import annotations

import torch

from .logprobs import MAX_LOGPROBS, packed_width
from .triton_support import tl, triton

if triton is not None:
    INT64_MIN = tl.constexpr(-(1 << 63))

    @triton.jit
    def _keys(x, idx, V):
        b = x.to(tl.int32, bitcast=True)
        ordered = b ^ ((b >> 31) & 0x7FFFFFFF)   # negative floats: flip the magnitude bits
        return (ordered.to(tl.int64) << 32) | (V - 1 - idx).to(tl.int64)

    @triton.jit
    def _lp_stats(logits_ptr, stride, V, part_m, part_s, NB, BLOCK: tl.constexpr):
        """Per block: max and softmax sum relative to it."""
        b = tl.program_id(0)
        row = tl.program_id(1)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        m_safe = tl.where(m > float("-inf"), m, 0.0)
        tl.store(part_m + row * NB + b, m)
        tl.store(part_s + row * NB + b, tl.sum(tl.where(x > float("-inf"), tl.exp(x - m_safe), 0.0), axis=0))

    @triton.jit
    def _lp_threshold(part_m, part_s, NB, row_lse, row_floor, K: tl.constexpr, NBMAX: tl.constexpr):
        """Per row: logsumexp, and the K-th largest block max: the top K are all >= it (K
        distinct entries, the blocks' maxima, are), so most blocks hold no candidate."""
        row = tl.program_id(0)
        o = tl.arange(0, NBMAX)
        pm = tl.load(part_m + row * NB + o, mask=o < NB, other=float("-inf"))
        ps = tl.load(part_s + row * NB + o, mask=o < NB, other=0.0)
        M = tl.max(pm, axis=0)
        tl.store(row_lse + row, M + tl.log(tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - M), 0.0), axis=0)))
        v = tl.where(o < NB, pm, float("nan"))  # nan: not a block (never the max, never removed)
        floor = tl.full((), float("-inf"), tl.float32)
        if NB >= K:
            for r in tl.static_range(K):
                top = tl.max(tl.where(v == v, v, float("-inf")), axis=0)
                first = tl.min(tl.where(v == top, o, NBMAX), axis=0)
                v = tl.where(o == first, float("nan"), v)
                floor = top
        tl.store(row_floor + row, floor)

    @triton.jit
    def _lp_candidates(logits_ptr, stride, V, part_m, row_floor, part_k, NB,
                       K: tl.constexpr, BLOCK: tl.constexpr):
        """Per block: its top entries among those >= the row's floor (at most K), as keys;
        the other slots get INT64_MIN."""
        b = tl.program_id(0)
        row = tl.program_id(1)
        at = (row * NB + b) * K
        floor = tl.load(row_floor + row)
        n = tl.zeros((), dtype=tl.int32)
        if tl.load(part_m + row * NB + b) >= floor:
            offs = b * BLOCK + tl.arange(0, BLOCK)
            inb = offs < V
            x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=inb, other=float("-inf")).to(tl.float32)
            cand = inb & (x >= floor)
            n = tl.minimum(tl.sum(cand.to(tl.int32), axis=0), K)
            keys = tl.where(cand, _keys(x, offs, V), INT64_MIN)
            for r in range(0, n):
                top = tl.max(keys, axis=0)
                tl.store(part_k + at + r, top)
                keys = tl.where(keys == top, INT64_MIN, keys)
        for r in range(n, K):
            tl.store(part_k + at + r, INT64_MIN)

    @triton.jit
    def _lp_merge(logits_ptr, stride, V, tokens_ptr, row_lse, part_k, NB, out_ptr,
                  K: tl.constexpr, NCAND: tl.constexpr):
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        lse = tl.load(row_lse + row)
        out = out_ptr + row.to(tl.int64) * (2 + 2 * K)
        tok = tl.load(tokens_ptr + row)
        tl.store(out, tok)
        lp = tl.load(row_ptr + tok).to(tl.float32) - lse
        tl.store(out + 1 + K, lp.to(tl.float64).to(tl.int64, bitcast=True))
        c = tl.arange(0, NCAND)
        keys = tl.load(part_k + row * NB * K + c, mask=c < NB * K, other=INT64_MIN)
        for r in tl.static_range(K):
            top = tl.max(keys, axis=0)
            keys = tl.where(keys == top, INT64_MIN, keys)
            idx = (V - 1 - (top & 0x7FFFFFFF)).to(tl.int32)   # the low half is < 2**31
            tl.store(out + 1 + r, idx.to(tl.int64))
            v = tl.load(row_ptr + idx).to(tl.float32) - lse
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
    row_lse = torch.empty(s, dtype=torch.float32, device=dev)
    row_floor = torch.empty(s, dtype=torch.float32, device=dev)
    part_k = torch.empty(s * nb * k, dtype=torch.int64, device=dev)
    out = torch.empty(s, packed_width(k), dtype=torch.int64, device=dev)
    stride = raw_logits.stride(0)
    _lp_stats[(nb, s)](raw_logits, stride, v, part_m, part_s, nb, BLOCK=block, num_warps=4)
    _lp_threshold[(s,)](part_m, part_s, nb, row_lse, row_floor, K=k, NBMAX=_pow2(nb), num_warps=4)
    _lp_candidates[(nb, s)](raw_logits, stride, v, part_m, row_floor, part_k, nb, K=k, BLOCK=block, num_warps=4)
    _lp_merge[(s,)](raw_logits, stride, v, tokens.contiguous(), row_lse, part_k, nb, out,
                    K=k, NCAND=_pow2(nb * k), num_warps=8)
    return out
