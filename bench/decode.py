"""Decode throughput: HF `generate` vs our engine (sync and async token handoff), one run, one table.

    python -m bench.decode                                   # CPU, models/tiny-llama, batch 1/8/64
    python -m bench.decode --device cuda --preset qwen2.5-0.5b
    python -m bench.decode --device cuda --preset llama-3-8b --batches 1,8,64 --out /tmp/8b.json
    python -m bench.decode --model /path/to/hf/checkpoint --device cuda --dtype bfloat16

What is measured (greedy, ignore EOS, every request of a batch has the same prompt length):

* decode throughput only, prefill excluded. For each implementation the clock starts when the
  host has the FIRST output token of every request of the batch and stops when it has the
  last; in that window each request produced (output_len - 1) tokens, so
  TPOT = window / (output_len - 1) and tok/s = batch * (output_len - 1) / window.
  - HF: timestamps from a `BaseStreamer` (generate hands it each step's tokens on the host;
    it syncs on every step anyway for its stop check). On CUDA with
    `cache_implementation="static"` (HF then auto-compiles the decode forward unless
    --hf-no-compile); on CPU the default dynamic cache.
  - ours: add the batch, step until every request has its first token, then step to the end.
    In async mode decode step 1 is queued before the prefill's tokens are read, so it starts
    on the device exactly when they become readable: the window holds output_len - 1 decode
    steps in both modes (no device sync at the clock start, which would skip one).
* each (implementation, batch) point runs once as warm-up with the same shapes first (CUDA
  graphs / torch.compile / allocator), then once measured.
* CUDA only: GPU busy fraction = 1 - (sum of inter-step GPU idle gaps) / window, and the gap
  p50/p99, from CUDA events recorded around every engine step (`EngineStats.gpu_idle_gap_us`);
  host time per step = engine time in step() minus time blocked on step events, per step.

Defaults: CPU: prompt 32, output 32, float32, torch single-threaded (--threads; the tiny
model's ops are too small to gain from threads and a busy machine makes OpenMP spin badly).
CUDA: prompt 256, output 128, bfloat16, preset qwen2.5-0.5b when no --model/--preset is given.
Presets are random-weight checkpoints of the real shapes written by
scripts/make_model.py:write_random_model under --model-dir (no downloads).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

PRESETS = ("qwen2.5-0.5b", "llama-3-8b")


@dataclass
class Row:
    model: str
    batch: int
    impl: str                  # "hf generate" | "engine sync" | "engine async"
    tpot_ms: float
    tok_s: float
    decode_tokens: int
    window_s: float
    gpu_busy: Optional[float] = None
    gap_p50_us: Optional[float] = None
    gap_p99_us: Optional[float] = None
    host_ms_per_step: Optional[float] = None
    steps: Optional[int] = None
    extra: dict = field(default_factory=dict)


# ---- models --------------------------------------------------------------------------------------

def _make_model_module():
    name = "make_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def resolve_model(args) -> tuple[str, str]:
    """(checkpoint folder, display name)."""
    if args.model:
        return args.model, Path(args.model).name
    if args.preset:
        mm = _make_model_module()
        out = Path(args.model_dir) / f"{args.preset}-{args.dtype}"
        gen_device = "cuda" if args.device == "cuda" else "cpu"
        mm.write_random_model(out, args.preset, args.dtype, device=gen_device)
        return str(out), args.preset
    path = REPO_ROOT / "models" / "tiny-llama"
    if not (path / "config.json").exists():
        mm = _make_model_module()
        arch, shard = mm.TINY_MODELS["tiny-llama"]
        mm.make_tiny(path, arch, shard_size=shard)
    return str(path), "tiny-llama"


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 32000)
    return [[rng.randrange(4, hi) for _ in range(prompt_len)] for _ in range(batch)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _pct(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# ---- HF generate ------------------------------------------------------------------------------------

class _Stamps:
    """A transformers streamer that records when each step's tokens reach the host."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def bench_hf(path: str, name: str, args) -> list[Row]:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class Stamps(_Stamps, BaseStreamer):
        pass

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    vocab = model.config.vocab_size
    rows = []
    for b in args.batch_list:
        ids = torch.tensor(_prompts(b, args.prompt_len, vocab, seed=b), device=args.device)
        # eos_token_id=None: no EOS stop (ignore_eos); checked below by the output length.
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                  do_sample=False, eos_token_id=None, pad_token_id=0)
        if args.device == "cuda":
            kw["cache_implementation"] = "static"
            if args.hf_no_compile:
                kw["disable_compile"] = True
        windows = []
        for rep in range(2):  # warm-up (compile, static cache), then measured
            st = Stamps()
            _sync(args.device)
            try:
                with torch.inference_mode():
                    out = model.generate(ids, streamer=st, **kw)
            except Exception as e:  # noqa: BLE001 - e.g. torch.compile unavailable: measure eager
                if kw.get("disable_compile") or args.device != "cuda":
                    raise
                print(f"  hf generate: auto-compiled decode failed ({type(e).__name__}: {e}); "
                      f"falling back to eager", file=sys.stderr, flush=True)
                kw["disable_compile"] = True
                st = Stamps()
                with torch.inference_mode():
                    out = model.generate(ids, streamer=st, **kw)
            _sync(args.device)
            n_new = out.shape[1] - ids.shape[1]
            assert n_new == args.output_len, (n_new, args.output_len)
            # times[0]: the prompt; times[1]: first new token (after prefill); times[-1]: last.
            assert len(st.times) == args.output_len + 1, len(st.times)
            windows.append(st.times[-1] - st.times[1])
        window = windows[-1]
        dec = b * (args.output_len - 1)
        rows.append(Row(name, b, "hf generate", window / (args.output_len - 1) * 1e3, dec / window, dec, window,
                        extra={"static_cache": args.device == "cuda",
                               "compile": args.device == "cuda" and not kw.get("disable_compile", False)}))
        _progress(rows[-1])
    del model
    _free(args.device)
    return rows


