"""Skinny GEMM (GEMV-like) Triton kernel for decode-sized linear layers (CUDA only).

``linear(x, weight, bias=None, out=None)`` == ``F.linear(x, weight, bias)``:
    x [..., K], weight [N, K] (nn.Linear layout), bias [N] or None; out [..., N] in x.dtype.
    Dispatch: ``ENABLED`` (module flag, default OFF, see below) and CUDA and x has 1..16
    rows (leading dims flattened) and dtype bf16/fp16 (x, weight and bias alike) and weight
    rows contiguous -> the Triton kernel; anything else -> ``torch.nn.functional.linear``
    (so CPU is exactly as before).

Kernel: one program per BLOCK_N output columns (rows of the weight); it streams its
[BLOCK_N, K] weight slab once, K-contiguous in BLOCK_K chunks (16-byte vector loads through
a deep cp.async pipeline), and computes all M <= 16 token rows at once as
out^T[BLOCK_N, 16] += W[BLOCK_N, BLOCK_K] @ x^T[BLOCK_K, 16] (tensor-core dot, fp32
accumulate; x rows >= M are clamped copies of row M-1 and never stored). When N alone gives
fewer programs than SMs and K is long, K is split over SPLIT_K programs: each writes an fp32
partial to a workspace, then bumps a per-tile counter (acq_rel atomic); the last of them sums
the partials in fixed order (deterministic), adds the bias, casts, stores and resets the
counter to 0 -- one kernel, no memset, no second pass.

CUDA-graph capturable: the grid and all configs are fixed by (M, N, K, device), no host sync.
The split-K counters live in a zeroed per-device ring allocated on the first non-capturing
call; a call made while capturing before that runs without split-K (still correct). Two
split-K GEMMs running at the same time on different streams could share counters only after
the ring (64 slices) wraps between them.

Measured (H200, bench/skinny_gemm.py, cold weights): faster than cuBLAS on the small Qwen
qkv/o_proj (~4.1 vs 4.4-4.7 us) and on Qwen down at M >= 8; slower on gate_up-sized and
Llama-3-8B shapes at M = 1 (e.g. 14336 -> 4096: 59 vs 32 us), where M = 1 is slower than
M = 16. Suspected cause, not yet verified: rows >= M are clamped copies of row M-1, so
every program loads 16 copies of the same x row each K step (one L2 hot spot); masking
those rows instead (no request issued) is the first thing to try, then the configs that
the bench's sweep found faster (Llama gate_up (64,128,1,4,3), 4096x4096 (32,128,2,4,4)).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

try:  # Triton is optional at import time (CPU-only machines).
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["linear", "ENABLED", "MAX_M", "HAS_TRITON", "pick_config"]

# Module flag: False routes every call to F.linear. OFF by default: measured on an H200
# (bench/skinny_gemm.py), the Qwen2.5-0.5B batch-1 decode step under a CUDA graph was
# 0.957 ms with it vs 0.905 ms with cuBLAS (wins on qkv/o_proj, loses on gate_up/down and on
# the Llama-3-8B shapes at M=1). BACKEND_SKINNY_GEMM=1 (or setting this to True) turns it on.
ENABLED = os.environ.get("BACKEND_SKINNY_GEMM", "0") == "1"
MAX_M = 16
BLOCK_M = 16  # tl.dot needs >= 16; M < 16 rows are clamped copies, never stored

_SUPPORTED = (torch.bfloat16, torch.float16)
_SMEM_BUDGET = 72 * 1024  # per program: 3 programs per H100/H200 SM
_LOCK_SLICE = 1024  # counters per slice (split-K is used only for fewer tiles than that)
_LOCK_RING = 64
_locks: dict = {}  # device index -> [int32 tensor [_LOCK_RING * _LOCK_SLICE], next slice]
_num_sms: dict = {}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def pick_config(N: int, K: int, num_sms: int, elem_bytes: int = 2, allow_split: bool = True):
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) from the shape only."""
    block_n = 16
    for bn in (64, 32):  # the widest slab that still gives every SM a program (64: one wave)
        tiles = _cdiv(N, bn)
        if tiles >= num_sms and (bn < 64 or tiles <= 2 * num_sms):
            block_n = bn
            break
    block_k = 256 if (K >= 2048 and K % 256 == 0 and block_n <= 32) else 128
    n_tiles, k_tiles = _cdiv(N, block_n), _cdiv(K, block_k)
    split = 1
    while (allow_split and n_tiles * split < num_sms and k_tiles // (split * 2) >= 4 and split < 16
           and n_tiles <= _LOCK_SLICE):
        split *= 2
    tiles_per = _cdiv(k_tiles, split)
    stage_bytes = (block_n + BLOCK_M) * block_k * elem_bytes
    stages = max(2, min(8, tiles_per, _SMEM_BUDGET // stage_bytes))
    return block_n, block_k, split, 4, stages


if HAS_TRITON:

    @triton.jit(do_not_specialize=["M"])
    def _skinny_kernel(X, W, B, OUT, WS, LOCKS, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                       EVEN_N: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        if EVEN_N:
            rn = offs_n
        else:
            rn = tl.where(mask_n, offs_n, 0)  # clamped rows: unmasked weight loads
        rm = tl.minimum(offs_m, M - 1)

        k_tiles = tl.cdiv(K, BLOCK_K)
        if SPLIT_K == 1:
            k_lo = 0
            k_hi = k_tiles
        else:
            per = tl.cdiv(k_tiles, SPLIT_K)
            k_lo = pid_k * per
            k_hi = tl.minimum(k_lo + per, k_tiles)

        w_ptrs = W + rn.to(tl.int64)[:, None] * stride_wn + (k_lo * BLOCK_K + offs_k)[None, :]
        x_ptrs = X + rm[None, :] * stride_xm + (k_lo * BLOCK_K + offs_k)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kt in range(k_lo, k_hi):
            if EVEN_K:
                w = tl.load(w_ptrs)
                xt = tl.load(x_ptrs)
            else:
                kk = kt * BLOCK_K + offs_k
                w = tl.load(w_ptrs, mask=kk[None, :] < K, other=0.0)
                xt = tl.load(x_ptrs, mask=kk[:, None] < K, other=0.0)
            acc = tl.dot(w, xt, acc)  # [BLOCK_N, BLOCK_M] = W tile @ x^T tile
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

        out_mask = mask_n[:, None] & (offs_m[None, :] < M)
        out_ptrs = OUT + offs_m[None, :] * stride_om + offs_n[:, None]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(B + rn).to(tl.float32)[:, None]
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=out_mask)
        else:
            # WS: [SPLIT_K, M, N] fp32 partials
            ws_tile = WS + offs_m[None, :] * N + offs_n[:, None]
            tl.store(ws_tile + pid_k * M * N, acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is issued before the release below
            count = tl.atomic_add(LOCKS + pid_n, 1, sem="acq_rel", scope="gpu")
            if count == SPLIT_K - 1:  # last one in: reduce in fixed order
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(ws_tile + s * M * N, mask=out_mask, other=0.0,
                                     cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(B + rn).to(tl.float32)[:, None]
                tl.store(out_ptrs, total.to(OUT.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(LOCKS + pid_n, 0)  # ready for the next launch / graph replay


def _sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _num_sms.get(idx)
    if n is None:
        n = _num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def _lock_slice(device: torch.device) -> Optional[torch.Tensor]:
    """A zeroed counter slice, or None while capturing before the ring exists."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    entry = _locks.get(idx)
    if entry is None:
        if torch.cuda.is_current_stream_capturing():
            return None  # a zeros() here would only be recorded, not run now
        buf = torch.zeros(_LOCK_RING * _LOCK_SLICE, dtype=torch.int32, device=device)
        entry = _locks[idx] = [buf, 0]
    buf, i = entry
    entry[1] = (i + 1) % _LOCK_RING
    return buf[i * _LOCK_SLICE:(i + 1) * _LOCK_SLICE]


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            out2: torch.Tensor, cfg, locks: Optional[torch.Tensor]) -> torch.Tensor:
    """Run the kernel on x2 [M, K] (rows contiguous) into out2 [M, N] with config cfg.
    ``locks`` must be a zeroed int32 tensor of >= cdiv(N, BLOCK_N) entries when SPLIT_K > 1.
    Device-agnostic so the Triton interpreter can run it on CPU tensors."""
    M, K = x2.shape
    N = weight.shape[0]
    block_n, block_k, split, warps, stages = cfg
    n_tiles = _cdiv(N, block_n)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
    else:
        ws = out2  # unused
        locks = out2
    _skinny_kernel[(n_tiles, split)](
        x2, weight, bias if bias is not None else weight, out2, ws, locks,
        M, N, K, x2.stride(0), weight.stride(0), out2.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split, EVEN_K=K % block_k == 0, EVEN_N=N % block_n == 0,
        num_warps=warps, num_stages=stages)
    return out2


def supported(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """True when ``linear`` would take the Triton kernel for these arguments."""
    if not (ENABLED and HAS_TRITON and x.is_cuda and x.dtype in _SUPPORTED):
        return False
    if weight.dim() != 2 or weight.dtype != x.dtype or weight.device != x.device:
        return False
    if weight.stride(1) != 1 or x.shape[-1] != weight.shape[1]:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.stride(0) != 1):
        return False
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 1 <= m <= MAX_M and x.dim() >= 2


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias); the Triton skinny kernel for 1..16 CUDA bf16/fp16 rows.
    ``out`` (optional, [..., N] contiguous, x.dtype) receives the result on either path."""
    if not supported(x, weight, bias):
        if out is None:
            return F.linear(x, weight, bias)
        out.copy_(F.linear(x, weight, bias))
        return out
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if out is None:
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    out2 = out.view(M, N)
    cfg = pick_config(N, K, _sms(x.device), x.element_size())
    locks = None
    if cfg[2] > 1:
        locks = _lock_slice(x.device)
        if locks is None:  # capturing before the counters exist: no split-K
            cfg = pick_config(N, K, _sms(x.device), x.element_size(), allow_split=False)
    _launch(x2, weight, bias, out2, cfg, locks)
    return out
