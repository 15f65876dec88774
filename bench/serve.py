"""Serving benchmark: the real tritonserver driven by perf_analyzer, beside the in-process
closed loop (AsyncEngine) and steady decode of the same engine configuration, in one run.

    python -m bench.serve --preset qwen2.5-0.5b --device cuda --out-dir $OUT     (the lent GPU:
        bash bench/serve.sh, which unpacks the carried Triton bundle first)
    python -m bench.serve --smoke --out-dir /tmp/serve                           (CPU, tiny model:
        `make bench-serve`; tests/server/test_bench_serve.py runs the same, smaller)

What runs, in this order (one engine configuration for every part, `engine_params`):
  1. Triton: tritonserver on a temporary repository holding only `llm`, its config.pbtxt
     parameters replaced by the engine's (plus the variant's glue/engine overrides, one server per
     --variant). perf_analyzer drives it: gRPC, --streaming, closed loop (--concurrency-range c),
     its --input-data JSON holding the workload's requests (token ids, max_tokens, ignore_eos,
     the sampling's temperature/top_p), c (>= 4) warm-up requests, then max(--min-requests,
     c * --rounds) measured ones. Timings from its --profile-export-file. Where genai-perf is
     installed (not on the lent GPU) and the model has a tokenizer, the first server also holds
     `ensemble` (+ pre/postprocessing) and genai-perf profiles it (--genai-points).
  2. In-process: the same closed loop on AsyncEngine with the output callback (the thread
     Triton's sender runs on), same requests, same warm-up. Part `inproc-process` (not in the
     default --parts): the same loop on EngineProcessClient, the engine the llm model runs (its
     core in its own process), without Triton: where Triton's cost and the core's part.
  3. Steady decode, same engine: the fixed workload's batch of c requests submitted at once;
     the step time is measured over the window where all c are decoding (from the last first
     token to the first finish): window / (tokens each request got in it).
  4. The mixed workload (issue 13): --mixed-requests requests (prompts and outputs uniform in
     --mixed-prompt / --mixed-output, greedy, ignore_eos) submitted at once, AsyncEngine with
     async_token_handoff on vs off: output tok/s.

Workloads: "fixed" (every prompt --prompt-len tokens, --output-len output tokens) and "mixed"
(lengths uniform in the --mixed-* ranges; a deterministic set cycled through in order).
Samplings: "greedy" (temperature 0) and "top_p" (temperature 0.7, top_p 0.9). ignore_eos always.

Per request: TTFT = first response - send; TPOT = (last response - first response) / (tokens - 1)
(client-side: perf_analyzer's response timestamps, the callback's clock in-process); p50/p99
over requests. Output tok/s = tokens / (last response - first send). Errors = failed requests
(the server's nv_inference_request_failure delta and perf_analyzer's exit status) + requests
whose token count is not their max_tokens. GPU busy = mean nvidia-smi utilization.gpu sampled
every 100 ms over the point (CUDA only). Where the engine thread's host time goes, per step
(second table): schedule / submit / update (EngineStats, and through Triton the llm metrics
llm_step_phase_seconds_total), its CPU time, and "not running" (host time less CPU time: waits
for the GIL or a core). --core-profile is cProfile over every thread of the core (Python 3.12
profiles them all), which slows the loop: use it for where, not how much.

Output: the markdown table on stdout and serve.md, every row in serve.json (--out-dir), both
rewritten after every row. A server that does not start, or a part that fails, is recorded in
the table's header and the run goes on (exit status 1); --time-budget skips the points not
started in time and lists them there. --core-profile: each Triton server's engine core profiles
its loop thread (cProfile, BACKEND_LIB_CORE_PROFILE) over the server's life: core-<variant>.prof
and .txt.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
from backend_lib.engine_stats import HOST_PHASES  # noqa: E402
from backend_lib.envs import CORE_PROFILE_ENV, CORE_SWITCH_INTERVAL_ENV  # noqa: E402
from backend_lib.free_port import free_ports  # noqa: E402
from bench import proc_cpu  # noqa: E402

SAMPLINGS = {"greedy": {"temperature": 0.0, "top_p": 1.0},
             "top_p": {"temperature": 0.7, "top_p": 0.9}}
LLM_CONFIG = REPO_ROOT / "model_repository" / "llm" / "config.pbtxt"
PYTHON_SWITCH_INTERVAL_S = sys.getswitchinterval()


def log(msg: str) -> None:
    print(f"[serve {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _pct(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# ---- engine configuration --------------------------------------------------------------------

def shipped_parameters() -> dict[str, str]:
    """The `llm` model's config.pbtxt parameters, as shipped."""
    text = LLM_CONFIG.read_text()
    return dict(re.findall(r'^parameters \{ key: "([^"]+)" value: \{ string_value: "([^"]*)" \} \}', text, re.M))


