"""One-token attention merge + o_proj as one kernel, split over the heads (Triton).

At batch 1 the split decode attention leaves, per head, partial softmax states of its splits
(triton_attention.DecodePartials); today a reduce kernel merges them and a gemv projects the
result: two kernels, each a fixed ~3 µs at the 0.5B shape. decode_gemv's MERGE_SPLITS prologue
folds the merge into o_proj's gemv, but there every program owns output columns across all of
K, so every program merges every head (slower, bench/RESULTS.md sixteenth session).

Here the grid is split the other way: program (g, n) merges only its HEADS heads and multiplies
them by the matching K-slice of W_o for output columns n * BLOCK_N ..., a split-K partial of
the output added with fp32 atomics into an accumulator [1, N]. Its reader, the MLP's add +
norm prologue (decode_mlp's kernel, or decode_gemv's ADD_RMSNORM), rounds it to the model dtype
where the unfused o_proj would have rounded its store. The accumulators form the same ring as
decode_mlp's (one per layer, layer i's kernel zeroes layer i - 1's, layer 0's the last
layer's: accumulator_ring.AccumulatorRing), so each is zeroed after its reader and before its writer.
The sum's order varies between runs (atomics); the merged attention rounds as the reduce
kernel's store rounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .triton_support import HAS_TRITON, tl, triton  # noqa: F401 - the kernels' globals
from .triton_support import INTERPRET as _INTERPRET
from .triton_support import pdl_launch, pdl_release_dependents  # noqa: F401


@dataclass(frozen=True)
class OprojConfig:
    heads: int      # heads merged per program (its K-slice: heads x head_dim columns)
    block_n: int    # output columns per program
    num_warps: int


DEFAULT_CONFIG = OprojConfig(1, 128, 4)
CANDIDATES = (OprojConfig(1, 128, 4), OprojConfig(1, 256, 4), OprojConfig(2, 128, 4),
              OprojConfig(1, 64, 2), OprojConfig(2, 256, 8))


if HAS_TRITON:
    from .decode_gemv import _merged_attention_chunk  # noqa: F401 - called from the kernel

    @triton.jit
    def _merge_oproj_kernel(PA, PM, PL, SL, W, B, ACC, ZERO, N, K, num_splits, stride_w,
                            HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                            HEADS: tl.constexpr, D: tl.constexpr, ATTN_BLOCK_N: tl.constexpr,
                            SPLIT_CHUNK: tl.constexpr):
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
        DT = W.dtype.element_ty
        BLOCK_K: tl.constexpr = HEADS * D
        k0 = pid_k * BLOCK_K
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        # Weights only: issued before the wait for the attention kernel.
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                    mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        if USE_PDL:
            pdl_release_dependents()
            tl.extra.cuda.gdc_wait()
        if (pid_k == 0) & (pid_n == 0):  # the ring's previous accumulator (module docstring)
            for z0 in range(0, N, BLOCK_N):
                zo = z0 + tl.arange(0, BLOCK_N)
                tl.store(ZERO + zo, tl.zeros([BLOCK_N], tl.float32), mask=zo < N)
        ran = tl.minimum(num_splits, tl.cdiv(tl.load(SL), ATTN_BLOCK_N))
        x = _merged_attention_chunk(PA, PM, PL, k0, ran, num_splits, K, BLOCK_K, D, SPLIT_CHUNK, DT)
        part = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if HAS_BIAS:
            if pid_k == 0:
                part += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.atomic_add(ACC + offs_n, part, mask=n_mask, sem="relaxed")


def supported(parts, w: torch.Tensor, cfg: OprojConfig = DEFAULT_CONFIG) -> bool:
    d = parts.head_dim
    return (HAS_TRITON and (parts.acc.is_cuda or _INTERPRET) and w.dim() == 2 and w.stride(1) == 1
            and w.dtype == parts.dtype and w.shape[1] == parts.num_heads * d and d & (d - 1) == 0)


def merge_oproj(parts, w: torch.Tensor, b: Optional[torch.Tensor] = None, *, acc: torch.Tensor,
                zero: torch.Tensor, cfg: OprojConfig = DEFAULT_CONFIG, pdl: bool = False) -> torch.Tensor:
    """merge(parts) @ W^T (+ b) added into acc (fp32 [1, N], zero before the call; returned);
    zero (fp32 [1, N]) is set to 0. parts: triton_attention.DecodePartials of one row;
    W [N, num_heads * head_dim]."""
    if not supported(parts, w, cfg):
        raise ValueError(f"decode_oproj: cannot merge {parts.num_heads} heads of {parts.head_dim} "
                         f"({parts.dtype}) into w {tuple(w.shape)} {w.dtype} (K must be heads x "
                         "head_dim, head_dim a power of 2, one dtype, w's rows contiguous)")
    n = w.shape[0]
    if b is not None and (b.dtype != w.dtype or b.numel() != n):
        raise ValueError(f"decode_oproj: bias must be {n} values of {w.dtype}")
    for name, t in (("acc", acc), ("zero", zero)):
        if t.dtype != torch.float32 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"decode_oproj: {name} must be a contiguous fp32 buffer of {n} values")
    if acc.data_ptr() == zero.data_ptr():
        raise ValueError("decode_oproj: acc and zero must be different buffers")
    grid = (triton.cdiv(parts.num_heads, cfg.heads), triton.cdiv(n, cfg.block_n))
    _merge_oproj_kernel[grid](
        parts.acc, parts.m, parts.l, parts.seq_lens, w, b if b is not None else w, acc, zero, n,
        w.shape[1], parts.num_splits, w.stride(0), HAS_BIAS=b is not None, USE_PDL=pdl,
        BLOCK_N=cfg.block_n, HEADS=cfg.heads, D=parts.head_dim, ATTN_BLOCK_N=parts.block_n,
        SPLIT_CHUNK=8, num_warps=cfg.num_warps, **pdl_launch(pdl))
    return acc.view(1, n)


@dataclass
class DecodeOproj:
    """The kernel's configuration for the model's o_proj (None: the reduce kernel and
    decode_gemv's projection measured faster, and run), timed at start-up, and the ring of
    per-layer accumulators."""
    pdl: bool
    ring: object            # accumulator_ring.AccumulatorRing
    cfg: Optional[OprojConfig] = DEFAULT_CONFIG
    timings: Optional[dict] = None

    def for_layers(self, layers, dtype: torch.dtype) -> Optional[list["LayerOproj"]]:
        """Each layer's merge + o_proj for a one-token forward over `layers` (all of the
        model's, in order), or None (the reduce kernel and the gemv for every layer: all or
        none, since each layer's kernel zeroes the previous layer's accumulator)."""
        s = layers[0].self_attn.s
        if (self.cfg is None or len(layers) != self.ring.buffers.shape[0] or s.head_dim & (s.head_dim - 1)
                or any(layer.self_attn.o_proj.weight.dtype != dtype for layer in layers)):
            return None
        return [LayerOproj(self, i) for i in range(len(layers))]

    def tune(self, o_proj, gemv_table, num_heads: int, head_dim: int) -> None:
        """Candidates against the reduce kernel + gemv_table's projection, each timed as 50
        calls in one graph, weights cycled through copies larger than L2, on stand-in partial
        states of 16 splits with the decode attention's batch-1 tile (those with a tile of a
        300-token context ran)."""
        from .skinny_gemm import time_candidates, weight_copies
        from .triton_attention import DecodePartials, _decode_tiling, merge_decode_partials
        from .accumulator_ring import AccumulatorRing
        from .decode_mlp import _Proj
        w, b = o_proj.weight, o_proj.bias
        dev, splits = w.device, 16
        attn_block_n, _, _ = _decode_tiling(torch.empty(0, 1, 1, head_dim, dtype=w.dtype, device=dev))
        parts = DecodePartials(
            acc=torch.randn(num_heads * splits, head_dim, device=dev), m=torch.randn(num_heads * splits, device=dev),
            l=torch.rand(num_heads * splits, device=dev) + 1, seq_lens=torch.tensor([300], dtype=torch.int32, device=dev),
            num_splits=splits, block_n=attn_block_n, num_heads=num_heads, head_dim=head_dim, dtype=w.dtype)
        ring = AccumulatorRing.create(2, w.shape[0], dev)
        copies = weight_copies(w, b)

        def unfused(_x, ww, bb):
            o = merge_decode_partials(parts, pdl=self.pdl)
            return gemv_table.run(o.view(1, -1), _Proj(ww, bb))[0]

        def fused(c):
            return lambda _x, ww, bb: merge_oproj(parts, ww, bb, acc=ring.buffers[0], zero=ring.buffers[1],
                                                  cfg=c, pdl=self.pdl)

        times = time_candidates(unfused, fused, CANDIDATES, w, copies, "decode merge + o_proj")
        del copies
        self.cfg = min(times, key=times.get)
        self.timings = times


@dataclass(frozen=True)
class LayerOproj:
    """Layer `index`'s merge + o_proj: called (DecodePartials, o_proj module) -> fp32 [1, N]."""
    table: DecodeOproj
    index: int

    def __call__(self, parts, o_proj):
        acc, zero = self.table.ring.for_layer(self.index)
        return merge_oproj(parts, o_proj.weight, o_proj.bias, acc=acc, zero=zero, cfg=self.table.cfg,
                           pdl=self.table.pdl)


def install(model, gemv_table, mode: str) -> Optional[DecodeOproj]:
    """mode (envs.decode_attn_reduce): "splitk" (this kernel where start-up timing beats the
    reduce kernel + gemv), "splitk-force" (untimed: tests); anything else: None."""
    if mode not in ("splitk", "splitk-force") or gemv_table is None or not HAS_TRITON or len(model.layers) < 2:
        return None
    from .accumulator_ring import AccumulatorRing
    from .triton_support import pdl_supported
    s = model.shape
    o_proj = model.layers[0].self_attn.o_proj
    table = DecodeOproj(pdl=gemv_table.pdl and pdl_supported(o_proj.weight.device),
                        ring=AccumulatorRing.create(len(model.layers), s.hidden_size, o_proj.weight.device))
    if mode == "splitk":
        table.tune(o_proj, gemv_table, s.num_heads, s.head_dim)
    model.one_token_oproj = table
    return table
