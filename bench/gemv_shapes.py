"""The one-token projections of a model shape, each timed the way start-up tuning times it:
the unfused ops (the feeding op's kernel, then cuBLAS) beside every decode_gemv tile, split-K
tiles included, as 50 calls in one CUDA graph over weight copies larger than L2. Prints µs per
call and the weight-read bandwidth each reaches, beside the device's copy bandwidth (issue 12:
which projections are far from the roofline, and what the tuner picks for them).

    python -m bench.gemv_shapes --preset qwen2.5-0.5b,llama-3-8b --out $OUT/gemv_shapes.json

CUDA only (the tiles are Triton kernels timed inside CUDA graphs).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from backend_lib.layers.decode_gemv import ADD_RMSNORM, PLAIN, RMSNORM, SILU_MUL  # noqa: E402
from scripts import load_make_model  # noqa: E402

PROLOGUE_NAMES = {PLAIN: "plain", RMSNORM: "rmsnorm", ADD_RMSNORM: "add+rmsnorm", SILU_MUL: "silu*mul"}


def projections(preset: str) -> list[tuple[str, int, int, int, bool, bool]]:
    """(name, prologue, N, K, bias, rope) of one decoder layer's one-token projections."""
    cfg = load_make_model().RANDOM_PRESETS[preset]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    mlp_bias = cfg.get("mlp_bias", False)
    return [("qkv", ADD_RMSNORM, (hq + 2 * hkv) * d, h, qkv_bias, True),
            ("o_proj", PLAIN, h, hq * d, cfg.get("attention_bias", False) and cfg["model_type"] != "qwen2", False),
            ("gate_up", ADD_RMSNORM, 2 * inter, h, mlp_bias, False),
            ("down", SILU_MUL, h, inter, mlp_bias, False)]


def tile_label(cfg) -> str:
    """A decode_gemv tile as the tables name it, e.g. "8x512 w4 split 4" or "8x512 w4 ahead 2 norm 1024"."""
    return (f"{cfg.block_n}x{cfg.block_k} w{cfg.num_warps}" + (f" split {cfg.split_k}" if cfg.split_k > 1 else "")
            + (f" ahead {cfg.ahead}" if cfg.ahead > 1 else "") + (f" norm {cfg.norm_block}" if cfg.norm_block else ""))


def rows_for(name: str, n: int, k: int, prologue: int, times: dict, chosen, elem_bytes: int,
             copy_bw: float) -> list[dict]:
    """One row per timed variant (None: the unfused ops), the weight bytes over its time."""
    wbytes = n * k * elem_bytes
    out = []
    for cfg, us in sorted(times.items(), key=lambda kv: kv[1]):
        label = "unfused (op + cuBLAS)" if cfg is None else tile_label(cfg)
        tbps = wbytes / (us * 1e-6) / 1e12
        out.append(dict(proj=name, prologue=PROLOGUE_NAMES.get(prologue, str(prologue)), n=n, k=k,
                        variant=label, us=us, tb_s=tbps, of_copy=tbps * 1e12 / copy_bw if copy_bw else None,
                        chosen=cfg == chosen))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| projection | N x K | variant | µs/call | weight TB/s | x copy bw | chosen |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        of = "" if r["of_copy"] is None else f"{r['of_copy']:.2f}"
        lines.append(f"| {r['proj']} ({r['prologue']}) | {r['n']} x {r['k']} | {r['variant']} | {r['us']:.2f} | "
                     f"{r['tb_s']:.2f} | {of} | {'**yes**' if r['chosen'] else ''} |")
    return "\n".join(lines)


def measure(preset: str, copy_bw: float) -> list[dict]:
    import torch

    from backend_lib.layers import decode_gemv as dg
    dev = torch.device("cuda")
    cfg = load_make_model().RANDOM_PRESETS[preset]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rows = []
    for name, prologue, n, k, bias, rope in projections(preset):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
        heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"], d) if rope else None
        table_ = dg.DecodeGemv(pdl=dg.pdl_supported(dev), rope=rope, num_layers=2)
        table_.tune([(prologue, w, b, heads)])
        key = dg.shape_key(prologue, w, b, rope)
        rows += rows_for(name, n, k, prologue, table_.timings[key], table_.configs[key], 2, copy_bw)
        del w, b
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b,llama-3-8b")
    ap.add_argument("--out", default="", help="JSON of every row")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench.gemv_shapes: needs CUDA (Triton tiles timed in CUDA graphs)", file=sys.stderr)
        return 2
    return run_presets(args.preset.split(","), measure, table, args.out)


def run_presets(presets: list[str], measure, table, out: str, note: str = "") -> int:
    """measure(preset, copy_bw) -> rows for each preset, printed as table(rows) as each ends;
    every row in the JSON at `out` (rewritten after each preset)."""
    import torch

    from bench.decode import measure_copy_bandwidth
    copy_bw = measure_copy_bandwidth()
    result = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_Bps": copy_bw, "presets": {}}
    print(f"{result['gpu']}, copy bandwidth {copy_bw / 1e12:.2f} TB/s{note}")
    for preset in presets:
        rows = measure(preset, copy_bw)
        result["presets"][preset] = rows
        print(f"\n### {preset}\n\n{table(rows)}", flush=True)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