def engine_params(args, model_path: str) -> dict[str, str]:
    """The engine configuration of every part of the run, as llm model parameters (strings):
    the shipped config (engine "shipped") or its large-batch variant (engine "large": 512
    sequences, 8192-token budget, graphs up to 512; vLLM's defaults on a GPU of 70 GiB or more
    are 1024 sequences, 8192 tokens, graphs up to 512), sized so that the run's longest request
    fits (max_model_len) and every running sequence has its blocks (num_kv_blocks)."""
    # engine fields, plus the one glue parameter that acts on the process and so also on the
    # in-process runs (new_engine)
    p = {k: v for k, v in shipped_parameters().items()
         if k not in _glue_parameter_names() or k == "gil_switch_interval_ms"}
    if args.engine == "large":
        # 512 sequences hold the whole 512-request burst at once (with 256 the burst's second
        # half waited for the first: 58.6k against 70.0k output tok/s on the H200, RESULTS.md)
        p.update(max_num_seqs="512", max_num_batched_tokens="8192", cuda_graph_max_batch="512")
    bs = int(p["block_size"])
    # only the parts this run has: a KV cache sized for the burst does not fit the 8B shape on
    # an 80 GiB card
    mixed_lengths = "mixed" in args.workloads or "burst" in args.parts
    longest = max([args.prompt_len + args.output_len]
                  + ([args.mixed_prompt[1] + args.mixed_output[1]] if mixed_lengths else []))
    max_len = (longest + bs) // bs * bs
    p.update(model_path=str(Path(model_path).resolve()), device=args.device, dtype=args.dtype,
             load_format=args.load_format, max_model_len=str(max_len))
    for kv in args.set or []:
        k, v = kv.split("=", 1)
        p[k] = v
    if p.get("num_kv_blocks", "0") == "0":  # for the most sequences this run can have at once
        seqs = min(int(p["max_num_seqs"]),
                   max(list(args.concurrency) + ([args.mixed_requests] if "burst" in args.parts else [])))
        p["num_kv_blocks"] = str(seqs * (int(p["max_model_len"]) // bs) + 16)
    return p


def _glue_parameter_names() -> set[str]:
    from triton_glue.config import GLUE_PARAMETERS
    return set(GLUE_PARAMETERS)


# ---- workloads -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int


def workload(name: str, args, vocab: int, n: int, seed: int = 0) -> list[Req]:
    rng = random.Random(f"{name}-{seed}")
    hi = min(vocab, 32000)

    def prompt(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(10, hi) for _ in range(k))

    if name == "fixed":
        return [Req(prompt(args.prompt_len), args.output_len) for _ in range(n)]
    if name == "mixed":
        (p0, p1), (o0, o1) = args.mixed_prompt, args.mixed_output
        return [Req(prompt(rng.randint(p0, p1)), rng.randint(o0, o1)) for _ in range(n)]
    raise ValueError(f"unknown workload {name!r} (fixed | mixed)")


def sampling_params(sampling: str, max_tokens: int):
    from backend_lib import SamplingParams
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **SAMPLINGS[sampling])


# ---- one measured point ------------------------------------------------------------------------

@dataclass
class Record:
    t_send: float
    t_first: Optional[float] = None
    t_last: Optional[float] = None
    ntok: int = 0
    expected: int = 0
    responses: int = 0
    error: Optional[str] = None
    times: list = field(default_factory=list)   # steady decode only: every token's arrival

    @property
    def ok(self) -> bool:
        return self.error is None and self.ntok == self.expected


def row_from(path: str, workload_name: str, sampling: str, conc: int, recs: list[Record],
             gpu_busy: Optional[float], failures: int = 0, **extra) -> dict:
    good = [r for r in recs if r.t_first is not None]
    ttft = [(r.t_first - r.t_send) * 1e3 for r in good]
    tpot = [(r.t_last - r.t_first) / (r.ntok - 1) * 1e3 for r in good if r.ntok > 1]
    tokens = sum(r.ntok for r in recs)
    wall = (max(r.t_last for r in good) - min(r.t_send for r in recs)) if good else 0.0
    row = {"path": path, "workload": workload_name, "sampling": sampling, "concurrency": conc,
           "requests": len(recs), "errors": failures + sum(1 for r in recs if not r.ok),
           "output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall > 0 else 0.0,
           "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
           "tpot_ms_p50": _pct(tpot, 0.5), "tpot_ms_p99": _pct(tpot, 0.99),
           "tpot_ms_mean": statistics.fmean(tpot) if tpot else None,
           "responses_per_req": statistics.fmean(r.responses for r in recs) if recs else 0.0,
           # Little's law: the streams actually open on average, against the concurrency asked for
           "mean_in_flight": sum(r.t_last - r.t_send for r in good) / wall if wall > 0 else 0.0,
           "gpu_busy": gpu_busy}
    row.update(extra)
    bad = [r for r in recs if not r.ok][:3]
    if bad:
        row["error_examples"] = [f"{r.ntok}/{r.expected} tokens, error={r.error}" for r in bad]
    return row


def _progress(row: dict) -> None:
    f = lambda v, s: "n/a" if v is None else format(v, s)  # noqa: E731
    log(f"  {row['path']:28s} {row['workload']:5s} {row['sampling']:6s} c={row['concurrency']:<4d} "
        f"n={row['requests']:<4d} err={row['errors']} tok/s={row['tok_s']:.0f} "
        f"TTFT p50={f(row['ttft_ms_p50'], '.1f')} TPOT p50={f(row['tpot_ms_p50'], '.3f')} "
        f"p99={f(row['tpot_ms_p99'], '.3f')} ms in-flight={f(row.get('mean_in_flight'), '.1f')} busy={f(row['gpu_busy'], '.2f')}")


class GpuBusy:
    """nvidia-smi utilization.gpu, sampled every 100 ms in the background; mean(t0, t1) is the
    busy fraction over a window. None where nvidia-smi is absent (CPU)."""

    def __init__(self, enabled: bool):
        self.samples: list[tuple[float, float]] = []
        self.proc = None
        if enabled and shutil.which("nvidia-smi"):
            gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            self.proc = subprocess.Popen(
                ["nvidia-smi", "-i", gpu, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.strip()) / 100.0))
            except ValueError:
                pass

    def mean(self, t0: float, t1: float) -> Optional[float]:
        xs = [v for t, v in list(self.samples) if t0 <= t <= t1]
        return statistics.fmean(xs) if xs else None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


# ---- in-process --------------------------------------------------------------------------------

def closed_loop(eng, reqs: list[Req], sampling: str, conc: int, total: int, tag: str,
                timeout_s: float = 900.0, keep_times: bool = False) -> list[Record]:
    """A fixed number of requests in flight, a finished one replaced at once; requests taken
    from `reqs` in order (what perf_point asks of perf_analyzer with --max-threads 1)."""
    lock, done = threading.Lock(), threading.Event()
    recs: dict[str, Record] = {}
    finished: list[Record] = []
    nxt = [0]

    def submit() -> None:
        i = nxt[0]
        nxt[0] += 1
        r = reqs[i % len(reqs)]
        rid = f"{tag}-{i}"
        recs[rid] = Record(time.perf_counter(), expected=r.max_tokens)
        eng.add_request(rid, list(r.prompt), sampling_params(sampling, r.max_tokens), callback=cb)

    def cb(out) -> None:
        now = time.perf_counter()
        with lock:
            rec = recs[out.request_id]
            if out.new_token_ids:
                rec.t_first = rec.t_first or now
                rec.t_last = now
                rec.ntok += len(out.new_token_ids)
                rec.responses += 1
                if keep_times:
                    rec.times.extend([now] * len(out.new_token_ids))
            if out.finished:
                rec.error = out.error
                finished.append(rec)
                if nxt[0] < total:
                    submit()
                elif len(finished) == total:
                    done.set()

    with lock:
        for _ in range(min(conc, total)):
            submit()
    if not done.wait(timeout_s):
        raise TimeoutError(f"in-process run {tag} did not finish ({len(finished)}/{total})")
    return finished


def steady_step(recs: list[Record]) -> tuple[Optional[float], int]:
    """Step time while the whole batch decodes: from the moment every request has its first
    token to the first finish, divided by the tokens each request got in that window (one per
    step; the median over requests)."""
    t0 = max(r.times[0] for r in recs)
    t1 = min(r.times[-1] for r in recs)
    steps = statistics.median_low([sum(1 for t in r.times if t0 < t <= t1) for r in recs])
    return ((t1 - t0) / steps * 1e3 if steps > 0 else None), steps


def new_engine(params: dict[str, str], process: bool = False, **overrides):
    """AsyncEngine, or with process=True the llm model's engine: EngineProcessClient (the core
    in its own process), merging queued outputs as the llm model does."""
    from backend_lib import AsyncEngine, EngineConfig
    from backend_lib.engine_client import EngineProcessClient
    cfg = EngineConfig.from_parameters(dict(params, **overrides))
    # the llm model's process-wide GIL switch interval, when the run sets one (--set), applies
    # here too, so that both paths run with the same one
    # (and the engine core's, with process=True, as the llm model sets it)
    switch_ms = params.get("gil_switch_interval_ms", "").strip()
    if switch_ms:
        from triton_glue.config import positive_ms
        sys.setswitchinterval(positive_ms("gil_switch_interval_ms", switch_ms) / 1e3)
        os.environ[CORE_SWITCH_INTERVAL_ENV] = switch_ms
    else:
        sys.setswitchinterval(PYTHON_SWITCH_INTERVAL_S)
        os.environ.pop(CORE_SWITCH_INTERVAL_ENV, None)
    t = time.perf_counter()
    if process:
        eng = EngineProcessClient(cfg, merge_queued_outputs=True)
        log(f"engine process ready in {time.perf_counter() - t:.1f} s")
        return eng
    eng = AsyncEngine(cfg)
    log(f"in-process engine ready in {time.perf_counter() - t:.1f} s "
        f"(async handoff {'on' if eng.engine.async_enabled else 'off'})")
    return eng