# ---- our engine ----------------------------------------------------------------------------------------

def bench_engine(path: str, name: str, mode: str, args) -> list[Row]:
    from backend_lib import EngineConfig, LLMEngine, SamplingParams

    max_b = max(args.batch_list)
    bs = 16
    max_len = args.prompt_len + args.output_len + bs
    max_len = (max_len + bs - 1) // bs * bs
    cfg = EngineConfig(
        model_path=path, device=args.device, dtype=args.dtype, max_num_seqs=max_b,
        max_num_batched_tokens=max(max_b * args.prompt_len, max_len),  # every prefill in one step
        max_model_len=max_len, block_size=bs, num_kv_blocks=max_b * (max_len // bs) + 8,
        async_token_handoff=mode, enable_cuda_graph=True, cuda_graph_max_batch=max_b)
    eng = LLMEngine(cfg)
    impl = "engine async" if eng.async_enabled else "engine sync"
    if mode == "on":
        assert eng.async_enabled, eng.decision
    emulated = bool(getattr(eng.decision, "emulated", False))
    rows = []
    for b in args.batch_list:
        prompts = _prompts(b, args.prompt_len, eng.vocab_size, seed=b)
        window = 0.0
        for rep in range(2):  # warm-up with the same shapes, then measured
            sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            rids = [f"{mode}-{b}-{rep}-{i}" for i in range(b)]
            for rid, p in zip(rids, prompts):
                eng.add_request(rid, p, sp)
            got = {rid: 0 for rid in rids}
            while sum(1 for v in got.values() if v > 0) < b:
                for o in eng.step():
                    got[o.request_id] += len(o.new_token_ids)
            assert all(v == 1 for v in got.values()), "prefill must finish in one step"
            # No device sync here: in async mode decode step 1 is already queued behind the
            # prefill and started when the prefill's tokens were ready, i.e. when we read them;
            # waiting for it would move the clock start one step late.
            s0 = eng.stats()  # also drains the idle-gap samples of the prefill
            t0 = time.perf_counter()
            while eng.has_unfinished():
                for o in eng.step():
                    got[o.request_id] += len(o.new_token_ids)
            _sync(args.device)
            window = time.perf_counter() - t0
            s1 = eng.stats()
            assert all(v == args.output_len for v in got.values()), "wrong number of tokens"
            assert s1.kv_blocks_used == 0
        steps = (s1.async_steps_total + s1.sync_steps_total) - (s0.async_steps_total + s0.sync_steps_total)
        host = (s1.step_time_s - s0.step_time_s) - (s1.wait_time_s - s0.wait_time_s)
        gaps = list(s1.gpu_idle_gap_us)
        dec = b * (args.output_len - 1)
        row = Row(name, b, impl, window / (args.output_len - 1) * 1e3, dec / window, dec, window,
                  host_ms_per_step=host / max(steps, 1) * 1e3, steps=steps,
                  extra={"async_token_handoff": mode, "emulated": emulated})
        if args.device == "cuda":
            row.gpu_busy = max(0.0, 1.0 - sum(gaps) / 1e6 / window)
            row.gap_p50_us = _pct(gaps, 0.5)
            row.gap_p99_us = _pct(gaps, 0.99)
            row.extra["gap_samples"] = len(gaps)
        rows.append(row)
        _progress(row)
    if hasattr(eng, "close"):
        eng.close()
    del eng
    _free(args.device)
    return rows


# ---- output ----------------------------------------------------------------------------------------------

def _progress(row: Row) -> None:
    print(f"  {row.impl:13s} batch {row.batch:4d}: TPOT {row.tpot_ms:8.3f} ms  {row.tok_s:10.1f} tok/s",
          file=sys.stderr, flush=True)


def _fmt(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def markdown_table(rows: list[Row], cuda: bool) -> str:
    hf = {r.batch: r for r in rows if r.impl == "hf generate"}
    head = ["model", "batch", "impl", "TPOT ms", "decode tok/s", "x HF", "host ms/step"]
    if cuda:
        head += ["GPU busy %", "idle gap p50 µs", "idle gap p99 µs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    order = {"hf generate": 0, "engine sync": 1, "engine async": 2}
    for r in sorted(rows, key=lambda r: (r.batch, order.get(r.impl, 9))):
        base = hf.get(r.batch)
        cells = [r.model, str(r.batch), r.impl + (" (emulated)" if r.extra.get("emulated") else ""),
                 f"{r.tpot_ms:.3f}", f"{r.tok_s:.1f}",
                 f"{r.tok_s / base.tok_s:.2f}" if base else "-", _fmt(r.host_ms_per_step, ".3f")]
        if cuda:
            cells += [_fmt(r.gpu_busy, ".1f", 100.0), _fmt(r.gap_p50_us, ".1f"), _fmt(r.gap_p99_us, ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="local HF checkpoint folder (default: models/tiny-llama on CPU)")
    src.add_argument("--preset", choices=PRESETS, help="random-weight model of a real shape (written under --model-dir)")
    ap.add_argument("--model-dir", default="/tmp/bench-models", help="where --preset checkpoints are written")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 32 on CPU, 256 on CUDA")
    ap.add_argument("--output-len", type=int, default=None, help="default 32 on CPU, 128 on CUDA")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                    help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--impls", default="hf,sync,async", help="comma list of hf, sync, async")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on CPU)")
    ap.add_argument("--hf-no-compile", action="store_true", help="CUDA: keep HF generate eager (disable_compile)")
    ap.add_argument("--out", help="also write the rows and run metadata as JSON here")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    args.prompt_len = args.prompt_len or (256 if cuda else 32)
    args.output_len = args.output_len or (128 if cuda else 32)
    if args.output_len < 2:
        ap.error("--output-len must be >= 2 (decode is measured after the first token)")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if cuda and not args.model and not args.preset:
        args.preset = "qwen2.5-0.5b"
    args.batch_list = [int(x) for x in args.batches.split(",") if x.strip()]
    args.impl_list = [x.strip() for x in args.impls.split(",") if x.strip()]
    bad = set(args.impl_list) - {"hf", "sync", "async"}
    if bad:
        ap.error(f"--impls: unknown {sorted(bad)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    path, name = resolve_model(args)
    t_start = time.time()
    meta = {"device": args.device, "model": name, "model_path": path, "dtype": args.dtype,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "batches": args.batch_list,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "host": platform.node(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(f"decode bench: {name} on {args.device} ({meta['gpu'] or platform.processor() or 'cpu'}), {args.dtype}, "
          f"prompt {args.prompt_len}, output {args.output_len}, batches {args.batch_list}, "
          f"threads {meta['threads']}", file=sys.stderr, flush=True)
    rows: list[Row] = []
    if "hf" in args.impl_list:
        rows += bench_hf(path, name, args)
    if "sync" in args.impl_list:
        rows += bench_engine(path, name, "off", args)
    if "async" in args.impl_list:
        rows += bench_engine(path, name, "on", args)
    meta["elapsed_s"] = round(time.time() - t_start, 1)
    table = markdown_table(rows, args.device == "cuda")
    print(f"\nDecode throughput, {name}, {args.device}"
          f"{' (' + meta['gpu'] + ')' if meta['gpu'] else ''}, {args.dtype}, prompt {args.prompt_len}, "
          f"output {args.output_len}, greedy, ignore_eos; prefill excluded\n")
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
