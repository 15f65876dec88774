"""Host time per engine step: what the engine thread spends in `LLMEngine.step()` that is not
waiting on the device, at batch 1/64/256 of steady greedy decode; one table.

    python -m bench.host_loop                          # CPU: tiny model, a no-math decode program
    python -m bench.host_loop --profile 256            # + cProfile of the batch-256 steps
    python -m bench.host_loop --device cuda --preset qwen2.5-0.5b --out $OUT/host_loop.json
    # before/after in one run: an older backend_lib (e.g. `git archive <rev> backend_lib | tar -x -C DIR`)
    python -m bench.host_loop --device cuda --preset qwen2.5-0.5b --compare DIR
    # on a noisy box: N before/after pairs in alternating order, with the median ratio
    python -m bench.host_loop --batches 256 --churn 3 --prompt-len 256 --compare DIR --repeat 6
    # who launches the steps (EngineConfig.step_submission) and how far ahead (step_lookahead),
    # one table per configuration + a comparison; --device-us: an emulated device step time
    python -m bench.host_loop --submission inline,thread --lookahead 1,2 --device-us 100
    # requests coming and going: K aborted and K admitted before each timed step
    python -m bench.host_loop --batches 256 --churn 3 --compare DIR
    # + parts of the phases: block hashing, table updates, mixed packing, graph replays
    python -m bench.host_loop --batches 256 --churn 3 --prompt-len 256 --sections

What is measured: B requests (distinct prompts of --prompt-len + 0..15 tokens, greedy, ignore_eos) are admitted and
prefilled, a few decode steps run as warm-up, then `--steps` steady decode steps are timed.
host µs/step = (time in step() - time blocked on step events) / steps, the same measure as
bench/smoke_gpu.py and EngineStats: p50 and mean over the steps, and the engine thread's
CPU time per step (time.thread_time; on a shared CPU box it leaves out the time the thread
was descheduled, which inflates the wall-clock mean). The phase columns (p50, wrapped calls):
schedule (Scheduler.schedule), submit (what the engine thread spends getting the step on
its way: inline, ModelRunner.execute = plan + launch: table updates, packing, graph replay or
eager launch, the D2H copy; thread, ModelRunner.plan + the queue put), update
(Scheduler.update: tokens, stops, outputs) and the rest of step() (token readback,
bookkeeping). µs/row = slope between the first and the last batch.

--submission inline,thread: the same measurement for each step_submission mode (a fresh
engine each). In thread mode the engine thread's wait includes the submission thread's
launch (on CPU the "device" finishes at once), so compare wall µs/step (the loop's rate)
and engine + submission thread CPU µs/step, not host µs alone.

On CUDA the "device idle %" column is the sum of the GPU's idle gaps between the timed steps
(CUDA events, EngineStats.gpu_idle_gap_us) over their wall time.

--device-us N (CPU): an emulated device that takes N µs a step, serially in wall time (a step
launched at t runs from max(t, the previous step's end)); its token event completes at the
step's end and the host sleeps on it (GIL released), as it would wait on a GPU. The table
then also has the emulated device's idle share over the timed steps: what the host loop and
the submission mode cost the device.

* CPU (default): models/tiny-llama, and the decode graphs are CPU stand-ins (EagerGraph)
  around a program that does no math (returns fixed token ids and advances the positions the
  way the real program does), so the table is the engine's host work alone: the real
  scheduler, the runner's packing and graph-reuse decision, the handoff, the update.
* CUDA: the real model (--preset: random weights of that shape; or --model) and its captured
  CUDA graphs; host time excludes the waits on step events, as on CPU (thread CPU time
  includes any spin inside the event wait).
* --compare DIR: the same measurement twice in fresh processes, first with DIR/backend_lib
  (the "before"), then with this checkout's, printed side by side.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
_BACKEND_ENV = "HOST_LOOP_BACKEND_DIR"  # the --compare child imports backend_lib from here

if os.environ.get(_BACKEND_ENV):
    sys.path.insert(0, os.environ[_BACKEND_ENV])


class _PhaseTimer:
    """Wraps bound methods of one object to add their wall time to a named bucket."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        totals = self.totals
        totals.setdefault(name, 0.0)
        clock = time.perf_counter

        def timed(*a, **kw):
            t = clock()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] += clock() - t

        setattr(obj, attr, timed)

    def reset(self) -> None:
        for k in self.totals:
            self.totals[k] = 0.0