def free_engine(eng) -> None:
    eng.shutdown()
    del eng
    # The engine gc.freeze()s its start-up heap; close() breaks the runner's own cycles, and
    # unfrozen, a collection also frees any other cycle there before the next engine starts.
    gc.unfreeze()
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


INPROC_LABEL = "in-process AsyncEngine"
ENGINE_PROCESS_LABEL = "in-process EngineProcessClient"


def engine_step_stats(s0, s1, seconds: float) -> dict:
    """The engine's pace over a point from two EngineStats: steps a second, host µs a step
    (time in step() less the waits on the device), tokens a step, and the share of steps that
    carried prefill chunks (each costs the host more than a decode step)."""
    steps = (s1.async_steps_total + s1.sync_steps_total) - (s0.async_steps_total + s0.sync_steps_total)
    if steps <= 0:
        return {}
    host_s = (s1.step_time_s - s1.wait_time_s) - (s0.step_time_s - s0.wait_time_s)
    per_step = {f"{p}_us_per_step": (getattr(s1, f"{p}_time_s", 0.0) - getattr(s0, f"{p}_time_s", 0.0)) / steps * 1e6
                for p in (*HOST_PHASES, "host_cpu")}
    return {"steps_per_s": steps / seconds, "host_us_per_step": host_s / steps * 1e6, **per_step,
            "tokens_per_step": (s1.generation_tokens_total - s0.generation_tokens_total) / steps,
            "prefill_step_share": (s1.prefill_steps_total - s0.prefill_steps_total) / steps}


def run_inprocess(args, params, vocab, busy: GpuBusy, report: "Report", process: bool = False) -> None:
    """The closed loop on AsyncEngine and steady decode; process=True: the closed loop on
    EngineProcessClient (the llm model's engine, without Triton), no steady rows."""
    label = ENGINE_PROCESS_LABEL if process else INPROC_LABEL
    if report.over_budget(label):
        return
    eng = new_engine(params, process=process)
    try:
        for wl in args.workloads:
            reqs = workload(wl, args, vocab, args.distinct_requests)
            for sampling in args.samplings:
                for c in args.concurrency:
                    if report.over_budget(f"in-process {wl} {sampling} c={c}"):
                        continue
                    tag = f"ip-{wl}-{sampling}-{c}"
                    closed_loop(eng, reqs, sampling, c, max(c, args.warmup), tag + "-warm", args.point_timeout)
                    n = max(args.min_requests, c * args.rounds)
                    s0, t0 = eng.stats(), time.perf_counter()
                    recs = closed_loop(eng, reqs, sampling, c, n, tag, args.point_timeout)
                    t1 = time.perf_counter()
                    row = row_from(label, wl, sampling, c, recs, busy.mean(t0, t1))
                    row.update(engine_step_stats(s0, eng.stats(), t1 - t0))
                    report.add(row)
        if process:
            return
        # steady decode of the same engine: batch c of the fixed workload, all at once
        reqs = workload("fixed", args, vocab, max(args.concurrency), seed=1)
        for sampling in args.samplings:
            for c in args.concurrency:
                if report.over_budget(f"steady {sampling} c={c}"):
                    continue
                tag = f"steady-{sampling}-{c}"
                closed_loop(eng, reqs[:c], sampling, c, c, tag + "-warm", args.point_timeout)
                t0 = time.perf_counter()
                recs = closed_loop(eng, reqs[:c], sampling, c, c, tag, args.point_timeout, keep_times=True)
                step_ms, steps = steady_step(recs)
                row = row_from("steady decode (same engine)", "fixed", sampling, c, recs,
                               busy.mean(t0, time.perf_counter()), steady_steps=steps)
                # the steady row's TPOT and tok/s are the batch's step time, not per request
                row.update(tpot_ms_p50=step_ms, tpot_ms_p99=None, tpot_ms_mean=step_ms,
                           tok_s=c / step_ms * 1e3 if step_ms else 0.0, ttft_ms_p50=None, ttft_ms_p99=None)
                report.add(row)
    finally:
        free_engine(eng)


def run_mixed_burst(args, params, vocab, busy: GpuBusy, report: "Report") -> None:
    """The issue-13 mixed workload: every request submitted at once, async vs sync handoff."""
    reqs = workload("mixed", args, vocab, args.mixed_requests, seed=2)
    graph_modes = args.burst_mixed_graphs or [params.get("cuda_graph_mixed", "false")]
    for graphs in graph_modes:
        for mode in ("on", "off"):
            prefix = "in-process" + (f", mixed graphs {graphs}" if args.burst_mixed_graphs else "")
            if report.over_budget(f"burst {prefix} async handoff {mode}"):
                continue
            eng = new_engine(params, async_token_handoff=mode, cuda_graph_mixed=graphs)
            try:
                closed_loop(eng, reqs[:args.warmup], "greedy", args.warmup, args.warmup, f"burst-{mode}-warm",
                            args.point_timeout)
                # (an engine in another process has no runner here: no counts then)
                mixed = getattr(getattr(getattr(eng, "engine", None), "runner", None), "mixed_graphs", None)
                before = (mixed.steps_graphed, mixed.steps_eager) if mixed is not None else (0, 0)
                t0 = time.perf_counter()
                recs = closed_loop(eng, reqs, "greedy", len(reqs), len(reqs), f"burst-{mode}", args.point_timeout)
                if mixed is not None:
                    log(f"burst {prefix}, async {mode}: mixed steps graphed {mixed.steps_graphed - before[0]}, "
                        f"eager {mixed.steps_eager - before[1]}, graphs {len(mixed.graphs)} "
                        f"(capture {mixed.capture_s:.1f} s)")
                report.add(row_from(f"{prefix}, async handoff {mode}", "burst", "greedy", len(reqs), recs,
                                    busy.mean(t0, time.perf_counter()),
                                    async_enabled=bool(eng.engine.async_enabled)))
            finally:
                free_engine(eng)


# ---- Triton --------------------------------------------------------------------------------------

# A variant's pseudo-parameter: the llm model's dynamic_batching block with this queue delay (µs).
DYNAMIC_BATCHING = "_dynamic_batching_delay_us"
# A variant's pseudo-parameter: the llm model's instance_group count (stub processes).
INSTANCES = "_instances"


def _copy_model(root: Path, model: str, params: dict[str, str]) -> None:
    """root/model: model_repository/model whose parameters are `params` (others as shipped)."""
    dst = root / model
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(REPO_ROOT / "model_repository" / model, dst, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = (dst / "config.pbtxt").read_text()
    params = dict(params)
    delay_us = params.pop(DYNAMIC_BATCHING, None)
    if delay_us is not None:  # Triton's scheduler hands execute() every request queued meanwhile
        cfg += f"dynamic_batching {{ max_queue_delay_microseconds: {int(delay_us)} }}\n"
    instances = params.pop(INSTANCES, None)
    if instances is not None:
        cfg, n = re.subn(r"(instance_group \[ \{ count: )\d+", rf"\g<1>{int(instances)}", cfg)
        assert n == 1, f"{model}/config.pbtxt: no instance_group count to set"
    for k, v in params.items():
        line = f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}'
        pat = re.compile(r'^parameters \{ key: "' + re.escape(k) + r'" .*$', re.M)
        cfg, n = pat.subn(line.replace("\\", "\\\\"), cfg)
        if n == 0:
            cfg += line + "\n"
    (dst / "config.pbtxt").write_text(cfg)


