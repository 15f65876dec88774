"""Registers, spills and programs an SM of decode_gemv's one-token kernel for sm_90a, without a
GPU: each tuning candidate compiled by Triton for that target and its PTX put through the
ptxas that Triton ships (`ptxas -v`). Registers bound how many programs an SM keeps resident,
and with them how many weight bytes are in flight an SM (Little's law against the card's
bandwidth x latency; bench/RESULTS.md, twenty-fourth and twenty-seventh sessions).

    python -m bench.gemv_registers                        # the 8B q/k/v (add + norm + rope), every norm candidate
    python -m bench.gemv_registers --prologue silu_mul --k 14336     # the 8B down projection

Needs Triton 3.x with its NVIDIA backend (no GPU, no CUDA driver).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
MAX_PROGRAMS_PER_SM = 32
_POINTERS = ("X", "R", "LNW", "W", "B", "Y", "ROUT", "COS", "SIN", "KC", "VC", "PART_M", "PART_L", "ATTN_SL", "ZERO")
_INTS = ("N", "K", "stride_wn", "stride_cos", "num_splits", "k_per_split", "pf_bytes", "pf_programs")


def programs_per_sm(registers: int, num_warps: int) -> int:
    """Resident programs an SM (sm_90) allows by registers (allocated per warp in units of 256),
    threads and blocks; shared memory is not counted (these kernels use little)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(REGISTERS_PER_SM // (per_warp * num_warps), MAX_THREADS_PER_SM // (32 * num_warps),
               MAX_PROGRAMS_PER_SM)


def parse_ptxas(text: str) -> tuple[int, int]:
    """(registers a thread, spill store bytes) from `ptxas -v`'s report."""
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    if not regs:
        raise ValueError(f"no register count in ptxas output: {text[-400:]}")
    return int(regs[-1]), int(spills[-1]) if spills else 0


def compile_candidate(cfg, prologue: int, k: int, rope: bool, heads: tuple[int, int, int]) -> str:
    """The PTX of _gemv_kernel for one candidate, as decode_gemv.gemv would launch it with PDL."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backend_lib.layers import decode_gemv as dg
    fn = dg._gemv_kernel
    hq, hkv, d = heads
    constexprs = dict(
        PROLOGUE=prologue, HAS_BIAS=False, USE_PDL=True, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROPE=rope,
        HQ=hq, HKV=hkv, HEAD_DIM=d, HALF=d // 2, EARLY_RELEASE=True, ATTN_BLOCK_N=64, SPLIT_CHUNK=8,
        SPLIT_K=cfg.split_k > 1,
        NORM_BLOCK=dg.norm_block(cfg, prologue, k),
        L2_PREFETCH=False, PF_THREADS=cfg.num_warps * 32, AHEAD2=cfg.ahead == 2)
    signature = {a: "constexpr" if a in constexprs else "*bf16" if a in _POINTERS else
                 "*i64" if a in ("POS", "SLOT") else "i32" if a in _INTS else "fp32" for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(a),): v for a, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps)).asm["ptx"]


def ptxas_path() -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def measure(cfg, prologue: int, k: int, rope: bool, heads) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compile_candidate(cfg, prologue, k, rope, heads))
        run = subprocess.run([ptxas_path(), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True)
    regs, spills = parse_ptxas(run.stderr)
    resident = programs_per_sm(regs, cfg.num_warps)
    tile_bytes = cfg.block_n * cfg.block_k * 2
    return dict(config=cfg, registers=regs, spill_bytes=spills, programs_per_sm=resident,
                in_flight_kb=resident * cfg.ahead * tile_bytes / 1024)


def main(argv=None) -> int:
    from backend_lib.layers import decode_gemv as dg
    from bench.gemv_shapes import tile_label
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prologue", default="add_rmsnorm", choices=("plain", "rmsnorm", "add_rmsnorm", "silu_mul"))
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--heads", default="32,8,128", help="q heads, kv heads, head_dim (the rope epilogue)")
    ap.add_argument("--no-rope", action="store_true")
    args = ap.parse_args(argv)
    prologue = getattr(dg, args.prologue.upper())
    heads = tuple(int(x) for x in args.heads.split(","))
    norm = prologue in (dg.RMSNORM, dg.ADD_RMSNORM)
    rope = not args.no_rope and norm   # q/k/v: layer 0's takes RMSNORM, the others ADD_RMSNORM
    candidates = dg.CANDIDATES + (dg.NORM_AHEAD_CANDIDATES if norm else dg.SPLIT_K_CANDIDATES if not rope else ())
    print(f"_gemv_kernel for sm_90a: {args.prologue}{' + rope' if rope else ''}, K {args.k}, bf16, PDL")
    print("| tile | registers a thread | spill stores (bytes) | programs an SM | weight in flight an SM (KB) |")
    print("|---|---|---|---|---|")
    for cfg in candidates:
        r = measure(cfg, prologue, args.k, rope, heads)
        print(f"| {tile_label(cfg)} | {r['registers']} | {r['spill_bytes']} | {r['programs_per_sm']} | {r['in_flight_kb']:.0f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
