"""One-token projections as one kernel each, with the op that feeds them folded in, launched
with programmatic dependent launch (PDL) on Hopper (Triton).

At batch 1 a decoder layer of a 0.5B model streams ~30 MB of weights in ~7 µs at the memory
bandwidth, yet its ten kernels each cost a fixed ~3-5 µs (launch, the first DRAM round trip,
the tail) whatever their bytes. Two things cut that fixed cost:
  - fewer kernels: the residual add + RMSNorm that feeds q/k/v and gate/up, and the silu * mul
    that feeds down, run in the projection's prologue. Every program recomputes the row's
    norm: the row is K values (3.5-16 KB) read from L2, far less than its weight tile.
  - PDL: with ``launch_pdl`` the next kernel starts while this one runs. A program first loads
    its first weight tile (weights are never written by an earlier kernel of the step), then
    waits (``griddepcontrol.wait``) until the previous kernel's writes are visible, and only
    then reads activations. Each kernel also lets the next one launch as soon as it starts.
    Every kernel of the chain waits before it finishes, so "previous kernel complete" implies
    everything before it is complete too. The step's metadata (positions, KV slots, seq_lens,
    block tables) is complete a whole plain launch before the chain's first kernel starts: a
    plain launch starts only once everything before it is done, and between the metadata's
    writers (the decode prep kernel, or a later stage's table ops) and the chain sits one that
    writes none of it (the embedding gather; on later pipeline stages a copy of the incoming
    hidden state, DecoderModel.forward). So chain kernels read the metadata before their wait
    too (the rotation's tables here, the attention's tiles of earlier tokens in
    triton_attention).

y[N] = prologue(x) @ W[N, K]^T (+ b) for one row, fp32 accumulation, in x's dtype. Prologues:
  PLAIN         x as given
  RMSNORM       rms_norm(x) * ln_w            (layer 0: the stream is the embedding itself)
  ADD_RMSNORM   s = x + residual; rms_norm(s) * ln_w; program 0 also writes s (the new stream)
  SILU_MUL      silu(x[:K]) * x[K:]           (x is gate_up's output, [2K])
  MERGE_SPLITS  x is split decode attention's partial states (triton_attention.DecodePartials),
                merged per head as the reduce kernel does: o_proj without that kernel. Each
                program merges its BLOCK_K columns' heads from L2 (K x splits fp32, ~25 KB
                at the 0.5B shape), the reduce kernel's launch and its round trip saved.
Each rounds where the unfused torch ops round (HF's order), as layers/fused_ops.py does.

A program owns BLOCK_N output columns and walks K in BLOCK_K chunks, loading chunk c + 1
while it multiplies chunk c. With split_k > 1 (PLAIN and SILU_MUL only: o_proj and down, whose
consumer is an add + norm prologue that rounds an fp32 row) the grid also splits K: program
(n, s) walks the s-th slice of K and adds its partial sums into an fp32 accumulator with
atomics, so a projection with few output columns and a long K (the 0.5B down projection: 896
columns, K 4864) keeps every SM streaming instead of 112 programs walking K one after another.
Its accumulator is one of an AccumulatorRing (layers/accumulator_ring.py), zeroed by the next
layer's same projection; the sum's order varies between runs. Which (BLOCK_N, BLOCK_K, warps,
split_k) is fastest depends on the shape; `DecodeGemv.tune` measures inside a CUDA graph, as
the decode step runs them.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from .. import envs
from .triton_support import HAS_TRITON, tl, triton  # noqa: F401 - the kernels' globals
from .triton_support import INTERPRET as _INTERPRET
from .triton_support import compile_in_parallel, l2_prefetch, num_sms, pdl_launch  # noqa: F401
from .triton_support import pdl_release_dependents, pdl_supported  # noqa: F401
from .tuning_cache import MISS, TuningCache

logger = logging.getLogger(__name__)

PLAIN, RMSNORM, ADD_RMSNORM, SILU_MUL, MERGE_SPLITS = 0, 1, 2, 3, 4
_PROLOGUE_NAMES = {PLAIN: "plain", RMSNORM: "rmsnorm", ADD_RMSNORM: "add_rmsnorm", SILU_MUL: "silu_mul",
                   MERGE_SPLITS: "merge_splits"}


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1   # > 1: K split over that many programs per column block (fp32 atomics)
    ahead: int = 1     # weight tiles in flight while a tile is multiplied: 1, or 2 (NORM_AHEAD_CANDIDATES)
    norm_block: int = 0   # norm prologues: row values a load of its sum of squares (0: _NORM_BLOCK_MAX)


DEFAULT_CONFIG = GemvConfig(8, 1024, 4)
# What start-up tuning tries (few: each compiles once per prologue, then Triton's disk cache).
CANDIDATES = (GemvConfig(4, 1024, 4), GemvConfig(8, 1024, 4), GemvConfig(8, 512, 4),
              GemvConfig(16, 512, 4), GemvConfig(16, 1024, 8), GemvConfig(32, 256, 4),
              GemvConfig(16, 256, 4), GemvConfig(32, 128, 4), GemvConfig(32, 256, 8))
# ... and where the output may be an fp32 accumulator (SPLIT_K_PROLOGUES, no rope epilogue).
SPLIT_K_CANDIDATES = (GemvConfig(8, 1024, 4, 2), GemvConfig(8, 512, 4, 4), GemvConfig(8, 256, 4, 8),
                      GemvConfig(16, 512, 4, 2), GemvConfig(16, 512, 4, 4), GemvConfig(4, 512, 4, 4),
                      GemvConfig(4, 256, 4, 8), GemvConfig(16, 256, 8, 8))
SPLIT_K_PROLOGUES = (PLAIN, SILU_MUL, MERGE_SPLITS)   # o_proj and down, read by an add + norm prologue
# ... and where a norm prologue runs: the second tile loads as the wait ends, so HBM streams
# while every program reads the row for its norm (with one wave of programs, as q/k/v has,
# nothing else would). On the H100 the first four lost every norm projection of the 0.5B and
# 8B shapes (bench/RESULTS.md, twenty-fourth session): at the 8B q/k/v (K 4096) 8x1024 and 8x512
# take 255 and 254 registers a thread for sm_90, two programs an SM. Reading the row for its
# norm 1024 values at a time takes 8x512 and 4x1024 to 159 and 156 registers (ptxas, Triton 3.6;
# twenty-seventh session): three programs an SM with two 8 KB tiles in flight each, 48 KB of
# weight in flight an SM against the 32 KB of the 8x1024 tile tuning picks there, for cards whose
# bandwidth x latency asks more than 32 KB (the H200). Not timed yet.
NORM_AHEAD_CANDIDATES = (GemvConfig(8, 1024, 4, ahead=2), GemvConfig(4, 1024, 4, ahead=2),
                         GemvConfig(16, 512, 4, ahead=2), GemvConfig(8, 512, 4, ahead=2),
                         GemvConfig(8, 512, 4, ahead=2, norm_block=1024),
                         GemvConfig(4, 1024, 4, ahead=2, norm_block=1024))
# A split's K slice starts on a multiple of this many elements (16-byte aligned weight loads).
_SPLIT_ALIGN = 64
# The most of a weight the L2 prefetch asks for: two thirds of the H100's and H200's 50 MB L2
# (a whole 8B o_proj, 32 MiB); more would evict what it fetched before the projection reads it.
L2_PREFETCH_MAX_BYTES = 32 << 20
# The norm prologues read the row for its sum of squares in chunks of up to this many values:
# one L2 round trip for hidden sizes up to 4096 instead of one per BLOCK_K.
_NORM_BLOCK_MAX = 4096


def norm_block(cfg: GemvConfig, prologue: int, k: int) -> int:
    """The kernel's NORM_BLOCK: the row values a load of the norm's sum of squares reads (16,
    unused, for the prologues without a norm)."""
    if prologue not in (RMSNORM, ADD_RMSNORM):
        return 16
    return min(triton.next_power_of_2(k), cfg.norm_block or _NORM_BLOCK_MAX)


if HAS_TRITON:
    # The prologue codes as the kernels see them (a jit function reads only constexpr globals).
    _K_RMSNORM = tl.constexpr(RMSNORM)
    _K_ADD_RMSNORM = tl.constexpr(ADD_RMSNORM)
    _K_SILU_MUL = tl.constexpr(SILU_MUL)
    _K_MERGE_SPLITS = tl.constexpr(MERGE_SPLITS)

    @triton.jit
    def _stream_chunk(X, R, offs, mask, HAS_RES: tl.constexpr, DT: tl.constexpr):
        """The residual stream's values at offs, fp32: x, or x + residual rounded to DT the
        way the unfused `x = x + f(x)` rounds. An fp32 x (decode_mlp's accumulator) rounds to
        DT first, where the unfused projection rounded its store."""
        s = tl.load(X + offs, mask=mask, other=0.0).to(DT).to(tl.float32)
        if HAS_RES:
            s = (s + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(DT).to(tl.float32)
        return s

    @triton.jit
    def _merged_attention_chunk(PA, PM, PL, k0, ran, num_splits, K, BLOCK_K: tl.constexpr,
                                D: tl.constexpr, CHUNK: tl.constexpr, DT: tl.constexpr):
        """x[k0 : k0 + BLOCK_K] (whole heads of D; zeros from column K on) of one row's attention
        output, merged from the `ran` splits' partial softmax states CHUNK splits at a time
        (online, as the splits' own loops merge tiles), rounded to DT as the reduce kernel's
        store rounds."""
        HC: tl.constexpr = BLOCK_K // D
        heads = k0 // D + tl.arange(0, HC)
        h_mask = heads < K // D
        offs_c = tl.arange(0, CHUNK)
        offs_d = tl.arange(0, D)
        first = heads * num_splits                          # each head's split 0
        m_run = tl.full([HC], float("-inf"), tl.float32)
        l_run = tl.zeros([HC], tl.float32)
        acc = tl.zeros([HC, D], tl.float32)
        for c in range(0, ran, CHUNK):
            split = c + offs_c
            hs_mask = h_mask[:, None] & (split < ran)[None, :]
            row = first[:, None] + split[None, :]
            m = tl.load(PM + row, mask=hs_mask, other=float("-inf"))
            l = tl.load(PL + row, mask=hs_mask, other=0.0)
            part = tl.load(PA + row[:, :, None] * D + offs_d[None, None, :], mask=hs_mask[:, :, None], other=0.0)
            m_new = tl.maximum(m_run, tl.max(m, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # no split ran yet: all weights 0
            alpha = tl.exp2(m_run - m_ref)
            w = tl.where(hs_mask, tl.exp2(m - m_ref[:, None]), 0.0)
            l_run = l_run * alpha + tl.sum(l * w, 1)
            acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], 1)
            m_run = m_new
        o = acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
        return tl.reshape(o.to(DT).to(tl.float32), [BLOCK_K])

    @triton.jit
    def _weight_tile(w_rows, offs, n_mask, k_hi):
        """This program's rows at columns offs (zeros at or past k_hi, or past N)."""
        return tl.load(w_rows + offs[None, :], mask=n_mask[:, None] & (offs < k_hi)[None, :], other=0.0)

    @triton.jit
    def _prefetch_weights(W, pf_bytes, pf_programs, THREADS: tl.constexpr):
        """Programs 0 .. pf_programs - 1 (the first dispatched: one an SM) each ask L2 for
        1/pf_programs of the weight's first pf_bytes, one piece a thread. Issued before the PDL
        wait, it streams the weight while the previous kernel runs (after the decode attention,
        which reads little, HBM is otherwise idle), also the parts whose own programs are not
        resident yet."""
        pid = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)   # dispatch order
        if pid < pf_programs:
            share = tl.cdiv(tl.cdiv(pf_bytes, pf_programs), 16 * THREADS) * 16 * THREADS
            piece = share // THREADS
            start = pid.to(tl.int64) * share + tl.arange(0, THREADS).to(tl.int64) * piece
            nbytes = tl.minimum(tl.maximum(pf_bytes - start, 0), piece).to(tl.int32)
            l2_prefetch(W.to(tl.pointer_type(tl.int8)) + start, nbytes)

    @triton.jit
    def _rope_tables(pid, COS, SIN, POS, SLOT, stride_cos, DT: tl.constexpr, BLOCK_N: tl.constexpr,
                     HALF: tl.constexpr):
        """The rotation's cos/sin for this program's column pairs at the token's position, and
        its KV slot. Position and slot are written before the forward's first PDL kernel, so
        these load before the wait, while the previous kernel runs."""
        j = (pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)) % HALF
        pos = tl.load(POS).to(tl.int64)
        c1 = tl.load(COS + pos * stride_cos + j).to(DT).to(tl.float32)
        c2 = tl.load(COS + pos * stride_cos + HALF + j).to(DT).to(tl.float32)
        s1 = tl.load(SIN + pos * stride_cos + j).to(DT).to(tl.float32)
        s2 = tl.load(SIN + pos * stride_cos + HALF + j).to(DT).to(tl.float32)
        return c1, c2, s1, s2, tl.load(SLOT).to(tl.int64)

    @triton.jit
    def _rope_kv_epilogue(y, pid, Y, KC, VC, c1, c2, s1, s2, slot, N,
                          DT: tl.constexpr, BLOCK_N: tl.constexpr, HQ: tl.constexpr,
                          HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
        """y: this program's outputs (fp32, rounded to DT), pairs (j, j + HALF) of a head
        interleaved; c1..slot: _rope_tables'. Rotates q and k heads (neox rotate_half, as
        fused_ops' rope kernel rounds), stores q/k/v into Y and the rotated k and v into the
        paged cache."""
        BH: tl.constexpr = BLOCK_N // 2
        xa, xb = tl.split(tl.reshape(y, [BH, 2]))
        f = pid * BH + tl.arange(0, BH)              # index among the heads' first halves
        f_mask = f < N // 2
        head = f // HALF
        j = f % HALF
        rotate = head < HQ + HKV
        oa = tl.where(rotate, xa * c1 - xb * s1, xa).to(DT)
        ob = tl.where(rotate, xb * c2 + xa * s2, xb).to(DT)
        col = head * HEAD_DIM + j
        tl.store(Y + col, oa, mask=f_mask)
        tl.store(Y + col + HALF, ob, mask=f_mask)
        if slot >= 0:
            is_k = f_mask & (head >= HQ) & (head < HQ + HKV)
            is_v = f_mask & (head >= HQ + HKV)
            kv_head = tl.where(head >= HQ + HKV, head - HQ - HKV, head - HQ)
            cp = slot * (HKV * HEAD_DIM) + kv_head * HEAD_DIM + j
            tl.store(KC + cp, oa.to(KC.dtype.element_ty), mask=is_k)
            tl.store(KC + cp + HALF, ob.to(KC.dtype.element_ty), mask=is_k)
            tl.store(VC + cp, oa.to(VC.dtype.element_ty), mask=is_v)
            tl.store(VC + cp + HALF, ob.to(VC.dtype.element_ty), mask=is_v)

    @triton.jit
    def _chunk_inputs(X, R, LNW, PART_M, PART_L, offs, mask, k0, ran, num_splits, K, k_end,
                      PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, DT: tl.constexpr,
                      BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
        """What chunk [k0, k0 + BLOCK_K) of x is made from, loaded (fp32): (stream, ln weight)
        for the norms, (gate, up) for SILU_MUL, (x, x) otherwise. Loaded a chunk ahead of its
        use, with the next weight tile, so no L2 round trip sits between two tiles. k_end: the
        end of this program's K slice (merged heads past it are not this program's)."""
        if (PROLOGUE == _K_RMSNORM) or (PROLOGUE == _K_ADD_RMSNORM):
            a = _stream_chunk(X, R, offs, mask, HAS_RES, DT)
            b = tl.load(LNW + offs, mask=mask, other=0.0).to(tl.float32)
        elif PROLOGUE == _K_SILU_MUL:
            a = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(X + K + offs, mask=mask, other=0.0).to(tl.float32)
        elif PROLOGUE == _K_MERGE_SPLITS:
            a = _merged_attention_chunk(X, PART_M, PART_L, k0, ran, num_splits, k_end, BLOCK_K, HEAD_DIM,
                                        SPLIT_CHUNK, DT)
            b = a
        else:
            a = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            b = a
        return a, b

    @triton.jit
    def _chunk_x(a, b, rstd, PROLOGUE: tl.constexpr, DT: tl.constexpr):
        """x's chunk from _chunk_inputs' pair, rounded where the unfused ops round."""
        if (PROLOGUE == _K_RMSNORM) or (PROLOGUE == _K_ADD_RMSNORM):
            x = ((a * rstd).to(DT).to(tl.float32) * b).to(DT).to(tl.float32)
        elif PROLOGUE == _K_SILU_MUL:
            x = ((a / (1.0 + tl.exp(-a))).to(DT).to(tl.float32) * b).to(DT).to(tl.float32)
        else:
            x = a
        return x

    @triton.jit
    def _gemv_kernel(X, R, LNW, W, B, Y, ROUT, N, K, eps, stride_wn,
                     COS, SIN, POS, KC, VC, SLOT, stride_cos,
                     PART_M, PART_L, ATTN_SL, num_splits, ZERO, k_per_split,
                     PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROPE: tl.constexpr = False,
                     HQ: tl.constexpr = 0, HKV: tl.constexpr = 0, HEAD_DIM: tl.constexpr = 2,
                     HALF: tl.constexpr = 1, EARLY_RELEASE: tl.constexpr = True,
                     ATTN_BLOCK_N: tl.constexpr = 64, SPLIT_CHUNK: tl.constexpr = 8,
                     SPLIT_K: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 16,
                     pf_bytes=0, pf_programs=0, L2_PREFETCH: tl.constexpr = False,
                     PF_THREADS: tl.constexpr = 128, AHEAD2: tl.constexpr = False):
        pid = tl.program_id(0)
        # SPLIT_K: this program's K slice [k_lo, k_hi) (k_per_split is K without a split);
        # Y is an fp32 accumulator the slices add into, ZERO the ring's buffer to clear.
        pid_k = tl.program_id(1)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        DT = W.dtype.element_ty if SPLIT_K else Y.dtype.element_ty
        lane = tl.arange(0, BLOCK_N)
        if ROPE:
            # Lanes 2i and 2i + 1 own columns j and j + HALF of one head: the rotation's pair.
            f = pid * (BLOCK_N // 2) + lane // 2
            offs_n = (f // HALF) * HEAD_DIM + f % HALF + (lane % 2) * HALF
            n_mask = f < N // 2
        else:
            offs_n = pid * BLOCK_N + lane
            n_mask = offs_n < N
        offs_kb = tl.arange(0, BLOCK_K)
        w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
        # The first weight tile does not depend on earlier kernels: in flight before the wait.
        w_next = _weight_tile(w_rows, k_lo + offs_kb, n_mask, k_hi)
        if L2_PREFETCH:
            _prefetch_weights(W, pf_bytes, pf_programs, PF_THREADS)
        if ROPE:
            c1, c2, s1, s2, slot = _rope_tables(pid, COS, SIN, POS, SLOT, stride_cos, DT, BLOCK_N, HALF)
        if USE_PDL:
            if EARLY_RELEASE:
                pdl_release_dependents()
            tl.extra.cuda.gdc_wait()

        HAS_RES: tl.constexpr = PROLOGUE == _K_ADD_RMSNORM
        NORM: tl.constexpr = (PROLOGUE == _K_RMSNORM) or (PROLOGUE == _K_ADD_RMSNORM)
        if AHEAD2:  # the second tile streams while the norm's row is read
            w_after = _weight_tile(w_rows, k_lo + BLOCK_K + offs_kb, n_mask, k_hi)
        ran = 0
        if PROLOGUE == _K_MERGE_SPLITS:  # the splits that had a KV tile (seq_len 0: none, zeros)
            ran = tl.minimum(num_splits, tl.cdiv(tl.load(ATTN_SL), ATTN_BLOCK_N))
        # The first chunk's inputs load with the norm's row (one L2 round trip, not two).
        in_a, in_b = _chunk_inputs(X, R, LNW, PART_M, PART_L, k_lo + offs_kb, k_lo + offs_kb < k_hi, k_lo,
                                   ran, num_splits, K, k_hi, PROLOGUE, HAS_RES, DT, BLOCK_K, HEAD_DIM, SPLIT_CHUNK)
        rstd = 0.0
        if NORM:  # the whole row in as few loads as registers allow (NORM_BLOCK: K up to 4096)
            offs_nb = tl.arange(0, NORM_BLOCK)
            ss = tl.zeros([NORM_BLOCK], dtype=tl.float32)
            for k0 in range(0, K, NORM_BLOCK):
                offs = k0 + offs_nb
                mask = offs < K
                s = _stream_chunk(X, R, offs, mask, HAS_RES, DT)
                if HAS_RES:
                    if (pid == 0) & (pid_k == 0):
                        tl.store(ROUT + offs, s.to(ROUT.dtype.element_ty), mask=mask)
                ss += s * s
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)

        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = w_next
            x = _chunk_x(in_a, in_b, rstd, PROLOGUE, DT)
            nxt = k0 + BLOCK_K + offs_kb
            nxt_mask = nxt < k_hi
            if AHEAD2:
                w_next = w_after
                w_after = _weight_tile(w_rows, nxt + BLOCK_K, n_mask, k_hi)
            else:
                w_next = _weight_tile(w_rows, nxt, n_mask, k_hi)
            in_a, in_b = _chunk_inputs(X, R, LNW, PART_M, PART_L, nxt, nxt_mask, k0 + BLOCK_K, ran,
                                       num_splits, K, k_hi, PROLOGUE, HAS_RES, DT, BLOCK_K, HEAD_DIM, SPLIT_CHUNK)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SPLIT_K:
            if pid_k == 0:  # the ring's previous accumulator: its reader is done (accumulator_ring)
                tl.store(ZERO + offs_n, tl.zeros([BLOCK_N], tl.float32), mask=n_mask)
            tl.atomic_add(Y + offs_n, acc, mask=n_mask, sem="relaxed")
        elif ROPE:
            _rope_kv_epilogue(acc.to(DT).to(tl.float32), pid, Y, KC, VC, c1, c2, s1, s2, slot, N,
                              DT, BLOCK_N, HQ, HKV, HEAD_DIM, HALF)
        else:
            tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)


def supported(x: torch.Tensor, w: torch.Tensor, prologue: int = PLAIN) -> bool:
    """x: one contiguous row in w's dtype; or fp32 (decode_mlp's accumulator) where the
    prologue adds it to the residual stream, which rounds it to w's dtype."""
    x_dtype_ok = x.dtype == w.dtype or (prologue == ADD_RMSNORM and x.dtype == torch.float32)
    return (HAS_TRITON and (x.is_cuda or _INTERPRET) and x.dim() == 2 and x.shape[0] == 1
            and w.dim() == 2 and w.stride(1) == 1 and x.is_contiguous() and x_dtype_ok)


@dataclass(frozen=True)
class RopeKV:
    """The q/k/v projection's epilogue: y's columns are [q heads | k heads | v heads] of
    head_dim each; q and k are rotated at `positions` (neox rotate_half over the whole head,
    cos/sin caches [max_pos, head_dim] fp32) and k, v written to the paged cache at
    `slot_mapping` (cache [blocks, block_size, num_kv_heads, head_dim]; slot < 0: no write)."""
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


def gemv(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *,
         prologue: int = PLAIN, residual: Optional[torch.Tensor] = None,
         ln_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
         cfg: GemvConfig = DEFAULT_CONFIG, pdl: bool = False, rope: Optional[RopeKV] = None,
         early_release: bool = True,
         out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None,
         zero: Optional[torch.Tensor] = None, l2_prefetch: bool = False, warmup: bool = False,
         ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [1, K] (SILU_MUL: [1, 2K]) -> (y [1, N], new residual or None). ADD_RMSNORM returns
    x + residual as the new residual (into residual_out when given: the tests poison it).
    rope: y is q/k/v, rotated, and k/v also land in the cache (RopeKV). early_release (with
    pdl): let the next kernel launch as this one starts, not only as it exits.
    cfg.split_k > 1: y is `out`, an fp32 [1, N] accumulator that must be zero, and `zero`
    (fp32 [1, N], another buffer) is set to 0 (AccumulatorRing.for_layer gives both).
    l2_prefetch: the first programs ask L2 for the weight before their PDL wait (Hopper, a
    contiguous 16-byte aligned weight; ignored elsewhere: _prefetch_meta). warmup: compile the
    launch's kernel without running it (JITFunction.warmup; compile_in_parallel)."""
    if not supported(x, w, prologue):
        raise ValueError(f"decode_gemv: x {tuple(x.shape)} {x.dtype} / w {tuple(w.shape)} {w.dtype} "
                         "not supported (one contiguous row, w's rows contiguous, one dtype (fp32 x "
                         "only before add + norm), Triton)")
    n, k = w.shape
    want = 2 * k if prologue == SILU_MUL else k
    if x.shape[1] != want:
        raise ValueError(f"decode_gemv: x has {x.shape[1]} columns, the weight [{n}, {k}] with "
                         f"prologue {prologue} needs {want}")
    if prologue in (RMSNORM, ADD_RMSNORM) and ln_weight is None:
        raise ValueError("decode_gemv: a norm prologue needs ln_weight")
    if prologue == ADD_RMSNORM and (residual is None or residual.shape != x.shape
                                    or not residual.is_contiguous()):
        raise ValueError("decode_gemv: ADD_RMSNORM needs a contiguous residual shaped like x")
    for name, t in (("residual", residual), ("ln_weight", ln_weight), ("bias", b)):
        if t is not None and t.dtype != w.dtype:
            raise ValueError(f"decode_gemv: {name} is {t.dtype}, w is {w.dtype} (one dtype)")
    if residual_out is not None and residual_out.data_ptr() in {t.data_ptr() for t in (x, residual)
                                                                if t is not None}:
        raise ValueError("decode_gemv: residual_out must not alias x or residual (program 0 "
                         "writes it while the others still read them)")
    rope_args, rope_meta = (x,) * 6 + (0,), {}
    if rope is not None:
        d = rope.head_dim
        if n != (rope.num_heads + 2 * rope.num_kv_heads) * d or d % 2 or cfg.block_n % 2:
            raise ValueError(f"decode_gemv: rope needs N = (heads + 2 kv heads) x head_dim = "
                             f"{(rope.num_heads + 2 * rope.num_kv_heads) * d} (got {n}), an even "
                             f"head_dim ({d}) and an even block_n ({cfg.block_n})")
        if not (rope.k_cache.is_contiguous() and rope.v_cache.is_contiguous()
                and rope.cos.stride(-1) == 1 and rope.sin.stride() == rope.cos.stride()):
            raise ValueError("decode_gemv: rope needs contiguous caches and cos/sin rows")
        if rope.cos.shape[-1] != d:
            raise ValueError(f"decode_gemv: rope tables are {rope.cos.shape[-1]} wide, the head "
                             f"{d}: rotary must span the whole head")
        rope_args = (rope.cos, rope.sin, rope.positions, rope.k_cache, rope.v_cache,
                     rope.slot_mapping, rope.cos.stride(0))
        rope_meta = dict(ROPE=True, HQ=rope.num_heads, HKV=rope.num_kv_heads, HEAD_DIM=d,
                         HALF=d // 2)
    y, split = _output(cfg, prologue, rope, w, out, zero)
    new_res = None
    if prologue == ADD_RMSNORM:
        new_res = torch.empty_like(residual) if residual_out is None else residual_out
    k_per_split = _k_per_split(k, cfg.split_k) if split else k
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    launch = functools.partial(_gemv_kernel.warmup, grid=grid) if warmup else _gemv_kernel[grid]
    launch(
        x, residual if residual is not None else x, ln_weight if ln_weight is not None else x,
        w, b if b is not None else w, y, new_res if new_res is not None else y,
        n, k, eps, w.stride(0), *rope_args, x, x, x, 0, zero if split else x, k_per_split,
        PROLOGUE=prologue, HAS_BIAS=b is not None, USE_PDL=pdl, EARLY_RELEASE=early_release,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, SPLIT_K=split,
        NORM_BLOCK=norm_block(cfg, prologue, k), AHEAD2=cfg.ahead == 2, **rope_meta,
        **_prefetch_meta(l2_prefetch, w, cfg),
        **pdl_launch(pdl))
    return y, new_res


def _prefetch_meta(wanted: bool, w: torch.Tensor, cfg: GemvConfig) -> dict:
    """The kernel's L2_PREFETCH arguments: on only where the bulk prefetch can run (a Hopper
    GPU, not the interpreter) over a contiguous, 16-byte aligned weight; at most
    L2_PREFETCH_MAX_BYTES of it (what is read first), shared by one program an SM."""
    nbytes = w.numel() * w.element_size()
    if not (wanted and w.is_cuda and not _INTERPRET and pdl_supported(w.device) and w.is_contiguous()
            and w.data_ptr() % 16 == 0 and nbytes % 16 == 0):
        return {}
    return dict(L2_PREFETCH=True, pf_bytes=min(nbytes, L2_PREFETCH_MAX_BYTES), pf_programs=num_sms(w.device),
                PF_THREADS=cfg.num_warps * 32)


def _output(cfg: GemvConfig, prologue: int, rope: Optional[RopeKV], w: torch.Tensor,
            out: Optional[torch.Tensor], zero: Optional[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """(y, split): with split_k > 1 the caller's fp32 accumulator `out` (checked with `zero`),
    else `out` or a new row in w's dtype."""
    n = w.shape[0]
    if cfg.split_k > 1:
        _check_split(prologue, rope, n, out, zero)
        return out, True
    return (torch.empty(1, n, dtype=w.dtype, device=w.device) if out is None else out), False


def _check_split(prologue: int, rope: Optional[RopeKV], n: int, acc: Optional[torch.Tensor],
                 zero: Optional[torch.Tensor]) -> None:
    if prologue not in SPLIT_K_PROLOGUES or rope is not None:
        raise ValueError(f"decode_gemv: split_k > 1 needs the PLAIN, SILU_MUL or MERGE_SPLITS prologue and no rope "
                         f"epilogue (got prologue {prologue}, rope {rope is not None})")
    for name, t in (("out", acc), ("zero", zero)):
        if t is None or t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"decode_gemv: split_k > 1 needs `{name}`, a contiguous fp32 buffer of "
                             f"{n} values (got {None if t is None else (tuple(t.shape), t.dtype)})")
    if acc.data_ptr() == zero.data_ptr():
        raise ValueError("decode_gemv: split_k > 1 needs `out` and `zero` to be different buffers")


def _k_per_split(k: int, split_k: int, head_dim: int = 1) -> int:
    """A split's K slice: 16-byte aligned weight loads, and whole heads where the prologue
    merges attention heads (head_dim)."""
    align = _SPLIT_ALIGN * head_dim // math.gcd(_SPLIT_ALIGN, head_dim)
    return -(-k // split_k // align) * align


def merge_supported(parts, w: torch.Tensor, cfg: GemvConfig) -> bool:
    """The o_proj gemv can merge `parts` itself: whole heads per BLOCK_K chunk (and per K
    slice, with split_k)."""
    d = parts.head_dim
    return (HAS_TRITON and (parts.acc.is_cuda or _INTERPRET) and w.dim() == 2 and w.stride(1) == 1
            and w.dtype == parts.dtype and w.shape[1] == parts.num_heads * d and d & (d - 1) == 0
            and cfg.block_k % d == 0)


def gemv_merged(parts, w: torch.Tensor, b: Optional[torch.Tensor] = None, *,
                cfg: GemvConfig = DEFAULT_CONFIG, pdl: bool = False, early_release: bool = True,
                out: Optional[torch.Tensor] = None, zero: Optional[torch.Tensor] = None,
                l2_prefetch: bool = False) -> torch.Tensor:
    """y [1, N] = merge(parts) @ W^T (+ b): the MERGE_SPLITS prologue (parts:
    triton_attention.DecodePartials of one row, W [N, num_heads * head_dim]). cfg.split_k > 1:
    each program merges only its K slice's heads; out and zero as gemv's."""
    if not merge_supported(parts, w, cfg):
        raise ValueError(f"decode_gemv: cannot merge {parts.num_heads} heads of {parts.head_dim} "
                         f"({parts.dtype}) into w {tuple(w.shape)} {w.dtype} with block_k {cfg.block_k} "
                         "(K must be heads x head_dim, head_dim a power of 2 dividing block_k, one dtype)")
    if b is not None and b.dtype != w.dtype:
        raise ValueError(f"decode_gemv: bias is {b.dtype}, w is {w.dtype} (one dtype)")
    n, k = w.shape
    y, split = _output(cfg, MERGE_SPLITS, None, w, out, zero)
    acc = parts.acc
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        acc, acc, acc, w, b if b is not None else w, y, y, n, k, 0.0, w.stride(0),
        acc, acc, acc, acc, acc, acc, 0,
        parts.m, parts.l, parts.seq_lens, parts.num_splits, zero if split else acc,
        _k_per_split(k, cfg.split_k, parts.head_dim) if split else k,
        PROLOGUE=MERGE_SPLITS, HAS_BIAS=b is not None, USE_PDL=pdl, EARLY_RELEASE=early_release,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, HEAD_DIM=parts.head_dim,
        ATTN_BLOCK_N=parts.block_n, SPLIT_K=split, AHEAD2=cfg.ahead == 2, **_prefetch_meta(l2_prefetch, w, cfg),
        **pdl_launch(pdl))
    return y


# ----------------------------------------------------------------------------------
# Torch reference (the unfused ops, HF's order)
# ----------------------------------------------------------------------------------
def _rms_norm_ref(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s32 = s.float()
    return weight * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)


def gemv_ref(x, w, b=None, *, prologue=PLAIN, residual=None, ln_weight=None, eps=1e-6):
    new_res = None
    if prologue == RMSNORM:
        x = _rms_norm_ref(x, ln_weight, eps)
    elif prologue == ADD_RMSNORM:
        new_res = x + residual
        x = _rms_norm_ref(new_res, ln_weight, eps)
    elif prologue == SILU_MUL:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return F.linear(x, w, b), new_res


def gemv_rope_ref(x, w, b, rope: RopeKV, **prologue):
    """The unfused q/k/v projection, rope and cache write: (q rotated [1, Hq * D], v [1, Hkv * D],
    k_cache, v_cache (written copies of rope's caches), new residual or None)."""
    from .fused_ops import rope_and_write_kv_ref
    y, new_res = gemv_ref(x, w, b, **prologue)
    hq, hkv, d = rope.num_heads, rope.num_kv_heads, rope.head_dim
    q, k, v = y.split([hq * d, hkv * d, hkv * d], dim=-1)
    k_cache, v_cache = rope.k_cache.clone(), rope.v_cache.clone()
    q = rope_and_write_kv_ref(q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), rope.cos,
                              rope.sin, rope.positions, k_cache, v_cache, rope.slot_mapping)
    return q.reshape(1, -1), v, k_cache, v_cache, new_res


# ----------------------------------------------------------------------------------
# The model's use: per-shape configurations, measured at start-up
# ----------------------------------------------------------------------------------
def shape_key(prologue: int, w: torch.Tensor, b: Optional[torch.Tensor], rope: bool) -> tuple:
    """What a tuned configuration is for: the prologue, the weight's shape, bias, epilogue."""
    return (prologue, w.shape[0], w.shape[1], b is not None, rope)


def _stand_in_rope(num_heads: int, num_kv_heads: int, head_dim: int, dtype, device) -> RopeKV:
    """A rope epilogue over throwaway tables and caches (timing only)."""
    cos = torch.rand(64, head_dim, device=device)
    cache = torch.zeros(4, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
    return RopeKV(cos, cos.clone(), torch.tensor([5], device=device), cache, cache.clone(),
                  torch.tensor([7], device=device), num_heads, num_kv_heads, head_dim)


@dataclass
class DecodeGemv:
    """The configuration of each (prologue, N, K, bias) the model's one-token forward uses,
    and whether kernels launch with PDL. `tune` fills `configs` by timing candidates inside
    a CUDA graph against the unfused ops (the op's own kernel, then the projection through
    cuBLAS); None: the unfused ops were faster and run instead. An untuned shape runs
    DEFAULT_CONFIG. A split-K configuration (o_proj, down) writes layer `layer`'s accumulator
    of `rings[key]` (one per layer of the forward: layers/accumulator_ring.py); a call without
    a layer index, or for a shape without a ring, runs the same tile unsplit."""

    pdl: bool = False
    rope: bool = False  # the q/k/v projection also rotates and writes the KV cache (RopeKV)
    early_release: bool = True  # with pdl: the next kernel may launch as soon as this one starts
    merge_attention: bool = False  # attention leaves its splits to o_proj's MERGE_SPLITS prologue
    num_layers: int = 0     # layers of the model's forward; split-K is tried only with 2 or more
    l2_prefetch: str = "off"  # envs.decode_gemv_l2_prefetch: off, oproj (after attention) or all
    configs: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    rings: dict = field(default_factory=dict)   # shape key -> AccumulatorRing (split-K shapes)
    picks: TuningCache = field(default_factory=lambda: TuningCache(None))   # kept picks (default: none)

    def run(self, x, proj, prologue=PLAIN, residual=None, ln_weight=None, eps=1e-6,
            rope: Optional[RopeKV] = None, layer: Optional[int] = None, after_attention: bool = False):
        w = proj.weight
        key = shape_key(prologue, w, proj.bias, rope is not None)
        cfg = self.configs.get(key, DEFAULT_CONFIG)
        if cfg is None or not supported(x, w, prologue):
            return self.unfused(x.to(w.dtype), proj, prologue, residual, ln_weight, eps, rope)
        out = zero = None
        if cfg.split_k > 1:
            ring = self.rings.get(key)
            if ring is None or layer is None:
                cfg = replace(cfg, split_k=1)
            else:
                out, zero = ring.for_layer(layer)
        return gemv(x, proj.weight, proj.bias, prologue=prologue, residual=residual,
                    ln_weight=ln_weight, eps=eps, cfg=cfg, pdl=self.pdl, rope=rope,
                    early_release=self.early_release, out=out, zero=zero,
                    l2_prefetch=self._prefetch(after_attention))

    def _prefetch(self, after_attention: bool) -> bool:
        return self.l2_prefetch == "all" or (self.l2_prefetch == "oproj" and after_attention)

    def make_rings(self, device) -> None:
        """An accumulator per layer for every shape whose tuned configuration splits K."""
        from .accumulator_ring import AccumulatorRing
        for key, cfg in self.configs.items():
            if cfg is not None and cfg.split_k > 1 and key not in self.rings:
                self.rings[key] = AccumulatorRing.create(self.num_layers, key[1], device)

    def project_attention(self, attn_out, proj, layer: Optional[int] = None) -> torch.Tensor:
        """o_proj of the attention output: a tensor [1, Hq * D], or split partials
        (triton_attention.DecodePartials, with merge_attention) that the projection merges in
        its prologue, or the reduce kernel merges where o_proj runs unfused (cuBLAS won)."""
        from .triton_attention import DecodePartials, merge_decode_partials
        if not isinstance(attn_out, DecodePartials):
            return self.run(attn_out.contiguous(), proj, layer=layer, after_attention=True)[0]
        w = proj.weight
        key = shape_key(PLAIN, w, proj.bias, False)
        cfg = self.configs.get(key, DEFAULT_CONFIG)
        if cfg is not None and merge_supported(attn_out, w, cfg):
            out = zero = None
            if cfg.split_k > 1:   # the tuned split of the plain o_proj, its ring
                ring = self.rings.get(key)
                if ring is None or layer is None:
                    cfg = replace(cfg, split_k=1)
                else:
                    out, zero = ring.for_layer(layer)
            return gemv_merged(attn_out, w, proj.bias, cfg=cfg, pdl=self.pdl, early_release=self.early_release,
                               out=out, zero=zero, l2_prefetch=self._prefetch(True))
        o = merge_decode_partials(attn_out, pdl=self.pdl)
        return self.run(o.view(1, -1), proj, layer=layer, after_attention=True)[0]

    def unfused(self, x, proj, prologue=PLAIN, residual=None, ln_weight=None, eps=1e-6,
                rope: Optional[RopeKV] = None):
        """What `run` computes, as the batched path does it: the op's kernel, the projection
        (proj: an nn.Linear, or any callable(x)), then rope + the cache write. y's k columns
        end rotated, as the fused epilogue leaves them: attention reads this step's k from y
        (triton_attention's newest_kv)."""
        from . import fused_ops
        new_res = None
        if prologue == RMSNORM:
            x = fused_ops.rms_norm(x, ln_weight, eps)
        elif prologue == ADD_RMSNORM:
            x, new_res = fused_ops.fused_add_rms_norm(x, residual, ln_weight, eps)
        elif prologue == SILU_MUL:
            x = fused_ops.silu_and_mul(x)
        y = proj(x)
        if rope is not None:
            hq, hkv, d = rope.num_heads, rope.num_kv_heads, rope.head_dim
            q, k, v = y.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = fused_ops.rope_and_write_kv(q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d),
                                            rope.cos, rope.sin, rope.positions, rope.k_cache,
                                            rope.v_cache, rope.slot_mapping, pdl=self.pdl)
            slots = rope.k_cache.shape[0] * rope.k_cache.shape[1]
            cached = rope.k_cache.view(slots, hkv, d)[rope.slot_mapping.clamp(min=0)].reshape(k.shape)
            k_rot = torch.where((rope.slot_mapping >= 0)[:, None], cached.to(y.dtype), k)  # slot -1: no write
            if q.data_ptr() != y.data_ptr():  # the torch reference rotates out of place
                y = torch.cat([q.reshape(1, -1), k_rot, v], dim=-1)
            else:
                with torch.no_grad():
                    y.narrow(-1, hq * d, hkv * d).copy_(k_rot)
        return y, new_res

    def tune(self, cases: list[tuple]) -> None:
        """cases: (prologue, weight, bias, heads) the model runs; heads (num_heads,
        num_kv_heads, head_dim) when the q/k/v projection carries the rope epilogue, else None.
        Each candidate is timed as 50 calls in one graph over weight copies larger than L2
        (each layer's weights are cold); the unfused ops are timed the same way, rope included.
        Split-K candidates are timed where the output may be an accumulator (SPLIT_K_PROLOGUES,
        no rope) and the forward has the 2 layers a ring needs. A pick that `picks` kept from
        an earlier engine or start is taken without timing (layers/tuning_cache.py)."""
        from .accumulator_ring import AccumulatorRing
        from .skinny_gemm import time_candidates, weight_copies
        for prologue, w, b, heads in cases:
            key = shape_key(prologue, w, b, heads is not None)
            if key in self.configs:
                continue
            split_k = (prologue in SPLIT_K_PROLOGUES and heads is None and self.num_layers >= 2
                       and envs.decode_gemv_split_k() == "on")
            if split_k:
                candidates = CANDIDATES + SPLIT_K_CANDIDATES
            else:
                candidates = CANDIDATES + (NORM_AHEAD_CANDIDATES if prologue in (RMSNORM, ADD_RMSNORM) else ())
            # the shape key and everything else that changes the kernel or what it is timed against
            kept_as = (f"{_PROLOGUE_NAMES[prologue]} {tuple(w.shape)} {w.dtype} bias={b is not None} rope={heads} "
                       f"pdl={self.pdl} early_release={self.early_release} split_k={split_k}")
            kept = self.picks.get(kept_as, candidates)
            if kept is not MISS:
                self.configs[key] = kept
                continue
            k = w.shape[1]
            x = torch.randn(1, 2 * k if prologue == SILU_MUL else k, dtype=w.dtype, device=w.device)
            res = torch.randn_like(x)
            ln = torch.ones(k, dtype=w.dtype, device=w.device)
            rope = None if heads is None else _stand_in_rope(*heads, w.dtype, w.device)
            copies = weight_copies(w, b)
            ring = AccumulatorRing.create(2, w.shape[0], w.device) if split_k else None

            def fused(c, warmup=False):
                acc, zero = ring.for_layer(0) if c.split_k > 1 else (None, None)
                return lambda xx, ww, bb: gemv(xx, ww, bb, prologue=prologue, residual=res, ln_weight=ln, cfg=c,
                                               pdl=self.pdl, rope=rope, early_release=self.early_release,
                                               out=acc, zero=zero, warmup=warmup)

            compile_in_parallel(lambda c=c: fused(c, warmup=True)(x, w, b) for c in candidates)

            times = time_candidates(
                lambda xx, ww, bb: self.unfused(xx, lambda t: F.linear(t, ww, bb), prologue, res, ln, rope=rope),
                fused, candidates, x, copies, f"decode gemv {key}")
            del copies
            self.configs[key] = min(times, key=times.get)
            self.timings[key] = times
            self.picks.put(kept_as, self.configs[key], times[self.configs[key]])
        fused = sum(c is not None for c in self.configs.values())
        logger.info("decode gemv: %d of %d shapes fused (pdl=%s)", fused, len(self.configs), self.pdl)
        for key, cfg in self.configs.items():
            t = self.timings.get(key)
            if t is None:
                logger.info("decode gemv %s: %s (kept in %s)", key, cfg, self.picks.path)
                continue
            logger.info("decode gemv %s: %s, %.2f µs (unfused %.2f µs)", key, cfg,
                        t.get(cfg, float("nan")), t.get(None, float("nan")))


# What a kept pick depends on besides its key: the kernel, how splits accumulate, how it is
# timed, and the unfused ops it is timed against.
_KERNEL_SOURCES = tuple(str(Path(__file__).with_name(f)) for f in
                        ("decode_gemv.py", "triton_support.py", "accumulator_ring.py", "skinny_gemm.py",
                         "fused_ops.py"))


def install(model, mode: str) -> Optional[DecodeGemv]:
    """mode (envs.decode_gemv): "on" (PDL where supported, rope + KV write in the q/k/v
    projection), "implicit" (as on, but a projection lets the next kernel launch only as it
    exits), "pdl" (PDL, rope a kernel of its own), "nopdl" (neither): tune the kernel for
    every projection of the model's one-token forward and route those forwards through it;
    "off": nothing (None)."""
    if mode == "off" or not HAS_TRITON:
        return None
    device = next(model.parameters()).device
    table = DecodeGemv(pdl=(mode in ("on", "pdl", "implicit") and pdl_supported(device)),
                       rope=(mode in ("on", "implicit")), early_release=(mode != "implicit"),
                       merge_attention=envs.decode_attn_reduce() == "oproj", num_layers=len(model.layers),
                       l2_prefetch=envs.decode_gemv_l2_prefetch(),
                       picks=TuningCache.open("decode_gemv", device, _KERNEL_SOURCES))
    s = model.shape
    # The model's forward_one_token decides the same: Qwen3's q/k norm keeps rope apart.
    heads = (s.num_heads, s.num_kv_heads, s.head_dim) if table.rope and not s.qk_norm else None
    cases = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        first = layer is model.layers[0]
        cases += [(RMSNORM if first else ADD_RMSNORM, attn.qkv_proj.weight, attn.qkv_proj.bias, heads),
                  (PLAIN, attn.o_proj.weight, attn.o_proj.bias, None),
                  (ADD_RMSNORM, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, None),
                  (SILU_MUL, mlp.down_proj.weight, mlp.down_proj.bias, None)]
    table.tune(cases)
    table.make_rings(device)
    model.one_token_gemv = table
    return table