# --sections: parts of the phases, timed where they are called (none contains another):
# (label, object path on the engine, method)
SECTIONS = (("block hashing", "scheduler", "_hashes"),
            ("table plan", "runner", "plan_tables"),
            ("mixed pack", "runner", "pack_mixed"),
            ("table apply", "runner", "apply_tables"),
            ("decode graph replay", "runner.decode_graphs", "replay"),
            ("mixed graph replay", "runner.mixed_graphs", "replay"))


def _wrap_sections(eng) -> _PhaseTimer:
    timer = _PhaseTimer()
    for label, path, attr in SECTIONS:
        obj = eng
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, attr):  # an older backend_lib (--compare) may lack one
            timer.wrap(obj, attr, label)
    return timer


def build_engine(args, submission: str = "inline", lookahead: int = 1, extra: dict | None = None):
    """extra: more EngineConfig fields."""
    import torch
    from backend_lib import EngineConfig, LLMEngine
    if args.device == "cpu":
        torch.set_num_threads(1)
    kw = dict(device=args.device, dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"),
              max_num_seqs=max(args.batches), max_model_len=args.max_model_len,
              max_num_batched_tokens=max(8192, max(args.batches) * args.prompt_len),
              async_token_handoff=args.async_handoff)
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = 0.5
    if submission != "inline":  # an older backend_lib (--compare) has no such field
        kw["step_submission"] = submission
    if lookahead != 1:
        kw["step_lookahead"] = lookahead
    from bench.decode import model_kwargs
    kw.update(model_kwargs(args.preset, args.model))
    from backend_lib.config import parameter_value
    kw.update({name: parameter_value(name, raw) for name, raw in getattr(args, "set", None) or ()})
    kw.update(extra or {})
    if args.device == "cpu":
        per_seq = (args.prompt_len + 16 + args.warmup + args.steps + 8) // 16 + 2
        # at least one sequence of max_model_len (the engine refuses fewer)
        kw["num_kv_blocks"] = max(max(args.batches) * per_seq, -(-args.max_model_len // 16) + 1) + 8
    eng = LLMEngine(EngineConfig(**kw))
    if args.device == "cpu":
        from bench.null_math_engine import strip_math
        strip_math(eng, args.device_us)
    return eng


def measure_batch(eng, batch: int, args, profile: bool) -> dict:
    from backend_lib import SamplingParams
    total_new = args.warmup + args.steps + 4
    sp = SamplingParams(max_tokens=total_new, temperature=0.0, ignore_eos=True)

    def add(i: int) -> None:
        # Prompt lengths prompt_len .. prompt_len + 15: rows open new KV blocks on different steps.
        prompt = [(i * 131 + j * 7) % 700 + 10 for j in range(args.prompt_len + i % 16)]
        prompt[0] = 10 + (i % 600)  # distinct first token: no prefix-cache sharing between rows
        prompt[1] = 10 + (i // 600)
        eng.add_request(f"b{batch}-{i}", prompt, sp)

    for i in range(batch):
        add(i)
    admitted = batch
    first = 0
    while first < batch:
        first += sum(1 for o in eng.step() if o.num_output_tokens == 1 and o.new_token_ids)
    def churn() -> None:
        # --churn K: K requests leave and K new ones arrive before each step (a closed loop's
        # turnover: their prefill chunks ride in the step, their rows are retired and reused)
        nonlocal admitted
        for _ in range(min(args.churn, batch)):
            eng.abort(f"b{batch}-{admitted - batch}")
            add(admitted)
            admitted += 1

    for _ in range(args.warmup):  # with the churn too: the timed steps then commit no warm-up backlog
        churn()
        eng.step()
    timer = eng._host_loop_timer
    timer.reset()
    sections = getattr(eng, "_host_loop_sections", None)
    if sections is not None:
        sections.reset()
    s0 = eng.stats()
    prof = cProfile.Profile() if profile else None
    gc_before = _gen2_collections()
    names = list(timer.totals)
    per_step: dict[str, list[float]] = {k: [] for k in ["host"] + names}
    cpu = 0.0
    sub_clock = _submission_thread_clock(eng)
    sub0 = time.clock_gettime(sub_clock) if sub_clock is not None else 0.0
    device = getattr(eng, "_emulated_device", None)
    if device is not None:
        device.start_window()
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(args.steps):
        churn()
        before = dict(timer.totals)
        st, wt, ct = eng._step_s, eng._wait_s, time.thread_time()
        eng.step()
        cpu += time.thread_time() - ct
        per_step["host"].append((eng._step_s - st) - (eng._wait_s - wt))
        for k in names:
            per_step[k].append(timer.totals[k] - before[k])
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    sub_cpu = time.clock_gettime(sub_clock) - sub0 if sub_clock is not None else 0.0
    s1 = eng.stats()
    device_idle = device_idle_share(device, s1, wall)
    gen = s1.generation_tokens_total - s0.generation_tokens_total
    wait = s1.wait_time_s - s0.wait_time_s
    n = args.steps
    host = per_step.pop("host")
    row = dict(batch=batch, steps=n, host_us=_median(host) * 1e6, host_mean_us=sum(host) / n * 1e6,
               cpu_us=cpu / n * 1e6, submit_thread_cpu_us=sub_cpu / n * 1e6, wall_us=wall / n * 1e6,
               device_idle_pct=device_idle * 100, wait_us=wait / n * 1e6, tokens_per_step=gen / n,
               **{f"{k}_us": _median(v) * 1e6 for k, v in per_step.items()})
    row["other_us"] = row["host_us"] - sum(row[f"{k}_us"] for k in names)
    if sections is not None:  # means: a section may run on some steps only (hashing, mixed packing)
        row["sections_us"] = {k: v / n * 1e6 for k, v in sections.totals.items()}
    row["gen2_collections"] = _gen2_collections() - gc_before
    # Finish the batch (not timed): the next batch starts from an empty engine.
    for rid in list(eng.scheduler.requests):
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(args.profile_sort).print_stats(args.profile_top)
        row["profile"] = s.getvalue()
    return row


def device_idle_share(device, stats, wall: float) -> float:
    """The emulated device's idle share (CPU), or the GPU's idle gaps over `wall` from CUDA
    events (EngineStats.gpu_idle_gap_us since the stats taken when the window opened)."""
    if device is not None:
        return device.idle_s / wall
    if stats.gpu_idle_gap_us:
        return sum(stats.gpu_idle_gap_us) / 1e6 / wall
    return float("nan")


def _submission_thread_clock(eng):
    """The CPU-time clock of the engine's submission thread (None: inline submission)."""
    thread = getattr(getattr(eng, "submission", None), "_thread", None)
    if thread is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    return time.pthread_getcpuclockid(thread.ident)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def _gen2_collections() -> int:
    stats = gc.get_stats()
    return stats[2]["collections"] if len(stats) > 2 else 0


def run_here(args, submission: str = "inline", lookahead: int = 1) -> dict:
    import backend_lib
    eng = build_engine(args, submission, lookahead)
    timer = _PhaseTimer()
    timer.wrap(eng.scheduler, "schedule", "schedule")
    if hasattr(eng, "submission"):
        timer.wrap(eng.submission, "submit", "submit")
    else:  # an older backend_lib (--compare): the engine thread calls execute itself
        timer.wrap(eng.runner, "execute", "submit")
    timer.wrap(eng.scheduler, "update", "update")
    eng._host_loop_timer = timer
    eng._host_loop_sections = _wrap_sections(eng) if getattr(args, "sections", False) else None
    try:
        rows = [measure_batch(eng, b, args, profile=(b == args.profile)) for b in args.batches]
    finally:
        close = getattr(eng, "close", None)
        if close is not None:
            close()
    return dict(backend=str(Path(backend_lib.__file__).resolve().parent), device=args.device, submission=submission,
                lookahead=lookahead, device_us=args.device_us,
                model=args.preset or args.model or "tiny-llama (no-math decode program)", rows=rows)


def slope(rows: list[dict]) -> float:
    if len(rows) < 2 or rows[-1]["batch"] == rows[0]["batch"]:
        return float("nan")
    return (rows[-1]["host_us"] - rows[0]["host_us"]) / (rows[-1]["batch"] - rows[0]["batch"])


def table(result: dict, label: str) -> str:
    cols = ("schedule", "submit", "update", "other")
    lines = [f"{label}: {result['model']} on {result['device']} (backend_lib at {result['backend']})",
             "| batch | host µs/step p50 | mean | thread CPU µs/step | " + " | ".join(f"{c} µs" for c in cols) + " | wait µs | tok/step | gen2 GCs |",
             "|---|---|---|---|" + "---|" * len(cols) + "---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | {r['host_us']:.1f} | {r['host_mean_us']:.1f} | {r['cpu_us']:.1f} | " + " | ".join(f"{r.get(c + '_us', 0.0):.1f}" for c in cols)
                     + f" | {r['wait_us']:.1f} | {r['tokens_per_step']:.0f} | {r['gen2_collections']} |")
    lines.append(f"µs/row (batch {result['rows'][0]['batch']} -> {result['rows'][-1]['batch']}): {slope(result['rows']):.2f}")
    return "\n".join(lines)


def sections_table(result: dict, label: str) -> str:
    """--sections: the mean µs per step of each timed section, per batch."""
    names = list(result["rows"][0]["sections_us"])
    lines = [f"{label}, sections (mean µs per step, inside the phases above)",
             "| batch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in result["rows"]:
        lines.append(f"| {r['batch']} | " + " | ".join(f"{r['sections_us'][k]:.1f}" for k in names) + " |")
    return "\n".join(lines)


def submission_table(results: dict[str, dict]) -> str:
    """Per batch, one row per (step_submission, step_lookahead): the loop's rate, who spends
    the CPU, and (--device-us) the emulated device's idle share."""
    first = next(iter(results.values()))
    dev = f", emulated device {first['device_us']:g} µs/step" if first.get("device_us") else ""
    lines = [f"step_submission x step_lookahead{dev}",
             "| batch | submission | lookahead | wall µs/step | device idle % | host µs/step p50 "
             "| engine thread CPU µs/step | submission thread CPU µs/step | submit µs | wait µs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, b in enumerate(first["rows"]):
        for res in results.values():
            r = res["rows"][i]
            lines.append(f"| {b['batch']} | {res['submission']} | {res['lookahead']} | {r['wall_us']:.1f} "
                         f"| {r['device_idle_pct']:.1f} | {r['host_us']:.1f} | {r['cpu_us']:.1f} "
                         f"| {r['submit_thread_cpu_us']:.1f} | {r['submit_us']:.1f} | {r['wait_us']:.1f} |")
    return "\n".join(lines)


def compare_table(before: dict, after: dict) -> str:
    lines = ["| batch | before host µs/step | after host µs/step | after / before |", "|---|---|---|---|"]
    for b, a in zip(before["rows"], after["rows"]):
        lines.append(f"| {b['batch']} | {b['host_us']:.1f} | {a['host_us']:.1f} | {a['host_us'] / b['host_us']:.2f} |")
    lines.append(f"| µs/row | {slope(before['rows']):.2f} | {slope(after['rows']):.2f} | "
                 f"{slope(after['rows']) / slope(before['rows']):.2f} |")
    return "\n".join(lines)


def repeat_table(pairs: list[tuple[dict, dict]]) -> str:
    """--repeat: per batch, host µs/step p50 of every pair (order alternating), and the medians."""
    lines = [f"{len(pairs)} pairs, alternating order", "| batch | after / before, each pair | median ratio | "
             "median before µs | median after µs |", "|---|---|---|---|---|"]
    for i, row in enumerate(pairs[0][0]["rows"]):
        b = [p[0]["rows"][i]["host_us"] for p in pairs]
        a = [p[1]["rows"][i]["host_us"] for p in pairs]
        ratios = [x / y for x, y in zip(a, b)]
        lines.append(f"| {row['batch']} | {' '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f} | "
                     f"{statistics.median(b):.1f} | {statistics.median(a):.1f} |")
    return "\n".join(lines)


def run_child(args, backend_dir: str | None, submission: str | None = None, lookahead: int | None = None) -> dict:
    """This benchmark in a fresh process; backend_dir: import backend_lib from there."""
    env = dict(os.environ)
    env.pop(_BACKEND_ENV, None)
    if backend_dir:
        env[_BACKEND_ENV] = str(Path(backend_dir).resolve())
    argv = _forward_args(args)
    if submission is not None:
        argv += ["--submission", submission, "--lookahead", str(lookahead)]
    return run_json_child("bench.host_loop", argv, env)


def _forward_args(args) -> list[str]:
    a = ["--device", args.device, "--batches", ",".join(map(str, args.batches)), "--steps", str(args.steps),
         "--warmup", str(args.warmup), "--prompt-len", str(args.prompt_len), "--max-model-len", str(args.max_model_len),
         "--async-handoff", args.async_handoff]
    for name in ("preset", "model", "dtype"):
        if getattr(args, name):
            a += [f"--{name}", getattr(args, name)]
    if args.profile:
        a += ["--profile", str(args.profile), "--profile-top", str(args.profile_top),
              "--profile-sort", args.profile_sort]
    if args.switch_interval_ms is not None:
        a += ["--switch-interval-ms", str(args.switch_interval_ms)]
    if args.device_us:
        a += ["--device-us", str(args.device_us)]
    if args.churn:
        a += ["--churn", str(args.churn)]
    if args.sections:
        a += ["--sections"]
    for name, raw in args.set:
        a += ["--set", f"{name}={raw}"]
    return a


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Which engine build_engine makes: the device and the model."""
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--preset", default=None, help="random weights of this shape (bench/decode.py presets)")
    p.add_argument("--model", default=None, help="a local HF checkpoint (default: models/tiny-llama)")
    p.add_argument("--dtype", default=None)


def run_json_child(module: str, argv: list[str], env: dict | None = None) -> dict:
    """`python -m module --child-out FILE argv...` in a fresh process (a CUDA engine sizes its KV
    cache from the memory it finds free: a second engine in one process would find the first
    one's); what it wrote to FILE as JSON."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        subprocess.run([sys.executable, "-m", module, "--child-out", out] + argv, check=True, cwd=str(REPO_ROOT),
                       env=env)
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def _engine_field(text: str) -> tuple[str, str]:
    """--set FIELD=VALUE, checked: an EngineConfig field and a value of its type."""
    from backend_lib.config import parameter_value
    name, sep, value = (part.strip() for part in text.partition("="))
    try:
        if not sep:
            raise ValueError
        parameter_value(name, value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: must be FIELD=VALUE with an EngineConfig field"
                                         + (f" ({e})" if str(e) else "")) from None
    return name, value


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--batches", default="1,64,256", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--async-handoff", default="on", choices=("on", "off", "auto"),
                   help="async_token_handoff (on CPU, 'on' runs the overlapped loop with CPU stand-ins)")
    p.add_argument("--churn", type=int, default=0,
                   help="requests replaced before each timed step (aborted and admitted anew)")
    p.add_argument("--profile", type=int, default=0, help="cProfile the measured steps of this batch")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--profile-sort", default="tottime", choices=("tottime", "cumulative"),
                   help="the profile's order: time in the function itself, or with its callees")
    p.add_argument("--compare", default=None, metavar="DIR", help="also run with DIR/backend_lib (before)")
    p.add_argument("--repeat", type=int, default=1,
                   help="with --compare: this many before/after pairs (alternating order), and their medians")
    p.add_argument("--lookahead", default=[1], type=lambda s: [int(x) for x in s.split(",")],
                   help="step_lookahead values to measure, e.g. 1,2")
    p.add_argument("--device-us", type=float, default=0.0,
                   help="CPU: an emulated device taking this many µs a step (0: none, the step completes at once)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval for the run (how long a thread waiting for the GIL waits "
                        "before it asks for it; Python's default is 5 ms)")
    p.add_argument("--submission", default=["inline"], type=lambda s: [x.strip() for x in s.split(",")],
                   help="step_submission modes to measure, e.g. inline,thread (a fresh engine each)")
    p.add_argument("--set", action="append", type=_engine_field, default=[],
                   help="FIELD=VALUE: an EngineConfig field as config.pbtxt spells it (repeatable), "
                        "e.g. max_num_batched_tokens=8192 as the served `large` engine has")
    p.add_argument("--sections", action="store_true",
                   help="also time parts of the phases (block hashing, table updates, mixed packing, "
                        "graph replays): one more table")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat < 1 or (args.repeat > 1 and not args.compare):
        p.error("--repeat is a number of before/after pairs (>= 1), with --compare")
    if args.compare and (args.submission != ["inline"] or args.lookahead != [1]):
        p.error("--compare measures inline submission, lookahead 1 only")
    if args.device_us and args.device != "cpu":
        p.error("--device-us emulates a device on CPU")
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    if args.child_out:
        res = run_here(args, args.submission[0], args.lookahead[0])
        with open(args.child_out, "w") as f:
            json.dump(res, f)
        return
    if args.compare:
        pairs = []
        for i in range(args.repeat):
            # alternate which side runs first: on a shared box the second run of a pair is
            # often slower, which one order alone would count as a difference
            if i % 2 == 0:
                before = run_child(args, args.compare)
                after = run_child(args, None)
            else:
                after = run_child(args, None)
                before = run_child(args, args.compare)
            pairs.append((before, after))
        before, after = pairs[0]
        results = dict(before=before, after=after)
        text = "\n\n".join([table(before, "before"), table(after, "after"), compare_table(before, after)]
                            + ([repeat_table(pairs)] if len(pairs) > 1 else []))
    elif len(args.submission) * len(args.lookahead) > 1:
        by_mode = {f"step_submission={m}, step_lookahead={d}": run_child(args, None, m, d)
                   for m in args.submission for d in args.lookahead}
        results = by_mode
        text = "\n\n".join([table(r, f"host loop, {k}") for k, r in by_mode.items()] + [submission_table(by_mode)])
    else:
        after = run_here(args, args.submission[0], args.lookahead[0])
        results = dict(after=after)
        text = table(after, f"host loop, step_submission={args.submission[0]}, step_lookahead={args.lookahead[0]}")
    for key in results:
        for r in results[key].get("rows", []):
            prof = r.pop("profile", None)
            if prof:
                print(f"---- cProfile ({key}, batch {r['batch']}, {r['steps']} steps) ----\n{prof}")
    if args.sections:
        text += "".join(f"\n\n{sections_table(res, key)}" for key, res in results.items()
                        if isinstance(res, dict) and res.get("rows"))
    print(text)
    if args.compare and args.repeat > 1:
        results["pairs"] = [dict(before=b, after=a) for b, a in pairs]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
