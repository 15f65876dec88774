"""A closed loop whose requests arrive one at a time, as they reach the engine through Triton
(one execute() per request): what the admission pattern costs the engine's host loop, and
what `scheduler_delay_factor` buys back; one table, a fresh engine per factor.

    python -m bench.trickle                                    # CPU: emulated 1800 µs device steps
    python -m bench.trickle --delay-factors 0,1,2,4 --device-us 2200 --repeat 5   # medians of 5
    python -m bench.trickle --device cuda --preset qwen2.5-0.5b --out $OUT/trickle.json

What is measured: --concurrency streams, each sending a request (distinct prompt of
--prompt-len + 0..15 tokens, greedy, ignore_eos, --output-len tokens) and, when its final
output arrives, the next one (after a random pause of 0..--think-us, default none). The engine runs
`LLMEngine.step()` in a loop on this thread. After the first --warmup-rounds requests per
stream, the window closes once each stream has finished --rounds more. Streams start spread
over --stagger-ms (about one request's lifetime), so that arrivals stay out of step.

Columns: output tok/s over the window; TPOT p50/p99 (per request, (last token - first token)
/ (tokens - 1)); TTFT p50 (arrival to first token); mixed share (steps that carried prefill
chunks, EngineStats.prefill_steps_total, over all steps); prompts per admitting step; host
µs/step p50 (time in step() not waiting on the device, as bench/host_loop.py); device idle %
(CPU: the emulated device's; CUDA: the GPU's idle gaps, EngineStats.gpu_idle_gap_us).

* CPU (default): models/tiny-llama with bench/host_loop.py's no-math decode and mixed
  programs behind an emulated device (--device-us per step, serial in wall time): the real
  scheduler, runner packing, handoff and update at a GPU's pace, without a GPU.
* CUDA: the real model (--preset: random weights of that shape) and its CUDA graphs.
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import time
from pathlib import Path

from bench import host_loop


def _engine_args(a) -> argparse.Namespace:
    """What host_loop.build_engine reads, for this run's shape."""
    return argparse.Namespace(device=a.device, preset=a.preset, model=a.model, dtype=a.dtype,
                              batches=[a.concurrency], prompt_len=a.prompt_len,
                              max_model_len=a.max_model_len, async_handoff="on", device_us=a.device_us,
                              warmup=0, steps=a.output_len)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_here(a, factor: float) -> dict:
    from backend_lib import SamplingParams
    eng = host_loop.build_engine(_engine_args(a), extra={"scheduler_delay_factor": factor})
    rng = random.Random(a.seed)
    sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    clock = time.perf_counter
    serial = 0
    arrivals: list[tuple[float, int]] = []   # (when, stream): a heap
    live: dict[str, dict] = {}                # request id -> its stream, arrival, token times
    done_per_stream = [0] * a.concurrency
    finished: list[dict] = []

    def send(stream: int, now: float) -> None:
        nonlocal serial
        i = serial
        serial += 1
        prompt = [(i * 131 + j * 7) % 700 + 10 for j in range(a.prompt_len + i % 16)]
        prompt[0], prompt[1] = 10 + i % 600, 10 + (i // 600) % 600  # no prefix-cache sharing
        rid = f"t{i}"
        eng.add_request(rid, prompt, sp)
        live[rid] = dict(stream=stream, arrival=now, times=[], counted=done_per_stream[stream] >= a.warmup_rounds)

    now = clock()
    # Streams start spread over one request's lifetime: a closed loop whose arrivals are not
    # in step (Triton's), not one that starts and ends all its requests together.
    arrivals = [(now + rng.uniform(0, a.stagger_ms / 1e3), s) for s in range(a.concurrency)]
    heapq.heapify(arrivals)
    window_open = None
    target = a.warmup_rounds + a.rounds
    host: list[float] = []
    device = getattr(eng, "_emulated_device", None)
    s0 = steps0 = None
    while min(done_per_stream) < target:
        now = clock()
        while arrivals and arrivals[0][0] <= now:
            send(heapq.heappop(arrivals)[1], now)
        if window_open is None and min(done_per_stream) >= a.warmup_rounds:
            window_open, s0 = now, eng.stats()
            steps0 = len(host)
            if device is not None:
                device.start_window()
        st, wt = eng._step_s, eng._wait_s
        outs = eng.step()
        host.append((eng._step_s - st) - (eng._wait_s - wt))
        t = clock()
        for o in outs:
            r = live.get(o.request_id)
            if r is None:
                continue
            r["times"].extend([t] * len(o.new_token_ids))
            if o.finished:
                del live[o.request_id]
                done_per_stream[r["stream"]] += 1
                if r["counted"]:  # even one that ends before the window opens
                    finished.append(r)
                if done_per_stream[r["stream"]] < target:
                    heapq.heappush(arrivals, (t + rng.uniform(0, a.think_us) / 1e6, r["stream"]))
        if not outs and not eng.has_unfinished() and arrivals:
            time.sleep(max(0.0, arrivals[0][0] - clock()))
    wall = clock() - window_open
    s1 = eng.stats()
    for rid in list(eng.scheduler.requests):
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    close = getattr(eng, "close", None)
    if close is not None:
        close()
    steps = (s1.async_steps_total + s1.sync_steps_total) - (s0.async_steps_total + s0.sync_steps_total)
    mixed = s1.prefill_steps_total - s0.prefill_steps_total
    tokens = s1.generation_tokens_total - s0.generation_tokens_total
    prompts = s1.prompt_tokens_total - s0.prompt_tokens_total
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in finished if len(r["times"]) > 1]
    ttft = [r["times"][0] - r["arrival"] for r in finished if r["times"]]
    idle = host_loop.device_idle_share(device, s1, wall)
    mean_prompt = a.prompt_len + 7.5
    return dict(factor=factor, requests=len(finished), steps=steps, output_tok_s=tokens / wall,
                tpot_p50_ms=_percentile(tpot, 0.5) * 1e3, tpot_p99_ms=_percentile(tpot, 0.99) * 1e3,
                ttft_p50_ms=_percentile(ttft, 0.5) * 1e3, mixed_share=mixed / max(steps, 1),
                prompts_per_mixed_step=prompts / mean_prompt / max(mixed, 1),
                host_us_p50=statistics.median(host[steps0:]) * 1e6, device_idle_pct=idle * 100)


