"""Kernels of one decode step: how many, which, how long; the GEMM shapes of the model at
small M against the weight-bandwidth roofline; and decode TPOT (issue 12's before/after).

    python -m bench.kernels --device cuda --out-dir $OUT        # H200: all three parts, ~3 min
    python -m bench.kernels --device cuda --out-dir $OUT --skinny   # + census and TPOT b1/b8 with the skinny GEMM
    python -m bench.kernels --device cuda --no-tpot --batch 8   # census + GEMMs only, batch 8
    python -m bench.kernels --device cuda --no-gemm --env-variant base:BACKEND_LIB_DECODE_GEMV=off \
        --env-variant gemv:BACKEND_LIB_DECODE_GEMV=on            # census and TPOT of each, one run
    python -m bench.kernels                                     # CPU smoke run (scaled-down model)

1. Kernel census (torch.profiler, CUDA activities): a Qwen2.5-0.5B-shaped checkpoint with
   random bf16 weights (scripts/make_model.py write_random_model, loaded through the normal
   safetensors path, so the load-time q/k/v and gate/up concatenation is what runs) in our
   engine, async handoff and CUDA graphs on; --batch requests with a --prompt-len prompt
   are prefilled, --warmup decode steps run, then --steps steady decode steps are profiled.
   Kernels, memcpys and memsets of those steps are read from the exported Chrome trace
   (kernels_trace.json in --out-dir) and divided by the step count: kernels per step, per
   layer, and a per-kernel table (calls/step, µs/call, µs/step, share of GPU time). If the
   profiler sees no kernel inside the graph replays, the census is repeated with graphs off
   (the same decode program, launched eagerly) and says so in its header line.
2. GEMM shapes (CUDA only): every projection of the 0.5B and 8B shapes as F.linear at M =
   1, 8, 16, timed with CUDA events over many calls that cycle through enough weight copies
   to defeat the L2 cache; µs per call and the weight-read bandwidth it reaches, beside the
   D2D copy bandwidth. With Triton, the same measurement `SkinnyGemmTable.tune` makes at
   start-up (backend_lib/layers/skinny_gemm.py): the fastest skinny configuration and
   whether it is selected (only when faster than cuBLAS).
3. TPOT (CUDA only, unless --no-tpot): `python -m bench.decode --impls async` for both
   presets at batch 1/8/64/256 (prompt 256, output 128; see bench/decode.py).

On CPU (smoke only, no performance meaning) part 1 runs a scaled-down 0.5B variant and
counts profiler CPU ops instead of kernels; parts 2 and 3 are skipped.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from backend_lib import envs  # noqa: E402
from bench.decode import parse_env_variant  # noqa: E402
from scripts import load_make_model  # noqa: E402

# Scaled-down 0.5B for the CPU smoke run (same structure: Qwen2 biases, GQA, tied head).
_CPU_OVERRIDES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=1024)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- 1. kernel census ---------------------------------------------------------------------------

def _weights_on_gpu(args) -> bool:
    """The 8B shape on CUDA: a config folder the engine fills with random weights on the GPU
    (load_format "dummy": writing 16 GB of safetensors would take minutes of the lease); the
    0.5B goes through the safetensors path."""
    return args.device == "cuda" and args.preset == "llama-3-8b"


def build_model(args) -> str:
    """The census's checkpoint folder (_weights_on_gpu: a config folder only)."""
    mm = load_make_model()
    cuda = args.device == "cuda"
    if _weights_on_gpu(args):
        from bench.decode import write_preset_config
        return write_preset_config(args.preset, args.model_dir)
    out = Path(args.model_dir) / (f"{args.preset}-random" if cuda else f"{args.preset}-small-random")
    path = mm.write_random_model(out, args.preset, dtype="bfloat16" if cuda else "float32",
                                 device=args.device, overrides=None if cuda else _CPU_OVERRIDES)
    return str(path)