def make_repository(root: Path, params: dict[str, str], with_text_models: bool = False) -> Path:
    """root/llm with the run's parameters; with_text_models: also `ensemble` (TensorRT-LLM's text
    interface: preprocessing -> llm -> postprocessing, tokenizer from the model folder), which
    genai-perf drives."""
    _copy_model(root, "llm", params)
    if with_text_models:
        _copy_model(root, "ensemble", {})
        for m in ("preprocessing", "postprocessing"):
            _copy_model(root, m, {"model_path": params["model_path"]})
    return root


# How long a point waits for the llm model's counters to cover it: an export comes every
# stats_interval_ms, and one whose engine stats are stale (the core did not answer within 2 s)
# holds the finished counts back for up to 3 exports (triton_glue/metrics.py).
COUNTERS_TIMEOUT_S = 30.0


def _read_failed(counters: dict[str, float]) -> bool:
    """A metric_sums read that failed (its values are nan)."""
    return any(v != v for v in counters.values())


class TritonServer:
    def __init__(self, repo: Path, log_path: Path, start_timeout_s: float, core_profile: Optional[Path] = None):
        from triton_glue import launch
        inst = launch.find_triton()
        backend_dir = launch.prepare_backend_dir(inst)
        self.http, self.grpc, self.metrics = free_ports(3)
        opts = launch.ServerOptions(model_repository=repo, http_port=self.http, grpc_port=self.grpc,
                                    metrics_port=self.metrics, address="127.0.0.1", access_key="",
                                    exit_timeout_s=30)
        env = launch.server_env(inst)
        env["TRITON_HTTP_PORT"] = str(self.http)
        if core_profile is not None:  # the engine core (a child of the llm stub) inherits it
            env[CORE_PROFILE_ENV] = str(core_profile)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(launch.server_argv(inst, backend_dir, opts), env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() - t0 > start_timeout_s:
                self.stop()
                raise RuntimeError(f"tritonserver not ready (rc={self.proc.returncode}):\n{self.log_tail()}")
            time.sleep(0.5)
        log(f"tritonserver ready in {time.monotonic() - t0:.1f} s (grpc {self.grpc})")

    def _ready(self) -> bool:
        try:  # --strict-readiness: every model of the repository is ready
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001
            return False

    def failures(self, models: tuple[str, ...] = ("llm",)) -> float:
        """Failed requests so far (nv_inference_request_failure) of these models."""
        return self.metric_sum("nv_inference_request_failure", models)

    def metric_sum(self, name: str, models: tuple[str, ...] = ("llm",)) -> float:
        """A metric's value summed over the lines of these models (nan if unreadable)."""
        return self.metric_sums((name,), models)[name]

    def metric_sums(self, names: tuple[str, ...], models: tuple[str, ...] = ("llm",)) -> dict[str, float]:
        """metric_sum of each name, from one read of the metrics endpoint."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as r:
                text = r.read().decode()
        except Exception:  # noqa: BLE001
            return {name: float("nan") for name in names}
        lines = [l for l in text.splitlines() if any(f'model="{m}"' in l for m in models)]
        return {name: _series_sum(lines, name) for name in names}

    def point_counters(self, timeout_s: float = 15.0) -> dict[str, float]:
        """POINT_COUNTERS before a point: a read that succeeded (a failed one, nan, would void
        every difference the point takes from it), within timeout_s, else the failed read."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.metric_sums(POINT_COUNTERS)
            if not _read_failed(got) or time.monotonic() >= deadline:
                return got
            time.sleep(0.1)

    def counters_covering(self, before: dict[str, float],
                          timeout_s: float = COUNTERS_TIMEOUT_S) -> tuple[dict[str, float], bool]:
        """POINT_COUNTERS once the llm model's exported engine stats cover every request Triton
        has ended since `before`, and whether they did. The model exports them from its monitor
        thread every stats interval, and a busy host can hold that thread up for longer than a
        point: read too early, the point's steps are not there yet. An export sends its finished
        requests last, and only with stats fresh from the engine (EngineMetrics.export), so once
        they cover the point so does the rest. After timeout_s, the last read that succeeded."""
        deadline = time.monotonic() + timeout_s
        last = None
        while True:
            after = self.metric_sums(POINT_COUNTERS)
            if not _read_failed(after):
                last = after
                ended = sum(after[k] - before[k] for k in ("nv_inference_request_success",
                                                           "nv_inference_request_failure"))
                # the engine's finished requests, and those the model turned away before the engine
                finished = sum(after[k] - before[k] for k in ("llm_requests_finished_total",
                                                              "llm_requests_rejected_total"))
                if finished >= ended:
                    return after, True
            if time.monotonic() >= deadline:
                return last or after, False
            time.sleep(0.1)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:  # the server leads its own group: Python stubs it left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def perf_analyzer_input(reqs: list[Req], sampling: str) -> dict:
    s = SAMPLINGS[sampling]
    return {"data": [{"input_ids": {"content": list(r.prompt), "shape": [len(r.prompt)]},
                      "max_tokens": [r.max_tokens], "stream": [True], "exclude_input_in_output": [True],
                      "ignore_eos": [True], "temperature": [s["temperature"]], "top_p": [s["top_p"]]}
                     for r in reqs]}


def _count_ids(v) -> int:
    """Tokens in one exported output_ids: a list, a bare number (one token) or "" (none)."""
    if isinstance(v, list):
        return len(v)
    return 1 if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def records_from_profile(path: Path) -> list[Record]:
    """perf_analyzer's profile export -> one Record per request (ns timestamps -> s); tokens
    counted from the streamed output_ids, expected from the request's max_tokens."""
    d = json.loads(path.read_text())
    recs = []
    for exp in d.get("experiments", []):
        for r in exp.get("requests", []):
            ts = [t / 1e9 for t in r.get("response_timestamps") or []]
            outs = r.get("response_outputs") or []
            ntok = sum(_count_ids(o.get("output_ids")) for o in outs)
            mt = (r.get("request_inputs") or {}).get("max_tokens")
            rec = Record(r["timestamp"] / 1e9, expected=int(mt[0] if isinstance(mt, list) else mt or 0),
                         ntok=ntok, responses=len(ts))
            # the last response may be an empty FINAL: the last token came with the one before
            tok_ts = [t for t, o in zip(ts, outs) if _count_ids(o.get("output_ids"))] if outs else ts
            if tok_ts:
                rec.t_first, rec.t_last = tok_ts[0], tok_ts[-1]
            recs.append(rec)
    return recs


def run_triton(args, params, vocab, busy: GpuBusy, work: Path, report: "Report") -> None:
    if args.engine == "large":  # two llm instances over one engine core, as the config advises on a GPU
        params = dict(params, **{INSTANCES: "2"})
    for i, (name, overrides) in enumerate(args.variants):
        label = "Triton" + (f" {name}" if name else "")
        genai = bool(args.genai_perf) and i == 0  # genai-perf on the first server only
        repo = make_repository(work / f"repo-{name or 'default'}", dict(params, **overrides), with_text_models=genai)
        if report.over_budget(label):
            continue
        try:
            profile = args.out_dir / f"core-{name or 'default'}.prof" if args.core_profile else None
            srv = TritonServer(repo, args.out_dir / f"server-{name or 'default'}.log", args.start_timeout, profile)
        except RuntimeError as e:  # the other servers and parts still run
            log(f"{label}: {e}")
            why = [l.strip(" |") for l in str(e).splitlines() if "UNAVAILABLE" in l or "rror" in l]
            report.failed_part(label, (why[0] if why else str(e).splitlines()[0])[:300])
            continue
        mine = []
        try:
            for wl in args.workloads:
                reqs = workload(wl, args, vocab, args.distinct_requests)
                for sampling in args.samplings:
                    data = work / f"input-{wl}-{sampling}.json"
                    data.write_text(json.dumps(perf_analyzer_input(reqs, sampling)))
                    for c in args.concurrency:
                        for threads in args.pa_threads:
                            point = label + (f" pa-threads {threads or 'default'}" if len(args.pa_threads) > 1 else "")
                            if not report.over_budget(f"{point} {wl} {sampling} c={c}"):
                                mine.append(report.add(perf_point(args, srv, point, wl, sampling, c, data, busy,
                                                                  work, threads)))
            if genai:
                for sampling, c in args.genai_points:
                    if not report.over_budget(f"genai-perf {sampling} c={c}"):
                        mine.append(report.add(genai_point(args, srv, sampling, c, busy, work)))
        finally:
            srv.stop()
        if profile is not None:
            write_core_profile(profile, label)
        tracebacks = [l for l in srv.log_path.read_text(errors="replace").splitlines() if "Traceback" in l]
        if tracebacks:
            log(f"server log has {len(tracebacks)} Traceback(s): {srv.log_path}")
            for r in mine:
                r["server_tracebacks"] = len(tracebacks)
            report.write()


def write_core_profile(profile: Path, label: str, top: int = 30) -> None:
    """--core-profile: the engine core's loop thread over the server's life (its points and
    warm-ups; cProfile slows the loop, so read shares, not times), top functions by own time
    into <profile>.txt beside the pstats file."""
    import io
    import pstats
    if not profile.exists():
        log(f"{label}: no core profile at {profile} (the core did not end through STOP)")
        return
    text = io.StringIO()
    pstats.Stats(str(profile), stream=text).sort_stats("tottime").print_stats(top)
    profile.with_suffix(".txt").write_text(f"{label}: engine core loop thread\n{text.getvalue()}")
    log(f"{label}: core profile in {profile.with_suffix('.txt')}")


# llm's counters a perf_analyzer point reads before and after: Triton's request counts and
# queue / execute() time, the stub's sends, the engine's steps and GPU idle time.
POINT_COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_queue_duration_us",
                  "nv_inference_compute_infer_duration_us", "llm_responses_sent_total",
                  "llm_response_send_seconds_total", "llm_async_steps_total", "llm_sync_steps_total",
                  "llm_gpu_idle_gap_seconds_sum", "llm_step_seconds_total", "llm_step_gpu_wait_seconds_total",
                  "llm_generation_tokens_total", "llm_prefill_steps_total", "llm_step_host_cpu_seconds_total",
                  "llm_requests_finished_total", "llm_requests_rejected_total",
                  *(f'llm_step_phase_seconds_total{{phase="{p}"}}' for p in HOST_PHASES))


