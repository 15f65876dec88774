"""Triton kernels (CUDA) for the sampler and the penalties: the same functions as the torch
definitions in sampler.py / penalties.py, without sorting the vocabulary and without
[rows x vocab] temporaries.

One program per row (IMPL "rows"; "split", the default, runs sampling_split.py's kernels, the
same function with each row across many programs), so each row pays only for its own filters:

- greedy row: one pass (argmax).
- temperature row: one pass (argmax of z + gumbel, the noise hashed in registers).
- filtered row (min_p / top-k / top-p): the first pass also tracks max z, the softmax mass
  and the Gumbel winner over the whole vocabulary. Gumbel-max over the kept set equals the
  unfiltered winner whenever that winner is kept, and is kept iff fewer than top_k tokens and
  less than top_p of the mass lie strictly above it (one more pass; min_p needs none). Only
  rows whose winner falls outside the kept set search the exact threshold: passes that count
  the mass above 16 pivots at once narrow the interval holding the boundary until it holds
  at most SCRATCH tokens, which are gathered and sorted in registers (the same prefix rule
  as the sort-based definition), then one pass draws the winner over the kept tokens.

Rounding: z = logits / temperature is IEEE division (as in torch); exp/log are the GPU's,
so scores may differ from torch's in the last bits (near-ties can break differently).
"""
from __future__ import annotations

import functools

import torch

from .. import envs

from .triton_support import INTERPRET, num_sms, tl, triton  # None without Triton: the torch path runs there

