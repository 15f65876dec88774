"""The one-token MLP as one kernel (Triton): add + RMSNorm, gate/up, silu * mul and down.

decode_gemv runs a batch-1 MLP as two kernels (gate_up with the add + norm prologue, down
with the silu * mul prologue). Each kernel of a 0.5B layer pays a fixed ~3-5 µs (launch, the
first DRAM round trip, the tail) on top of its bytes, and down cannot start streaming its
weights until every gate/up output exists. Here one grid does both: a program owns BLOCK_I
intermediate channels, computes their gate and up values from its rows of W_gate_up, applies
silu * mul, and multiplies them by the matching BLOCK_I columns of W_down, a split-K partial
of the whole output, added with fp32 atomics into an accumulator [1, H]. Its first gate/up
tile and first down tile are in flight before the PDL wait (weights never depend on earlier
kernels), so the down weights stream alongside gate/up instead of after them.

What differs from the two-kernel path:
  - the MLP's output is the fp32 accumulator, not a bf16 row. Its consumer (the next layer's
    q/k/v projection, decode_gemv's ADD_RMSNORM prologue) rounds it to the model dtype where
    the unfused down projection would have rounded its store.
  - the sum over programs is in atomic order, so the last bits of a row vary between runs
    (before rounding; the rounded values change only on a tie).
  - the accumulator must be zero before the first atomic. The model keeps one per layer and
    layer i's kernel zeroes layer i - 1's (its reader, layer i's q/k/v projection, is done by
    then: every kernel of the PDL chain waits for its predecessor, which waited for its own),
    layer 0's zeroes the last layer's (read by the final norm of the previous step). Each
    accumulator is thus zeroed once a forward, after its reader and before its writer.
    That holds for a whole forward over all the model's layers, one after another, as the
    decode step runs them; `AccumulatorRing` owns the buffers and the ring (decode_oproj
    keeps a second one).

Rounding follows the unfused ops (HF's order): gate and up round to the dtype, silu(gate)
rounds, the product rounds, as decode_gemv's SILU_MUL prologue does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .accumulator_ring import AccumulatorRing  # noqa: F401 - re-exported: its users import it from here
from .decode_gemv import _rms_norm_ref
from .triton_support import HAS_TRITON, tl, triton  # noqa: F401 - the kernels' globals
from .triton_support import INTERPRET as _INTERPRET
from .triton_support import pdl_launch, pdl_release_dependents, pdl_supported  # noqa: F401

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MlpConfig:
    block_i: int    # intermediate channels per program (>= 16: a 32-byte run of each W_down row)
    block_k: int    # hidden columns per gate/up chunk
    block_h: int    # outputs per down chunk
    num_warps: int


DEFAULT_CONFIG = MlpConfig(16, 512, 512, 4)
CANDIDATES = (MlpConfig(16, 512, 512, 4), MlpConfig(16, 1024, 1024, 8), MlpConfig(16, 256, 256, 4),
              MlpConfig(32, 256, 256, 8), MlpConfig(32, 512, 512, 8))


if HAS_TRITON:
    from .decode_gemv import _stream_chunk  # noqa: F401 - called from the kernel

    @triton.jit
    def _mlp_kernel(X, R, LNW, WGU, BGU, WD, BD, ACC, ZERO, ROUT, H, I, eps, stride_gu, stride_d,
                    HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_I: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
        pid = tl.program_id(0)
        DT = ROUT.dtype.element_ty
        ch = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        ch_mask = ch < I
        offs_kb = tl.arange(0, BLOCK_K)
        offs_hb = tl.arange(0, BLOCK_H)
        gate_rows = WGU + ch[:, None].to(tl.int64) * stride_gu
        up_rows = WGU + (ch + I)[:, None].to(tl.int64) * stride_gu
        down_cols = WD + ch[None, :]
        # Weights only: issued before the wait for the previous kernel.
        kmask0 = ch_mask[:, None] & (offs_kb < H)[None, :]
        g_next = tl.load(gate_rows + offs_kb[None, :], mask=kmask0, other=0.0)
        u_next = tl.load(up_rows + offs_kb[None, :], mask=kmask0, other=0.0)
        d_next = tl.load(down_cols + offs_hb[:, None].to(tl.int64) * stride_d,
                         mask=(offs_hb < H)[:, None] & ch_mask[None, :], other=0.0)
        if USE_PDL:
            pdl_release_dependents()
            tl.extra.cuda.gdc_wait()
        if pid == 0:  # the ring's previous accumulator: its reader is done (module docstring)
            for h0 in range(0, H, BLOCK_H):
                tl.store(ZERO + h0 + offs_hb, tl.zeros([BLOCK_H], tl.float32), mask=h0 + offs_hb < H)

        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs = k0 + offs_kb
            mask = offs < H
            s = _stream_chunk(X, R, offs, mask, True, DT)
            if pid == 0:
                tl.store(ROUT + offs, s.to(ROUT.dtype.element_ty), mask=mask)
            ss += s * s
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / H + eps)

        g_acc = tl.zeros([BLOCK_I], dtype=tl.float32)
        u_acc = tl.zeros([BLOCK_I], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            gw = g_next
            uw = u_next
            offs = k0 + offs_kb
            mask = offs < H
            nxt = offs + BLOCK_K
            nmask = ch_mask[:, None] & (nxt < H)[None, :]
            g_next = tl.load(gate_rows + nxt[None, :], mask=nmask, other=0.0)
            u_next = tl.load(up_rows + nxt[None, :], mask=nmask, other=0.0)
            s = _stream_chunk(X, R, offs, mask, True, DT)
            ln = tl.load(LNW + offs, mask=mask, other=0.0).to(tl.float32)
            x = ((s * rstd).to(DT).to(tl.float32) * ln).to(DT).to(tl.float32)
            g_acc += tl.sum(gw.to(tl.float32) * x[None, :], axis=1)
            u_acc += tl.sum(uw.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            g_acc += tl.load(BGU + ch, mask=ch_mask, other=0.0).to(tl.float32)
            u_acc += tl.load(BGU + I + ch, mask=ch_mask, other=0.0).to(tl.float32)
        g = g_acc.to(DT).to(tl.float32)
        u = u_acc.to(DT).to(tl.float32)
        a = ((g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * u).to(DT).to(tl.float32)
        a = tl.where(ch_mask, a, 0.0)

        for h0 in range(0, H, BLOCK_H):
            dw = d_next
            offs_h = h0 + offs_hb
            nh = offs_h + BLOCK_H
            d_next = tl.load(down_cols + nh[:, None].to(tl.int64) * stride_d,
                             mask=(nh < H)[:, None] & ch_mask[None, :], other=0.0)
            part = tl.sum(dw.to(tl.float32) * a[None, :], axis=1)
            if HAS_BIAS:
                if pid == 0:
                    part += tl.load(BD + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)
            tl.atomic_add(ACC + offs_h, part, mask=offs_h < H, sem="relaxed")


def supported(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """x: one contiguous row, in the weights' dtype or fp32 (decode_oproj's accumulator,
    rounded to the weights' dtype as it is added to the residual stream)."""
    return (HAS_TRITON and (x.is_cuda or _INTERPRET) and x.dim() == 2 and x.shape[0] == 1
            and x.is_contiguous() and w_gate_up.dim() == 2 and w_down.dim() == 2
            and w_gate_up.stride(1) == 1 and w_down.stride(1) == 1
            and w_gate_up.dtype == w_down.dtype and x.dtype in (w_gate_up.dtype, torch.float32))


