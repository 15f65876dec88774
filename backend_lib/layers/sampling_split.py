"""The sampler's Triton kernels with each row split across many programs.

sampling_kernels.py runs one program per row: at batch 1 one SM walks the whole vocabulary,
and at any batch the slowest row (a top-p row searching its threshold) sets the step's time.
Here every pass over the logits runs on a grid of (chunks x rows) programs writing per-chunk
partials, and a one-program-per-row kernel combines them. The function is the same as
sampling_kernels' (the same noise, the same Gumbel winner with the lowest index on ties, the
same kept sets and threshold rules); only the order of float sums differs.

Passes (every launch is fixed, so the sequence is capturable; rows a stage does not concern
return at once):
    pass1 / combine1   the Gumbel winner (argmax for greedy rows), and for filtered rows the max
                       and min z
    check / combine2   is the winner kept? (count and mass strictly above it, the kept mass)
    ROUNDS x pivots / narrow
                       the threshold search for the rows whose winner was dropped: count or
                       mass at PIVOTS thresholds per round, until the boundary interval holds
                       at most SCRATCH tokens
    gather / resolve   the interval's z values, sorted in registers: the exact threshold
    draw / combine3    the winner over the kept set {z >= threshold}
    fallback           rows the rounds did not resolve (massive ties, top_k > SCRATCH) run
                       sampling_kernels' per-row program
top-k with top-p: the count search gathers every token of z >= lo (at most SCRATCH), so the
top-k threshold and top-p's prefix over the top-k set come from one sorted list.
"""
from __future__ import annotations

import torch

from . import sampling_kernels as rows_impl
from .sampling_kernels import PIVOTS, SCRATCH
from .triton_support import num_sms, tl, triton

ROUNDS = 3           # parallel search rounds before the per-row fallback
SCRATCH_SPLIT = SCRATCH  # boundary tokens sorted per row (tests lower it to reach every path)
STAGE_FALLBACK = 5   # == FALLBACK below, for the host side
BLOCK = 1024         # elements per inner step of a chunk program
PIVOT_BLOCK = 256    # the pivot pass holds [PIVOT_BLOCK, PIVOTS] tiles
MIN_CHUNK, MAX_CHUNK = 1024, 8192
# The pivot passes (PIVOTS thresholds per element) run only for the rows still searching, a
# few of the batch: finer chunks there give those rows enough programs to fill the GPU.
PIVOT_CHUNK_DIVISOR, MIN_PIVOT_CHUNK = 4, 1024
TARGET_PROGRAMS = 2048  # chunks x rows per pass: enough to fill every SM at batch 1
WORKERS_PER_SM = 4      # programs per SM of the passes that walk the work list
PIVOT_WARPS = 4
PASS_WARPS = 4          # pass1 and check, the passes over every row
RESOLVE_WARPS = 32      # one program sorts a row's boundary values (bench.sampler_kernels: 32 > 16 > 8)