def perf_point(args, srv: TritonServer, label, wl, sampling, c, data: Path, busy: GpuBusy, work: Path,
               threads: int = 1) -> dict:
    n = max(args.min_requests, c * args.rounds)
    warm = max(c, args.warmup)
    prof = work / f"profile-{label.replace(' ', '_')}-{wl}-{sampling}-{c}.json"
    prof.unlink(missing_ok=True)
    cmd = [args.perf_analyzer, "-m", "llm", "-u", f"127.0.0.1:{srv.grpc}", "-i", "grpc", "--streaming",
           "--input-data", str(data), "--concurrency-range", str(c), "--request-count", str(n),
           "--warmup-request-count", str(warm), "--measurement-interval", "600000",
           "--profile-export-file", str(prof)]
    # threads=1: one thread holds all c streams and walks the data entries in order, as
    # closed_loop does. perf_analyzer's own default (threads=0) is 16 threads sharing the c
    # streams, each with a fixed 1/16 of the requests over a fixed stride of entries: on mixed
    # lengths their work differs ~3x, and a thread that is done leaves its streams idle.
    if threads:
        cmd += ["--max-threads", str(threads)]
    before = srv.point_counters()
    cpu0 = proc_cpu.thread_cpu(srv.proc.pid)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"perf_analyzer timed out after {args.point_timeout} s\n{e.stdout or ''}"
    t1 = time.perf_counter()
    cpu1 = proc_cpu.thread_cpu(srv.proc.pid)
    gpu = busy.mean(t0, t1)
    after, covered = srv.counters_covering(before)
    if not covered:
        why = ("unreadable before it" if _read_failed(before)
               else f"within {COUNTERS_TIMEOUT_S:.0f} s")
        log(f"{label} {wl} {sampling} c={c}: the llm model's counters did not cover the point ({why}); "
            "its engine columns are partial")
    d = {k: after[k] - before[k] for k in POINT_COUNTERS}
    failures = d["nv_inference_request_failure"]
    sent, send_s = d["llm_responses_sent_total"], d["llm_response_send_seconds_total"]
    steps, idle_s = d["llm_async_steps_total"] + d["llm_sync_steps_total"], d["llm_gpu_idle_gap_seconds_sum"]
    reqs = d["nv_inference_request_success"] + failures
    queue_us, exec_us = d["nv_inference_queue_duration_us"], d["nv_inference_compute_infer_duration_us"]
    recs = records_from_profile(prof) if prof.exists() else []
    (args.out_dir / f"pa-{label.replace(' ', '_')}-{wl}-{sampling}-{c}.txt").write_text(" ".join(cmd) + "\n" + out)
    # the stub's cost per response: the Triton path's suspect at high concurrency
    # and the engine's pace: steps a second, and how long the GPU waited between two of them
    extra = {"send_us": send_s / sent * 1e6 if sent > 0 else None, "sends_per_s": sent / (t1 - t0),
             "steps_per_s": steps / (t1 - t0), "idle_us_per_step": idle_s / steps * 1e6 if steps > 0 else None,
             # and Triton's side of each request: waiting for execute(), and execute() itself
             "queue_us": queue_us / reqs if reqs > 0 else None, "exec_us": exec_us / reqs if reqs > 0 else None}
    # the engine thread's host work per step (its time in step() less its waits on the GPU), and
    # the batch it ran (tokens of the requests finished in the window per step)
    # which threads of the server, the stub and the engine core were busy (share of one CPU)
    extra["thread_cpu"] = proc_cpu.busy_threads(cpu0, cpu1, t1 - t0)
    extra["counters_cover_point"] = covered
    if steps > 0:
        extra["host_us_per_step"] = (d["llm_step_seconds_total"] - d["llm_step_gpu_wait_seconds_total"]) / steps * 1e6
        extra["host_cpu_us_per_step"] = d["llm_step_host_cpu_seconds_total"] / steps * 1e6
        for p in HOST_PHASES:
            extra[f"{p}_us_per_step"] = d[f'llm_step_phase_seconds_total{{phase="{p}"}}'] / steps * 1e6
        extra["tokens_per_step"] = d["llm_generation_tokens_total"] / steps
        extra["prefill_step_share"] = d["llm_prefill_steps_total"] / steps
    if rc != 0 or not recs:
        extra["perf_analyzer_rc"] = rc
        extra["perf_analyzer_tail"] = out[-800:]
        log(f"perf_analyzer rc={rc}: {out[-400:]}")
    # failed requests: the server's count, plus a failed perf_analyzer run (or none recorded)
    failed = int(failures) if failures == failures else 0
    failed += (1 if rc != 0 else 0) + (0 if recs else n)
    return row_from(label, wl, sampling, c, recs, gpu, failures=failed, **extra)