def mlp(x: torch.Tensor, residual: torch.Tensor, ln_weight: torch.Tensor, w_gate_up: torch.Tensor,
        w_down: torch.Tensor, b_gate_up: Optional[torch.Tensor] = None,
        b_down: Optional[torch.Tensor] = None, *, acc: torch.Tensor, zero: torch.Tensor,
        eps: float = 1e-6, cfg: MlpConfig = DEFAULT_CONFIG, pdl: bool = False,
        residual_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(silu(gate) * up) of rms_norm(x + residual) * ln_weight, x + residual).
    x, residual [1, H]; w_gate_up [2I, H] (gate rows, then up rows); w_down [H, I].
    acc: fp32 [1, H], zero before the call (it is returned, holding the output); zero: an
    fp32 [1, H] buffer this call sets to 0 (AccumulatorRing: the ring's previous one)."""
    if not supported(x, w_gate_up, w_down):
        raise ValueError(f"decode_mlp: x {tuple(x.shape)} {x.dtype}, w_gate_up {tuple(w_gate_up.shape)} "
                         f"{w_gate_up.dtype}, w_down {tuple(w_down.shape)} {w_down.dtype} not supported "
                         "(one contiguous row, weights' rows contiguous, one dtype, Triton)")
    h = x.shape[1]
    two_i, k = w_gate_up.shape
    inter = two_i // 2
    if k != h or two_i % 2 or tuple(w_down.shape) != (h, inter):
        raise ValueError(f"decode_mlp: w_gate_up must be [2I, H={h}] and w_down [H={h}, I]; got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    for name, t in (("residual", residual), ("ln_weight", ln_weight), ("b_gate_up", b_gate_up),
                    ("b_down", b_down)):
        if t is not None and t.dtype != w_gate_up.dtype:
            raise ValueError(f"decode_mlp: {name} is {t.dtype}, the weights are {w_gate_up.dtype} "
                             "(one dtype)")
    if residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError("decode_mlp: residual must be contiguous and shaped like x")
    if (b_gate_up is None) != (b_down is None):
        raise ValueError("decode_mlp: give both biases or neither")
    for name, t in (("acc", acc), ("zero", zero)):
        if t.dtype != torch.float32 or t.numel() != h or not t.is_contiguous():
            raise ValueError(f"decode_mlp: {name} must be a contiguous fp32 buffer of {h} values")
    if acc.data_ptr() == zero.data_ptr():
        raise ValueError("decode_mlp: acc and zero must be different buffers")
    new_res = torch.empty_like(residual) if residual_out is None else residual_out
    _mlp_kernel[(triton.cdiv(inter, cfg.block_i),)](
        x, residual, ln_weight, w_gate_up, b_gate_up if b_gate_up is not None else w_gate_up,
        w_down, b_down if b_down is not None else w_down, acc, zero, new_res, h, inter, eps,
        w_gate_up.stride(0), w_down.stride(0), HAS_BIAS=b_gate_up is not None, USE_PDL=pdl,
        BLOCK_I=cfg.block_i, BLOCK_K=cfg.block_k, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps,
        **pdl_launch(pdl))
    return acc.view(1, h), new_res


def mlp_ref(x, residual, ln_weight, w_gate_up, w_down, b_gate_up=None, b_down=None, eps=1e-6):
    """The unfused ops in HF's order: (output in x's dtype, new residual)."""
    import torch.nn.functional as F
    new_res = x + residual
    hn = _rms_norm_ref(new_res, ln_weight, eps)
    gate, up = F.linear(hn, w_gate_up, b_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down, b_down), new_res


@dataclass
class DecodeMlp:
    """The fused MLP's configuration per (H, I, bias), measured at start-up against the two
    decode_gemv kernels it replaces (None: those were faster, and run)."""
    pdl: bool = False
    accumulators: Optional[AccumulatorRing] = None
    configs: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def config(self, mlp_module) -> Optional[MlpConfig]:
        w = mlp_module.gate_up_proj.weight
        return self.configs.get(_key(w, mlp_module.gate_up_proj.bias), DEFAULT_CONFIG)

    def for_layers(self, x: torch.Tensor, layers) -> Optional[list["LayerMlp"]]:
        """Each layer's fused MLP for a one-token forward of x over `layers` (all of the
        model's, in order), or None: the two-kernel path for every layer. All or none, since
        each layer's kernel zeroes the previous layer's accumulator."""
        if len(layers) != self.accumulators.buffers.shape[0]:
            return None
        cfgs = [self.config(layer.mlp) for layer in layers]
        mlps = [layer.mlp for layer in layers]
        if any(c is None for c in cfgs) or not all(
                supported(x, m.gate_up_proj.weight, m.down_proj.weight) for m in mlps):
            return None
        return [LayerMlp(self, i, c) for i, c in enumerate(cfgs)]

    def tune(self, mlp_module, gemv_table) -> None:
        """Time each candidate (50 calls in a graph, weights cycled through copies larger than
        L2) against gemv_table's gate_up + down kernels timed the same way."""
        from . import decode_gemv
        from .skinny_gemm import time_candidates
        gu, down = mlp_module.gate_up_proj, mlp_module.down_proj
        key = _key(gu.weight, gu.bias)
        if key in self.configs:
            return
        h = gu.weight.shape[1]
        dev, dt = gu.weight.device, gu.weight.dtype
        x, res = torch.randn(1, h, dtype=dt, device=dev), torch.randn(1, h, dtype=dt, device=dev)
        ln = torch.ones(h, dtype=dt, device=dev)
        n = max(2, min(16, -(-(128 << 20) // (gu.weight.numel() * gu.weight.element_size()
                                              + down.weight.numel() * down.weight.element_size()))))
        # time_linear_us cycles (w, b) pairs: here w is the pair of weights, b unused
        copies = [((gu.weight, down.weight), None)]
        copies += [((gu.weight.clone(), down.weight.clone()), None) for _ in range(n - 1)]
        bias = (gu.bias, down.bias)
        ring = AccumulatorRing.create(2, h, dev)

        def pair(xx, ws, _b):
            g, _ = gemv_table.run(xx, _Proj(ws[0], bias[0]), decode_gemv.ADD_RMSNORM, res, ln)
            return gemv_table.run(g, _Proj(ws[1], bias[1]), decode_gemv.SILU_MUL)[0]

        def fused(c):
            return lambda xx, ws, _b: mlp(xx, res, ln, ws[0], ws[1], *bias, acc=ring.buffers[0],
                                          zero=ring.buffers[1], cfg=c, pdl=self.pdl)[0]

        times = time_candidates(pair, fused, CANDIDATES, x, copies, f"decode mlp {key}")
        del copies
        self.configs[key] = min(times, key=times.get)
        self.timings[key] = times
        logger.info("decode mlp %s: %s (µs: %s)", key, self.configs[key],
                    {str(c): round(t, 2) for c, t in times.items()})