BLOCK = 1024
PIVOTS = 16          # thresholds evaluated per search pass (the interval shrinks 15x a pass)
SCRATCH = 2048       # boundary tokens resolved by sorting in registers
MAX_ROUNDS = 12      # search passes before giving up on exactness (ties): keep the interval
# "split": each row across many programs (sampling_split.py); "rows": one program per row.
# Read when a step's kernels are launched (captured graphs keep the choice they were built with).
IMPL = envs.sampler_impl()


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:
    @triton.jit
    def _hash32(x):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _row_key(seed, position):
        # sampler.row_keys in uint32: hash(hash(seed low) ^ seed high ^ hash(position + phi)).
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = (seed >> 32).to(tl.uint32)
        p = ((position + 0x9E3779B9) & 0xFFFFFFFF).to(tl.uint32)
        return _hash32(_hash32(lo) ^ hi ^ _hash32(p))

    # The passes over the logits are compute-bound at batch 256 (39 M elements a step): the
    # noise uses the GPU's log2 unit (lg2.approx, absolute error ~2^-22) instead of libdevice's
    # logf (~10 FMAs an element), and z = x / T divides by one reciprocal per row. The
    # interpreter has no inline PTX and rounds tl.fma twice: it keeps tl.log and div_rn.
    GPU_MATH = tl.constexpr(not INTERPRET)
    LN2 = tl.constexpr(0.6931471805599453)

    @triton.jit
    def _log2_approx(x):
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _over_t(x, T):
        """x / T, rounded as IEEE division (torch's): with r = RN(1/T), q = RN(x r) and the exact
        remainder x - qT, RN(q + (x - qT) r) is RN(x / T) (Markstein's theorem; off by an ulp
        only where the remainder underflows, |x| < ~2^-100). An infinite q (-inf, a masked
        logit, or an overflow) is the quotient. 1/T is finite: a sampled row's T is >= 1e-5
        (request.SAMPLING_EPS; below it a row is greedy). div_rn spends ~10 instructions and a
        slow-path branch on every element; here the reciprocal is per row."""
        if GPU_MATH:
            r = tl.math.div_rn(1.0, T)
            q = x * r
            z = tl.where(tl.abs(q) < float("inf"), tl.fma(tl.fma(-q, T, x), r, q), q)
        else:
            z = tl.math.div_rn(x, T)
        return z

    @triton.jit
    def _gumbel(key, idx):
        # key: uint32 scalar, idx: int32 block -> Gumbel noise, bit-equal uniforms to torch's.
        h = _hash32(key * 0x01000193 + idx.to(tl.uint32))
        bits = h >> 9
        if GPU_MATH:
            # w = bits + 0.5 without an int-to-float conversion (a quarter-rate instruction):
            # 2^23 + bits is the float whose mantissa is bits. u and v = 1 - u are exact.
            w = (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388607.5
            u = w * (1.0 / 8388608.0)
            v = (8388608.0 - w) * (1.0 / 8388608.0)
            # -log(u) near u = 1 decides the largest noise, the winners: lg2.approx's absolute
            # error would swamp it there, so that end uses the series of -log(1 - v)
            # (relative error < 2e-7 for v < 1/32). Elsewhere, and for the outer log, the
            # absolute error moves the noise by < 1e-5.
            near_one = v * (1.0 + v * (0.5 + v * (0.3333333333 + v * (0.25 + v * 0.2))))
            e = tl.where(v < 0.03125, near_one, _log2_approx(u) * -LN2)
            g = _log2_approx(e) * -LN2
        else:
            g = -tl.log(-tl.log((bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)))
        return g

    @triton.jit
    def _search(row_ptr, V, T, M, lo, hi, target, scratch_ptr,
                BY_COUNT: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                SCRATCH: tl.constexpr, MAX_ROUNDS: tl.constexpr):
        """The largest z value t >= lo with F(t) >= target, F(t) = count (BY_COUNT) or
        softmax mass (relative to exp(M)) of {z >= t}. Invariant: F(lo) >= target."""
        j = tl.arange(0, PIVOTS)
        c_in = SCRATCH + 1     # tokens in [lo, hi); > SCRATCH: keep narrowing
        c_hi = 0               # count of {z >= hi}
        w_hi = 0.0             # mass of {z >= hi}
        done = lo >= hi
        thr = lo
        r = 0
        while (r < MAX_ROUNDS) & (c_in > SCRATCH) & (done == 0):
            piv = lo + (hi - lo) * (j.to(tl.float32) / (PIVOTS - 1))
            piv = tl.where(j == PIVOTS - 1, hi, piv)
            cnt = tl.zeros([PIVOTS], dtype=tl.int32)
            mass = tl.zeros([PIVOTS], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                z = _over_t(x, T)
                ge = z[:, None] >= piv[None, :]
                cnt += tl.sum(ge.to(tl.int32), axis=0)
                mass += tl.sum(tl.where(ge, tl.exp(z - M)[:, None], 0.0), axis=0)
            if BY_COUNT:
                ok = cnt >= target
            else:
                ok = mass >= target
            js = tl.max(tl.where(ok, j, 0), axis=0)
            no_op = tl.sum(tl.where(j == 0, ok.to(tl.int32), 0), axis=0) == 0
            at_max = js == PIVOTS - 1
            js = tl.minimum(js, PIVOTS - 2)
            new_lo = tl.sum(tl.where(j == js, piv, 0.0), axis=0)
            new_hi = tl.sum(tl.where(j == js + 1, piv, 0.0), axis=0)
            c_lo = tl.sum(tl.where(j == js, cnt, 0), axis=0)
            c_hi = tl.sum(tl.where(j == js + 1, cnt, 0), axis=0)
            w_hi = tl.sum(tl.where(j == js + 1, mass, 0.0), axis=0)
            c_in = c_lo - c_hi
            thr = new_lo
            if r == 0:
                # F(lo) < target: the filter keeps the whole domain (e.g. top_k >= its size).
                # hi is the row's max on the first pass: F(max) >= target keeps only the max.
                thr = tl.where(no_op, lo, tl.where(at_max, hi, new_lo))
                done = no_op | at_max
            lo = new_lo
            hi = new_hi
            r += 1
        if (done == 0) & (c_in <= SCRATCH):
            # Gather the boundary interval's tokens, sort them, apply the prefix rule.
            base = 0
            for start in range(0, V, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
                z = _over_t(x, T)
                inside = (z >= lo) & (z < hi)
                pos = base + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                tl.store(scratch_ptr + pos, z, mask=inside & (pos < SCRATCH))
                base += tl.sum(inside.to(tl.int32), axis=0)
            tl.debug_barrier()
            o = tl.arange(0, SCRATCH)
            v = tl.load(scratch_ptr + o, mask=o < c_in, other=float("-inf"))
            v = tl.sort(v, 0, descending=True)
            if BY_COUNT:
                i = tl.minimum(tl.maximum(target.to(tl.int32) - c_hi - 1, 0), c_in - 1)
            else:
                e = tl.where(o < c_in, tl.exp(v - M), 0.0)
                before = w_hi + tl.cumsum(e, axis=0) - e
                n_keep = tl.sum(((o < c_in) & (before < target)).to(tl.int32), axis=0)
                i = tl.maximum(n_keep - 1, 0)
            thr = tl.sum(tl.where(o == i, v, 0.0), axis=0)
        return thr

    @triton.jit
    def _sample_kernel(logits_ptr, stride, V, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, pos_ptr,
                       out_ptr, scratch_ptr, stage_ptr,
                       ONLY_STAGE: tl.constexpr, USE_FILTERS: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                       SCRATCH: tl.constexpr, MAX_ROUNDS: tl.constexpr):
        row = tl.program_id(0)
        # ONLY_STAGE >= 0: only the rows whose stage_ptr entry equals it (sampling_split's fallback).
        go = True
        if ONLY_STAGE >= 0:
            go = tl.load(stage_ptr + row) == ONLY_STAGE
        if go:
            row_ptr = logits_ptr + row.to(tl.int64) * stride
            T = tl.load(temp_ptr + row)
            ninf = float("-inf")
            tok = tl.zeros((), dtype=tl.int32)
            if T > 0:
                key = _row_key(tl.load(seed_ptr + row), tl.load(pos_ptr + row))
                best = tl.full((), ninf, tl.float32)
                m = tl.full((), ninf, tl.float32)
                zsum = tl.zeros((), dtype=tl.float32)
                zmin = tl.full((), float("inf"), tl.float32)
                for start in range(0, V, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    inb = offs < V
                    x = tl.load(row_ptr + offs, mask=inb, other=ninf).to(tl.float32)
                    z = _over_t(x, T)
                    s = tl.where(inb, z + _gumbel(key, offs), ninf)
                    bs = tl.max(s, axis=0)
                    bi = tl.argmax(s, axis=0) + start
                    tok = tl.where(bs > best, bi, tok)
                    best = tl.maximum(best, bs)
                    if USE_FILTERS:
                        m_new = tl.maximum(m, tl.max(z, axis=0))
                        alpha = tl.where(m_new > ninf, tl.exp(m - m_new), 1.0)
                        zsum = zsum * alpha + tl.sum(tl.where(z > ninf, tl.exp(z - m_new), 0.0), axis=0)
                        m = m_new
                        zmin = tl.minimum(zmin, tl.min(tl.where(z > ninf, z, float("inf")), axis=0))
                if USE_FILTERS:
                    k = tl.load(top_k_ptr + row).to(tl.int32)
                    p = tl.load(top_p_ptr + row)
                    mp = tl.load(min_p_ptr + row)
                    k_on = (k > 0) & (k < V)
                    p_on = p < 1.0
                    mp_on = mp > 0.0
                    if k_on | p_on | mp_on:
                        t_m = tl.where(mp_on, m + tl.log(tl.maximum(mp, 1e-30)), ninf)
                        z_s = _over_t(tl.load(row_ptr + tok).to(tl.float32), T)
                        kept = z_s >= t_m
                        mass_s = zsum
                        if k_on | p_on:
                            # Is the unfiltered winner kept? Count and mass strictly above it.
                            c_gt = tl.zeros((), dtype=tl.int32)
                            w_gt = tl.zeros((), dtype=tl.float32)
                            w_all = tl.zeros((), dtype=tl.float32)
                            for start in range(0, V, BLOCK):
                                offs = start + tl.arange(0, BLOCK)
                                x = tl.load(row_ptr + offs, mask=offs < V, other=ninf).to(tl.float32)
                                z = _over_t(x, T)
                                e = tl.where(z >= t_m, tl.exp(z - m), 0.0)
                                gt = (z > z_s) & (z >= t_m)
                                c_gt += tl.sum(gt.to(tl.int32), axis=0)
                                w_gt += tl.sum(tl.where(gt, e, 0.0), axis=0)
                                w_all += tl.sum(e, axis=0)
                            mass_s = w_all
                            kept = kept & ((k_on == 0) | (c_gt < k))
                            # top-p after top-k renormalizes over the top-k set: decided by the search.
                            kept = kept & ((p_on == 0) | ((k_on == 0) & (w_gt < p * w_all)))
                        if kept == 0:
                            thr = tl.maximum(t_m, zmin)
                            if k_on:
                                thr = _search(row_ptr, V, T, m, thr, m, k.to(tl.float32),
                                              scratch_ptr + row.to(tl.int64) * SCRATCH,
                                              True, BLOCK, PIVOTS, SCRATCH, MAX_ROUNDS)
                                if p_on:
                                    w = tl.zeros((), dtype=tl.float32)
                                    for start in range(0, V, BLOCK):
                                        offs = start + tl.arange(0, BLOCK)
                                        x = tl.load(row_ptr + offs, mask=offs < V, other=ninf).to(tl.float32)
                                        z = _over_t(x, T)
                                        w += tl.sum(tl.where(z >= thr, tl.exp(z - m), 0.0), axis=0)
                                    mass_s = w
                            if p_on:
                                tl.debug_barrier()
                                thr = _search(row_ptr, V, T, m, thr, m, p * mass_s,
                                              scratch_ptr + row.to(tl.int64) * SCRATCH,
                                              False, BLOCK, PIVOTS, SCRATCH, MAX_ROUNDS)
                            best = tl.full((), ninf, tl.float32)
                            for start in range(0, V, BLOCK):
                                offs = start + tl.arange(0, BLOCK)
                                inb = offs < V
                                x = tl.load(row_ptr + offs, mask=inb, other=ninf).to(tl.float32)
                                z = _over_t(x, T)
                                s = tl.where(inb & (z >= thr), z + _gumbel(key, offs), ninf)
                                bs = tl.max(s, axis=0)
                                bi = tl.argmax(s, axis=0) + start
                                tok = tl.where(bs > best, bi, tok)
                                best = tl.maximum(best, bs)
            else:
                best = tl.full((), ninf, tl.float32)
                for start in range(0, V, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    x = tl.load(row_ptr + offs, mask=offs < V, other=ninf).to(tl.float32)
                    bs = tl.max(x, axis=0)
                    bi = tl.argmax(x, axis=0) + start
                    tok = tl.where(bs > best, bi, tok)
                    best = tl.maximum(best, bs)
            tl.store(out_ptr + row, tok.to(tl.int64))

    @triton.jit
    def _any_ids(ids_ptr, stride, rows, in_rows, n, IDS_BLOCK: tl.constexpr):
        """Per row: does its list ids_ptr[row, :n] hold an id (>= 0; -1 is padding)?"""
        found = tl.zeros(rows.shape, dtype=tl.int1)
        o = tl.arange(0, IDS_BLOCK)
        for start in range(0, n, IDS_BLOCK):
            ids = tl.load(ids_ptr + rows[:, None] * stride + start + o[None, :],
                          mask=in_rows[:, None] & (start + o < n)[None, :], other=-1)
            found = found | (tl.max(ids, axis=1) >= 0)
        return found

    @triton.jit
    def _written_rows_kernel(S, slot_ptr, rep_ptr, pres_ptr, freq_ptr,
                             banned_ptr, banned_stride, NB, stop_ptr, stop_stride, NS, left_ptr,
                             written_ptr, work_ptr, ROWS: tl.constexpr, IDS_BLOCK: tl.constexpr):
        """One program: written[row] = 1 for the rows something writes into (penalties, banned
        ids, stop ids masked for min_tokens), and those rows as a work list (work_ptr[0] rows
        at work_ptr[1:]): a step where no row needs a copy launches no per-chunk programs."""
        listed = 0
        for start in range(0, S, ROWS):
            rows = start + tl.arange(0, ROWS)
            in_rows = rows < S
            slot = tl.load(slot_ptr + rows, mask=in_rows, other=0)
            penalized = ((tl.load(rep_ptr + slot, mask=in_rows, other=1.0) != 1.0)
                         | (tl.load(pres_ptr + slot, mask=in_rows, other=0.0) != 0.0)
                         | (tl.load(freq_ptr + slot, mask=in_rows, other=0.0) != 0.0))
            masked = (_any_ids(banned_ptr, banned_stride, rows, in_rows, NB, IDS_BLOCK)
                      | (_any_ids(stop_ptr, stop_stride, rows, in_rows, NS, IDS_BLOCK)
                         & (tl.load(left_ptr + rows, mask=in_rows, other=0) > 0)))
            w = (penalized | masked) & in_rows
            tl.store(written_ptr + rows, w.to(tl.int32), mask=in_rows)
            at = listed + tl.cumsum(w.to(tl.int32), axis=0) - 1
            tl.store(work_ptr + 1 + at, rows, mask=w)
            listed += tl.sum(w.to(tl.int32), axis=0)
        tl.store(work_ptr, listed)

    @triton.jit
    def _penalty_chunk(in_ptr, in_stride, out_ptr, out_stride, V, slot_ptr, counts_ptr, prompt_ptr,
                       table_stride, rep_ptr, pres_ptr, freq_ptr, row, c,
                       COPY: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """One chunk of one row: out = the row's penalized logits (float32). COPY: out is a
        separate float32 tensor, so a row without penalties is copied (upcast); else in place,
        and such a row is left alone."""
        slot = tl.load(slot_ptr + row)
        rp = tl.load(rep_ptr + slot)
        pres = tl.load(pres_ptr + slot)
        freq = tl.load(freq_ptr + slot)
        src = in_ptr + row.to(tl.int64) * in_stride
        dst = out_ptr + row.to(tl.int64) * out_stride
        if (rp != 1.0) | (pres != 0.0) | (freq != 0.0):
            c_ptr = counts_ptr + slot.to(tl.int64) * table_stride
            p_ptr = prompt_ptr + slot.to(tl.int64) * table_stride
            for sub in range(0, CHUNK, BLOCK):
                offs = c * CHUNK + sub + tl.arange(0, BLOCK)
                inb = offs < V
                x = tl.load(src + offs, mask=inb, other=0.0).to(tl.float32)
                cnt = tl.load(c_ptr + offs, mask=inb, other=0)
                seen = (cnt > 0) | (tl.load(p_ptr + offs, mask=inb, other=0) != 0)
                x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rp), x * rp), x)
                x = x - freq * cnt.to(tl.float32) - pres * (cnt > 0).to(tl.float32)
                tl.store(dst + offs, x, mask=inb)
        elif COPY:
            for sub in range(0, CHUNK, BLOCK):
                offs = c * CHUNK + sub + tl.arange(0, BLOCK)
                inb = offs < V
                tl.store(dst + offs, tl.load(src + offs, mask=inb, other=0.0).to(tl.float32), mask=inb)

    @triton.jit
    def _penalty_kernel(in_ptr, in_stride, out_ptr, out_stride, V, slot_ptr, counts_ptr, prompt_ptr,
                        table_stride, rep_ptr, pres_ptr, freq_ptr,
                        COPY: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Every row, a (chunks x rows) grid."""
        _penalty_chunk(in_ptr, in_stride, out_ptr, out_stride, V, slot_ptr, counts_ptr, prompt_ptr,
                       table_stride, rep_ptr, pres_ptr, freq_ptr, tl.program_id(1), tl.program_id(0),
                       COPY, CHUNK, BLOCK)

    @triton.jit
    def _penalty_listed_kernel(in_ptr, in_stride, out_ptr, out_stride, V, slot_ptr, counts_ptr,
                               prompt_ptr, table_stride, rep_ptr, pres_ptr, freq_ptr, work_ptr, C,
                               CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """The work list's rows (copied to out), its (row, chunk) items over a fixed grid."""
        for item in range(tl.program_id(0), tl.load(work_ptr) * C, tl.num_programs(0)):
            _penalty_chunk(in_ptr, in_stride, out_ptr, out_stride, V, slot_ptr, counts_ptr, prompt_ptr,
                           table_stride, rep_ptr, pres_ptr, freq_ptr, tl.load(work_ptr + 1 + item // C),
                           item % C, True, CHUNK, BLOCK)


@functools.lru_cache(maxsize=8)
def _zeros(n: int, device: str) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32, device=device)


def sample_rows_kernel(logits: torch.Tensor, st, use_filters: bool, only_stage=None,
                       out: torch.Tensor | None = None, clean_rows=None) -> torch.Tensor:
    """The Triton sampler: (masked) logits [S, V] f32 (or bf16: loads upcast) -> ids [S] int64
    (sampler.py's function).
    IMPL "split" (the default) runs sampling_split's chunked kernels; "rows" this module's
    one program per row. only_stage=(stages [S] int32, value): only those rows, into `out`.
    clean_rows: see sampling_split.sample_rows_split (split only)."""
    if only_stage is None and IMPL == "split":
        from .sampling_split import sample_rows_split
        return sample_rows_split(logits, st, use_filters, clean_rows)
    assert clean_rows is None, "the per-row kernel reads one tensor"
    s, v = logits.shape
    logits = logits.contiguous()
    if out is None:
        out = torch.empty(s, dtype=torch.int64, device=logits.device)
    min_p = st.min_p if st.min_p is not None else _zeros(s, str(logits.device))[:s]
    scratch = torch.empty(s * SCRATCH if use_filters else 1, dtype=torch.float32, device=logits.device)
    stages, only = only_stage if only_stage is not None else (out, -1)
    _sample_kernel[(s,)](logits, logits.stride(0), v, st.temperature.contiguous(), st.top_k.contiguous(),
                         st.top_p.contiguous(), min_p.contiguous(), st.seed.contiguous(), st.position.contiguous(),
                         out, scratch, stages,
                         ONLY_STAGE=only, USE_FILTERS=use_filters, BLOCK=BLOCK, PIVOTS=PIVOTS, SCRATCH=SCRATCH,
                         MAX_ROUNDS=MAX_ROUNDS, num_warps=8)
    return out


PENALTY_CHUNK = 4096  # tokens per program of the penalty / upcast pass
WORKERS_PER_SM = 4    # programs per SM of the pass over the listed rows


def apply_penalties_kernel(logits: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                           prompt_mask: torch.Tensor, rep: torch.Tensor, pres: torch.Tensor,
                           freq: torch.Tensor, out: torch.Tensor | None = None,
                           sparse_for=None, written: torch.Tensor | None = None) -> torch.Tensor:
    """Penalized logits [S, V] (per-slot tables indexed by `slots`): in place on contiguous
    float32 logits, or, with `out` (float32, any input dtype), one pass that writes every row
    upcast and the penalty rows penalized (the bf16 logits' only float32 copy).
    sparse_for (the step's SamplingTensors, with `out` and `written` [S] int32): only the rows
    with penalties, banned ids or min_tokens-masked stop ids are written to `out`, and
    written[row] = 1 for them, 0 for the rows left to be read from `logits`."""
    s, v = logits.shape
    dst = logits if out is None else out
    c = triton.cdiv(v, PENALTY_CHUNK)
    tables = (slots, counts, prompt_mask.view(torch.uint8), counts.stride(0), rep, pres, freq)
    if sparse_for is None:
        _penalty_kernel[(c, s)](logits, logits.stride(0), dst, dst.stride(0), v, *tables,
                                COPY=out is not None, CHUNK=PENALTY_CHUNK, BLOCK=1024, num_warps=4)
        return dst
    st = sparse_for
    banned, stops = st.banned_ids.contiguous(), st.min_stop_ids.contiguous()
    work = torch.empty(s + 1, dtype=torch.int32, device=logits.device)
    _written_rows_kernel[(1,)](s, slots, rep, pres, freq, banned, banned.stride(0), banned.shape[1],
                               stops, stops.stride(0), stops.shape[1], st.min_tokens_left.contiguous(),
                               written, work, ROWS=128, IDS_BLOCK=16, num_warps=4)
    workers = min(c * s, WORKERS_PER_SM * num_sms(logits.device))
    _penalty_listed_kernel[(workers,)](logits, logits.stride(0), dst, dst.stride(0), v, *tables, work, c,
                                       CHUNK=PENALTY_CHUNK, BLOCK=1024, num_warps=4)
    return dst