def _engine(path: str, args, cuda_graph: bool):
    from backend_lib import EngineConfig, LLMEngine
    bs = 16
    max_len = (args.prompt_len + args.warmup + args.steps + 2 * bs) // bs * bs
    return LLMEngine(EngineConfig(
        model_path=path, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
        max_num_seqs=max(args.batch, 1), max_num_batched_tokens=max(args.batch * args.prompt_len, max_len),
        max_model_len=max_len, block_size=bs, num_kv_blocks=args.batch * (max_len // bs) + 8,
        async_token_handoff="on", enable_cuda_graph=cuda_graph, cuda_graph_max_batch=max(args.batch, 1),
        load_format="dummy" if _weights_on_gpu(args) else "safetensors"))


# The census's sampling (bench/decode.py's modes): request i's SamplingParams keywords.
SAMPLINGS = {
    "greedy": lambda i: dict(temperature=0.0),
    "temperature": lambda i: dict(temperature=0.7, seed=i),
    "top_p": lambda i: dict(temperature=0.7, top_p=0.9, seed=i),
    "logprobs": lambda i: dict(temperature=0.0, logprobs=5),
}


def profile_decode_steps(path: str, args, cuda_graph: bool, trace: Path) -> dict:
    """Profile args.steps steady decode steps; returns {"events": [(cat, name, dur_us)],
    "steps", "wall_s", "graph", "num_layers"}."""
    from torch.profiler import ProfilerActivity, profile

    from backend_lib import SamplingParams
    cuda = args.device == "cuda"
    eng = _engine(path, args, cuda_graph)
    total = args.warmup + args.steps + 4
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        sp = SamplingParams(max_tokens=total, ignore_eos=True, **SAMPLINGS[args.sampling](i))
        eng.add_request(f"k{i}", torch.randint(4, min(eng.vocab_size, 32000), (args.prompt_len,),
                                               generator=g).tolist(), sp)
    for _ in range(1 + args.warmup):  # the prefill, then warm decode steps
        eng.step()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    graph = eng.runner.decode_graphs is not None
    num_layers = eng.runner.shape.num_layers
    while eng.has_unfinished():
        eng.step()
    eng.close()
    del eng
    prof.export_chrome_trace(str(trace))
    with open(trace) as f:
        raw = json.load(f)
    evs = raw["traceEvents"] if isinstance(raw, dict) else raw
    cats = _DEVICE_CATS if cuda else ("cpu_op",)
    picked = [e for e in evs if e.get("ph") == "X" and e.get("cat") in cats]
    events = [(e.get("cat"), e.get("name", "?"), float(e.get("dur", 0.0))) for e in picked]
    # Kernels of one launch share its correlation id: a graph replay's kernels, in order.
    launches: dict = defaultdict(list)
    for e in picked:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            launches[corr].append((float(e.get("ts", 0.0)), e.get("name", "?"), float(e.get("dur", 0.0))))
    biggest = sorted((sorted(v) for v in launches.values()), key=len)
    one_launch = biggest[-1] if biggest and len(biggest[-1]) > 1 else []
    return {"events": events, "steps": args.steps, "wall_s": wall, "graph": graph, "num_layers": num_layers,
            "one_launch": [(name, dur, ts - one_launch[0][0]) for ts, name, dur in one_launch]}


def kernel_family(name: str) -> str:
    """A coarse class of a kernel name, for the summary lines."""
    n = name.lower()
    if n.startswith("memcpy") or n.startswith("memset"):
        return "memcpy/memset"
    if any(t in n for t in ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "skinny")):
        return "GEMM"
    if "paged" in n or "attention" in n or "flash" in n:
        return "attention"
    if any(t in n for t in ("rms_norm", "rope", "silu", "add_rms")):
        return "fused elementwise (ours)"
    return "other (torch elementwise, index, reduce, sampler)"


