"""Decode throughput: HF `generate` and HF continuous batching vs our engine (sync and async
token handoff), one run, one table per model.

    python -m bench.decode                                   # CPU, models/tiny-llama, batch 1/8/64
    python -m bench.decode --device cuda --out-dir $OUT      # H200: both presets, batch 1/8/64/256 (~5-7 min)
    python -m bench.decode --device cuda --preset llama-3-8b --batches 1,8,64 --out /tmp/8b.json
    python -m bench.decode --model /path/to/hf/checkpoint --device cuda --dtype bfloat16
    python -m bench.decode --device cuda --preset qwen2.5-0.5b --impls async --batches 1,64,256 \
        --sampling greedy,temperature,top_p,logprobs              # issue 14's sampler rows
        [--sampler split,rows]                                    # both kernel sets, one engine each
    python -m bench.decode --device cuda --impls async --batches 1,8 \
        --env-variant base:BACKEND_LIB_DECODE_GEMV=off --env-variant gemv:BACKEND_LIB_DECODE_GEMV=on

What is measured (greedy unless --sampling, ignore EOS, every request of a batch has the
same prompt length):

* --sampling (our engine only; HF rows stay greedy): a comma list of SAMPLING_MODES, each
  measured on the same engine for every batch, with a "x greedy" column: greedy; temperature
  (0.7); top_p (temperature 0.7 + top_p 0.9); logprobs (greedy + the top-5 raw logprobs).
  Sampled modes are seeded per request (seed = batch * 1000 + index).

* decode throughput only, prefill excluded. For each implementation the clock starts when the
  host has the FIRST output token of every request of the batch and stops when it has the
  last; in that window each request produced (output_len - 1) tokens, so
  TPOT = window / (output_len - 1) and tok/s = batch * (output_len - 1) / window.
  - HF `generate` (bench/_hf.py): timestamps from a `BaseStreamer`. On CUDA with
    `cache_implementation="static"`, EAGER by default (`--hf-compile` lets HF auto-compile the
    decode step; it recompiles per batch size, minutes per model); on CPU the dynamic cache.
  - HF continuous batching (`generate_batch`, when transformers has it; `paged|sdpa` unless
    flash_attn is installed): its per-token host timestamps (`record_timestamps`). Failures
    are recorded as n/a, not fatal.
  - ours: add the batch, step until every request has its first token, then step to the end.
    In async mode decode step 1 is queued before the prefill's tokens are read, so it starts
    on the device exactly when they become readable: the window holds output_len - 1 decode
    steps in both modes (no device sync at the clock start, which would skip one).
* each (implementation, batch) point runs once as warm-up with the same shapes first (CUDA
  graphs / torch.compile / allocator), then once measured. An HF point whose predicted wall
  time (previous batch, scaled linearly) exceeds --hf-max-point-s is skipped and says why.
* CUDA only: GPU busy fraction = 1 - (sum of inter-step GPU idle gaps) / window, and the gap
  p50/p99, from CUDA events recorded around every engine step (`EngineStats.gpu_idle_gap_us`);
  host time per step = engine time in step() minus time blocked on step events, per step.
* CUDA only: the weight-bytes roofline: device bandwidth from a 2 GiB D2D copy ((read +
  write) / time, median of 10), roofline TPOT at batch 1 = weight bytes per step / bandwidth.
* CUDA only: timeline.png in --out-dir: GPU busy/idle of --timeline-steps consecutive steady
  decode steps of our engine, sync vs async (bench/_timeline.py; per-step CUDA events).

Defaults: CPU: prompt 32, output 32, float32, torch single-threaded (--threads; the tiny
model's ops are too small to gain from threads and a busy machine makes OpenMP spin badly),
impls hf,sync,async. CUDA: prompt 256, output 128, bfloat16, both presets (qwen2.5-0.5b, then
llama-3-8b) when no --model/--preset is given, impls hf,cb,sync,async. Presets write only a
config folder under --model-dir (config.json + generation_config.json, numbers from
scripts/make_model.py:RANDOM_PRESETS): our engine uses load_format="dummy", HF builds
`from_config` on the device; random weights, same shapes (speed only). Each model is freed
before the next. The tables are printed last; decode.json goes to --out-dir.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from backend_lib import envs  # noqa: E402

from scripts import load_make_model  # noqa: E402

PRESETS = ("qwen2.5-0.5b", "llama-3-8b")


@dataclass
class Row:
    model: str
    batch: int
    impl: str                  # "hf generate" | "hf cb" | "engine sync" | "engine async"
    tpot_ms: Optional[float]   # None: skipped / n/a (see note)
    tok_s: Optional[float]
    decode_tokens: Optional[int]
    window_s: Optional[float]
    gpu_busy: Optional[float] = None
    gap_p50_us: Optional[float] = None
    gap_p99_us: Optional[float] = None
    host_ms_per_step: Optional[float] = None
    steps: Optional[int] = None
    note: str = ""
    extra: dict = field(default_factory=dict)
    sampling: str = "greedy"   # a SAMPLING_MODES key


# --sampling modes: SamplingParams keywords (a seed per request is added to sampled modes).
SAMPLING_MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_p": dict(temperature=0.7, top_p=0.9),
    "logprobs": dict(temperature=0.0, logprobs=5),
}


def sampling_params(mode: str, max_tokens: int, batch: int, index: int):
    from backend_lib import SamplingParams
    kw = dict(SAMPLING_MODES[mode])
    if kw["temperature"] > 0:
        kw["seed"] = batch * 1000 + index
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


# ---- models --------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    path: str
    name: str
    dummy: bool   # random weights of the config's shape (config folder only, no checkpoint)


def write_preset_config(preset: str, root: str) -> str:
    """A config-only folder for a preset: config.json (the transformers config class of the
    preset's model_type, numbers from scripts/make_model.py:RANDOM_PRESETS, plus the legacy
    rope keys) and generation_config.json with an EOS id. No weights: our engine uses
    load_format="dummy", HF builds from_config on the device."""
    from transformers import GenerationConfig
    mm = load_make_model()
    arch = dict(mm.RANDOM_PRESETS[preset])
    out = Path(root) / f"{preset}-config"
    out.mkdir(parents=True, exist_ok=True)
    cfg = mm.make_hf_config(arch, arch["vocab_size"])
    cfg.save_pretrained(str(out))
    mm._add_legacy_rope_keys(out / "config.json", arch["rope_theta"], arch.get("rope_scaling"))
    GenerationConfig(bos_token_id=mm.BOS_ID, eos_token_id=mm.EOS_ID, pad_token_id=mm.PAD_ID).save_pretrained(str(out))
    return str(out)


def model_kwargs(preset: Optional[str], model: Optional[str]) -> dict:
    """EngineConfig's model_path (and load_format): random weights of a preset's shape, a local
    checkpoint, or models/tiny-llama."""
    if preset:
        return dict(model_path=write_preset_config(preset, tempfile.mkdtemp()), load_format="dummy")
    return dict(model_path=model or str(REPO_ROOT / "models" / "tiny-llama"))


def resolve_models(args) -> list[ModelSpec]:
    if args.model:
        return [ModelSpec(args.model, Path(args.model).name, False)]
    if args.preset_list:
        return [ModelSpec(write_preset_config(p, args.model_dir), p, True) for p in args.preset_list]
    path = REPO_ROOT / "models" / "tiny-llama"
    if not (path / "config.json").exists():
        mm = load_make_model()
        arch, shard = mm.TINY_MODELS["tiny-llama"]
        mm.make_tiny(path, arch, shard_size=shard)
    return [ModelSpec(str(path), "tiny-llama", False)]


def weight_bytes_per_step(path: str, dtype: str) -> int:
    """Weight bytes one decode step must read: every layer's projections plus the LM head
    (the input embedding is only gathered; tied or not, the head is read once). Norms and
    biases are negligible and left out."""
    from backend_lib.models.llama import ModelShape
    from backend_lib.models.loader import load_hf_config
    s = ModelShape.from_hf_config(load_hf_config(path))
    attn = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    elem = 4 if dtype == "float32" else 2
    return (s.num_layers * (attn + mlp) + s.vocab_size * s.hidden_size) * elem


def measure_copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large D2D copy: (read + write) / time,
    median of `reps` event-timed copies after one warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del src, dst
    free_device_memory("cuda")
    return 2 * nbytes / _pct(times, 0.5)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 32000)
    return [[rng.randrange(4, hi) for _ in range(prompt_len)] for _ in range(batch)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device_memory(device: str) -> None:
    """Collect garbage and give the caching allocator's free blocks and cuBLAS's workspaces
    back: what is still allocated after it is what live objects hold."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        # cuBLAS keeps a workspace per (handle, stream) for the process (64 MiB on an H100):
        # cleared, what is left allocated is what a closed engine kept
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