if triton is not None:
    from .sampling_kernels import _gumbel, _over_t, _row_key

    # Row stages (state_i[STAGE]).
    DONE = tl.constexpr(0)
    CHECK = tl.constexpr(1)
    SEARCH = tl.constexpr(2)
    GATHER = tl.constexpr(3)
    DRAW = tl.constexpr(4)
    FALLBACK = tl.constexpr(5)
    # Per-row float state: rows of state_f [FIELDS, S].
    F_MAX = tl.constexpr(0)      # max z
    F_ZS = tl.constexpr(1)       # z of the unfiltered winner
    F_TM = tl.constexpr(2)       # min_p threshold (-inf: off)
    F_LO = tl.constexpr(3)       # search interval [lo, hi)
    F_HI = tl.constexpr(4)
    F_TARGET = tl.constexpr(5)   # count (k) or mass (p * kept mass) the threshold must reach
    F_WHI = tl.constexpr(6)      # mass of {z >= hi}
    F_THR = tl.constexpr(7)      # the kept set is {z >= thr}
    F_ZMIN = tl.constexpr(8)     # min finite z
    # Per-row int state: rows of state_i [IFIELDS, S].
    I_STAGE = tl.constexpr(0)
    I_BY_COUNT = tl.constexpr(1)  # 1: top-k search (gather all of z >= lo), 0: top-p
    I_CHI = tl.constexpr(2)       # count of {z >= hi}
    I_GATHERED = tl.constexpr(3)  # tokens written to scratch (atomic)
    I_TOK = tl.constexpr(4)       # the unfiltered winner

    @triton.jit
    def _dense(written_ptr, row, DUAL: tl.constexpr):
        """Does this row's data come from the (float32) logits? Without DUAL every row does;
        with it only the rows written_ptr marks, the others come from the raw logits."""
        if DUAL:
            d = tl.load(written_ptr + row) != 0
        else:
            d = tl.full((), 1, tl.int1)
        return d

    @triton.jit
    def _load_x(row_ptr, raw_row, dense, offs, mask, other):
        if dense:
            x = tl.load(row_ptr + offs, mask=mask, other=other).to(tl.float32)
        else:
            x = tl.load(raw_row + offs, mask=mask, other=other).to(tl.float32)
        return x

    @triton.jit
    def _keep_better(score, offs, best_v, best_i):
        """Per-lane running winners (reduced once, by _lane_winner): strict > keeps a lane's
        lowest index on ties, as lanes see increasing offsets."""
        upd = score > best_v
        return tl.where(upd, score, best_v), tl.where(upd, offs, best_i)

    @triton.jit
    def _lane_winner(best_v, best_i):
        """(best score, its lowest index) over the lanes; all -inf: index 0, as argmax."""
        best = tl.max(best_v, axis=0)
        tok = tl.min(tl.where(best_v == best, best_i, 2147483647), axis=0)
        return best, tl.where(best > float("-inf"), tok, 0)

    @triton.jit
    def _filters(top_k_ptr, top_p_ptr, min_p_ptr, row, V):
        k = tl.load(top_k_ptr + row).to(tl.int32)
        p = tl.load(top_p_ptr + row)
        mp = tl.load(min_p_ptr + row)
        return k, p, mp, (k > 0) & (k < V), p < 1.0, mp > 0.0

    @triton.jit
    def _pass1(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
               temp_ptr, seed_ptr, pos_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
               part_f, part_i, C,
               USE_FILTERS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Per chunk: the winner (score, index) and, for filtered rows, max / min finite z.
        part_f [3, S, C] (best, max z, min z), part_i [S, C]."""
        c = tl.program_id(0)
        row = tl.program_id(1)
        SC = tl.num_programs(1) * C
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        raw_row = raw_ptr + row.to(tl.int64) * raw_stride
        dense = _dense(written_ptr, row, DUAL)
        T = tl.load(temp_ptr + row)
        ninf = float("-inf")
        first = c * CHUNK
        # Per-lane running values, reduced once at the end: a block reduction per step would
        # cost more than the step's arithmetic.
        best_v = tl.full((BLOCK,), ninf, tl.float32)
        best_i = tl.zeros((BLOCK,), dtype=tl.int32)
        m_v = tl.full((BLOCK,), ninf, tl.float32)
        zmin_v = tl.full((BLOCK,), float("inf"), tl.float32)
        if T > 0:
            key = _row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
            stats = False
            if USE_FILTERS:
                k, p, mp, k_on, p_on, mp_on = _filters(top_k_ptr, top_p_ptr, min_p_ptr, row, V)
                stats = k_on | p_on | mp_on
            for sub in range(0, CHUNK, BLOCK):
                offs = first + sub + tl.arange(0, BLOCK)
                inb = offs < V
                x = _load_x(row_ptr, raw_row, dense, offs, inb, ninf)
                z = _over_t(x, T)
                s = tl.where(inb, z + _gumbel(key, offs), ninf)
                best_v, best_i = _keep_better(s, offs, best_v, best_i)
                if stats:
                    m_v = tl.maximum(m_v, z)
                    zmin_v = tl.minimum(zmin_v, tl.where(z > ninf, z, float("inf")))
        else:
            for sub in range(0, CHUNK, BLOCK):
                offs = first + sub + tl.arange(0, BLOCK)
                x = _load_x(row_ptr, raw_row, dense, offs, offs < V, ninf)
                best_v, best_i = _keep_better(x, offs, best_v, best_i)
        best, tok = _lane_winner(best_v, best_i)
        m = tl.max(m_v, axis=0)
        zmin = tl.min(zmin_v, axis=0)
        at = row * C + c
        tl.store(part_f + at, best)
        tl.store(part_f + SC + at, m)
        tl.store(part_f + 2 * SC + at, zmin)
        tl.store(part_i + at, tok)

    @triton.jit
    def _winner(part_f, part_i, row, C, CMAX: tl.constexpr):
        """The lowest index among the chunks' best scores (all -inf: index 0, as argmax)."""
        o = tl.arange(0, CMAX)
        inc = o < C
        pb = tl.load(part_f + row * C + o, mask=inc, other=float("-inf"))
        pi = tl.load(part_i + row * C + o, mask=inc, other=2147483647)
        best, tok = _lane_winner(pb, pi)  # padding: -inf scores, never the lowest index
        return tok

    @triton.jit
    def _combine1(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
                  temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_f, part_i, C,
                  out_ptr, state_f, state_i, work_ptr,
                  USE_FILTERS: tl.constexpr, CMAX: tl.constexpr):
        row = tl.program_id(0)
        S = tl.num_programs(0)
        SC = S * C
        tok = _winner(part_f, part_i, row, C, CMAX)
        tl.store(out_ptr + row, tok.to(tl.int64))
        if USE_FILTERS:
            if row == 0:
                tl.store(work_ptr, 0)   # _combine2 appends to the work list
            stage = tl.zeros((), dtype=tl.int32)
            T = tl.load(temp_ptr + row)
            tl.store(state_i + I_GATHERED * S + row, 0)
            if T > 0:
                k, p, mp, k_on, p_on, mp_on = _filters(top_k_ptr, top_p_ptr, min_p_ptr, row, V)
                if k_on | p_on | mp_on:
                    ninf = float("-inf")
                    o = tl.arange(0, CMAX)
                    inc = o < C
                    m = tl.max(tl.load(part_f + SC + row * C + o, mask=inc, other=ninf), axis=0)
                    zmin = tl.min(tl.load(part_f + 2 * SC + row * C + o, mask=inc, other=float("inf")), axis=0)
                    t_m = tl.where(mp_on, m + tl.log(tl.maximum(mp, 1e-30)), ninf)
                    x_s = _load_x(logits_ptr + row.to(tl.int64) * stride, raw_ptr + row.to(tl.int64) * raw_stride,
                                  _dense(written_ptr, row, DUAL), tok, tok >= 0, 0.0)
                    z_s = _over_t(x_s, T)
                    tl.store(state_f + F_MAX * S + row, m)
                    tl.store(state_f + F_ZS * S + row, z_s)
                    tl.store(state_f + F_TM * S + row, t_m)
                    tl.store(state_f + F_ZMIN * S + row, zmin)
                    tl.store(state_f + F_THR * S + row, tl.maximum(t_m, zmin))
                    tl.store(state_i + I_TOK * S + row, tok)
                    stage = tl.where(k_on | p_on, CHECK, tl.where(z_s < t_m, DRAW, DONE))
            tl.store(state_i + I_STAGE * S + row, stage)

    @triton.jit
    def _check(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
               temp_ptr, state_f, state_i, part_f, part_i, C,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Per chunk, for CHECK rows: count and mass of {z > z_s, z >= t_m}, mass of {z >= t_m}.
        part_f [2, S, C] (mass above, kept mass), part_i [S, C]."""
        c = tl.program_id(0)
        row = tl.program_id(1)
        S = tl.num_programs(1)
        if tl.load(state_i + I_STAGE * S + row) == CHECK:
            row_ptr = logits_ptr + row.to(tl.int64) * stride
            raw_row = raw_ptr + row.to(tl.int64) * raw_stride
            dense = _dense(written_ptr, row, DUAL)
            T = tl.load(temp_ptr + row)
            m = tl.load(state_f + F_MAX * S + row)
            z_s = tl.load(state_f + F_ZS * S + row)
            t_m = tl.load(state_f + F_TM * S + row)
            c_gt = tl.zeros((BLOCK,), dtype=tl.int32)   # per lane, reduced once at the end
            w_gt = tl.zeros((BLOCK,), dtype=tl.float32)
            w_all = tl.zeros((BLOCK,), dtype=tl.float32)
            for sub in range(0, CHUNK, BLOCK):
                offs = c * CHUNK + sub + tl.arange(0, BLOCK)
                x = _load_x(row_ptr, raw_row, dense, offs, offs < V, float("-inf"))
                z = _over_t(x, T)
                e = tl.where(z >= t_m, tl.exp(z - m), 0.0)
                gt = (z > z_s) & (z >= t_m)
                c_gt += gt.to(tl.int32)
                w_gt += tl.where(gt, e, 0.0)
                w_all += e
            at = row * C + c
            tl.store(part_f + at, tl.sum(w_gt, axis=0))
            tl.store(part_f + S * C + at, tl.sum(w_all, axis=0))
            tl.store(part_i + at, tl.sum(c_gt, axis=0))

    @triton.jit
    def _combine2(V, top_k_ptr, top_p_ptr, min_p_ptr, state_f, state_i, part_f, part_i, C, work_ptr,
                  CMAX: tl.constexpr):
        """Kept winner: done. Else set up the search (sampling_kernels' rule: top-k by count
        first, top-p by mass), starting at z_s when the winner is dropped by that filter.
        Every row not done by now goes on the work list (work_ptr[0] rows at work_ptr[1:])."""
        row = tl.program_id(0)
        S = tl.num_programs(0)
        stage = tl.load(state_i + I_STAGE * S + row)
        if stage == CHECK:
            k, p, mp, k_on, p_on, mp_on = _filters(top_k_ptr, top_p_ptr, min_p_ptr, row, V)
            o = tl.arange(0, CMAX)
            inc = o < C
            w_gt = tl.sum(tl.load(part_f + row * C + o, mask=inc, other=0.0), axis=0)
            w_all = tl.sum(tl.load(part_f + S * C + row * C + o, mask=inc, other=0.0), axis=0)
            c_gt = tl.sum(tl.load(part_i + row * C + o, mask=inc, other=0), axis=0)
            z_s = tl.load(state_f + F_ZS * S + row)
            t_m = tl.load(state_f + F_TM * S + row)
            floor = tl.load(state_f + F_THR * S + row)   # max(t_m, zmin)
            kept = (z_s >= t_m) & ((k_on == 0) | (c_gt < k))
            kept = kept & ((p_on == 0) | ((k_on == 0) & (w_gt < p * w_all)))
            if kept == 0:
                if k_on:
                    lo = tl.where((z_s >= t_m) & (c_gt >= k), z_s, floor)
                    target = k.to(tl.float32)
                else:
                    target = p * w_all
                    lo = tl.where((z_s >= t_m) & (w_gt >= target), z_s, floor)
                tl.store(state_f + F_LO * S + row, lo)
                tl.store(state_f + F_HI * S + row, tl.load(state_f + F_MAX * S + row))
                tl.store(state_f + F_TARGET * S + row, target)
                tl.store(state_i + I_BY_COUNT * S + row, k_on.to(tl.int32))
            stage = tl.where(kept, DONE, SEARCH)
            tl.store(state_i + I_STAGE * S + row, stage)
        if stage != DONE:
            tl.store(work_ptr + 1 + tl.atomic_add(work_ptr, 1), row)

    @triton.jit
    def _pivot_values(state_f, row, S, PIVOTS: tl.constexpr):
        j = tl.arange(0, PIVOTS)
        lo = tl.load(state_f + F_LO * S + row)
        hi = tl.load(state_f + F_HI * S + row)
        piv = lo + (hi - lo) * (j.to(tl.float32) / (PIVOTS - 1))
        return tl.where(j == PIVOTS - 1, hi, piv)

    @triton.jit
    def _pivots(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
                temp_ptr, state_f, state_i, part_f, part_i, C, S, work_ptr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
        """Per chunk, for SEARCH rows: count and mass of {z >= pivot} at each pivot.
        part_f, part_i [S, C, PIVOTS]."""
        for item in range(tl.program_id(0), tl.load(work_ptr) * C, tl.num_programs(0)):
            row = tl.load(work_ptr + 1 + item // C)
            c = item % C
            _pivots_chunk(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL, V,
                          temp_ptr, state_f, state_i, part_f, part_i, C, S, row, c,
                          CHUNK, BLOCK, PIVOTS)

    @triton.jit
    def _pivots_chunk(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
                      temp_ptr, state_f, state_i, part_f, part_i, C, S, row, c,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
        if tl.load(state_i + I_STAGE * S + row) == SEARCH:
            row_ptr = logits_ptr + row.to(tl.int64) * stride
            raw_row = raw_ptr + row.to(tl.int64) * raw_stride
            dense = _dense(written_ptr, row, DUAL)
            T = tl.load(temp_ptr + row)
            m = tl.load(state_f + F_MAX * S + row)
            piv = _pivot_values(state_f, row, S, PIVOTS)
            cnt = tl.zeros([BLOCK, PIVOTS], dtype=tl.int32)   # per lane, reduced once at the end
            mass = tl.zeros([BLOCK, PIVOTS], dtype=tl.float32)
            for sub in range(0, CHUNK, BLOCK):
                offs = c * CHUNK + sub + tl.arange(0, BLOCK)
                x = _load_x(row_ptr, raw_row, dense, offs, offs < V, float("-inf"))
                z = _over_t(x, T)
                ge = z[:, None] >= piv[None, :]
                cnt += ge.to(tl.int32)
                mass += tl.where(ge, tl.exp(z - m)[:, None], 0.0)
            at = (row * C + c) * PIVOTS + tl.arange(0, PIVOTS)
            tl.store(part_f + at, tl.sum(mass, axis=0))
            tl.store(part_i + at, tl.sum(cnt, axis=0))

    @triton.jit
    def _pick(vals, j, at):
        return tl.sum(tl.where(j == at, vals, 0), axis=0)

    @triton.jit
    def _narrow(state_f, state_i, part_f, part_i, C,
                FIRST: tl.constexpr, LAST: tl.constexpr, CMAX: tl.constexpr, PIVOTS: tl.constexpr,
                SCRATCH: tl.constexpr):
        """One search round's decision (sampling_kernels._search's loop body). Top-k rows
        narrow until {z >= lo} fits SCRATCH; top-p rows until [lo, hi) does."""
        row = tl.program_id(0)
        S = tl.num_programs(0)
        if tl.load(state_i + I_STAGE * S + row) == SEARCH:
            j = tl.arange(0, PIVOTS)
            o = tl.arange(0, CMAX)
            at = (row * C + o[:, None]) * PIVOTS + j[None, :]
            inc = (o < C)[:, None]
            cnt = tl.sum(tl.load(part_i + at, mask=inc, other=0), axis=0)
            mass = tl.sum(tl.load(part_f + at, mask=inc, other=0.0), axis=0)
            piv = _pivot_values(state_f, row, S, PIVOTS)
            target = tl.load(state_f + F_TARGET * S + row)
            by_count = tl.load(state_i + I_BY_COUNT * S + row) != 0
            ok = tl.where(by_count, cnt.to(tl.float32) >= target, mass >= target)
            js = tl.max(tl.where(ok, j, 0), axis=0)
            no_op = tl.sum(tl.where(j == 0, ok.to(tl.int32), 0), axis=0) == 0
            at_max = js == PIVOTS - 1
            # top-k: {z >= piv[js]} holds the k-th largest (or everything, when F(lo) < k).
            c_at = _pick(cnt, j, js)
            gather_c = c_at <= SCRATCH
            # ... unless more than SCRATCH tokens tie at the boundary, or k > SCRATCH.
            fallback_c = (c_at > SCRATCH) & (at_max | no_op)
            # top-p: on the first round the filter may keep the whole domain, or only the max.
            draw_m = (no_op | at_max) & FIRST
            jm = tl.minimum(js, PIVOTS - 2)
            c_lo = _pick(cnt, j, jm)
            c_hi = _pick(cnt, j, jm + 1)
            gather_m = (draw_m == 0) & (c_lo - c_hi <= SCRATCH)
            stage = tl.where(by_count, tl.where(gather_c, GATHER, tl.where(fallback_c, FALLBACK, SEARCH)),
                             tl.where(draw_m, DRAW, tl.where(gather_m, GATHER, SEARCH)))
            if LAST:
                stage = tl.where(stage == SEARCH, FALLBACK, stage)
            tl.store(state_f + F_LO * S + row, tl.where(by_count, _pick(piv, j, js), _pick(piv, j, jm)))
            tl.store(state_f + F_HI * S + row, tl.where(by_count, _pick(piv, j, js + 1), _pick(piv, j, jm + 1)))
            tl.store(state_f + F_WHI * S + row, _pick(mass, j, jm + 1))
            tl.store(state_f + F_THR * S + row, tl.where(no_op, _pick(piv, j, 0), _pick(piv, j, PIVOTS - 1)))
            tl.store(state_i + I_CHI * S + row, c_hi)
            tl.store(state_i + I_STAGE * S + row, stage)

    @triton.jit
    def _gather(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
                temp_ptr, state_f, state_i, scratch_ptr, C, S, work_ptr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr, SCRATCH: tl.constexpr):
        """GATHER rows: append the z values of the boundary set to the row's scratch (any
        order: resolve sorts them)."""
        for item in range(tl.program_id(0), tl.load(work_ptr) * C, tl.num_programs(0)):
            row = tl.load(work_ptr + 1 + item // C)
            c = item % C
            _gather_chunk(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL, V,
                          temp_ptr, state_f, state_i, scratch_ptr, S, row, c,
                          CHUNK, BLOCK, SCRATCH)

    @triton.jit
    def _gather_chunk(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
                      temp_ptr, state_f, state_i, scratch_ptr, S, row, c,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr, SCRATCH: tl.constexpr):
        if tl.load(state_i + I_STAGE * S + row) == GATHER:
            row_ptr = logits_ptr + row.to(tl.int64) * stride
            raw_row = raw_ptr + row.to(tl.int64) * raw_stride
            dense = _dense(written_ptr, row, DUAL)
            T = tl.load(temp_ptr + row)
            lo = tl.load(state_f + F_LO * S + row)
            # top-k rows gather all of {z >= lo}
            hi = tl.where(tl.load(state_i + I_BY_COUNT * S + row) != 0, float("inf"),
                          tl.load(state_f + F_HI * S + row))
            out = scratch_ptr + row.to(tl.int64) * SCRATCH
            for sub in range(0, CHUNK, BLOCK):
                offs = c * CHUNK + sub + tl.arange(0, BLOCK)
                x = _load_x(row_ptr, raw_row, dense, offs, offs < V, float("-inf"))
                z = _over_t(x, T)
                inside = (z >= lo) & (z < hi)
                n = tl.sum(inside.to(tl.int32), axis=0)
                if n > 0:
                    base = tl.atomic_add(state_i + I_GATHERED * S + row, n)
                    pos = base + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                    tl.store(out + pos, z, mask=inside & (pos < SCRATCH))

    @triton.jit
    def _resolve(top_k_ptr, top_p_ptr, state_f, state_i, scratch_ptr, SCRATCH: tl.constexpr):
        """GATHER rows: sort the boundary values, apply the prefix rule -> threshold."""
        row = tl.program_id(0)
        S = tl.num_programs(0)
        if tl.load(state_i + I_STAGE * S + row) == GATHER:
            n = tl.minimum(tl.load(state_i + I_GATHERED * S + row), SCRATCH)
            m = tl.load(state_f + F_MAX * S + row)
            o = tl.arange(0, SCRATCH)
            valid = o < n
            v = tl.load(scratch_ptr + row.to(tl.int64) * SCRATCH + o, mask=valid, other=float("-inf"))
            v = tl.sort(v, 0, descending=True)
            if tl.load(state_i + I_BY_COUNT * S + row) != 0:
                k = tl.load(top_k_ptr + row).to(tl.int32)
                i = tl.maximum(tl.minimum(k, n) - 1, 0)
                thr = tl.sum(tl.where(o == i, v, 0.0), axis=0)
                p = tl.load(top_p_ptr + row)
                if p < 1.0:
                    # top-p over the top-k set (renormalized): the prefix rule on the same list.
                    in_k = valid & (v >= thr)
                    e = tl.where(in_k, tl.exp(v - m), 0.0)
                    before = tl.cumsum(e, axis=0) - e
                    n_keep = tl.sum((in_k & (before < p * tl.sum(e, axis=0))).to(tl.int32), axis=0)
                    thr = tl.sum(tl.where(o == tl.maximum(n_keep - 1, 0), v, 0.0), axis=0)
            else:
                e = tl.where(valid, tl.exp(v - m), 0.0)
                before = tl.load(state_f + F_WHI * S + row) + tl.cumsum(e, axis=0) - e
                target = tl.load(state_f + F_TARGET * S + row)
                n_keep = tl.sum((valid & (before < target)).to(tl.int32), axis=0)
                thr = tl.sum(tl.where(o == tl.maximum(n_keep - 1, 0), v, 0.0), axis=0)
            tl.store(state_f + F_THR * S + row, thr)
            tl.store(state_i + I_STAGE * S + row, DRAW)

    @triton.jit
    def _draw(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
              temp_ptr, seed_ptr, pos_ptr, state_f, state_i, part_f, part_i, C, S,
              work_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """DRAW rows, per chunk: the Gumbel winner over {z >= thr}. part_f, part_i [S, C]."""
        for item in range(tl.program_id(0), tl.load(work_ptr) * C, tl.num_programs(0)):
            row = tl.load(work_ptr + 1 + item // C)
            c = item % C
            _draw_chunk(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL, V,
                        temp_ptr, seed_ptr, pos_ptr, state_f, state_i, part_f, part_i,
                        C, S, row, c, CHUNK, BLOCK)

    @triton.jit
    def _draw_chunk(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, DUAL: tl.constexpr, V,
                    temp_ptr, seed_ptr, pos_ptr, state_f, state_i, part_f, part_i,
                    C, S, row, c, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(state_i + I_STAGE * S + row) == DRAW:
            row_ptr = logits_ptr + row.to(tl.int64) * stride
            raw_row = raw_ptr + row.to(tl.int64) * raw_stride
            dense = _dense(written_ptr, row, DUAL)
            T = tl.load(temp_ptr + row)
            thr = tl.load(state_f + F_THR * S + row)
            key = _row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
            ninf = float("-inf")
            best_v = tl.full((BLOCK,), ninf, tl.float32)
            best_i = tl.zeros((BLOCK,), dtype=tl.int32)
            first = c * CHUNK
            for sub in range(0, CHUNK, BLOCK):
                offs = first + sub + tl.arange(0, BLOCK)
                inb = offs < V
                x = _load_x(row_ptr, raw_row, dense, offs, inb, ninf)
                z = _over_t(x, T)
                s = tl.where(inb & (z >= thr), z + _gumbel(key, offs), ninf)
                best_v, best_i = _keep_better(s, offs, best_v, best_i)
            best, tok = _lane_winner(best_v, best_i)
            tl.store(part_f + row * C + c, best)
            tl.store(part_i + row * C + c, tok)

    @triton.jit
    def _densify(logits_ptr, stride, raw_ptr, raw_stride, written_ptr, V, state_i, S, work_ptr, C,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """FALLBACK rows read from the raw logits get their float32 rows: the per-row kernel
        that finishes them reads one tensor."""
        for item in range(tl.program_id(0), tl.load(work_ptr) * C, tl.num_programs(0)):
            row = tl.load(work_ptr + 1 + item // C)
            c = item % C
            if (tl.load(state_i + I_STAGE * S + row) == FALLBACK) & (tl.load(written_ptr + row) == 0):
                for sub in range(0, CHUNK, BLOCK):
                    offs = c * CHUNK + sub + tl.arange(0, BLOCK)
                    inb = offs < V
                    x = tl.load(raw_ptr + row.to(tl.int64) * raw_stride + offs, mask=inb).to(tl.float32)
                    tl.store(logits_ptr + row.to(tl.int64) * stride + offs, x, mask=inb)

    @triton.jit
    def _combine3(state_i, part_f, part_i, C, out_ptr, CMAX: tl.constexpr):
        row = tl.program_id(0)
        S = tl.num_programs(0)
        if tl.load(state_i + I_STAGE * S + row) == DRAW:
            tl.store(out_ptr + row, _winner(part_f, part_i, row, C, CMAX).to(tl.int64))

    @triton.jit
    def _mask_ids_kernel(logits_ptr, stride, banned_ptr, banned_stride, NB, stop_ptr, stop_stride, NS,
                         left_ptr, BLOCK: tl.constexpr):
        """sampler.apply_masks_ in one launch: -inf at the row's banned ids, and at its stop ids
        while min_tokens is not reached (ids < 0 are padding)."""
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        o = tl.arange(0, BLOCK)
        for start in range(0, NB, BLOCK):
            ids = tl.load(banned_ptr + row * banned_stride + start + o, mask=start + o < NB, other=-1)
            tl.store(row_ptr + ids, float("-inf"), mask=ids >= 0)
        if tl.load(left_ptr + row) > 0:
            for start in range(0, NS, BLOCK):
                ids = tl.load(stop_ptr + row * stop_stride + start + o, mask=start + o < NS, other=-1)
                tl.store(row_ptr + ids, float("-inf"), mask=ids >= 0)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunk_size(rows: int, vocab: int) -> int:
    """Tokens per chunk program: about TARGET_PROGRAMS programs per pass, within bounds."""
    want = -(-vocab * rows // TARGET_PROGRAMS)
    return max(MIN_CHUNK, min(MAX_CHUNK, _pow2(want)))


def sample_rows_split(logits: torch.Tensor, st, use_filters: bool, clean_rows=None) -> torch.Tensor:
    """sampling_kernels.sample_rows_kernel's function, each row split across chunk programs.
    clean_rows=(raw [S, V], written [S] int32): `logits` holds only the rows written marks;
    the others are read from raw (penalties.upcast_apply_sparse made them so)."""
    s, v = logits.shape
    logits = logits.contiguous()
    dev = logits.device
    chunk = chunk_size(s, v)
    c = -(-v // chunk)
    cmax = _pow2(c)
    temp, seed, pos = st.temperature.contiguous(), st.seed.contiguous(), st.position.contiguous()
    top_k, top_p = st.top_k.contiguous(), st.top_p.contiguous()
    min_p = (st.min_p if st.min_p is not None else rows_impl._zeros(s, str(dev))[:s]).contiguous()
    chunk_p = max(MIN_PIVOT_CHUNK, chunk // PIVOT_CHUNK_DIVISOR)
    c_p = -(-v // chunk_p)
    out = torch.empty(s, dtype=torch.int64, device=dev)
    part_f = torch.empty(s * max(3 * c, c_p * PIVOTS if use_filters else 0), dtype=torch.float32, device=dev)
    part_i = torch.empty(s * max(c, c_p * PIVOTS if use_filters else 0), dtype=torch.int32, device=dev)
    raw, written = clean_rows if clean_rows is not None else (logits, out)
    raw = raw.contiguous()
    # every pass over the logits takes the same source arguments
    src = (logits, logits.stride(0), raw, raw.stride(0), written, clean_rows is not None, v)
    grid = (c, s)
    _pass1[grid](*src, temp, seed, pos, top_k, top_p, min_p, part_f, part_i, c,
                 USE_FILTERS=use_filters, CHUNK=chunk, BLOCK=BLOCK, num_warps=PASS_WARPS)
    state_f = torch.empty(9 * s if use_filters else 1, dtype=torch.float32, device=dev)
    state_i = torch.empty(5 * s if use_filters else 1, dtype=torch.int32, device=dev)
    work = torch.empty(s + 1 if use_filters else 1, dtype=torch.int32, device=dev)
    _combine1[(s,)](*src, temp, top_k, top_p, min_p, part_f, part_i, c, out, state_f, state_i, work,
                    USE_FILTERS=use_filters, CMAX=cmax, num_warps=1)
    if not use_filters:
        return out
    _check[grid](*src, temp, state_f, state_i, part_f, part_i, c, CHUNK=chunk, BLOCK=BLOCK, num_warps=PASS_WARPS)
    _combine2[(s,)](v, top_k, top_p, min_p, state_f, state_i, part_f, part_i, c, work, CMAX=cmax, num_warps=1)
    # The later passes concern the few rows on the work list: a grid of (chunks x rows)
    # programs would spend its time launching programs that exit at once.
    workers = (min(c_p * s, WORKERS_PER_SM * num_sms(dev)),)
    for r in range(ROUNDS):
        _pivots[workers](*src, temp, state_f, state_i, part_f, part_i, c_p, s, work,
                         CHUNK=chunk_p, BLOCK=PIVOT_BLOCK, PIVOTS=PIVOTS, num_warps=PIVOT_WARPS)
        _narrow[(s,)](state_f, state_i, part_f, part_i, c_p, FIRST=r == 0, LAST=r == ROUNDS - 1,
                      CMAX=_pow2(c_p), PIVOTS=PIVOTS, SCRATCH=SCRATCH_SPLIT, num_warps=4)
    scratch = torch.empty(s * SCRATCH_SPLIT, dtype=torch.float32, device=dev)
    _gather[workers](*src, temp, state_f, state_i, scratch, c, s, work,
                     CHUNK=chunk, BLOCK=BLOCK, SCRATCH=SCRATCH_SPLIT, num_warps=4)
    _resolve[(s,)](top_k, top_p, state_f, state_i, scratch, SCRATCH=SCRATCH_SPLIT, num_warps=RESOLVE_WARPS)
    _draw[workers](*src, temp, seed, pos, state_f, state_i, part_f, part_i, c, s, work,
                   CHUNK=chunk, BLOCK=BLOCK, num_warps=4)
    _combine3[(s,)](state_i, part_f, part_i, c, out, CMAX=cmax, num_warps=1)
    if clean_rows is not None:
        _densify[workers](logits, logits.stride(0), raw, raw.stride(0), written, v, state_i, s, work, c,
                          CHUNK=chunk, BLOCK=BLOCK, num_warps=4)
    rows_impl.sample_rows_kernel(logits, st, True, only_stage=(state_i[:s], STAGE_FALLBACK), out=out)
    return out


def apply_masks_kernel(logits: torch.Tensor, st) -> torch.Tensor:
    """sampler.apply_masks_ in one launch (in place on contiguous logits)."""
    s = logits.shape[0]
    banned, stops = st.banned_ids.contiguous(), st.min_stop_ids.contiguous()
    _mask_ids_kernel[(s,)](logits, logits.stride(0), banned, banned.stride(0), banned.shape[1],
                           stops, stops.stride(0), stops.shape[1], st.min_tokens_left.contiguous(),
                           BLOCK=64, num_warps=1)
    return logits
