"""Paged attention kernels in Triton (CUDA).

KV cache layout (per layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (contiguous)

The KV of the current step's tokens is already in the cache when attention runs, so
both kernels read K/V from the cache only.

Public API
----------
``paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None)``
    One query token per sequence (q: [B, Hq, D]).  Flash-decoding: the KV tiles of a
    sequence are dealt round-robin to ``num_splits`` programs per (sequence, kv head); a
    small second kernel merges their partial softmax states.  All q heads of a GQA group
    are processed by one program, so each KV tile is read once per kv head.  The split
    count depends only on shapes (B, Hkv, max_blocks), never on ``seq_lens`` values, so
    the call is CUDA-graph capturable.  Rows with ``seq_len == 0`` produce zeros.

``paged_decode_partials(q, k_cache, v_cache, block_tables, seq_lens, scale)``
    The same for one sequence, without the merge: its splits' partial softmax states
    (``DecodePartials``), merged by the kernel that consumes the output (the o_proj gemv's
    prologue, layers/decode_gemv.py) or by ``merge_decode_partials``.

``paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
scale, max_q_len, out=None)``
    Varlen mixed batch (chunked prefill and decode rows together), causal.  The new
    tokens of sequence ``s`` sit at absolute positions
    ``seq_lens[s] - q_len_s .. seq_lens[s] - 1``.  Rows of a tile are (token, q head of
    the group) pairs, so decode rows (q_len 1) also read each KV tile once per kv head.

``reference_paged_attention(...)``
    Slow float32 torch reference (loops) for tests.

All kernels accumulate in float32.  ``q``/``out`` may be strided views (last dim must be
contiguous).  Triton is imported lazily-safe: the module imports without Triton (the
reference still works), the kernels then raise at call time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import envs
from .triton_support import num_sms, pdl_launch, pdl_release_dependents  # noqa: F401

try:  # Triton is optional at import time (CPU-only CI machines).
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "DecodePartials",
    "merge_decode_partials",
    "paged_decode_attention",
    "paged_decode_partials",
    "paged_prefill_attention",
    "reference_paged_attention",
    "HAS_TRITON",
]

_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _kv_tile(bt_row, k_base, v_base, tok, mask, stride_kb, stride_kt, stride_vb, stride_vt, offs_d, d_mask,
                 PAGE: tl.constexpr):
        """K and V of tokens `tok` (one KV tile) of one kv head, through the block table."""
        page = tl.load(bt_row + tok // PAGE, mask=mask, other=0).to(tl.int64)
        slot = (tok % PAGE).to(tl.int64)
        kv_mask = mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + page[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_base + page[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        return k, v

    @triton.jit
    def _with_newest(k, v, tok, newest, k_new, v_new):
        """A KV tile whose token `newest` (if it holds it) is replaced by k_new / v_new."""
        is_new = (tok == newest)[:, None]
        return tl.where(is_new, k_new[None, :], k), tl.where(is_new, v_new[None, :], v)

    @triton.jit
    def _attend_tile(q, k, v, tok, seq_len, m_i, l_i, acc, scale_log2e, DOT_PREC: tl.constexpr):
        """One KV tile folded into the online softmax state (m_i, l_i, acc) of a GQA group."""
        n_mask = tok < seq_len
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2e
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    @triton.jit
    def _paged_decode_kernel(
        Q, K, V, BT, SL, O, PART_ACC, PART_M, PART_L, COUNTERS, KN, VN,
        scale_log2e,
        stride_qb, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_btb,
        stride_ob, stride_oh,
        stride_knb, stride_knh, stride_vnb, stride_vnh,
        num_splits,                 # runtime: programs per (seq, kv head) on axis 2
        G: tl.constexpr,            # q heads per kv head
        GP: tl.constexpr,           # G padded (power of 2, >= 16 for tl.dot)
        D: tl.constexpr,
        DP: tl.constexpr,           # D padded to power of 2
        PAGE: tl.constexpr,         # cache block size (tokens)
        BLOCK_N: tl.constexpr,      # tokens per KV tile
        SPLIT: tl.constexpr,        # write partials (merged by the reduce kernel or the consumer)
        DOT_PREC: tl.constexpr,
        USE_PDL: tl.constexpr = False,  # launched with PDL: release the next kernel, then wait
        FUSED_REDUCE: tl.constexpr = False,  # SPLIT: the last split of a (seq, kv head) merges them here
        SP: tl.constexpr = 2,       # FUSED_REDUCE: num_splits padded to a power of 2
        GM: tl.constexpr = 1,       # FUSED_REDUCE: G padded to a power of 2 (the merge's head rows)
        MERGE_CHUNK: tl.constexpr = 8,  # FUSED_REDUCE: splits' partial outputs loaded at once
        NEWEST_KV: tl.constexpr = False,  # each row's newest K/V come from KN/VN, not the cache
        PREFETCH_KV: tl.constexpr = True,  # NEWEST_KV: the first tile loads before the PDL wait
        EARLY_EXIT: tl.constexpr = False,  # SPLIT + USE_PDL: splits without a tile exit before the wait
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        if USE_PDL:
            pdl_release_dependents()

        # seq_lens and block tables are written before the forward's first PDL kernel
        # (layers/decode_gemv.py, the chain): read while the previous kernel still runs.
        seq_len = tl.load(SL + b)
        n_tiles = tl.cdiv(seq_len, BLOCK_N)
        if SPLIT and USE_PDL and EARLY_EXIT:
            # A split without a tile reads and writes nothing: it leaves now instead of holding
            # its registers through the wait, where they would keep the running projection's
            # programs off the SM (the grid is sized for the longest sequence, so at batch 1
            # most splits have no tile). Split 0 always waits: the kernel completes only after
            # the one before it, which the chain's later kernels rely on (decode_gemv).
            if (sp > 0) & (sp >= n_tiles):
                return

        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < G
        d_mask = offs_d < D
        heads = kvh * G + offs_g

        bt_row = BT + b.to(tl.int64) * stride_btb
        k_base = K + kvh.to(tl.int64) * stride_kh
        v_base = V + kvh.to(tl.int64) * stride_vh
        newest = seq_len - 1
        # NEWEST_KV: the cache is read up to the newest token, which comes from KN/VN.
        cached_end = newest if NEWEST_KV else seq_len
        first_tok = sp * BLOCK_N + offs_n
        if NEWEST_KV and PREFETCH_KV:
            # Every cached token but the newest was written by earlier steps: this split's
            # first tile is in flight before the wait.
            k_first, v_first = _kv_tile(bt_row, k_base, v_base, first_tok, first_tok < cached_end, stride_kb,
                                        stride_kt, stride_vb, stride_vt, offs_d, d_mask, PAGE)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        if NEWEST_KV and not PREFETCH_KV:
            k_first, v_first = _kv_tile(bt_row, k_base, v_base, first_tok, first_tok < cached_end, stride_kb,
                                        stride_kt, stride_vb, stride_vt, offs_d, d_mask, PAGE)

        if SPLIT:
            if sp >= n_tiles:
                # No tile for this split: the reduce kernel ignores it (never reads it).
                if FUSED_REDUCE:
                    if sp == 0:  # a padding row (seq_len 0): no split runs, its output is zeros
                        tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                                 tl.zeros([GP, DP], O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
                return

        q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        q = q.to(K.dtype.element_ty)

        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)

        # Tiles sp, sp + num_splits, ... (round-robin: balanced for any seq_len).
        next_tile = sp
        if NEWEST_KV:
            k_new = tl.load(KN + b.to(tl.int64) * stride_knb + kvh * stride_knh + offs_d, mask=d_mask,
                            other=0.0).to(K.dtype.element_ty)
            v_new = tl.load(VN + b.to(tl.int64) * stride_vnb + kvh * stride_vnh + offs_d, mask=d_mask,
                            other=0.0).to(V.dtype.element_ty)
            if sp < n_tiles:
                k, v = _with_newest(k_first, v_first, first_tok, newest, k_new, v_new)
                m_i, l_i, acc = _attend_tile(q, k, v, first_tok, seq_len, m_i, l_i, acc, scale_log2e, DOT_PREC)
            next_tile = sp + num_splits
        for tile in range(next_tile, n_tiles, num_splits):
            tok = tile * BLOCK_N + offs_n
            k, v = _kv_tile(bt_row, k_base, v_base, tok, tok < cached_end, stride_kb, stride_kt, stride_vb,
                            stride_vt, offs_d, d_mask, PAGE)
            if NEWEST_KV:
                k, v = _with_newest(k, v, tok, newest, k_new, v_new)
            m_i, l_i, acc = _attend_tile(q, k, v, tok, seq_len, m_i, l_i, acc, scale_log2e, DOT_PREC)

        out_mask = g_mask[:, None] & d_mask[None, :]
        if not SPLIT:
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            o = acc / l_safe[:, None]
            o_ptrs = O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=out_mask)
        else:
            # partials: [B, Hq, num_splits, DP] and [B, Hq, num_splits]
            row = (b.to(tl.int64) * (tl.num_programs(1) * G) + heads) * num_splits + sp
            tl.store(PART_ACC + row[:, None] * DP + offs_d[None, :], acc, mask=out_mask)
            tl.store(PART_M + row, m_i, mask=g_mask)
            tl.store(PART_L + row, l_i, mask=g_mask)
            if FUSED_REDUCE:
                # Every split that ran counts itself in once its partials are stored (the
                # barrier: all of this program's stores, the atomic's release: visible GPU-wide);
                # the last one to count merges them, as the reduce kernel would, and leaves
                # the counter at 0 for the next launch (CUDA graph replays included).
                tl.debug_barrier()
                counter = COUNTERS + b * tl.num_programs(1) + kvh
                ran = tl.minimum(num_splits, n_tiles)
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == ran - 1:
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                    _merge_group(PART_ACC, PART_M, PART_L, O, b, kvh, tl.num_programs(1) * G, num_splits, ran,
                                 stride_ob, stride_oh, G, GM, D, DP, SP, MERGE_CHUNK)

    @triton.jit
    def _paged_decode_reduce_kernel(
        PART_ACC, PART_M, PART_L, SL, O,
        stride_ob, stride_oh,
        HQ,
        num_splits,
        D: tl.constexpr,
        DP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SP: tl.constexpr,           # num_splits padded to power of 2
        USE_PDL: tl.constexpr = False,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        if USE_PDL:
            pdl_release_dependents()
        # seq_lens: written before the forward's first PDL kernel, read before the wait
        ran = tl.minimum(num_splits, tl.cdiv(tl.load(SL + b), BLOCK_N))   # only splits that ran
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        _merge_splits(PART_ACC, PART_M, PART_L, O, b, h, HQ, num_splits, ran, stride_ob, stride_oh,
                      D, DP, SP, "")

    @triton.jit
    def _merge_splits(PART_ACC, PART_M, PART_L, O, b, h, HQ, num_splits, ran, stride_ob, stride_oh,
                      D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr, CACHE: tl.constexpr):
        """Head h of row b: the `ran` splits' partial softmax states merged into O.
        CACHE ".cg": read them from L2 (other programs of the same kernel wrote them)."""
        offs_s = tl.arange(0, SP)
        offs_d = tl.arange(0, DP)
        s_mask = offs_s < ran
        d_mask = offs_d < D
        row = (b.to(tl.int64) * HQ + h) * num_splits + offs_s

        m = tl.load(PART_M + row, mask=s_mask, other=float("-inf"), cache_modifier=CACHE)
        l = tl.load(PART_L + row, mask=s_mask, other=0.0, cache_modifier=CACHE)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.where(s_mask, tl.exp2(m - m_max), 0.0)
        l_tot = tl.sum(l * w, 0)
        acc = tl.load(PART_ACC + row[:, None] * DP + offs_d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=CACHE)
        o = tl.sum(acc * w[:, None], 0)
        l_safe = tl.where(l_tot > 0.0, l_tot, 1.0)
        o = o / l_safe
        o_ptrs = O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=d_mask)

    @triton.jit
    def _merge_group(PART_ACC, PART_M, PART_L, O, b, kvh, HQ, num_splits, ran, stride_ob, stride_oh,
                     G: tl.constexpr, GM: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr,
                     CHUNK: tl.constexpr):
        """The fused reduce's merge: the G heads of kv head kvh of row b, all at once (one program
        does it, after the last split finished: merging head after head, as _merge_splits does
        for one, would chain ~3 L2 round trips per head on the step's critical path). Partials
        are read with .cg: other programs of this kernel wrote them."""
        offs_g = tl.arange(0, GM)
        offs_s = tl.arange(0, SP)
        offs_c = tl.arange(0, CHUNK)
        offs_d = tl.arange(0, DP)
        g_mask = offs_g < G
        d_mask = offs_d < D
        rows = (b.to(tl.int64) * HQ + kvh * G + offs_g) * num_splits      # [GM]: each head's split 0
        gs_mask = g_mask[:, None] & (offs_s < ran)[None, :]
        m = tl.load(PART_M + rows[:, None] + offs_s[None, :], mask=gs_mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(PART_L + rows[:, None] + offs_s[None, :], mask=gs_mask, other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 1)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        l_tot = tl.sum(l * tl.where(gs_mask, tl.exp2(m - m_max[:, None]), 0.0), 1)
        acc = tl.zeros([GM, DP], tl.float32)
        for c in range(0, ran, CHUNK):
            split = c + offs_c
            gc_mask = g_mask[:, None] & (split < ran)[None, :]
            mc = tl.load(PART_M + rows[:, None] + split[None, :], mask=gc_mask, other=float("-inf"),
                         cache_modifier=".cg")
            w = tl.where(gc_mask, tl.exp2(mc - m_max[:, None]), 0.0)                     # [GM, CHUNK]
            part = tl.load(PART_ACC + ((rows[:, None] + split[None, :]) * DP)[:, :, None] + offs_d[None, None, :],
                           mask=gc_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
            acc += tl.sum(part * w[:, :, None], 1)
        o = acc / tl.where(l_tot > 0.0, l_tot, 1.0)[:, None]
        heads = kvh * G + offs_g
        tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])

    @triton.jit
    def _find_seq(CU, pid, num_seqs, BLOCK_Q: tl.constexpr):
        """The last sequence s with cu[s] // BLOCK_Q + s <= pid (binary search)."""
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(CU + mid) // BLOCK_Q + mid
            if start <= pid:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _prefill_tile(
        q, q_pos, m_i, l_i, acc,
        bt_row, k_base, v_base,
        n0, kv_end, scale_log2e,
        stride_kb, stride_kt, stride_vb, stride_vt,
        offs_n, offs_d, d_mask,
        PAGE: tl.constexpr,
        MASKED: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        kpos = n0 + offs_n
        if MASKED:
            n_mask = kpos < kv_end
            page = tl.load(bt_row + kpos // PAGE, mask=n_mask, other=0).to(tl.int64)
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            page = tl.load(bt_row + kpos // PAGE).to(tl.int64)
            kv_mask = d_mask[None, :]
        slot = (kpos % PAGE).to(tl.int64)
        k = tl.load(k_base + page[:, None] * stride_kb + slot[:, None] * stride_kt
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2e
        if MASKED:
            vis = (kpos[None, :] <= q_pos[:, None]) & n_mask[None, :]
            qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + page[:, None] * stride_vb + slot[:, None] * stride_vt
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    @triton.jit
    def _paged_prefill_kernel(
        Q, K, V, O, CU, SL, BT,
        scale_log2e,
        stride_qt, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_bts,
        stride_ot, stride_oh,
        num_seqs,                   # FLAT: sequences in CU (padding ones have q_len 0)
        G: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,      # rows = (token, head-in-group) pairs
        BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr,
        FLAT: tl.constexpr,         # grid (T // BLOCK_Q + num_seqs, hkv): shapes only
        BLOCK_Q: tl.constexpr,      # FLAT: tokens per tile (BLOCK_Q * G <= BLOCK_M)
    ):
        if FLAT:
            # Sequence s owns programs cu[s] // BLOCK_Q + s ..: an upper bound on the tiles
            # of the sequences before it, so every tile has a program and the grid depends
            # only on (T, num_seqs), never on the q_lens (CUDA-graph capturable).
            pid = tl.program_id(0)
            kvh = tl.program_id(1)
            s = _find_seq(CU, pid, num_seqs, BLOCK_Q)
            q_start = tl.load(CU + s)
            q_len = tl.load(CU + s + 1) - q_start
            row0 = (pid - (q_start // BLOCK_Q + s)) * (BLOCK_Q * G)
            tile_rows = BLOCK_Q * G
        else:
            mt = tl.program_id(0)
            s = tl.program_id(1)
            kvh = tl.program_id(2)
            q_start = tl.load(CU + s)
            q_len = tl.load(CU + s + 1) - q_start
            row0 = mt * BLOCK_M
            tile_rows = BLOCK_M
        rows_total = q_len * G
        if row0 >= rows_total:
            return
        seq_len = tl.load(SL + s)
        ctx = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, DP)
        d_mask = offs_d < D

        rows = row0 + offs_m
        r_mask = (rows < rows_total) & (offs_m < tile_rows)
        tok = rows // G
        heads = kvh * G + rows % G
        q_pos = ctx + tok       # padding rows: q_pos >= seq_len (harmless, not stored)

        q_ptrs = (Q + (q_start + tok).to(tl.int64)[:, None] * stride_qt
                  + heads[:, None] * stride_qh + offs_d[None, :])
        q = tl.load(q_ptrs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        q = q.to(K.dtype.element_ty)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)

        bt_row = BT + s.to(tl.int64) * stride_bts
        k_base = K + kvh.to(tl.int64) * stride_kh
        v_base = V + kvh.to(tl.int64) * stride_vh

        first_tok = row0 // G
        last_tok = tl.minimum((row0 + tile_rows - 1) // G, q_len - 1)
        kv_end = ctx + last_tok + 1                 # exclusive, <= seq_len
        full_end = ((ctx + first_tok + 1) // BLOCK_N) * BLOCK_N   # visible to all rows

        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, q_pos, m_i, l_i, acc, bt_row, k_base, v_base, n0, kv_end, scale_log2e,
                stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, d_mask,
                PAGE, False, DOT_PREC)
        for n0 in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, q_pos, m_i, l_i, acc, bt_row, k_base, v_base, n0, kv_end, scale_log2e,
                stride_kb, stride_kt, stride_vb, stride_vt, offs_n, offs_d, d_mask,
                PAGE, True, DOT_PREC)

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = (O + (q_start + tok).to(tl.int64)[:, None] * stride_ot
                  + heads[:, None] * stride_oh + offs_d[None, :])
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


# ----------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------
def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _check_common(q, k_cache, v_cache):
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; paged attention kernels unavailable")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("last dim of q / caches must be contiguous")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same dtype")
    _, page, hkv, d = k_cache.shape
    hq = q.shape[-2]
    if q.shape[-1] != d:
        raise ValueError(f"head_dim mismatch: q {q.shape[-1]} vs cache {d}")
    if hq % hkv != 0:
        raise ValueError(f"num_q_heads {hq} not a multiple of num_kv_heads {hkv}")
    if page & (page - 1) != 0:
        raise ValueError(f"block_size {page} must be a power of 2")
    return page, hkv, d, hq, hq // hkv


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# k_cache.data_ptr() -> int32 counters, all 0 between launches: one set per layer's cache, so
# that no two kernels that may run at once (two engines' streams) share a counter.
_COUNTERS: dict[int, torch.Tensor] = {}


def _split_counters(k_cache: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """The fused reduce's counters for `n` (sequence, kv head) pairs; None (use the reduce
    kernel) where a larger set would have to be allocated inside a CUDA-graph capture (memory
    of the graph's pool must not outlive it)."""
    key = k_cache.data_ptr()
    have = _COUNTERS.get(key)
    if have is not None and have.numel() >= n and have.device == k_cache.device:
        return have
    if k_cache.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    have = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=k_cache.device)
    return have


SPLIT_PROGRAMS_PER_SM = 3


def decode_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      block_n: int = 64, num_sms: int = 132) -> int:
    """Static split count for the decode kernel (depends only on shapes)."""
    programs = batch * num_kv_heads
    # ~3 resident programs per SM: enough to saturate HBM, and a single wave when the
    # batch alone fills the GPU (B*Hkv >= target -> no split, no reduce kernel).
    target = SPLIT_PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    max_tiles = max(1, -(-max_blocks * block_size // block_n))
    return max(1, min(-(-target // programs), max_tiles, envs.decode_attn_max_splits()))


# 16-bit caches with head_dim 128 and up take 32 KV tokens a tile, not 64, where batch x kv
# heads is below the 3 programs an SM under which decode_num_splits splits the context: at 64
# (4 warps) the kernel spills for sm_90, and on the H100 the Llama-3-8B shape's batch-1 step took
# 5.24 ms with 32 against 5.37 ms with 64 (two interleaved runs), the kernel alone 6.4 against
# 7.1 µs at batch 1 and 11.4 against 12.3 at batch 8 (context 384). Unsplit, each program walks
# the whole context and the 64-token tile's bytes in flight win: 149.8 against 158.2 µs at
# batch 256 (context 384), 708 against 778 at context 2048; equal at batch 64 (bench/RESULTS.md
# twenty-sixth and twenty-seventh sessions). At head_dim 128 the 32-token tile is 16 KB, which
# also brings newest_kv (NEWEST_KV_MAX_TILE_BYTES) to the one-token steps.
HALF_TILE_HEAD_DIM = 128


def _decode_tiling(k_cache: torch.Tensor, batch: int = 1) -> tuple[int, int, int]:
    """(block_n, num_stages, num_warps) of the split decode kernel for the cache's dtype and a
    batch of `batch` rows, or the tile BACKEND_LIB_DECODE_ATTN_TILE names."""
    if k_cache.element_size() >= 4:
        block_n, num_stages = 32, 2
    elif (k_cache.shape[-1] >= HALF_TILE_HEAD_DIM
          and batch * k_cache.shape[-2] < SPLIT_PROGRAMS_PER_SM * num_sms(k_cache.device)):
        block_n, num_stages = 32, 3
    else:
        block_n, num_stages = 64, 3
    tile = envs.decode_attn_tile()
    return (block_n, num_stages, 4) if tile is None else (tile[0], num_stages, tile[1])


def _partial_buffers(n: int, dp: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(acc [n * dp], m [n], l [n]) fp32 for n (row, head, split) partial states: one
    allocation (less host overhead), each piece 16-byte aligned."""
    n4 = -(-n // 4) * 4
    buf = torch.empty(n * dp + 2 * n4, dtype=torch.float32, device=device)
    return buf[: n * dp], buf[n * dp: n * dp + n], buf[n * dp + n4: n * dp + n4 + n]


def _launch_reduce(part_acc, part_m, part_l, seq_lens, out, num_heads: int, num_splits: int, d: int,
                   block_n: int, pdl: bool) -> None:
    """The reduce kernel over (rows, heads): each head's splits merged into out."""
    dp, sp = _next_pow2(d), max(2, _next_pow2(num_splits))
    _paged_decode_reduce_kernel[(out.shape[0], num_heads)](
        part_acc, part_m, part_l, seq_lens, out,
        out.stride(0), out.stride(1),
        num_heads, num_splits,
        D=d, DP=dp, BLOCK_N=block_n,
        SP=sp, USE_PDL=pdl,
        num_warps=4 if dp * sp >= 4096 else 2, **pdl_launch(pdl),
    )


# newest_kv holds a split's first KV tile (K and V) across the PDL wait. On the H200 the tree
# with it and the other early loads took the 0.5B shape (head_dim 64, bf16: 16 KB a tile) at
# batch 1 from 0.581 to 0.544 ms, while the 8B shape (head_dim 128: 32 KB) was 0.19 ms a step
# slower (twenty-second session; the H100 loses 0.25 ms, twenty-third and twenty-fourth). No
# projection explains it, nor do empty splits (that run's grid had almost none), nor registers
# (254 against 255 without it, for sm_90); it adds 14 KB of shared memory a program
# (bench/RESULTS.md twenty-fourth session). Larger tiles read the newest token from the cache.
NEWEST_KV_MAX_TILE_BYTES = 16 * 1024


def newest_kv_pays(k_cache: torch.Tensor) -> bool:
    """Whether a one-token step's decode attention should take newest_kv (the tile size it
    was measured faster at)."""
    block_n, _, _ = _decode_tiling(k_cache)
    return 2 * block_n * k_cache.shape[-1] * k_cache.element_size() <= NEWEST_KV_MAX_TILE_BYTES


def newest_kv_wanted(k_cache: torch.Tensor) -> bool:
    """newest_kv_pays, unless BACKEND_LIB_DECODE_NEWEST_KV forces it on or off."""
    mode = envs.decode_newest_kv()
    return newest_kv_pays(k_cache) if mode == "auto" else mode == "on"


def _check_newest_kv(newest_kv, q, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """newest_kv's (k, v), each [B, Hkv, D] with a contiguous last dim, or a ValueError naming it."""
    k, v = newest_kv
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (q.shape[0], hkv, d) or t.stride(-1) != 1:
            raise ValueError(f"newest_kv {name}: must be [batch {q.shape[0]}, num_kv_heads {hkv}, head_dim {d}] "
                             f"with a contiguous last dim; got {tuple(t.shape)} strides {tuple(t.stride())}")
    return k, v


def _paged_strides(q, k_cache, v_cache, block_tables, out) -> tuple:
    """The element strides both paged kernels take, in their parameter order: q's row (a token,
    or a sequence in decode) and head, each cache's page, slot and head, the block table's row,
    and out's row and head."""
    return (q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1))


def _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l,
                   counters: Optional[torch.Tensor], scale: float, num_splits: int, block_n: int, *,
                   checked: tuple, split: bool, pdl: bool, num_warps: int, num_stages: int,
                   newest_kv: Optional[tuple] = None) -> None:
    """One launch of the split decode kernel over (rows, kv heads, splits). checked:
    _check_common's result; split: store the partial states (else the output); counters: the
    fused reduce's (None: no fused reduce); newest_kv: paged_decode_attention's."""
    page, hkv, d, _, g = checked
    kn, vn = _check_newest_kv(newest_kv, q, hkv, d) if newest_kv is not None else (q, q)
    _paged_decode_kernel[(q.shape[0], hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l,
        counters if counters is not None else seq_lens, kn, vn,
        float(scale) * _LOG2E,
        *_paged_strides(q, k_cache, v_cache, block_tables, out),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        num_splits,
        G=g, GP=max(16, _next_pow2(g)), D=d, DP=_next_pow2(d), PAGE=page, BLOCK_N=block_n, SPLIT=split,
        DOT_PREC=_dot_prec(k_cache.dtype), USE_PDL=pdl, FUSED_REDUCE=counters is not None,
        SP=max(2, _next_pow2(num_splits)), GM=_next_pow2(g), num_warps=num_warps, num_stages=num_stages,
        NEWEST_KV=newest_kv is not None,
        PREFETCH_KV=newest_kv is not None and envs.decode_kv_prefetch() == "on",
        EARLY_EXIT=envs.decode_attn_early_exit() == "on", **pdl_launch(pdl),
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    *,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    pdl: bool = False,
    fused_reduce: Optional[bool] = None,
    newest_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Single-token-per-sequence paged attention.

    q: [B, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (KV tokens incl. the
    current one; 0 = padding row -> zeros).  Returns out [B, Hq, D] (dtype of q).

    ``num_splits``/``block_n``/``num_warps``/``num_stages`` are tuning overrides; the
    defaults depend only on shapes, so the call is CUDA-graph capturable. pdl: launch both
    kernels with programmatic dependent launch (layers/decode_gemv.py explains the chain).
    fused_reduce: with splits, the last split of each (sequence, kv head) to finish merges
    them in the same kernel (no reduce kernel; per-layer counters, see _split_counters);
    None: BACKEND_LIB_DECODE_ATTN_REDUCE (envs.decode_attn_reduce).
    newest_kv: (k, v) [B, Hkv, D], each row's newest token's K/V (at seq_len - 1), as the
    cache holds them once written: read from there, not from the cache, whose tiles then load
    before the PDL wait (an earlier kernel of the step writes only that slot).
    """
    page, hkv, d, hq, g = _check_common(q, k_cache, v_cache)
    bsz = q.shape[0]
    assert q.dim() == 3 and block_tables.dim() == 2 and block_tables.shape[0] == bsz
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1
    if bsz == 0:
        return out

    default_block_n, default_stages, default_warps = _decode_tiling(k_cache, bsz)
    block_n = default_block_n if block_n is None else block_n
    num_stages = default_stages if num_stages is None else num_stages
    num_warps = default_warps if num_warps is None else num_warps
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = decode_num_splits(bsz, hkv, max_blocks, page, block_n, num_sms(q.device))
    num_splits = max(1, int(num_splits))
    if num_splits > 1:
        part_acc, part_m, part_l = _partial_buffers(bsz * hq * num_splits, _next_pow2(d), q.device)
    else:
        part_acc = part_m = part_l = out  # unused
    if fused_reduce is None:
        fused_reduce = envs.decode_attn_reduce() == "fused"
    counters = _split_counters(k_cache, bsz * hkv) if fused_reduce and num_splits > 1 else None

    _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_m, part_l, counters, scale,
                   num_splits, block_n, checked=(page, hkv, d, hq, g), split=num_splits > 1, pdl=pdl,
                   num_warps=num_warps, num_stages=num_stages, newest_kv=newest_kv)
    if num_splits > 1 and counters is None:
        _launch_reduce(part_acc, part_m, part_l, seq_lens, out, hq, num_splits, d, block_n, pdl)
    return out


@dataclass(frozen=True)
class DecodePartials:
    """One decode row's attention before its splits are merged: for head h and split s (row
    h * num_splits + s), acc[row] (head_dim fp32, the unnormalised output), m[row] (the
    running max, log2 domain) and l[row] (the softmax denominator). Only the first
    min(num_splits, ceil(seq_lens[0] / block_n)) splits ran; the others hold garbage."""
    acc: torch.Tensor        # [num_heads * num_splits, head_dim] fp32
    m: torch.Tensor          # [num_heads * num_splits] fp32
    l: torch.Tensor          # [num_heads * num_splits] fp32
    seq_lens: torch.Tensor   # [1] int32: the row's KV length (0: a padding row, output zeros)
    num_splits: int
    block_n: int             # KV tokens per tile: tile t went to split t % num_splits
    num_heads: int
    head_dim: int
    dtype: torch.dtype       # the merged output's dtype (q's)


def paged_decode_partials(q, k_cache, v_cache, block_tables, seq_lens, scale: float, *,
                          num_splits: Optional[int] = None, pdl: bool = False,
                          newest_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> DecodePartials:
    """paged_decode_attention for one row (q [1, Hq, D], D a power of 2) that leaves the merge
    to the consumer: one kernel less per layer at batch 1, where each kernel's fixed cost is
    most of its time. Always split (num_splits 1 included), so the consumer has one input.
    newest_kv: as paged_decode_attention's."""
    page, hkv, d, hq, g = _check_common(q, k_cache, v_cache)
    if q.dim() != 3 or q.shape[0] != 1 or block_tables.shape[0] != 1:
        raise ValueError(f"paged_decode_partials: one row (q [1, Hq, D]); got q {tuple(q.shape)}")
    if d & (d - 1):
        raise ValueError(f"paged_decode_partials: head_dim {d} must be a power of 2")
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    block_n, num_stages, num_warps = _decode_tiling(k_cache)
    if num_splits is None:
        num_splits = decode_num_splits(1, hkv, block_tables.shape[1], page, block_n, num_sms(q.device))
    num_splits = max(1, int(num_splits))
    acc, m, l = _partial_buffers(hq * num_splits, d, q.device)
    parts = DecodePartials(acc=acc.view(hq * num_splits, d), m=m, l=l, seq_lens=seq_lens, num_splits=num_splits,
                           block_n=block_n, num_heads=hq, head_dim=d, dtype=q.dtype)
    _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, q, parts.acc, parts.m, parts.l, None, scale,
                   num_splits, block_n, checked=(page, hkv, d, hq, g), split=True, pdl=pdl, num_warps=num_warps,
                   num_stages=num_stages, newest_kv=newest_kv)
    return parts


def merge_decode_partials(parts: DecodePartials, pdl: bool = False) -> torch.Tensor:
    """The merged attention output [1, Hq, D] (the reduce kernel): where the consumer cannot
    merge (a projection that runs through cuBLAS)."""
    out = torch.empty(1, parts.num_heads, parts.head_dim, dtype=parts.dtype, device=parts.acc.device)
    _launch_reduce(parts.acc, parts.m, parts.l, parts.seq_lens, out, parts.num_heads, parts.num_splits,
                   parts.head_dim, parts.block_n, pdl)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_q_len: Optional[int],
    out: Optional[torch.Tensor] = None,
    *,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Varlen causal paged attention for a mixed batch (chunked prefill + decode rows).

    q: [T, Hq, D] (new tokens of all sequences, concatenated); cu_seqlens_q: [S+1] int32;
    seq_lens: [S] int32 total KV length incl. new tokens; block_tables: [S, max_blocks]
    int32; max_q_len: host int >= every q_len.  Query i of sequence s is at absolute
    position seq_lens[s] - q_len_s + i and attends to KV positions <= that.

    max_q_len None: the flat grid, sized from the shapes (T, S) alone, every program
    finding its (sequence, tile) in cu_seqlens_q on the device: CUDA-graph capturable
    for a fixed (T, S) bucket. Tokens past cu_seqlens_q[S] (bucket padding) belong to no
    sequence and their output rows are left unwritten; padding sequences have q_len 0.
    """
    page, hkv, d, hq, g = _check_common(q, k_cache, v_cache)
    assert q.dim() == 3
    num_seqs = seq_lens.shape[0]
    assert cu_seqlens_q.shape[0] == num_seqs + 1 and cu_seqlens_q.is_contiguous()
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1
    flat = max_q_len is None
    if num_seqs == 0 or q.shape[0] == 0 or (not flat and max_q_len <= 0):
        return out

    dp = _next_pow2(d)
    big = k_cache.element_size() >= 4
    rows = q.shape[0] * g if flat else int(max_q_len) * g
    if block_m is None:
        # H200 sweep (bench/attention_kernels.py): 64 beat 128 on every prefill / mixed case.
        block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    if flat:
        block_m = max(block_m, _next_pow2(g))  # a flat tile holds whole tokens (>= 1)
    if block_n is None:
        block_n = 32 if big else 64
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 2 if (big or block_m >= 128) else 3

    block_q = max(1, block_m // g)
    if flat:
        grid = (q.shape[0] // block_q + num_seqs, hkv)
    else:
        grid = (triton.cdiv(rows, block_m), num_seqs, hkv)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables,
        float(scale) * _LOG2E,
        *_paged_strides(q, k_cache, v_cache, block_tables, out),
        num_seqs,
        G=g, D=d, DP=dp, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PREC=_dot_prec(k_cache.dtype), FLAT=flat, BLOCK_Q=block_q,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# ----------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------
def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    cu_seqlens_q: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Float32 torch reference (slow, loops over sequences).

    Decode form (cu_seqlens_q None): q [B, Hq, D], one query per sequence at the last
    position.  Varlen form: q [T, Hq, D] with cu_seqlens_q [S+1]; causal.
    Returns float32 [*, Hq, D]; sequences with seq_len 0 give zeros.
    """
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    hq = q.shape[1]
    g = hq // hkv
    seq_lens_l = [int(x) for x in seq_lens.tolist()]
    if cu_seqlens_q is None:
        cu = list(range(len(seq_lens_l) + 1))
    else:
        cu = [int(x) for x in cu_seqlens_q.tolist()]
    bt = block_tables.long()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, seq_len in enumerate(seq_lens_l):
        q0, q1 = cu[s], cu[s + 1]
        q_len = q1 - q0
        if q_len == 0 or seq_len == 0:
            continue
        n_pages = -(-seq_len // page)
        pages = bt[s, :n_pages]
        k = k_cache[pages].reshape(-1, hkv, d)[:seq_len].float()   # [L, Hkv, D]
        v = v_cache[pages].reshape(-1, hkv, d)[:seq_len].float()
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)          # [Hq, L, D]
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        qs = q[q0:q1].float().transpose(0, 1)                       # [Hq, q_len, D]
        scores = torch.matmul(qs, k.transpose(1, 2)) * scale       # [Hq, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        kv_pos = torch.arange(seq_len, device=q.device)
        mask = kv_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.matmul(p, v).transpose(0, 1)
    return out