def _pct(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


# ---- HF baselines (helpers in bench/_hf.py) ------------------------------------------------------

def _skip_row(name: str, b: int, impl: str, note: str) -> Row:
    print(f"  {impl:13s} batch {b:4d}: {note}", file=sys.stderr, flush=True)
    return Row(name, b, impl, None, None, None, None, note=note)


def bench_hf(spec: ModelSpec, args) -> list[Row]:
    from bench import _hf
    name = spec.name
    model = _hf.load_model(spec.path, getattr(torch, args.dtype), args.device, spec.dummy)
    vocab = model.config.vocab_size
    rows: list[Row] = []
    history: dict = {}  # impl -> (batch, wall seconds of its last point)
    dec_steps = args.output_len - 1

    def point(impl: str, b: int, fn, *a) -> None:
        reason = _hf.point_guard(history, impl, b, args.hf_max_point_s)
        if reason:
            rows.append(_skip_row(name, b, impl, "skipped: " + reason))
            return
        t0 = time.perf_counter()
        try:
            window, extra = fn(model, _prompts(b, args.prompt_len, vocab, seed=b), args, *a)
        except Exception as e:  # noqa: BLE001 - a baseline that fails is recorded, not fatal
            rows.append(_skip_row(name, b, impl, f"n/a: {type(e).__name__}: {str(e)[:160]}"))
            free_device_memory(args.device)
            return
        history[impl] = (b, extra["rep_wall_s"])
        dec = b * dec_steps
        rows.append(Row(name, b, impl, window / dec_steps * 1e3, dec / window, dec, window,
                        extra=dict(extra, point_wall_s=round(time.perf_counter() - t0, 1))))
        _progress(rows[-1])

    if "hf" in args.impl_list:
        kw = _hf.generate_kwargs(args)
        for b in args.batch_list:
            point("hf generate", b, _hf.run_generate, kw)
    if "cb" in args.impl_list:
        if not _hf.has_generate_batch(model):
            for b in args.batch_list:
                rows.append(_skip_row(name, b, "hf cb", "n/a: this transformers has no generate_batch"))
        else:
            extra = _hf.prepare_cb(model, args)
            cbc = _hf.cb_config(max(args.batch_list))
            for b in args.batch_list:
                point("hf cb", b, _hf.run_generate_batch, cbc)
                if rows and rows[-1].impl == "hf cb" and rows[-1].tpot_ms is not None:
                    rows[-1].extra.update(extra)
            _hf.destroy_cb(model)
    del model
    free_device_memory(args.device)
    return rows


# ---- our engine ----------------------------------------------------------------------------------------

def parse_env_variant(text: str) -> tuple[str, dict]:
    """'NAME:VAR=VALUE,VAR=VALUE' -> (NAME, {VAR: VALUE})."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise ValueError(f"--env-variant {text!r}: expected NAME:VAR=VALUE[,VAR=VALUE]")
    env = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        var, eq, val = item.partition("=")
        if not eq or not var:
            raise ValueError(f"--env-variant {text!r}: {item!r} is not VAR=VALUE")
        env[var] = val
    return name, env


def bench_engine(spec: ModelSpec, mode: str, args, timeline: Optional[dict] = None,
                 sampler: Optional[str] = None, variant: str = "") -> list[Row]:
    """timeline: {"batch": B, "steps": N, "skip": K, "lanes": dict} to record N steady decode
    steps of batch B (CUDA events of each step) into lanes[impl]. sampler: the sampling
    kernels' implementation for this engine (sampling_kernels.IMPL; its graphs keep it).
    variant: the --env-variant's name this engine runs under (added to the row's impl)."""
    from backend_lib import EngineConfig, LLMEngine
    from backend_lib.layers import sampling_kernels
    if sampler:
        sampling_kernels.IMPL = sampler
    from bench._timeline import StepRecorder

    name = spec.name
    max_b = max(args.batch_list)
    bs = 16
    max_len = args.prompt_len + args.output_len + bs
    max_len = (max_len + bs - 1) // bs * bs
    # The cache holds what the run needs; max_model_len sizes the decode graphs' block tables and
    # with them the split decode attention's grid (a served model's is the checkpoint's).
    model_len = max(args.max_model_len, max_len)
    cfg = EngineConfig(
        model_path=spec.path, device=args.device, dtype=args.dtype, max_num_seqs=max_b,
        max_num_batched_tokens=max(max_b * args.prompt_len, max_len),  # every prefill in one step
        max_model_len=model_len, block_size=bs,
        num_kv_blocks=max(max_b * (max_len // bs), model_len // bs + 1) + 8,
        async_token_handoff=mode, enable_cuda_graph=True, cuda_graph_max_batch=max_b,
        # Prefill is not timed, and mixed-step graphs up to this one-step prefill budget (65536
        # tokens at batch 256) are ~80 captures of forwards up to that size at start-up.
        cuda_graph_mixed=False,
        pipeline_parallel_size=args.pp, load_format="dummy" if spec.dummy else "safetensors")
    t_init = time.perf_counter()
    eng = LLMEngine(cfg)
    t_init = time.perf_counter() - t_init
    impl = ("engine async" if eng.async_enabled else "engine sync") + (f" pp{args.pp}" if args.pp > 1 else "")
    if len(args.sampler_list) > 1:
        impl += f" [{sampler}]"
    if variant:
        impl += f" [{variant}]"
    print(f"  {impl}: engine ready in {t_init:.1f} s", file=sys.stderr, flush=True)
    picks = gemv_picks(eng, getattr(args, "copy_bandwidth", None))
    for pk in picks:
        print(f"  {impl}: {pick_line(pk)}", file=sys.stderr, flush=True)
    if mode == "on":
        assert eng.async_enabled, eng.decision
    emulated = bool(getattr(eng.decision, "emulated", False))
    rows = []
    for b, smode in [(b, m) for b in args.batch_list for m in args.sampling_list]:
        prompts = _prompts(b, args.prompt_len, eng.vocab_size, seed=b)
        window = 0.0
        record = (timeline is not None and args.device == "cuda" and b == timeline["batch"]
                  and smode == args.sampling_list[0])
        for rep in range(2):  # warm-up with the same shapes, then measured
            rids = [f"{mode}-{smode}-{b}-{rep}-{i}" for i in range(b)]
            for i, (rid, p) in enumerate(zip(rids, prompts)):
                eng.add_request(rid, p, sampling_params(smode, args.output_len, b, i))
            got = {rid: 0 for rid in rids}
            while sum(1 for v in got.values() if v > 0) < b:
                for o in eng.step():
                    got[o.request_id] += len(o.new_token_ids)
            assert all(v == 1 for v in got.values()), "prefill must finish in one step"
            # No device sync here: in async mode decode step 1 is already queued behind the
            # prefill and started when the prefill's tokens were ready, i.e. when we read them;
            # waiting for it would move the clock start one step late.
            s0 = eng.stats()  # also drains the idle-gap samples of the prefill
            rec = StepRecorder(eng) if (record and rep == 1) else None
            if rec:
                rec.__enter__()
            t0 = time.perf_counter()
            while eng.has_unfinished():
                for o in eng.step():
                    got[o.request_id] += len(o.new_token_ids)
            _sync(args.device)
            window = time.perf_counter() - t0
            if rec:
                rec.__exit__()
            s1 = eng.stats()
            assert all(v == args.output_len for v in got.values()), "wrong number of tokens"
            assert s1.kv_blocks_used == 0
        steps = (s1.async_steps_total + s1.sync_steps_total) - (s0.async_steps_total + s0.sync_steps_total)
        host = (s1.step_time_s - s0.step_time_s) - (s1.wait_time_s - s0.wait_time_s)
        gaps = list(s1.gpu_idle_gap_us)
        dec = b * (args.output_len - 1)
        row = Row(name, b, impl, window / (args.output_len - 1) * 1e3, dec / window, dec, window,
                  host_ms_per_step=host / max(steps, 1) * 1e3, steps=steps,
                  extra={"async_token_handoff": mode, "emulated": emulated, "engine_init_s": round(t_init, 1),
                         **({"gemv_picks": picks} if picks else {})},
                  sampling=smode)
        if args.device == "cuda":
            row.gpu_busy = max(0.0, 1.0 - sum(gaps) / 1e6 / window)
            row.gap_p50_us = _pct(gaps, 0.5)
            row.gap_p99_us = _pct(gaps, 0.99)
            row.extra["gap_samples"] = len(gaps)
        if record:
            timeline["lanes"][impl] = rec.intervals_us(timeline["skip"], timeline["steps"])
        rows.append(row)
        _progress(row)
    if hasattr(eng, "close"):
        eng.close()
    del eng
    free_device_memory(args.device)
    if args.device == "cuda":   # what a closed engine did not give back limits the engines a process can build
        print(f"  {impl}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated after it closed",
              file=sys.stderr, flush=True)
    return rows


def _projection_name(prologue: int, n: int, k: int, rope: bool) -> str:
    """Which one-token projection a decode_gemv shape is: the q/k/v projection carries the rope
    epilogue (or, without it, is the norm-fed one no wider than 3 x hidden); gate_up is the
    other norm-fed one."""
    from backend_lib.layers.decode_gemv import PLAIN, SILU_MUL
    if prologue == PLAIN:
        return "o_proj"
    if prologue == SILU_MUL:
        return "down"
    return "qkv" if rope or n <= 3 * k else "gate_up"


def gemv_picks(eng, copy_bw: Optional[float]) -> list[dict]:
    """The engine's one-token projections as start-up tuning left them, one dict a shape: the
    tile it picked, and when it timed them in this engine (not a pick kept from an earlier
    engine or start), the pick's µs and its fraction of the copy bandwidth, the unfused ops'
    µs and the fastest candidate of each kind (bench.gemv_shapes times them all). Empty
    without the kernel (CPU, a pipeline)."""
    from bench.gemv_shapes import PROLOGUE_NAMES, rows_for, tile_label
    table = getattr(getattr(eng, "runner", None), "one_token_gemv", None)
    if table is None:
        return []
    elem = next(eng.runner.model.parameters()).element_size()
    out = []
    for key, cfg in table.configs.items():
        prologue, n, k, _, rope = key
        name = _projection_name(prologue, n, k, rope)
        pick = {"proj": name, "prologue": PROLOGUE_NAMES.get(prologue, str(prologue)), "n": n, "k": k,
                "pick": "unfused (op + cuBLAS)" if cfg is None else tile_label(cfg)}
        times = table.timings.get(key)
        if times:
            rows = rows_for(name, n, k, prologue, times, cfg, elem, copy_bw or 0.0)
            chosen = next(r for r in rows if r["chosen"])
            pick.update(us=chosen["us"], of_copy=chosen["of_copy"], unfused_us=times.get(None))
            # the fastest of each kind the tuner weighed: plain tiles, split-K, two tiles ahead
            for kind, test in (("plain", lambda c: c.split_k == 1 and c.ahead == 1),
                               ("split_k", lambda c: c.split_k > 1), ("ahead", lambda c: c.ahead > 1)):
                timed = [(us, c) for c, us in times.items() if c is not None and test(c)]
                if timed:
                    us, c = min(timed, key=lambda t: t[0])
                    pick[f"best_{kind}"] = {"tile": tile_label(c), "us": us}
        else:
            pick["kept"] = True
        out.append(pick)
    return out


def pick_line(pk: dict) -> str:
    """One gemv_picks entry as the line bench.decode prints (done_when.sh greps "decode gemv")."""
    head = f"decode gemv {pk['proj']} ({pk['prologue']}) {pk['n']} x {pk['k']}: {pk['pick']}"
    if pk.get("kept"):
        return head + " (kept from an earlier tuning)"
    of = "" if pk.get("of_copy") is None else f", {pk['of_copy']:.2f} of copy"
    unfused = "" if pk.get("unfused_us") is None else f"; unfused {pk['unfused_us']:.2f}"
    best = "".join(f"; best {kind.removeprefix('best_').replace('_', '-')} {pk[kind]['tile']} {pk[kind]['us']:.2f}"
                   for kind in ("best_plain", "best_split_k", "best_ahead") if kind in pk)
    return f"{head}, {pk['us']:.2f} µs{of}{unfused}{best}"


# ---- output ----------------------------------------------------------------------------------------------

def _progress(row: Row) -> None:
    print(f"  {row.impl:13s} {row.sampling:11s} batch {row.batch:4d}: TPOT {row.tpot_ms:8.3f} ms  "
          f"{row.tok_s:10.1f} tok/s", file=sys.stderr, flush=True)


def _fmt(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


_ORDER = {"hf generate": 0, "hf cb": 1, "engine sync": 2, "engine async": 3}


def markdown_table(rows: list[Row], cuda: bool) -> str:
    hf = {(r.model, r.batch): r for r in rows if r.impl == "hf generate" and r.tok_s}
    greedy = {(r.model, r.batch, r.impl): r for r in rows if r.sampling == "greedy" and r.tpot_ms}
    sampled = any(r.sampling != "greedy" for r in rows)
    head = ["model", "batch", "impl"] + (["sampling", "x greedy TPOT"] if sampled else []) + \
        ["TPOT ms", "output tok/s", "x HF"]
    if cuda:
        head += ["GPU busy %", "idle gap p50 µs", "idle gap p99 µs"]
    head += ["host ms/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in sorted(rows, key=lambda r: (r.batch, _ORDER.get(r.impl.split(" [")[0], 9), r.impl, list(SAMPLING_MODES).index(r.sampling))):
        impl = r.impl + (" (emulated)" if r.extra.get("emulated") else "")
        lead = [r.model, str(r.batch), impl]
        if sampled:
            g = greedy.get((r.model, r.batch, r.impl))
            lead += [r.sampling, f"{r.tpot_ms / g.tpot_ms:.3f}" if (g and r.tpot_ms) else "-"]
        if r.tok_s is None:
            cells = lead + [r.note or "n/a"] + ["-"] * (len(head) - len(lead) - 1)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        base = hf.get((r.model, r.batch))
        cells = lead + [f"{r.tpot_ms:.3f}", f"{r.tok_s:.1f}",
                        f"{r.tok_s / base.tok_s:.2f}" if (base and r.sampling == "greedy") else "-"]
        if cuda:
            cells += [_fmt(r.gpu_busy, ".1f", 100.0), _fmt(r.gap_p50_us, ".1f"), _fmt(r.gap_p99_us, ".1f")]
        cells += [_fmt(r.host_ms_per_step, ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def roofline_table(roof: dict, rows: list[Row]) -> str:
    head = ["model", "weight GB/step", "copy bandwidth TB/s", "roofline TPOT ms (batch 1)",
            "engine async TPOT ms (batch 1)", "x roofline", "engine sync TPOT ms (batch 1)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name, r in roof.items():
        tp = {x.impl: x.tpot_ms for x in rows if x.model == name and x.batch == 1 and x.tpot_ms}
        a, s = tp.get("engine async"), tp.get("engine sync")
        lines.append("| " + " | ".join([
            name, f"{r['weight_bytes'] / 1e9:.3f}", f"{r['bandwidth'] / 1e12:.2f}", f"{r['tpot_ms']:.3f}",
            _fmt(a, ".3f"), f"{a / r['tpot_ms']:.2f}" if a else "-", _fmt(s, ".3f")]) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="local HF checkpoint folder (default: models/tiny-llama on CPU)")
    src.add_argument("--preset", help=f"comma list of {', '.join(PRESETS)}: random weights of a real shape, "
                                      f"no checkpoint (default on CUDA: both)")
    ap.add_argument("--model-dir", default="/tmp/bench-models", help="where preset config folders are written")
    ap.add_argument("--batches", default=None, help="default 1,8,64 on CPU, 1,8,64,256 on CUDA")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 32 on CPU, 256 on CUDA")
    ap.add_argument("--output-len", type=int, default=None, help="default 32 on CPU, 128 on CUDA")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                    help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--impls", default=None,
                    help="comma list of hf (generate), cb (generate_batch), sync, async; "
                         "default hf,sync,async on CPU (CB sizes its cache slowly there), hf,cb,sync,async on CUDA")
    ap.add_argument("--sampling", default="greedy",
                    help=f"comma list of {', '.join(SAMPLING_MODES)}: our engine's rows for each (HF stays greedy)")
    ap.add_argument("--sampler-settings", default="",
                    help="KEY=VALUE,... over backend_lib/layers/sampling_split's launch settings "
                         "(see bench/sampler_kernels.py), for the whole run")
    ap.add_argument("--env-variant", action="append", default=[],
                    help="NAME:VAR=VALUE[,VAR=VALUE], repeatable: one engine each, built and run "
                         "with those environment variables (e.g. gemv:BACKEND_LIB_DECODE_GEMV=on)")
    ap.add_argument("--sampler", default="",
                    help="comma list of sampling-kernel implementations (CUDA), one engine each: "
                         "split (each row across many programs, the default) and rows (one program per row)")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline_parallel_size of our engine (one GPU per stage: issue 6's two-GPU run)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on CPU)")
    ap.add_argument("--hf-compile", action="store_true",
                    help="CUDA: let HF generate auto-compile its static-cache decode step. Off by default: "
                         "it recompiles per batch size, which alone would take minutes of the run")
    ap.add_argument("--hf-no-compile", action="store_true", help="(the default) keep HF generate eager")
    ap.add_argument("--hf-max-point-s", type=float, default=90.0,
                    help="skip an HF point when 2 x the previous batch's measured run time, scaled linearly "
                         "by batch, exceeds this (0: never skip)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="our engine's max_model_len (default 0: prompt + output + a block, the least the run "
                         "needs). A served model takes its checkpoint's (the presets': 131072 for "
                         "llama-3-8b, 32768 for qwen2.5-0.5b), which widens the decode graphs' block tables and so the split "
                         "attention's grid at small batches")
    ap.add_argument("--timeline", default="qwen2.5-0.5b:8",
                    help="MODEL:BATCH whose sync and async decode steps are drawn (CUDA; '' to skip); "
                         "MODEL falls back to the first model run")
    ap.add_argument("--timeline-steps", type=int, default=30)
    ap.add_argument("--out-dir", default=os.environ.get("BENCH_OUT_DIR", "/tmp/bench-out"),
                    help="decode.json and timeline.png go here (env BENCH_OUT_DIR)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    args.prompt_len = args.prompt_len or (256 if cuda else 32)
    args.output_len = args.output_len or (128 if cuda else 32)
    if args.output_len < 2:
        ap.error("--output-len must be >= 2 (decode is measured after the first token)")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.hf_compile = args.hf_compile and not args.hf_no_compile
    args.preset_list = [p.strip() for p in (args.preset or "").split(",") if p.strip()]
    if cuda and not args.model and not args.preset_list:
        args.preset_list = list(PRESETS)
    bad = set(args.preset_list) - set(PRESETS)
    if bad:
        ap.error(f"--preset: unknown {sorted(bad)} (choose from {PRESETS})")
    args.batch_list = [int(x) for x in (args.batches or ("1,8,64,256" if cuda else "1,8,64")).split(",") if x.strip()]
    args.sampling_list = [x.strip() for x in args.sampling.split(",") if x.strip()]
    if args.sampler_settings:
        from backend_lib.layers import sampling_split
        from bench.sampler_kernels import settings
        for k, v in settings(args.sampler_settings).items():
            setattr(sampling_split, k, v)
    args.sampler_list = [x.strip() for x in args.sampler.split(",") if x.strip()] or [None]
    try:
        args.env_variants = [parse_env_variant(v) for v in args.env_variant] or [("", {})]
    except ValueError as e:
        ap.error(str(e))
    if set(args.sampler_list) - {None, "split", "rows"}:
        ap.error(f"--sampler: choose from split, rows (got {args.sampler})")
    bad = set(args.sampling_list) - set(SAMPLING_MODES)
    if bad or not args.sampling_list:
        ap.error(f"--sampling: unknown {sorted(bad)} (choose from {', '.join(SAMPLING_MODES)})")
    args.impl_list = [x.strip() for x in (args.impls or ("hf,cb,sync,async" if cuda else "hf,sync,async")).split(",")
                      if x.strip()]
    bad = set(args.impl_list) - {"hf", "cb", "sync", "async"}
    if bad:
        ap.error(f"--impls: unknown {sorted(bad)}")
    return args


def _timeline_target(args, models: list[ModelSpec]) -> Optional[tuple[str, int]]:
    if args.device != "cuda" or not args.timeline:
        return None
    mname, _, b = args.timeline.rpartition(":")
    names = [m.name for m in models]
    if mname not in names:
        mname = names[0]
    b = int(b)
    if b not in args.batch_list or not {"sync", "async"} & set(args.impl_list):
        return None
    return mname, b


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = resolve_models(args)
    t_start = time.time()
    meta = {"device": args.device, "models": [m.name for m in models], "dtype": args.dtype,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "batches": args.batch_list,
            "impls": args.impl_list, "sampling": args.sampling_list, "hf_compile": args.hf_compile,
            "max_model_len": args.max_model_len or "prompt + output + a block",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "host": platform.node(),
            "gpu": torch.cuda.get_device_name() if cuda else None}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(f"decode bench: {', '.join(meta['models'])} on {args.device} "
          f"({meta['gpu'] or platform.processor() or 'cpu'}), {args.dtype}, prompt {args.prompt_len}, "
          f"output {args.output_len}, batches {args.batch_list}, impls {args.impl_list}, "
          f"threads {meta['threads']}, transformers {meta.get('transformers')}", file=sys.stderr, flush=True)
    if cuda and "hf" in args.impl_list:
        print(f"  hf generate: static cache, {'auto-compiled' if args.hf_compile else 'eager (no compile; --hf-compile to enable)'}",
              file=sys.stderr, flush=True)

    roof: dict = {}
    bandwidth = None
    if cuda:
        bandwidth = measure_copy_bandwidth()
        meta["copy_bandwidth_Bps"] = bandwidth
        args.copy_bandwidth = bandwidth   # the projections' picks are reported against it
        print(f"  device copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s", file=sys.stderr, flush=True)
    tl_target = _timeline_target(args, models)
    timeline = None
    rows: list[Row] = []
    for spec in models:
        t_model = time.time()
        print(f"\n== {spec.name} ({'random weights, config only' if spec.dummy else spec.path})",
              file=sys.stderr, flush=True)
        if bandwidth:
            wb = weight_bytes_per_step(spec.path, args.dtype)
            roof[spec.name] = {"weight_bytes": wb, "bandwidth": bandwidth, "tpot_ms": wb / bandwidth * 1e3}
        tl = None
        if tl_target and tl_target[0] == spec.name:
            tl = timeline = {"model": spec.name, "batch": tl_target[1], "steps": args.timeline_steps,
                             "skip": 20, "lanes": {}}
        if {"hf", "cb"} & set(args.impl_list):
            rows += bench_hf(spec, args)
        for (variant, env), sampler in [(v, s) for v in args.env_variants for s in args.sampler_list]:
            with envs.overridden(env):
                if "sync" in args.impl_list:
                    rows += bench_engine(spec, "off", args, tl, sampler, variant)
                if "async" in args.impl_list:
                    rows += bench_engine(spec, "on", args, tl, sampler, variant)
        print(f"  ({spec.name}: {time.time() - t_model:.0f} s)", file=sys.stderr, flush=True)
    meta["elapsed_s"] = round(time.time() - t_start, 1)

    notes = []
    if timeline and timeline["lanes"]:
        from bench._timeline import busy_fraction, write_png
        png = out_dir / "timeline.png"
        lanes = [(k, timeline["lanes"][k]) for k in ("engine sync", "engine async") if k in timeline["lanes"]]
        title = (f"{timeline['model']} batch {timeline['batch']}: {args.timeline_steps} consecutive decode steps "
                 f"(after {timeline['skip']}), GPU busy (filled) / idle, from per-step CUDA events")
        how = write_png(png, lanes, title)
        busy = ", ".join(f"{k} busy {busy_fraction(iv) * 100:.1f}%" for k, iv in lanes if iv)
        notes.append(f"timeline: {png} ({how}; lanes top to bottom: {', '.join(k for k, _ in lanes)}; {busy})")
    result = {"meta": meta, "rows": [asdict(r) for r in rows], "roofline": roof, "timeline": timeline}
    js = json.dumps(result, indent=2)
    for p in [out_dir / "decode.json"] + ([Path(args.out)] if args.out else []):
        p.write_text(js)
        notes.append(f"json: {p}")

    # The tables last.
    print(f"\nDecode throughput, {args.device}{' (' + meta['gpu'] + ')' if meta['gpu'] else ''}, {args.dtype}, "
          f"prompt {args.prompt_len}, output {args.output_len}, sampling {','.join(args.sampling_list)}, ignore_eos; prefill excluded; "
          f"{'max_model_len ' + str(args.max_model_len) + '; ' if args.max_model_len else ''}"
          f"HF generate {'static cache, ' + ('compiled' if args.hf_compile else 'eager') if cuda else 'dynamic cache'}; "
          f"run took {meta['elapsed_s']:.0f} s")
    for n in notes:
        print(n)
    for spec in models:
        print(f"\n### {spec.name}\n")
        print(markdown_table([r for r in rows if r.model == spec.name], cuda))
    if roof:
        print("\n### Weight-bytes roofline (batch-1 decode reads every weight once per step)\n")
        print(roofline_table(roof, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