GENAI_LABEL = "Triton genai-perf (ensemble)"
GENAI_MODELS = ("ensemble", "preprocessing", "llm", "postprocessing")


def genai_point(args, srv: TritonServer, sampling: str, c: int, busy: GpuBusy, work: Path) -> dict:
    """genai-perf against `ensemble` (text in/out over the same engine; `--backend tensorrtllm`,
    whose inputs carry temperature and top_p): the fixed workload's shape as synthetic prompts,
    min_length = max_tokens instead of ignore_eos; its own TTFT / inter-token latency / output
    tok/s (output tokens counted by re-tokenizing the streamed text: near, not exactly,
    max_tokens)."""
    n = max(args.min_requests, c * args.rounds)
    art = work / f"genai-{sampling}-{c}"
    shutil.rmtree(art, ignore_errors=True)
    s = SAMPLINGS[sampling]
    cmd = [args.genai_perf, "profile", "-m", "ensemble", "--backend", "tensorrtllm", "--endpoint-type", "kserve",
           "--streaming", "-u", f"127.0.0.1:{srv.grpc}", "--tokenizer", args.model_path,
           "--num-dataset-entries", str(args.distinct_requests),
           "--synthetic-input-tokens-mean", str(args.prompt_len), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(args.output_len), "--output-tokens-mean-deterministic",
           "--extra-inputs", f"temperature:{s['temperature']}",
           "--extra-inputs", f"top_p:{s['top_p']}",
           "--concurrency", str(c), "--request-count", str(n), "--warmup-request-count", str(max(c, args.warmup)),
           "--random-seed", "0", "--artifact-dir", str(art)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="200",
               PATH=f"{Path(args.perf_analyzer).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    fail0 = srv.failures(GENAI_MODELS)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout, env=env, cwd=work)
        rc, out = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        rc, out = 124, f"genai-perf timed out after {args.point_timeout} s"
    gpu = busy.mean(t0, time.perf_counter())
    failures = srv.failures(GENAI_MODELS) - fail0
    (args.out_dir / f"genai-{sampling}-{c}.txt").write_text(" ".join(cmd) + "\n" + out)
    summary = next(art.glob("**/profile_export_genai_perf.json"), None)
    export = next(art.glob("**/profile_export.json"), None)
    failed = (int(failures) if failures == failures else 0) + (1 if rc != 0 else 0)
    row = {"path": GENAI_LABEL, "workload": "fixed", "sampling": sampling, "concurrency": c, "requests": 0,
           "errors": failed, "output_tokens": 0, "wall_s": None, "tok_s": 0.0, "ttft_ms_p50": None,
           "ttft_ms_p99": None, "tpot_ms_p50": None, "tpot_ms_p99": None, "tpot_ms_mean": None,
           "responses_per_req": 0.0, "gpu_busy": gpu}
    if summary is None:
        row.update(errors=failed + n, genai_tail=out[-800:])
        log(f"genai-perf rc={rc}: {out[-400:]}")
        return row
    g = json.loads(summary.read_text())

    def ms(metric: str, stat: str) -> Optional[float]:
        m = g.get(metric) or {}
        v = m.get(stat)
        return None if v is None else v * {"ms": 1.0, "ns": 1e-6, "us": 1e-3, "s": 1e3}.get(m.get("unit", "ms"), 1.0)

    count = int(g["request_count"]["avg"])
    row.update(requests=count, output_tokens=int(round(g["output_sequence_length"]["avg"] * count)),
               tok_s=g["output_token_throughput"]["avg"], ttft_ms_p50=ms("time_to_first_token", "p50"),
               ttft_ms_p99=ms("time_to_first_token", "p99"), tpot_ms_p50=ms("inter_token_latency", "p50"),
               tpot_ms_p99=ms("inter_token_latency", "p99"), tpot_ms_mean=ms("inter_token_latency", "avg"),
               output_tokens_min=g["output_sequence_length"].get("min"))
    if count != n:
        row["errors"] += abs(n - count)
    if export is not None:
        reqs = [q for e in json.loads(export.read_text()).get("experiments", []) for q in e.get("requests", [])]
        if reqs:
            row["responses_per_req"] = statistics.fmean(len(q.get("response_timestamps") or []) for q in reqs)
    return row


# ---- report ---------------------------------------------------------------------------------------

def _series_sum(lines: list[str], name: str) -> float:
    """The sum of a metric's series; name may select one label value: 'metric{label="value"}'."""
    base, _, label = name.partition("{")
    label = label.rstrip("}")
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines if l.startswith(base + "{") and label in l)


