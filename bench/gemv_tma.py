"""Hopper's TMA for the one-token projections' weight stream (issue 12: "TMA loads, measured").

decode_gemv's kernel streams weights through registers: each program holds its next weight
tile in registers while it multiplies the current one, so the bytes in flight an SM are
bounded by the registers (2 x 16 KB at the 8B shape's norm projections, bench/RESULTS.md
twenty-fourth session). A TMA load (a tensor descriptor's `load`, pipelined over `STAGES`
shared-memory buffers) keeps STAGES - 1 tiles in flight a program without holding them in
registers. This times, for every one-token projection of a model shape as a plain GEMV
(no prologue: the weight stream alone), at batch 1:

  cuBLAS      F.linear
  gemv        decode_gemv's kernel, every start-up candidate, with and without PDL
  tma         the TMA kernel below over a grid of (BLOCK_N, BLOCK_K, STAGES, warps), with and
              without PDL (with PDL it waits before its first load: the pipeliner must not
              hoist the activation loads above the wait)

each as 50 calls in one CUDA graph over weight copies larger than L2 (skinny_gemm's timer, as
start-up tuning times), and prints µs a call and the fraction of copy bandwidth.

    python -m bench.gemv_tma --preset qwen2.5-0.5b,llama-3-8b --out $OUT/gemv_tma.json

CUDA (sm_90) only; `--check-only` runs the kernel once against torch (also under
TRITON_INTERPRET=1 on CPU).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backend_lib.layers.triton_support import HAS_TRITON, pdl_launch, tl, triton  # noqa: E402,F401
from scripts import load_make_model  # noqa: E402


@dataclass(frozen=True)
class TmaConfig:
    block_n: int
    block_k: int    # a TMA box holds at most 256 elements a dimension
    stages: int
    num_warps: int


TMA_CONFIGS = tuple(TmaConfig(n, k, s, w) for n, k, s, w in itertools.product(
    (8, 16, 32, 64), (128, 256), (3, 4, 6), (4,)) if n * k * 2 * s <= 160 * 1024)

if HAS_TRITON:
    @triton.jit
    def _tma_gemv_kernel(w_desc, X, Y, N, K, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            w = w_desc.load([pid * BLOCK_N, k0])          # rows / columns past the weight: zeros
            x = tl.load(X + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=offs_n < N)


def tma_gemv(x: torch.Tensor, w: torch.Tensor, cfg: TmaConfig, pdl: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] @ w[N, K]^T through TMA weight loads."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    _tma_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        desc, x, y, n, k, USE_PDL=pdl, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        num_warps=cfg.num_warps, **pdl_launch(pdl))
    return y


def _set_allocator() -> None:
    """TMA descriptors built on the device need a scratch allocator; host-built ones (here) do
    not, but some Triton releases ask for one anyway."""
    if hasattr(triton, "set_allocator"):
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def projections(preset: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's one-token projections and the LM head."""
    cfg = load_make_model().RANDOM_PRESETS[preset]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    return [("qkv", (hq + 2 * hkv) * d, h), ("o_proj", h, hq * d), ("gate_up", 2 * inter, h),
            ("down", h, inter), ("lm_head", cfg["vocab_size"], h)]


def check(device: str, dtype=torch.float32) -> float:
    """Worst relative error of tma_gemv against torch over a few odd shapes."""
    worst = 0.0
    for n, k in ((100, 296), (37, 512), (64, 132)):   # rows 16-byte aligned (TMA)
        w = torch.randn(n, k, device=device, dtype=dtype)
        x = torch.randn(1, k, device=device, dtype=dtype)
        y = tma_gemv(x, w, TmaConfig(16, 128, 3, 4)).float()
        ref = (x.float() @ w.float().t())
        worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
    return worst


def measure(preset: str, copy_bw: float) -> list[dict]:
    from backend_lib.layers import decode_gemv as dg
    from backend_lib.layers.skinny_gemm import time_linear_us, weight_copies
    from bench.gemv_shapes import tile_label
    dev = torch.device("cuda")
    rows = []
    for name, n, k in projections(preset):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        copies = weight_copies(w, None)
        times = {"cuBLAS": time_linear_us(lambda xx, ww, bb: F.linear(xx, ww), x, copies)}
        for pdl in (False, True):
            tag = " pdl" if pdl else ""
            for c in dg.CANDIDATES:
                call = (lambda c=c, pdl=pdl: lambda xx, ww, bb: dg.gemv(xx, ww, None, cfg=c, pdl=pdl))()
                times[f"gemv {tile_label(c)}{tag}"] = time_linear_us(call, x, copies)
            for c in TMA_CONFIGS:
                y = tma_gemv(x, w, c, pdl)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    raise AssertionError(f"{name} {c}: relative error {err}")
                call = (lambda c=c, pdl=pdl: lambda xx, ww, bb: tma_gemv(xx, ww, c, pdl))()
                times[f"tma {c.block_n}x{c.block_k} s{c.stages} w{c.num_warps}{tag}"] = time_linear_us(call, x, copies)
        wbytes = n * k * 2
        for variant, us in times.items():
            rows.append(dict(proj=name, n=n, k=k, variant=variant, us=us,
                             of_copy=wbytes / (us * 1e-6) / copy_bw if copy_bw else None))
        del w, copies
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """Per projection: cuBLAS, and the best of each family (gemv / tma, with and without PDL)."""
    lines = ["| projection | N x K | cuBLAS | gemv | gemv pdl | tma | tma pdl | best tma config |",
             "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["proj"] for r in rows):
        mine = [r for r in rows if r["proj"] == name]

        def best(prefix, pdl):
            cand = [r for r in mine if r["variant"].startswith(prefix) and r["variant"].endswith(" pdl") == pdl]
            return min(cand, key=lambda r: r["us"])

        cells = [next(r for r in mine if r["variant"] == "cuBLAS")] + [best(p, d) for p in ("gemv", "tma")
                                                                        for d in (False, True)]
        fmt = " | ".join(f"{r['us']:.2f} ({r['of_copy']:.2f})" for r in cells)
        lines.append(f"| {name} | {mine[0]['n']} x {mine[0]['k']} | {fmt} | {min(cells[3:], key=lambda r: r['us'])['variant']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b,llama-3-8b")
    ap.add_argument("--check-only", action="store_true", help="the kernel against torch, then exit")
    ap.add_argument("--out", default="", help="JSON of every row")
    args = ap.parse_args(argv)
    if not HAS_TRITON:
        print("bench.gemv_tma: needs Triton", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        _set_allocator()
    if args.check_only:
        err = check(device)
        print(f"tma_gemv against torch: worst relative error {err:.2e}")
        return 0 if err < 1e-4 else 1
    if device != "cuda":
        print("bench.gemv_tma: needs CUDA (sm_90 TMA)", file=sys.stderr)
        return 2
    from bench.gemv_shapes import run_presets
    return run_presets(args.preset.split(","), measure, table, args.out,
                       note="; µs a call (fraction of copy bandwidth)")


if __name__ == "__main__":
    sys.exit(main())