def table(rows: list[dict], a) -> str:
    dev = f"emulated device {a.device_us:g} µs/step" if a.device == "cpu" else (a.preset or a.model or "cuda")
    lines = [f"trickle: {a.concurrency} streams, prompt {a.prompt_len}+0..15, output {a.output_len}, pause 0..{a.think_us:g} µs, "
             f"{a.rounds} rounds per stream; {dev}",
             "| scheduler_delay_factor | output tok/s | x factor 0 | TPOT ms p50 | p99 | TTFT ms p50 | mixed share "
             "| prompts / mixed step | host µs/step p50 | device idle % | requests |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = rows[0]["output_tok_s"]
    for r in rows:
        lines.append(f"| {r['factor']:g} | {r['output_tok_s']:.0f} | {r['output_tok_s'] / base:.2f} | {r['tpot_p50_ms']:.3f} "
                     f"| {r['tpot_p99_ms']:.3f} | {r['ttft_p50_ms']:.1f} | {r['mixed_share']:.2f} "
                     f"| {r['prompts_per_mixed_step']:.1f} | {r['host_us_p50']:.0f} | {r['device_idle_pct']:.1f} | {r['requests']} |")
    return "\n".join(lines)


def _child(a, factor: float) -> dict:
    """One factor in a fresh process."""
    argv = ["--delay-factors", f"{factor:g}"]
    for k in ("device", "preset", "model", "dtype", "concurrency", "prompt_len", "output_len", "max_model_len",
              "think_us", "stagger_ms", "device_us", "rounds", "warmup_rounds", "seed"):
        v = getattr(a, k)
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return host_loop.run_json_child("bench.trickle", argv)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    host_loop.add_model_args(p)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--think-us", type=float, default=0.0,
                   help="a stream's pause before its next request: uniform in 0..this (0: at once, as "
                        "perf_analyzer's closed loop)")
    p.add_argument("--device-us", type=float, default=1800.0, help="CPU: the emulated device's µs per step")
    p.add_argument("--stagger-ms", type=float, default=None,
                   help="streams start uniformly within this many ms (default: output-len x 1.8 ms, "
                        "about one request's lifetime)")
    p.add_argument("--rounds", type=int, default=2, help="requests per stream in the measured window")
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="runs per factor (alternating order), medians")
    p.add_argument("--delay-factors", default=[0.0, 2.0, 4.0], type=lambda s: [float(x) for x in s.split(",")])
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device != "cpu":
        a.device_us = 0.0
    if a.stagger_ms is None:
        a.stagger_ms = a.output_len * 1.8
    if a.child_out:
        with open(a.child_out, "w") as f:
            json.dump(run_here(a, a.delay_factors[0]), f)
        return
    runs: dict[float, list[dict]] = {f: [] for f in a.delay_factors}
    for i in range(a.repeat):
        # alternate the order: on a shared box a later run is often slower
        for f in (a.delay_factors if i % 2 == 0 else reversed(a.delay_factors)):
            runs[f].append(_child(a, f))
    rows = [_median_row(rs) for rs in runs.values()]
    print(table(rows, a))
    if a.repeat > 1:
        print(f"\n{a.repeat} runs per factor (alternating order), medians above; output tok/s of each run:")
        for f, rs in runs.items():
            print(f"  factor {f:g}: " + " ".join(f"{r['output_tok_s']:.0f}" for r in rs))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(dict(args=vars(a), rows=rows, runs={str(k): v for k, v in runs.items()}), f, indent=1)


def _median_row(runs: list[dict]) -> dict:
    """Each column's median over the runs of one factor."""
    return {k: (statistics.median(r[k] for r in runs) if isinstance(v, float) else v) for k, v in runs[0].items()}


if __name__ == "__main__":
    main()