def _f(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(rows: list[dict], header: str) -> str:
    """One table: per (workload, sampling, concurrency) the steady step, in-process, Triton
    rows; TPOT p50 against in-process, tok/s against steady decode at the same batch."""
    steady = {(r["sampling"], r["concurrency"]): r for r in rows if r["path"].startswith("steady")}
    inproc = {(r["workload"], r["sampling"], r["concurrency"]): r for r in rows if r["path"] == INPROC_LABEL}
    order = {"steady decode (same engine)": 0, INPROC_LABEL: 1, ENGINE_PROCESS_LABEL: 2}
    lines = [header, "",
             "| workload | sampling | concurrency | path | streams in flight | requests | errors | output tok/s | x steady tok/s | "
             "TTFT ms p50 | p99 | TPOT ms p50 | p99 | TPOT p50 x in-process | TPOT p50 x steady step | "
             "GPU busy | responses/request | stub send µs/response | stub sends/s | engine steps/s | "
             "GPU idle µs/step | engine host µs/step | tokens/step | prefill steps share | Triton queue µs/request | "
             "execute µs/request |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    loop_rows = [r for r in rows if r["workload"] != "burst"]
    wl_order = {"fixed": 0, "mixed": 1}
    for r in sorted(loop_rows, key=lambda r: (wl_order.get(r["workload"], 9), r["sampling"], r["concurrency"],
                                              order.get(r["path"], 3), r["path"])):
        # steady decode runs the fixed shape: a reference for the fixed workload only
        st = steady.get((r["sampling"], r["concurrency"])) if r["workload"] == "fixed" else None
        ip = inproc.get((r["workload"], r["sampling"], r["concurrency"]))
        x_ip = (r["tpot_ms_p50"] / ip["tpot_ms_p50"]) if ip and ip["tpot_ms_p50"] and r["tpot_ms_p50"] else None
        x_st = (r["tpot_ms_p50"] / st["tpot_ms_p50"]) if st and st["tpot_ms_p50"] and r["tpot_ms_p50"] else None
        x_tok = (r["tok_s"] / st["tok_s"]) if st and st["tok_s"] else None
        lines.append(f"| {r['workload']} | {r['sampling']} | {r['concurrency']} | {r['path']} | "
                     f"{_f(r.get('mean_in_flight'), '.1f')} | {r['requests']} | "
                     f"{r['errors']} | {r['tok_s']:.0f} | {_f(x_tok, '.2f')} | {_f(r['ttft_ms_p50'], '.1f')} | "
                     f"{_f(r['ttft_ms_p99'], '.1f')} | {_f(r['tpot_ms_p50'], '.3f')} | {_f(r['tpot_ms_p99'], '.3f')} | "
                     f"{_f(x_ip, '.2f')} | {_f(x_st, '.2f')} | {_f(r['gpu_busy'], '.2f')} | "
                     f"{r['responses_per_req']:.1f} | {_f(r.get('send_us'), '.0f')} | "
                     f"{_f(r.get('sends_per_s'), '.0f')} | {_f(r.get('steps_per_s'), '.0f')} | "
                     f"{_f(r.get('idle_us_per_step'), '.0f')} | {_f(r.get('host_us_per_step'), '.0f')} | "
                     f"{_f(r.get('tokens_per_step'), '.0f')} | {_f(r.get('prefill_step_share'), '.2f')} | "
                     f"{_f(r.get('queue_us'), '.0f')} | "
                     f"{_f(r.get('exec_us'), '.0f')} |")
    busy = [r for r in loop_rows if r.get("thread_cpu")]
    if busy:
        lines += ["", "Busy threads during each Triton point (share of one CPU, >= 5 %; process/thread):", ""]
        lines += [f"- {r['path']} {r['workload']} {r['sampling']} c={r['concurrency']}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["thread_cpu"].items()) for r in busy]
    burst = [r for r in rows if r["workload"] == "burst"]
    if burst:
        syncs = {r["path"].rsplit(", async handoff", 1)[0]: r for r in burst if r["path"].endswith("off")}
        lines += ["", "Mixed workload, every request submitted at once (greedy, ignore_eos):", "",
                  "| path | requests | errors | output tokens | wall s | output tok/s | x sync | TTFT ms p50 | "
                  "TPOT ms p50 | p99 | GPU busy |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in burst:
            sync = syncs.get(r["path"].rsplit(", async handoff", 1)[0])
            x = r["tok_s"] / sync["tok_s"] if sync and sync["tok_s"] else None
            lines.append(f"| {r['path']} | {r['requests']} | {r['errors']} | {r['output_tokens']} | "
                         f"{r['wall_s']:.2f} | {r['tok_s']:.0f} | {_f(x, '.2f')} | {_f(r['ttft_ms_p50'], '.1f')} | "
                         f"{_f(r['tpot_ms_p50'], '.3f')} | {_f(r['tpot_ms_p99'], '.3f')} | {_f(r['gpu_busy'], '.2f')} |")
    hosts = [r for r in loop_rows if r.get("host_us_per_step") is not None]
    if hosts:
        lines += ["", "The engine thread's host work per step (µs; rest: token readback and bookkeeping; not "
                  "running: host time less the thread's CPU time, waiting for the GIL or a core):", "",
                  "| workload | sampling | concurrency | path | host | schedule | submit | update | rest | "
                  "CPU | not running |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in hosts:
            phases = [r.get(f"{p}_us_per_step") for p in HOST_PHASES]
            cpu = r.get("host_cpu_us_per_step")
            rest = r["host_us_per_step"] - sum(phases) if None not in phases else None
            off = r["host_us_per_step"] - cpu if cpu else None
            lines.append(f"| {r['workload']} | {r['sampling']} | {r['concurrency']} | {r['path']} | "
                         f"{r['host_us_per_step']:.0f} | " + " | ".join(_f(v, '.0f') for v in phases)
                         + f" | {_f(rest, '.0f')} | {_f(cpu, '.0f')} | {_f(off, '.0f')} |")
    return "\n".join(lines) + "\n"


# ---- main -----------------------------------------------------------------------------------------

def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _range(s: str) -> tuple[int, int]:
    a, b = s.split("-")
    return int(a), int(b)


def _variant(s: str) -> tuple[str, dict[str, str]]:
    """NAME or NAME:key=value,key=value (llm parameters for that server)."""
    name, _, kvs = s.partition(":")
    return name, dict(kv.split("=", 1) for kv in kvs.split(",") if kv)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", help="qwen2.5-0.5b | llama-3-8b: random weights of that shape (load_format dummy)")
    src.add_argument("--model", help="a checkpoint folder (default models/tiny-llama)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tiny model, tiny sizes (make bench-serve, the make-test smoke test)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda with --preset, else cpu)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--engine", choices=("shipped", "large"), default=None,
                    help="shipped: the llm model's config.pbtxt; large: 512 sequences, 8192-token budget, "
                         "Triton with two llm instances over one engine core (default: large on cuda, "
                         "shipped on cpu)")
    ap.add_argument("--set", action="append", help="KEY=VALUE engine parameter override (repeatable)")
    ap.add_argument("--variant", action="append", type=_variant, dest="variants",
                    help="NAME[:k=v,...]: one Triton server per variant with these llm parameters "
                         "(e.g. 'coalesce-off:stream_coalesce=off'; _dynamic_batching_delay_us=N adds llm's "
                         "dynamic_batching block, _instances=N sets its instance_group count); default one, as configured")
    ap.add_argument("--burst-mixed-graphs", type=lambda s: [x for x in s.split(",") if x], default=None,
                    help="burst part: run it for each of these cuda_graph_mixed values (e.g. off,on; "
                         "default: as configured)")
    ap.add_argument("--parts", default="triton,genai,inproc,burst",
                    help="comma list of triton, genai (genai-perf on the first server), inproc, "
                         "inproc-process (the closed loop on EngineProcessClient), burst")
    ap.add_argument("--concurrency", type=_int_list, default=None, help="default 1,16,64,256 (cpu: 1,4)")
    ap.add_argument("--workloads", default="fixed,mixed", help="fixed, mixed")
    ap.add_argument("--samplings", default="greedy,top_p", help="greedy, top_p")
    ap.add_argument("--prompt-len", type=int, default=None, help="fixed workload (default 256; smoke 16)")
    ap.add_argument("--output-len", type=int, default=None, help="fixed workload (default 128; smoke 8)")
    ap.add_argument("--mixed-prompt", type=_range, default=None, help="default 16-1024 (smoke 4-32)")
    ap.add_argument("--mixed-output", type=_range, default=None, help="default 16-512 (smoke 2-12)")
    ap.add_argument("--mixed-requests", type=int, default=None, help="burst size (default 512; smoke 24)")
    ap.add_argument("--distinct-requests", type=int, default=64, help="requests in a workload set (cycled)")
    ap.add_argument("--rounds", type=int, default=None, help="measured requests per point: c * rounds "
                                                               "(default 4; smoke 2)")
    ap.add_argument("--min-requests", type=int, default=None, help="at least this many (default 16; smoke 4)")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests per point (at least c)")
    ap.add_argument("--pa-threads", type=_int_list, default=[1],
                    help="perf_analyzer --max-threads per point, comma list, each a row (0: its own "
                         "default, 16 threads; default 1, the in-process loop's order)")
    ap.add_argument("--perf-analyzer", default=os.environ.get("PA") or str(REPO_ROOT / "build" / "bin" / "perf_analyzer"))
    ap.add_argument("--genai-perf", default=str(REPO_ROOT / "build" / "genai-venv" / "bin" / "genai-perf"),
                    help="genai-perf (scripts/install_genai_perf.sh); its rows run where it is installed and "
                         "the model has a tokenizer (not the presets), and 'genai' is in --parts")
    ap.add_argument("--genai-points", default=None,
                    help="SAMPLING:C,... genai-perf points (default: every sampling x concurrency)")
    ap.add_argument("--emulated-step-us", type=float, default=0.0,
                    help="the llm model's engine process runs bench/emulated_engine.py (no model: a token "
                         "per running request every this many µs) instead of the engine; parts triton "
                         "and inproc-process only: the serving path at GPU speed without a GPU")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds: points not started by then are skipped (and listed); 0: no limit")
    ap.add_argument("--point-timeout", type=float, default=300.0)
    ap.add_argument("--model-dir", default="/tmp/bench-models", help="where preset config folders go")
    ap.add_argument("--keep-work", action="store_true", help="keep the temporary folder (repositories, "
                    "perf_analyzer inputs and profile exports)")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or str(REPO_ROOT / "build" / "serve_out"))
    ap.add_argument("--core-profile", action="store_true",
                    help="cProfile each Triton server's engine core loop thread: core-<variant>.prof and "
                         ".txt (top functions) in --out-dir")
    a = ap.parse_args(argv)
    gpu = a.device == "cuda" or (a.device is None and a.preset and not a.smoke)
    a.device = a.device or ("cuda" if gpu else "cpu")
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    a.engine = a.engine or ("large" if a.device == "cuda" else "shipped")
    small = a.smoke or a.device == "cpu"
    defaults = dict(concurrency=[1, 4] if small else [1, 16, 64, 256], prompt_len=16 if small else 256,
                    output_len=8 if small else 128, mixed_prompt=(4, 32) if small else (16, 1024),
                    mixed_output=(2, 12) if small else (16, 512), mixed_requests=24 if small else 512,
                    rounds=2 if small else 4, min_requests=4 if small else 16)
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.parts = set(a.parts.split(","))
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.samplings = [s for s in a.samplings.split(",") if s]
    for s in a.samplings:
        if s not in SAMPLINGS:
            ap.error(f"--samplings: {s!r} is not one of {sorted(SAMPLINGS)}")
    a.variants = a.variants or [("", {})]
    a.genai_points = ([(p.split(":")[0], int(p.split(":")[1])) for p in a.genai_points.split(",") if p]
                      if a.genai_points else [(s, c) for s in a.samplings for c in a.concurrency])
    a.load_format = "dummy" if a.preset else "safetensors"
    a.out_dir = Path(a.out_dir)
    return a


def resolve_model(a) -> str:
    if a.preset:
        from bench.decode import write_preset_config
        return write_preset_config(a.preset, a.model_dir)
    path = Path(a.model or REPO_ROOT / "models" / "tiny-llama").resolve()
    if not (path / "config.json").exists():
        raise SystemExit(f"no model at {path} (make model)")
    return str(path)


def genai_perf_usable(a, model: str) -> Optional[str]:
    """The genai-perf command when its rows can run here, else None (and why, logged)."""
    if "genai" not in a.parts or "triton" not in a.parts:
        return None
    why = None
    if not Path(a.genai_perf).exists():
        why = f"not installed at {a.genai_perf} (scripts/install_genai_perf.sh)"
    elif not any((Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        why = f"no tokenizer in {model} (it re-tokenizes text)"
    if why:
        log(f"genai-perf rows skipped: {why}")
        return None
    return a.genai_perf


class Report:
    """The rows so far, written to serve.json / serve.md after every row (a run cut short by the
    device's time limit still leaves its table), and the run's time budget."""

    def __init__(self, a, params: dict[str, str], name: str):
        self.a, self.params, self.name = a, params, name
        self.rows: list[dict] = []
        self.skipped: list[str] = []
        self.part_errors: list[dict] = []
        self.t0 = time.perf_counter()

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        _progress(row)
        self.write()
        return row

    def over_budget(self, what: str) -> bool:
        if self.a.time_budget and time.perf_counter() - self.t0 > self.a.time_budget:
            log(f"skipped (time budget {self.a.time_budget:.0f} s spent): {what}")
            self.skipped.append(what)
            return True
        return False

    def failed_part(self, part: str, error: str) -> None:
        self.part_errors.append({"part": part, "error": error})
        self.write()

    def header(self) -> str:
        a, p = self.a, self.params
        h = (f"{self.name}, {a.device} {a.dtype}, engine `{a.engine}` (max_num_seqs {p['max_num_seqs']}, "
             f"max_num_batched_tokens {p['max_num_batched_tokens']}, cuda_graph_max_batch "
             f"{p['cuda_graph_max_batch']}, async_token_handoff {p['async_token_handoff']}); "
             f"fixed: prompt {a.prompt_len} / output {a.output_len}; mixed: prompts {a.mixed_prompt[0]}-"
             f"{a.mixed_prompt[1]} / outputs {a.mixed_output[0]}-{a.mixed_output[1]}; ignore_eos; "
             f"run {time.perf_counter() - self.t0:.0f} s")
        if self.skipped:
            h += f"; SKIPPED (time budget): {', '.join(self.skipped)}"
        if self.part_errors:
            h += "; FAILED: " + "; ".join(f"{e['part']}: {' '.join(e['error'].split())[:300]}"
                                          for e in self.part_errors)
        return h

    def write(self) -> str:
        a = self.a
        table = markdown(self.rows, self.header())
        meta = {"model": self.name, "model_path": a.model_path, "device": a.device, "dtype": a.dtype,
                "engine": a.engine, "params": self.params, "argv": sys.argv[1:],
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "skipped": self.skipped, "part_errors": self.part_errors}
        (a.out_dir / "serve.json").write_text(json.dumps({"meta": meta, "rows": self.rows}, indent=1))
        (a.out_dir / "serve.md").write_text(table)
        return table


def emulate_engine(a) -> None:
    """--emulated-step-us: the engine processes this run starts (Triton's llm, inproc-process)
    inherit the environment that makes them build bench/emulated_engine.py's engine."""
    from backend_lib.envs import ENGINE_CLASS_ENV
    from bench.emulated_engine import STEP_US_ENV
    other = sorted(set(a.parts) - {"triton", "inproc-process"})
    if other:
        raise SystemExit(f"--emulated-step-us: parts {','.join(other)} run no engine process (use "
                         "--parts triton,inproc-process)")
    os.environ[ENGINE_CLASS_ENV] = "bench.emulated_engine:EmulatedEngine"
    os.environ[STEP_US_ENV] = f"{a.emulated_step_us:g}"


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model(a)
    a.model_path = model
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    params = engine_params(a, model)
    a.genai_perf = genai_perf_usable(a, model)
    name = a.preset or Path(model).name
    log(f"model {name} ({model}), engine {a.engine}: " + ", ".join(f"{k}={v}" for k, v in params.items()))
    if a.emulated_step_us:
        emulate_engine(a)
        name += f" (emulated engine, {a.emulated_step_us:g} µs/step)"
    busy = GpuBusy(a.device == "cuda")
    report = Report(a, params, name)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    parts = [("triton", lambda: run_triton(a, params, vocab, busy, work, report)),
             ("inproc", lambda: run_inprocess(a, params, vocab, busy, report)),
             ("inproc-process", lambda: run_inprocess(a, params, vocab, busy, report, process=True)),
             ("burst", lambda: run_mixed_burst(a, params, vocab, busy, report))]
    try:
        for part, run in parts:
            if part not in a.parts:
                continue
            try:
                run()
            except Exception as e:  # noqa: BLE001 - the next part still runs; the table says so
                import traceback
                traceback.print_exc()
                report.failed_part(part, repr(e))
    finally:
        busy.close()
        if a.keep_work:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(report.write())
    return 1 if report.part_errors or any(r["errors"] for r in report.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