def _short(name: str, width: int = 90) -> str:
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def critical_path(seq: list) -> list[float]:
    """Each kernel's share of a graph replay's wall time: how far its end lies past every
    earlier kernel's end (seq: (name, µs, start µs) in launch order). Under PDL a kernel
    starts before its predecessor ends and its duration includes its wait, so durations
    overlap; these shares do not, and they sum to the replay's span (an idle gap before a
    kernel counts to that kernel: its launch)."""
    shares, last_end = [], seq[0][2] if seq else 0.0
    for _, dur, start in seq:
        end = start + dur
        shares.append(max(0.0, end - last_end))
        last_end = max(last_end, end)
    return shares


def _critical_by_kernel(seq: list, shares: list[float], num_layers: int) -> list[str]:
    """The replay's wall time by kernel name: total, per layer, and calls."""
    by: dict = defaultdict(lambda: [0, 0.0])
    for (name, _, _), share in zip(seq, shares):
        by[name][0] += 1
        by[name][1] += share
    lines = ["", f"Wall time of one replay by kernel ({sum(shares):.1f} µs from the first kernel's start "
                 f"to the last one's end):", "", "| kernel | calls | µs on the critical path | per layer |",
             "|---|---|---|---|"]
    for name, (k, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{_short(name, 70)}` | {k} | {t:.1f} | {t / num_layers:.2f} |")
    return lines


def census_tables(c: dict, cuda: bool) -> str:
    steps = c["steps"]
    by_name: dict = defaultdict(lambda: [0, 0.0])
    fam: dict = defaultdict(lambda: [0, 0.0])
    for cat, name, dur in c["events"]:
        by_name[name][0] += 1
        by_name[name][1] += dur
        f = kernel_family(name) if cuda else "cpu op"
        fam[f][0] += 1
        fam[f][1] += dur
    n = sum(v[0] for v in by_name.values())
    busy = sum(v[1] for v in by_name.values())
    unit = "kernels" if cuda else "CPU ops (nested; smoke run)"
    lines = [f"{unit} per decode step: {n / steps:.1f} ({n / steps / c['num_layers']:.1f} per layer over "
             f"{c['num_layers']} layers, LM head and sampler included); device busy {busy / steps:.1f} µs/step; "
             f"wall {c['wall_s'] / steps * 1e3:.3f} ms/step under the profiler; "
             f"{'CUDA graphs' if c['graph'] else 'eager (no graphs)'}", ""]
    lines += ["| family | per step | µs/step | % of busy |", "|---|---|---|---|"]
    for f, (k, d) in sorted(fam.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {f} | {k / steps:.1f} | {d / steps:.1f} | {100 * d / max(busy, 1e-9):.1f} |")
    if cuda and c["graph"] and len(c.get("one_launch") or []) >= c["num_layers"]:
        seq = c["one_launch"]
        shares = critical_path(seq)
        lines += ["", f"One graph replay (the decode program), in launch order: {len(seq)} kernels, "
                      f"{sum(d for _, d, _ in seq):.1f} µs of kernel time; the remaining {n / steps - len(seq):.1f} "
                      f"kernels per step run outside the graph (table updates, relay/handoff copies). "
                      f"start: µs after the replay's first kernel began; critical: how far its end lies "
                      f"past every earlier kernel's end.", "",
                  "| # | kernel | µs | start | critical |", "|---|---|---|---|---|"]
        lines += [f"| {i} | `{_short(name, 70)}` | {d:.2f} | {t:.1f} | {share:.2f} |"
                  for i, ((name, d, t), share) in enumerate(zip(seq, shares))]
        lines += _critical_by_kernel(seq, shares, c["num_layers"])
    lines += ["", "| kernel | calls/step | µs/call | µs/step | % of busy |", "|---|---|---|---|---|"]
    for name, (k, d) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{_short(name)}` | {k / steps:.2f} | {d / k:.2f} | {d / steps:.2f} | "
                     f"{100 * d / max(busy, 1e-9):.1f} |")
    return "\n".join(lines)


# ---- 2. GEMM shapes at small M ------------------------------------------------------------------

