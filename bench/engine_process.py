"""The engine loop in process (AsyncEngine) vs in its own process (EngineProcessClient), with a
sender that holds the GIL as Triton's Python stub does, without Triton.

    python -m bench.engine_process [--device cpu|cuda] [--model DIR | --preset qwen2.5-0.5b]
                                   [--concurrency 16,64] [--sender-us 300] [--output-len 64]

A closed loop of C streams (greedy, ignore_eos): each callback holds the GIL for --sender-us
(pure-Python work standing in for building pb_utils responses and response_sender.send, ~0.3 ms
each in the stub) and a finished request is replaced at once. Per engine and C: output tok/s,
TPOT p50 (callback clock), engine steps/s, and this process's CPU time per engine step (all its
threads: with the engine process that is the reader and the callbacks only; the core's own CPU
is reported beside it). Prints a markdown table; nothing is asserted.

--null-math-us N (CPU): both engines run the real scheduler and runner without the model's math
behind an emulated device of N µs a step (bench/null_math_engine.py): the host side of serving
at a GPU's pace. --stagger-ms: the streams start spread over that time, so that their requests
keep arriving one at a time (Triton's pattern) rather than in step.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _busy(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:  # holds the GIL, as the stub's Python does
        pass


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick


def run(engine_cls, cfg, conc: int, total: int, prompt_len: int, output_len: int, sender_us: float,
        delivery_threads: int = 1, stagger_ms: float = 0.0) -> dict:
    from backend_lib import SamplingParams
    eng = engine_cls(cfg, merge_queued_outputs=True, delivery_threads=delivery_threads)
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    lock = threading.Lock()
    done = threading.Event()
    state = {"sent": 0, "finished": 0, "tokens": 0}
    first, last, ntok, added = {}, {}, {}, {}

    def submit() -> None:
        with lock:
            i = state["sent"]
            if i >= total:
                return
            state["sent"] += 1
        prompt = [4 + (i * 7 + k) % 500 for k in range(prompt_len)]
        prompt[0], prompt[1] = 4 + i % 500, 4 + (i // 500) % 500  # distinct: no prefix-cache hits
        added[f"r{i}"] = time.perf_counter()
        eng.add_request(f"r{i}", prompt, sp, callback=cb)

    def cb(out) -> None:
        _busy(sender_us)
        now = time.perf_counter()
        rid = out.request_id
        if out.new_token_ids:
            first.setdefault(rid, now)
            last[rid] = now
            ntok[rid] = ntok.get(rid, 0) + len(out.new_token_ids)
        if out.finished:
            with lock:
                state["finished"] += 1
                state["tokens"] += ntok.get(rid, 0)
                fin = state["finished"]
            if fin >= total:
                done.set()
            else:
                submit()

    try:
        for _ in range(2):  # warm-up
            list(eng.add_request(f"w{_}", [5, 6, 7], sp))
        s0 = eng.stats()
        steps0 = s0.sync_steps_total + s0.async_steps_total
        cpu0, core0 = time.process_time(), (_cpu_of(eng.pid) if hasattr(eng, "pid") else 0.0)
        t0 = time.perf_counter()
        # The streams start at once, or spread over stagger_ms (then their requests keep
        # arriving one at a time, as through Triton, instead of in step).
        starts = sorted(random.Random(0).uniform(0, stagger_ms / 1e3) for _ in range(conc))
        for at in starts:
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            submit()
        done.wait(600)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        core = (_cpu_of(eng.pid) - core0) if hasattr(eng, "pid") else None
        s1 = eng.stats()
        steps = s1.sync_steps_total + s1.async_steps_total - steps0
        in_step = s1.step_time_s - s0.step_time_s
        waiting = s1.wait_time_s - s0.wait_time_s
    finally:
        eng.shutdown()
    tpots = [(last[r] - first[r]) / (ntok[r] - 1) for r in ntok if ntok[r] > 1]
    ttfts = [first[r] - added[r] for r in first if r in added]
    return {"tok_s": state["tokens"] / wall, "tpot_ms": 1e3 * statistics.median(tpots),
            "ttft_ms": 1e3 * statistics.median(ttfts),
            "steps_s": steps / wall, "cpu_ms_step": 1e3 * cpu / max(steps, 1),
            "in_step_ms": 1e3 * in_step / max(steps, 1), "wait_ms": 1e3 * waiting / max(steps, 1),
            "core_cpu_ms_step": None if core is None else 1e3 * core / max(steps, 1)}


def _use_null_math(a) -> None:
    """--null-math-us: the engine process builds NullMathEngine (it inherits this environment),
    and AsyncEngine's module-level LLMEngine becomes it too."""
    if a.device != "cpu" or a.preset:
        raise SystemExit("--null-math-us emulates the device on CPU (no --preset, --device cpu)")
    from backend_lib import async_engine
    from backend_lib.envs import ENGINE_CLASS_ENV
    from bench.null_math_engine import DEVICE_US_ENV, NullMathEngine
    os.environ[ENGINE_CLASS_ENV] = "bench.null_math_engine:NullMathEngine"
    os.environ[DEVICE_US_ENV] = f"{a.null_math_us:g}"
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env_path if env_path else "")
    async_engine.LLMEngine = NullMathEngine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_process", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO_ROOT / "models" / "tiny-llama"))
    ap.add_argument("--preset", help="qwen2.5-0.5b | llama-3-8b (dummy weights, bench/serve.py's presets)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--sender-us", type=float, default=300.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the step's token budget")
    ap.add_argument("--delivery-threads", default="1", help="comma list: threads running the callbacks")
    ap.add_argument("--engines", default="inproc,process", help="comma list of inproc, process")
    ap.add_argument("--stream-interval", type=int, default=1, help="EngineConfig.stream_interval")
    ap.add_argument("--stagger-ms", type=float, default=0.0,
                    help="the streams start spread over this many ms (0: all at once)")
    ap.add_argument("--null-math-us", type=float, default=0.0,
                    help="CPU: the real engine without model math behind an emulated device taking this many "
                         "µs a step (bench/null_math_engine.py), in process and in the engine process")
    ap.add_argument("--core-profile", default="", metavar="FILE",
                    help="cProfile the engine core's loop thread (pstats into FILE; the last process engine "
                         "run wins) and print its top functions at the end")
    a = ap.parse_args(argv)
    if a.core_profile:
        from backend_lib.envs import CORE_PROFILE_ENV
        os.environ[CORE_PROFILE_ENV] = a.core_profile
    if a.null_math_us:
        _use_null_math(a)
    from backend_lib import AsyncEngine, EngineConfig, EngineProcessClient
    model, load_format = a.model, "safetensors"
    if a.preset:
        from bench.decode import write_preset_config
        model, load_format = write_preset_config(a.preset, "/tmp/bench-models"), "dummy"
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    concs = [int(c) for c in a.concurrency.split(",")]
    max_len = (a.prompt_len + a.output_len + 16 + 15) // 16 * 16
    extra = dict(async_token_handoff="on") if a.null_math_us else {}
    cfg = EngineConfig(model_path=model, device=a.device, dtype=dtype, load_format=load_format,
                       max_num_seqs=max(concs), max_model_len=max_len, max_num_batched_tokens=a.max_num_batched_tokens,
                       num_kv_blocks=max(concs) * (max_len // 16) + 16, stream_interval=a.stream_interval, **extra)
    emulated = f" without its math, emulated device {a.null_math_us:g} µs/step" if a.null_math_us else ""
    print(f"model {model}{emulated} on {a.device}; sender holds the GIL {a.sender_us:g} us per callback; "
          f"prompt {a.prompt_len}, output {a.output_len}, {a.requests_per_stream} requests per stream, "
          f"stream_interval {a.stream_interval}")
    print("| engine | C | delivery threads | output tok/s | TTFT p50 ms | TPOT p50 ms | steps/s | "
          "engine thread in step() ms/step | of which waiting on the GPU | this process CPU ms/step | "
          "core CPU ms/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    engines = {"inproc": ("in-process AsyncEngine", AsyncEngine), "process": ("engine process", EngineProcessClient)}
    for c in concs:
        for dt in [int(x) for x in a.delivery_threads.split(",")]:
            for name, cls in (engines[e] for e in a.engines.split(",")):
                r = run(cls, cfg, c, c * a.requests_per_stream, a.prompt_len, a.output_len, a.sender_us, dt,
                        a.stagger_ms)
                core = "-" if r["core_cpu_ms_step"] is None else f"{r['core_cpu_ms_step']:.2f}"
                print(f"| {name} | {c} | {dt} | {r['tok_s']:.0f} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} | "
                      f"{r['steps_s']:.0f} | {r['in_step_ms']:.2f} | {r['wait_ms']:.2f} | {r['cpu_ms_step']:.2f} | "
                      f"{core} |", flush=True)
    if a.core_profile and os.path.exists(a.core_profile):
        import pstats
        print(f"\nengine core loop thread, cProfile ({a.core_profile}):")
        pstats.Stats(a.core_profile).sort_stats("tottime").print_stats(35)
    return 0


if __name__ == "__main__":
    sys.exit(main())
