"""Fused elementwise kernels for the decoder layer (Triton, CUDA only).

Each public function dispatches: Triton on CUDA tensors (when Triton imports), else the
plain torch reference below it, which follows HF's op order. The CPU model path does not
call these at all (llama.py keeps its original code there), so CPU numerics are untouched.

``rms_norm(x, weight, eps)``
    HF order: normalize in fp32, cast to x.dtype, then multiply by weight. One kernel.
``fused_add_rms_norm(x, residual, weight, eps) -> (normed, new_residual)``
    The residual stream of vLLM: new_residual = x + residual (rounded to the input dtype,
    as the unfused ``x = x + f(x)`` is), normed = rms_norm(new_residual). One kernel.
``silu_and_mul(gate_up) -> out``
    [T, 2I] -> [T, I]: silu(gate) (rounded to dtype, as F.silu is) * up. One kernel.
``rope_and_write_kv(q, k, v, cos_cache, sin_cache, positions, k_cache, v_cache, slot_mapping,
q_norm_weight=None, k_norm_weight=None, eps=1e-6) -> q``
    Optional Qwen3 per-head q/k RMSNorm, then neox rotary (rotate_half) on q and k, then
    the paged KV write of rotated k and v. q is rotated IN PLACE (it may be a strided view
    of the qkv projection output) and returned; the rotated k lands only in the cache (k
    itself is left unchanged). Cache layout [num_blocks, block_size, num_kv_heads, head_dim],
    slot = block * block_size + offset; rows with slot < 0 write nothing. One kernel.

All are CUDA-graph capturable: fixed grids from shapes, no host syncs.
"""
from __future__ import annotations

from typing import Optional

import torch

from .triton_support import HAS_TRITON, tl, triton  # noqa: F401 - the kernels' globals
from .triton_support import INTERPRET as _INTERPRET
from .triton_support import pdl_launch, pdl_release_dependents  # noqa: F401

__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_write_kv",
           "available", "HAS_TRITON"]