def model_gemm_shapes(preset: str) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, bias) of every projection of a preset, in step order; the LM head last."""
    a = load_make_model().RANDOM_PRESETS[preset]
    h, inter = a["hidden_size"], a["intermediate_size"]
    hd = a.get("head_dim") or h // a["num_attention_heads"]
    q, kv = a["num_attention_heads"] * hd, a["num_key_value_heads"] * hd
    qkv_bias = a["model_type"] == "qwen2" or bool(a.get("attention_bias"))
    return [("qkv_proj", q + 2 * kv, h, qkv_bias), ("o_proj", h, q, False),
            ("gate_up_proj", 2 * inter, h, False), ("down_proj", h, inter, False),
            ("lm_head", a["vocab_size"], h, False)]


def gemm_table(bandwidth: float) -> str:
    """cuBLAS (F.linear) per shape and M; with Triton, the start-up selection's view too: the
    fastest skinny configuration and what `SkinnyGemmTable.tune` picks (None: cuBLAS)."""
    import torch.nn.functional as F

    from backend_lib.layers import skinny_gemm as sg
    triton_ok = sg.HAS_TRITON
    head = "| model | GEMM | N x K | M | cuBLAS µs | cuBLAS TB/s | % of copy bw |"
    rule = "|---|---|---|---|---|---|---|"
    if triton_ok:
        head += " best skinny µs | skinny TB/s | best skinny config | selected |"
        rule += "---|---|---|---|"
    rows = [head, rule]
    ms = [1, 8, 16]
    for preset in ("qwen2.5-0.5b", "llama-3-8b"):
        for name, n, k, bias in model_gemm_shapes(preset):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
            table = None
            if triton_ok:
                table = sg.SkinnyGemmTable()
                table.tune([(w, b)], ms)
            else:
                copies = sg.weight_copies(w, b)
            for m in ms:
                if table is not None:
                    t = dict(table.timings[(m, n, k, bias)])
                    us = t.pop("cublas")
                else:
                    us = sg.time_linear_us(F.linear, torch.randn(m, k, device="cuda", dtype=torch.bfloat16), copies)
                tbs = n * k * 2 / (us * 1e-6) / 1e12
                row = f"| {preset} | {name} | {n} x {k} | {m} | {us:.2f} | {tbs:.2f} | {100 * tbs * 1e12 / bandwidth:.0f} |"
                if table is not None:
                    if t:
                        best = min(t, key=t.get)
                        row += f" {t[best]:.2f} | {n * k * 2 / (t[best] * 1e-6) / 1e12:.2f} | {best} |"
                    else:
                        row += " n/a | - | no configuration compiled |"
                    chosen = table.choice[(m, n, k, bias)]
                    row += f" {'cuBLAS' if chosen is None else 'skinny'} |"
                rows.append(row)
                _log(f"  {preset} {name} M={m}: cuBLAS {us:.2f} µs")
            del w, b, table
            torch.cuda.empty_cache()
    return "\n".join(rows)


def census_of(path: str, args, trace: Path) -> dict:
    census = profile_decode_steps(path, args, True, trace)
    if args.device == "cuda" and len(census["events"]) < census["steps"] * census["num_layers"]:
        # Fewer kernels than layers: the profiler did not see inside the graph replays.
        _log("  the profiler saw no kernels inside the graph replays: census repeated with graphs off")
        census = profile_decode_steps(path, args, False, trace)
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return census


def _skinny_env(on: bool):
    return envs.overridden({envs.SKINNY_GEMM_ENV: "on" if on else "off"})


# ---- main -----------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batch", type=int, default=1, help="decode batch of the census (default 1)")
    ap.add_argument("--preset", choices=("qwen2.5-0.5b", "llama-3-8b"), default="qwen2.5-0.5b",
                    help="the census's model shape (random weights; on CPU scaled down)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--sampling", choices=sorted(SAMPLINGS), default="greedy", help="the census's sampling")
    ap.add_argument("--warmup", type=int, default=10, help="decode steps before profiling")
    ap.add_argument("--steps", type=int, default=20, help="profiled decode steps")
    ap.add_argument("--model-dir", default="/tmp/bench-models", help="where the random checkpoint is written")
    ap.add_argument("--out-dir", default="/tmp/bench-out", help="kernels.md, kernels.json, kernels_trace.json")
    ap.add_argument("--no-gemm", action="store_true", help="skip the GEMM-shape table")
    ap.add_argument("--no-tpot", action="store_true", help="skip the TPOT run (bench.decode)")
    ap.add_argument("--env-variant", action="append", default=[],
                    help="NAME:VAR=VALUE[,VAR=VALUE], repeatable: the census and the TPOT once under "
                         "each (replaces the plain run and --skinny's)")
    ap.add_argument("--tpot-batches", default="1,8,64,256", help="the TPOT run's batches")
    ap.add_argument("--skinny", action="store_true",
                    help="also the census and the TPOT of batch 1 and 8 with BACKEND_LIB_SKINNY_GEMM=on "
                         "(the start-up selection of layers/skinny_gemm.py)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    if args.device == "cpu":
        args.prompt_len = min(args.prompt_len, 32)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    meta = {"device": args.device, "gpu": torch.cuda.get_device_name() if cuda else None,
            "torch": torch.__version__, "batch": args.batch, "prompt_len": args.prompt_len,
            "steps": args.steps}
    _log(f"kernel bench on {args.device} ({meta['gpu'] or 'cpu'}), torch {torch.__version__}")
    path = build_model(args)
    sections: list[str] = []
    result: dict = {"meta": meta}
    variants = [("", {})] + ([("skinny", {envs.SKINNY_GEMM_ENV: "on"})] if (cuda and args.skinny) else [])
    if args.env_variant:
        variants = [parse_env_variant(v) for v in args.env_variant]
    for name, env in variants:
        tag = f" ({name}: {' '.join(f'{k}={v}' for k, v in env.items())})" if name else ""
        with envs.overridden(env):
            census = census_of(path, args, out / f"kernels_trace{'_' + name if name else ''}.json")
        sections += [f"## Kernels of one decode step: {args.preset} shape, batch {args.batch}, "
                     f"prompt {args.prompt_len}, sampling {args.sampling}{tag}\n", census_tables(census, cuda), ""]
        result["census" + ("_" + name if name else "")] = {
            "kernels_per_step": len(census["events"]) / census["steps"],
            **{k: v for k, v in census.items() if k != "events"}}
    if cuda and not args.no_gemm:
        from bench.decode import measure_copy_bandwidth
        bw = measure_copy_bandwidth()
        meta["copy_bandwidth_Bps"] = bw
        sections += [f"## GEMM shapes at small M (bf16, weights from HBM; copy bandwidth {bw / 1e12:.2f} TB/s)\n",
                     gemm_table(bw)]
    md = "\n".join(sections)
    (out / "kernels.md").write_text(md + "\n")
    (out / "kernels.json").write_text(json.dumps(result, indent=2))
    if cuda and not args.no_tpot:
        from bench import decode
        decode.main(["--device", "cuda", "--impls", "async", "--batches", args.tpot_batches, "--timeline", "",
                     "--model-dir", args.model_dir, "--out-dir", str(out)]
                    + [a for v in args.env_variant for a in ("--env-variant", v)])
        if args.skinny and not args.env_variant:
            print("\n## TPOT with BACKEND_LIB_SKINNY_GEMM=on (batch 1 and 8: the graph buckets it tunes)\n")
            with _skinny_env(True):
                decode.main(["--device", "cuda", "--impls", "async", "--batches", "1,8", "--timeline", "",
                             "--model-dir", args.model_dir, "--out-dir", str(out / "skinny")])
    print(f"\n(kernel bench: {time.time() - t_start:.0f} s; trace {out / 'kernels_trace.json'})\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
