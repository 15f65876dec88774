"""Prefix caching: TTFT and prefill tokens computed for a shared-prefix burst, caching on vs
off, in one run (issue 11).

    python -m bench.prefix_cache                               # CPU smoke: tiny-llama, 8 x (200 + 16)
    python -m bench.prefix_cache --device cuda --out $OUT/prefix_cache.json
        # H200: Qwen2.5-0.5B shape (random weights, load_format=dummy), bfloat16,
        # 64 requests = one 2,000-token common prefix + a 64-token suffix each, 16 output tokens

Workload: N requests, every prompt = the same `--prefix` random ids + its own `--suffix`
random ids, greedy, ignore EOS, `--output` tokens; all N are added at t0 (a burst, as when a
system prompt is shared by concurrent users), then the engine steps to the end. The engine
config is the same for both modes except `enable_prefix_caching`: chunked prefill with a
`--budget` token budget, CUDA graphs, the async token handoff (auto). Each mode first runs
the same shapes once with a different prefix (warm-up: Triton kernels, graphs, allocator);
the measured burst's prefix is new to the cache, so the first request computes it and the
others hit it once its blocks are committed (the step after it was launched).

Reported per mode: TTFT (t0 -> the host has the request's first token) mean / p50 / p90 /
max, the burst's wall time, prefill tokens computed (EngineStats.prefill_tokens_total),
prefix-cache queried / hit tokens, and (on vs off) how many requests' greedy outputs are
identical (random weights in bf16: a near-tie may flip over different chunkings).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402


def _prompts(n: int, prefix_len: int, suffix_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 32000)
    prefix = [rng.randrange(4, hi) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(4, hi) for _ in range(suffix_len)] for _ in range(n)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _burst(eng, prompts, output_len: int, tag: str, device: str) -> dict:
    from backend_lib import SamplingParams
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    s0 = eng.stats()
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    _sync(device)
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, sp)
    first: dict[str, float] = {}
    tokens = {rid: [] for rid in rids}
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            tokens[o.request_id] += o.new_token_ids
    _sync(device)
    wall = time.perf_counter() - t0
    s1 = eng.stats()
    assert all(len(t) == output_len for t in tokens.values()), "wrong number of output tokens"
    assert s1.kv_blocks_used == 0, "KV blocks leaked"
    ttft = sorted(first[r] for r in rids)
    q = statistics.quantiles(ttft, n=10) if len(ttft) > 1 else [ttft[0]] * 9
    return {
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft), "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p90_ms": 1e3 * q[8], "ttft_max_ms": 1e3 * ttft[-1], "wall_s": wall,
        "prefill_tokens": s1.prefill_tokens_total - s0.prefill_tokens_total,
        "queried_tokens": s1.prefix_cache_queried_tokens_total - s0.prefix_cache_queried_tokens_total,
        "hit_tokens": s1.prefix_cache_hit_tokens_total - s0.prefix_cache_hit_tokens_total,
        "steps": (s1.async_steps_total + s1.sync_steps_total) - (s0.async_steps_total + s0.sync_steps_total),
        "tokens": [tokens[r] for r in rids],
    }


def run_mode(args, model_path: str, dummy: bool, caching: bool) -> dict:
    from backend_lib import EngineConfig, LLMEngine
    bs = 16
    per_seq = -(-(args.prefix + args.suffix + args.output) // bs)
    max_len = (per_seq + 1) * bs
    cfg = EngineConfig(
        model_path=model_path, device=args.device, dtype=args.dtype, max_num_seqs=args.requests,
        max_num_batched_tokens=args.budget, max_model_len=max_len, block_size=bs,
        num_kv_blocks=2 * args.requests * per_seq + 16, enable_prefix_caching=caching,
        cuda_graph_max_batch=args.requests, load_format="dummy" if dummy else "safetensors")
    t = time.perf_counter()
    eng = LLMEngine(cfg)
    print(f"  caching {'on' if caching else 'off'}: engine ready in {time.perf_counter() - t:.1f} s "
          f"(async={eng.async_enabled})", file=sys.stderr, flush=True)
    warm = _prompts(args.requests, args.prefix, args.suffix, eng.vocab_size, seed=1)
    _burst(eng, warm, args.output, "warm", args.device)
    res = _burst(eng, _prompts(args.requests, args.prefix, args.suffix, eng.vocab_size, seed=2),
                 args.output, "run", args.device)
    res["async"] = eng.async_enabled
    eng.close()
    del eng
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", help="a local HF checkpoint (default: cuda the qwen2.5-0.5b preset, cpu tiny-llama)")
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="random-weight shape on cuda (bench.decode presets)")
    ap.add_argument("--model-dir", default="/tmp/bench-models")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--prefix", type=int, default=None, help="common prefix tokens")
    ap.add_argument("--suffix", type=int, default=None, help="per-request suffix tokens")
    ap.add_argument("--output", type=int, default=None, help="output tokens per request")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.requests = args.requests or (64 if cuda else 8)
    args.prefix = args.prefix if args.prefix is not None else (2000 if cuda else 200)
    args.suffix = args.suffix if args.suffix is not None else (64 if cuda else 16)
    args.output = args.output or (16 if cuda else 8)
    if not cuda:
        torch.set_num_threads(args.threads)
    if args.model:
        model, name, dummy = args.model, Path(args.model).name, False
    elif cuda:
        from bench.decode import write_preset_config
        model, name, dummy = write_preset_config(args.preset, args.model_dir), args.preset, True
    else:
        model, name, dummy = str(REPO_ROOT / "models" / "tiny-llama"), "tiny-llama", False

    results = {c: run_mode(args, model, dummy, c) for c in (False, True)}
    same = sum(a == b for a, b in zip(results[False]["tokens"], results[True]["tokens"]))
    on, off = results[True], results[False]
    print(f"\nprefix caching, {name} {args.dtype} on {args.device}: {args.requests} requests x "
          f"({args.prefix} common + {args.suffix} own) prompt tokens, {args.output} output tokens, "
          f"budget {args.budget}, async={on['async']}")
    cols = ("caching", "TTFT mean ms", "p50 ms", "p90 ms", "max ms", "wall s", "prefill tok", "hit tok",
            "queried tok", "steps")
    print(" | ".join(cols))
    for label, r in (("off", off), ("on", on)):
        print(" | ".join([label, f"{r['ttft_mean_ms']:.1f}", f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p90_ms']:.1f}",
                          f"{r['ttft_max_ms']:.1f}", f"{r['wall_s']:.3f}", str(r["prefill_tokens"]),
                          str(r["hit_tokens"]), str(r["queried_tokens"]), str(r["steps"])]))
    print(f"TTFT mean off/on: {off['ttft_mean_ms'] / on['ttft_mean_ms']:.2f}x; prefill tokens off/on: "
          f"{off['prefill_tokens'] / max(on['prefill_tokens'], 1):.1f}x; identical greedy outputs: "
          f"{same}/{args.requests}")
    if args.out:
        doc = {"model": name, "device": args.device, "dtype": args.dtype, "requests": args.requests,
               "prefix": args.prefix, "suffix": args.suffix, "output": args.output, "budget": args.budget,
               "host": platform.node(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if cuda else None, "identical_outputs": same,
               "off": {k: v for k, v in off.items() if k != "tokens"},
               "on": {k: v for k, v in on.items() if k != "tokens"}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