@dataclass(frozen=True)
class LayerMlp:
    """Layer `index`'s MLP as one kernel: called (h, residual, post-attention norm, MLP
    module) -> (fp32 output accumulator [1, H], new residual)."""
    table: DecodeMlp
    index: int
    cfg: MlpConfig

    def __call__(self, h, residual, norm, mlp_module):
        acc, zero = self.table.accumulators.for_layer(self.index)
        gu, down = mlp_module.gate_up_proj, mlp_module.down_proj
        return mlp(h, residual, norm.weight, gu.weight, down.weight, gu.bias, down.bias, acc=acc,
                   zero=zero, eps=norm.eps, cfg=self.cfg, pdl=self.table.pdl)


@dataclass(frozen=True)
class _Proj:
    """A projection's weight and bias as decode_gemv's table reads them (timing only)."""
    weight: torch.Tensor
    bias: Optional[torch.Tensor]

    def __call__(self, x):
        import torch.nn.functional as F
        return F.linear(x, self.weight, self.bias)


def _key(w_gate_up: torch.Tensor, b: Optional[torch.Tensor]) -> tuple:
    return (w_gate_up.shape[1], w_gate_up.shape[0] // 2, b is not None)


def install(model, gemv_table, mode: str) -> Optional[DecodeMlp]:
    """mode (envs.decode_mlp): "on" (the fused MLP for every layer whose shape measured faster
    than the two kernels), "force" (for every layer, untimed), "off" (None)."""
    if mode == "off" or gemv_table is None or not HAS_TRITON or len(model.layers) < 2:
        return None
    device = next(model.parameters()).device
    table = DecodeMlp(pdl=gemv_table.pdl and pdl_supported(device),
                      accumulators=AccumulatorRing.create(len(model.layers), model.shape.hidden_size, device))
    if mode == "on":
        table.tune(model.layers[0].mlp, gemv_table)
    model.one_token_mlp = table
    return table