def available(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on tensors like ``t``."""
    return HAS_TRITON and t.is_cuda


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or _INTERPRET)


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


# ----------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(X, R, W, OUT, ROUT, stride_x, stride_r, stride_o, stride_ro, N, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        # The stream's dtype: X's, or with a residual ROUT's (X may be an fp32 accumulator of a
        # stream in that dtype, rounded first as its unfused store would round it).
        DT = ROUT.dtype.element_ty if HAS_RES else X.dtype.element_ty
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            # Round the sum to the stream dtype first, exactly like `x = x + f(x)` unfused.
            x = (x.to(DT).to(tl.float32) + r.to(tl.float32)).to(DT)
            tl.store(ROUT + row * stride_ro + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + cols, mask=mask, other=0.0)
        y = (xf * rstd).to(DT).to(tl.float32) * w.to(tl.float32)
        tl.store(OUT + row * stride_o + cols, y.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * stride_o + cols, (s * u).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_halves(x1, x2, c1, c2, s1, s2, W, eps, offs, dmask, HALF: tl.constexpr,
                     HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, DT: tl.constexpr):
        """x1, x2: [H, HALF] halves of each head (fp32 from dtype DT). Returns rotated
        halves in fp32 (each rounded to DT the way the unfused torch ops round)."""
        if QK_NORM:
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            rstd = 1.0 / tl.sqrt(ss / HEAD_DIM + eps)
            w1 = tl.load(W + offs, mask=dmask, other=0.0).to(tl.float32)
            w2 = tl.load(W + HALF + offs, mask=dmask, other=0.0).to(tl.float32)
            x1 = ((x1 * rstd[:, None]).to(DT).to(tl.float32) * w1[None, :]).to(DT).to(tl.float32)
            x2 = ((x2 * rstd[:, None]).to(DT).to(tl.float32) * w2[None, :]).to(DT).to(tl.float32)
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
        return o1, o2

    @triton.jit
    def _rope_write_kv_kernel(
        Q, K, V, COS, SIN, POS, KC, VC, SLOT, QW, KW,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
        eps,
        HQ: tl.constexpr, HKV: tl.constexpr, BH_Q: tl.constexpr, BH_KV: tl.constexpr,
        HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BHALF: tl.constexpr,
        QK_NORM: tl.constexpr, USE_PDL: tl.constexpr = False,
    ):
        if USE_PDL:  # launched with PDL: release the next kernel, then wait for the last one
            pdl_release_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        DT = Q.dtype.element_ty
        offs = tl.arange(0, BHALF)
        dmask = offs < HALF
        pos = tl.load(POS + t).to(tl.int64)
        # cos/sin are fp32 caches; HF casts them to the activation dtype before use.
        c1 = tl.load(COS + pos * stride_cos + offs, mask=dmask, other=0.0).to(DT).to(tl.float32)
        c2 = tl.load(COS + pos * stride_cos + HALF + offs, mask=dmask, other=0.0).to(DT).to(tl.float32)
        s1 = tl.load(SIN + pos * stride_cos + offs, mask=dmask, other=0.0).to(DT).to(tl.float32)
        s2 = tl.load(SIN + pos * stride_cos + HALF + offs, mask=dmask, other=0.0).to(DT).to(tl.float32)

        # ---- q: rotate in place
        hq = tl.arange(0, BH_Q)
        qmask = (hq[:, None] < HQ) & dmask[None, :]
        qp = Q + t * stride_qt + hq[:, None] * stride_qh + offs[None, :]
        q1 = tl.load(qp, mask=qmask, other=0.0).to(tl.float32)
        q2 = tl.load(qp + HALF, mask=qmask, other=0.0).to(tl.float32)
        q1, q2 = _rope_halves(q1, q2, c1, c2, s1, s2, QW, eps, offs, dmask, HALF, HEAD_DIM, QK_NORM, DT)
        tl.store(qp, q1.to(DT), mask=qmask)
        tl.store(qp + HALF, q2.to(DT), mask=qmask)

        # ---- k (rotated) and v -> paged cache (contiguous [slots, HKV, HEAD_DIM])
        slot = tl.load(SLOT + t).to(tl.int64)
        if slot >= 0:
            hk = tl.arange(0, BH_KV)
            kmask = (hk[:, None] < HKV) & dmask[None, :]
            kp = K + t * stride_kt + hk[:, None] * stride_kh + offs[None, :]
            k1 = tl.load(kp, mask=kmask, other=0.0).to(tl.float32)
            k2 = tl.load(kp + HALF, mask=kmask, other=0.0).to(tl.float32)
            k1, k2 = _rope_halves(k1, k2, c1, c2, s1, s2, KW, eps, offs, dmask, HALF, HEAD_DIM, QK_NORM, DT)
            cdt = KC.dtype.element_ty
            cp = slot * (HKV * HEAD_DIM) + hk[:, None] * HEAD_DIM + offs[None, :]
            tl.store(KC + cp, k1.to(DT).to(cdt), mask=kmask)
            tl.store(KC + cp + HALF, k2.to(DT).to(cdt), mask=kmask)
            vp = V + t * stride_vt + hk[:, None] * stride_vh + offs[None, :]
            v1 = tl.load(vp, mask=kmask, other=0.0)
            v2 = tl.load(vp + HALF, mask=kmask, other=0.0)
            tl.store(VC + cp, v1.to(VC.dtype.element_ty), mask=kmask)
            tl.store(VC + cp + HALF, v2.to(VC.dtype.element_ty), mask=kmask)


# ----------------------------------------------------------------------------------
# Torch references (HF op order)
# ----------------------------------------------------------------------------------
def rms_norm_ref(x, weight, eps):
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps):
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def silu_and_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_and_write_kv_ref(q, k, v, cos_cache, sin_cache, positions, k_cache, v_cache, slot_mapping,
                          q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    if q_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q


# ----------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> torch.Tensor:
    """2-D view [rows, N] with a unit last stride (copies only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _use_triton(x):
        return rms_norm_ref(x, weight, eps)
    x2 = _rows(x)
    n = x2.shape[1]
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0,
                                         n, eps, HAS_RES=False, BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual). x may be
    an fp32 accumulator of a stream in residual's dtype (the one-token path's split-K
    projections): it rounds to that dtype first, as `x.to(residual.dtype)` would."""
    if not _use_triton(x):
        return fused_add_rms_norm_ref(x.to(residual.dtype), residual, weight, eps)
    x2, r2 = _rows(x), _rows(residual)
    n = x2.shape[1]
    out = torch.empty(x2.shape, dtype=torch.promote_types(residual.dtype, weight.dtype), device=x.device)
    new_res = torch.empty(x2.shape, dtype=residual.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, new_res, x2.stride(0), r2.stride(0),
                                         out.stride(0), new_res.stride(0), n, eps,
                                         HAS_RES=True, BLOCK=block, num_warps=_warps(block))
    return out.view(x.shape), new_res.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not _use_triton(gate_up):
        return silu_and_mul_ref(gate_up)
    x2 = _rows(gate_up)
    inter = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block,
                                   num_warps=_warps(block))
    return out.view(*gate_up.shape[:-1], inter)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      q_norm_weight: Optional[torch.Tensor] = None,
                      k_norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                      pdl: bool = False) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] (strided views are fine if the last dim is contiguous).
    Returns q rotated (in place on the Triton path, a new tensor on the reference path).
    pdl: launched with programmatic dependent launch (one-token forwards)."""
    if not _use_triton(q):
        return rope_and_write_kv_ref(q, k, v, cos_cache, sin_cache, positions, k_cache, v_cache,
                                     slot_mapping, q_norm_weight, k_norm_weight, eps)
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert d % 2 == 0 and cos_cache.shape[-1] == d, "rotary must span the whole head"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos_cache.stride(-1) == 1 and sin_cache.stride() == cos_cache.stride()
    qk_norm = q_norm_weight is not None
    if t:
        half = d // 2
        _rope_write_kv_kernel[(t,)](
            q, k, v, cos_cache, sin_cache, positions, k_cache, v_cache, slot_mapping,
            q_norm_weight if qk_norm else q, k_norm_weight if qk_norm else k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_cache.stride(0), eps,
            HQ=hq, HKV=hkv, BH_Q=triton.next_power_of_2(hq), BH_KV=triton.next_power_of_2(hkv),
            HEAD_DIM=d, HALF=half, BHALF=triton.next_power_of_2(half), QK_NORM=qk_norm,
            USE_PDL=pdl, num_warps=4 if hq * d <= 4096 else 8, **pdl_launch(pdl),
        )
    return q
