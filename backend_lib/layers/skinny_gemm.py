"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ b) for M <= 16 (Triton).

At batch 1-16 a projection is a weight stream: every weight is read once and used by M rows,
so the kernel's job is to keep enough 16-byte weight loads in flight on every SM. A program
owns BLOCK_N output columns and a 1/SPLIT_K slice of K; it walks its slice in BLOCK_K chunks
(contiguous in W's rows, so the loads vectorize), accumulating in fp32:
  - M == 1: a GEMV, each chunk's products reduced into BLOCK_N fp32 sums (no tensor cores);
  - M > 1: tl.dot on a 16-row tile of x (rows past M masked to zero).
SPLIT_K > 1 writes fp32 partials [SPLIT_K, M, N] and a second small kernel sums them, adds
the bias and casts; SPLIT_K == 1 does that in the first kernel.

Which configuration, if any, beats cuBLAS depends on the shape and the GPU, so nothing is
assumed: `SkinnyGemmTable.tune` times cuBLAS (F.linear) and every candidate configuration
for each (M, N, K) the model uses, at start-up, and keeps a configuration only where it was
faster than cuBLAS; everywhere else F.linear runs. The path is off unless
BACKEND_LIB_SKINNY_GEMM=1 (backend_lib/envs.py).

Capturable in a CUDA graph: grids come from shapes, the partials buffer is allocated by the
caching allocator (the graph's pool under capture), no host syncs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

from .triton_support import HAS_TRITON, tl, triton  # noqa: F401 - the kernels' globals
from .triton_support import INTERPRET as _INTERPRET
MAX_M = 16
MIN_DOT_BLOCK = 16  # the M > 1 path's tl.dot tiles: BLOCK_N at least this


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int


# Candidates the start-up measurement tries; cuBLAS is always the other candidate.
# Few enough that compiling them all at start-up stays in seconds (Triton caches on disk).
# Narrow column blocks (4, 8: M == 1 only, tl.dot needs 16) give the small projections of a
# 0.5B model (N ~ 900-1200) one program per SM or more without a split-K reduction kernel.
CANDIDATES = tuple(SkinnyConfig(bn, bk, sk, w)
                   for bn, bk, w in ((16, 256, 4), (32, 256, 4), (64, 128, 4), (32, 512, 8))
                   for sk in (1, 4)) + tuple(SkinnyConfig(bn, bk, 1, w)
                                             for bn, bk, w in ((4, 512, 2), (8, 256, 2), (8, 512, 4)))


if HAS_TRITON:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, k_per_split,
                       stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
                       DOT_PREC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        offs_kb = tl.arange(0, BLOCK_K)
        if USE_DOT:
            offs_m = tl.arange(0, BLOCK_M)
            m_mask = offs_m < M
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs_k = k0 + offs_kb
                k_mask = offs_k < k_hi
                w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
            out_mask = m_mask[:, None] & n_mask[None, :]
            if SPLIT:
                tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=out_mask)
            else:
                if HAS_BIAS:
                    acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                         acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:  # M == 1: one output row
            # Reduced every chunk: a [BLOCK_N, BLOCK_K] fp32 accumulator would hold 64+
            # registers per thread and cut the CTAs (and loads in flight) per SM.
            acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs_k = k0 + offs_kb
                k_mask = offs_k < k_hi
                w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
                acc1 += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            if SPLIT:
                tl.store(part_ptr + pid_k * N + offs_n, acc1, mask=n_mask)
            else:
                if HAS_BIAS:
                    acc1 += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                tl.store(y_ptr + offs_n, acc1.to(y_ptr.dtype.element_ty), mask=n_mask)

    @triton.jit
    def _split_reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym,
                             HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
        n = offs % N
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + (offs // N) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (HAS_TRITON and (x.is_cuda or _INTERPRET) and x.dim() == 2 and 1 <= x.shape[0] <= MAX_M
            and w.dim() == 2 and w.shape[1] == x.shape[1] and w.stride(1) == 1 and x.stride(1) == 1
            and x.dtype == w.dtype)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None,
                  cfg: SkinnyConfig = SkinnyConfig(32, 256, 1, 4),
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (M <= 16) @ w[N, K]^T (+ b[N]) -> [M, N] in x.dtype, with configuration cfg
    (into `out` when given: the tests poison it to see every element written)."""
    if not supported(x, w):
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} {x.dtype} / w {tuple(w.shape)} {w.dtype} "
                         f"not supported (M in [1, {MAX_M}], contiguous rows, one dtype, Triton)")
    m, k = x.shape
    n = w.shape[0]
    if m > 1 and cfg.block_n < MIN_DOT_BLOCK:
        raise ValueError(f"skinny_linear: {cfg} serves M == 1 only (tl.dot needs BLOCK_N >= {MIN_DOT_BLOCK}; M = {m})")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    split = max(1, min(cfg.split_k, triton.cdiv(k, cfg.block_k)))
    # Each split's K range is a whole number of BLOCK_K chunks.
    k_per_split = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    bias = b if b is not None else y
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, w, bias, y, part, m, n, k, k_per_split, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=b is not None, SPLIT=split > 1, USE_DOT=m > 1,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=16,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if split > 1:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](part, bias, y, m, n, y.stride(0),
                                                           HAS_BIAS=b is not None, SPLIT_K=split, BLOCK=block)
    return y


def weight_copies(w: torch.Tensor, b: Optional[torch.Tensor], l2_bytes: int = 128 << 20
                  ) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """(w, b) and clones of it, together larger than the L2 cache: cycling through them makes
    a timing read the weights from HBM, as a decode step does (each layer's are different)."""
    n = max(2, min(64, -(-l2_bytes // (w.numel() * w.element_size()))))
    return [(w, b)] + [(w.clone(), None if b is None else b.clone()) for _ in range(n - 1)]


def time_linear_us(fn: Callable, x: torch.Tensor, copies: list, calls: int = 50) -> float:
    """Median µs per call of fn(x, w, b), cycling through `copies` (after warm-up). The calls
    are captured in one CUDA graph and replayed, as a decode step runs them: the figure is the
    kernel plus its boundary with the next one inside a graph. Timed as eager launches, a
    Triton kernel would pay Python's launch (~20-30 µs) and every small shape would look
    launch-bound, whichever kernel is faster on the device."""
    for w, b in copies[:3]:
        fn(x, w, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            w, b = copies[i % len(copies)]
            fn(x, w, b)
    graph.replay()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def time_candidates(reference: Callable, make_call: Callable, candidates, x: torch.Tensor, copies: list,
                    what: str) -> dict:
    """µs per call (time_linear_us) of `reference` under the key None and of make_call(cfg) for
    each candidate configuration; a configuration the compiler rejects is left out."""
    times = {None: time_linear_us(reference, x, copies)}
    for cfg in candidates:
        try:
            times[cfg] = time_linear_us(make_call(cfg), x, copies)
        except Exception as e:  # noqa: BLE001 - any compile/launch failure: not a candidate
            logger.debug("%s: config %s failed: %s", what, cfg, e)
    return times


class SkinnyGemmTable:
    """Per (M, N, K, has_bias): the configuration that measured faster than cuBLAS, or None
    (cuBLAS). `linear` dispatches by that table; shapes never tuned go to F.linear."""

    def __init__(self) -> None:
        self.choice: dict[tuple[int, int, int, bool], Optional[SkinnyConfig]] = {}
        self.timings: dict[tuple[int, int, int, bool], dict[str, float]] = {}

    def tune(self, weights: list[tuple[torch.Tensor, Optional[torch.Tensor]]], ms: list[int],
             margin: float = 0.97, force: bool = False) -> None:
        """Measure every candidate against F.linear for each distinct weight shape and M.
        A candidate is kept only if it takes < margin x cuBLAS's time (noise must not pick
        a kernel that is really no faster). force: keep the fastest candidate even when
        cuBLAS is faster (tests: every projection through the Triton kernel)."""
        seen = set()
        for w, b in weights:
            copies = None
            for m in ms:
                key = (m, w.shape[0], w.shape[1], b is not None)
                if key in seen or m > MAX_M:
                    continue
                seen.add(key)
                copies = copies or weight_copies(w, b)
                x = torch.randn(m, w.shape[1], dtype=w.dtype, device=w.device)
                t = {"cublas": time_linear_us(F.linear, x, copies)}
                best, best_t = None, float("inf") if force else t["cublas"] * margin
                for cfg in CANDIDATES:
                    try:
                        us = time_linear_us(lambda xx, ww, bb, c=cfg: skinny_linear(xx, ww, bb, c), x, copies)
                    except Exception as e:  # a configuration the compiler rejects: not a candidate
                        logger.debug("skinny config %s failed on %s: %s", cfg, key, e)
                        continue
                    t[str(cfg)] = us
                    if us < best_t:
                        best, best_t = cfg, us
                self.choice[key] = best
                self.timings[key] = t
            del copies
        picked = sum(c is not None for c in self.choice.values())
        logger.info("skinny GEMM: %d of %d (M, N, K) shapes faster than cuBLAS", picked, len(self.choice))

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= MAX_M:
            cfg = self.choice.get((x.shape[0], w.shape[0], w.shape[1], b is not None))
            if cfg is not None:
                return skinny_linear(x, w, b, cfg)
        return F.linear(x, w, b)


def install(model, ms: list[int], mode: str) -> Optional[SkinnyGemmTable]:
    """mode "on" / "force" (envs.skinny_gemm): tune the model's projections for each M in
    `ms` and route them through the table; "off": nothing (None)."""
    if mode == "off":
        return None
    if not HAS_TRITON:
        raise ValueError(f"skinny GEMM {mode!r} requested but Triton is not available")
    table = SkinnyGemmTable()
    table.tune([(p.weight, p.bias) for p in model.projections()], ms, force=(mode == "force"))
    model.set_gemm_table(table)
    return table
