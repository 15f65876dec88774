"""What a step that carries a prefill chunk costs, beside its GPU work and beside a decode-only
step of the same batch (issue 13 item 1: "a step with a 256-token chunk among 63 decodes costs
about what its GPU work costs"); one table.

    python -m bench.mixed_steps --device cuda --preset qwen2.5-0.5b --out $OUT/mixed_steps.json
    python -m bench.mixed_steps                      # CPU, tiny-llama: host times only (smoke)

For each (decodes D, chunk C): D requests decode steadily (greedy, ignore_eos, sync engine so a
step is measured alone); then, --reps times, one new request with a C-token prompt arrives and
the next step carries its whole prompt as one chunk among the D decodes. Per step:
  host ms  = time until `ModelRunner.execute` returns (everything the host does to launch it),
  wall ms  = host + waiting for its tokens (what the step costs the loop, sync),
  GPU ms   = the step's own device time: a `torch.cuda._sleep` is queued ahead of the step so the
             host has launched all of it before the device reaches it; CUDA events around the
             step's work then time the GPU alone (CUDA only).
The decode-only rows are the same measure on the steps between arrivals.

--mixed-graphs off|on|both: steps with a prefill chunk eager (off, the default), replayed as
CUDA graphs (on: EngineConfig.cuda_graph_mixed; on CPU through the graphs' eager stand-ins,
a smoke test of the control path only), or both, one engine after the other, one table each.

--profile D,C: after the table, torch.profiler over --reps arrivals of that point (host ops by
self CPU time, and the CUDA runtime calls: a synchronizing call shows as cudaStreamSynchronize /
cudaEventSynchronize / cudaHostAlloc / a blocking cudaMemcpyAsync). --sync-debug: the same
point under torch.cuda.set_sync_debug_mode("warn"), which prints each synchronizing call's stack.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path



def build_engine(args, mixed_graphs: bool = False):
    import torch
    from backend_lib import EngineConfig, LLMEngine
    if args.device == "cpu":
        torch.set_num_threads(1)
    kw = dict(device=args.device, dtype="float32" if args.device == "cpu" else "bfloat16",
              max_num_seqs=max(args.decodes) + 2, max_model_len=2048,
              max_num_batched_tokens=max(8192, max(args.chunks) + max(args.decodes)),
              async_token_handoff="off", enable_prefix_caching=False, cuda_graph_mixed=mixed_graphs)
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = 0.5
    from bench.decode import model_kwargs
    kw.update(model_kwargs(args.preset, args.model))
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(**kw))
    if mixed_graphs and args.device == "cpu":
        eng.runner.use_stand_in_graphs()
    mg = eng.runner.mixed_graphs
    if mg is not None:
        print(f"engine ready in {time.perf_counter() - t0:.1f} s; {len(mg.graphs)} mixed-step graphs captured "
              f"in {mg.capture_s:.1f} s, (tokens, rows) buckets {mg.buckets}", flush=True)
    return eng


class StepTimer:
    """Wraps runner.execute: host time to return, and (CUDA) the step's device time."""

    def __init__(self, eng, cuda: bool):
        import torch
        self.torch, self.cuda, self.records = torch, cuda, []
        self._execute = eng.runner.execute
        eng.runner.execute = self.execute

    def execute(self, sched, eos):
        torch = self.torch
        e0 = e1 = None
        if self.cuda:
            torch.cuda._sleep(40_000_000)  # ~20 ms of device time: the host launches the step behind it
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        handle = self._execute(sched, eos)
        host = time.perf_counter() - t0
        if self.cuda:
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
        self.records.append(dict(decode_only=sched.is_decode_only, rows=len(sched.rows),
                                 tokens=sched.num_tokens, host=host, e0=e0, e1=e1))
        return handle

    def resolve(self) -> list[dict]:
        out = []
        for r in self.records:
            if r["e0"] is not None:
                r["e1"].synchronize()
                r["gpu"] = r["e0"].elapsed_time(r["e1"]) / 1e3
            r.pop("e0"), r.pop("e1")
            out.append(r)
        self.records = []
        return out


def measure(eng, timer: StepTimer, decodes: int, chunk: int, args, vocab: int) -> dict:
    from backend_lib import SamplingParams
    reps = args.reps
    for i in range(decodes):
        prompt = [(i * 131 + j * 7) % (vocab - 20) + 10 for j in range(32)]
        eng.add_request(f"d{decodes}-{chunk}-{i}", prompt,
                        SamplingParams(max_tokens=10 * reps + 50, temperature=0.0, ignore_eos=True))
    while any(not r.output_token_ids for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    timer.resolve()
    mg = eng.runner.mixed_graphs
    graphed_before = mg.steps_graphed if mg is not None else 0
    walls: list[tuple[bool, float]] = []
    for k in range(reps):
        prompt = [(k * 977 + j * 13) % (vocab - 20) + 10 for j in range(chunk)]
        eng.add_request(f"c{decodes}-{chunk}-{k}", prompt,
                        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        for _ in range(3):  # the mixed step, then two decode-only steps
            t0 = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t0)
    recs = timer.resolve()
    for r, w in zip(recs, walls):
        r["wall"] = w - (0.02 if timer.cuda else 0.0)  # the queued sleep is not the step's
    mixed = [r for r in recs if not r["decode_only"] and r["tokens"] >= chunk]
    dec = [r for r in recs if r["decode_only"] and r["rows"] == decodes]

    def med(rs, key):
        vals = [r[key] for r in rs if key in r]
        return statistics.median(vals) * 1e3 if vals else None

    for rid in list(eng.scheduler.requests):
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    timer.resolve()
    return dict(decodes=decodes, chunk=chunk, mixed_graphs=mg is not None,
                mixed_steps_graphed=(mg.steps_graphed - graphed_before) if mg is not None else 0,
                mixed_steps=len(mixed), decode_steps=len(dec),
                mixed_host_ms=med(mixed, "host"), mixed_wall_ms=med(mixed, "wall"), mixed_gpu_ms=med(mixed, "gpu"),
                decode_host_ms=med(dec, "host"), decode_wall_ms=med(dec, "wall"), decode_gpu_ms=med(dec, "gpu"))


def table(rows: list[dict], header: str) -> str:
    def f(v):
        return "n/a" if v is None else f"{v:.3f}"
    lines = [header, "",
             "| decodes | chunk | mixed host ms | mixed wall ms | mixed GPU ms | wall / GPU | decode-only host ms | "
             "decode-only wall ms | decode-only GPU ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = (r["mixed_wall_ms"] / r["mixed_gpu_ms"]) if r["mixed_gpu_ms"] else None
        lines.append(f"| {r['decodes']} | {r['chunk']} | {f(r['mixed_host_ms'])} | {f(r['mixed_wall_ms'])} | "
                     f"{f(r['mixed_gpu_ms'])} | {f(ratio)} | {f(r['decode_host_ms'])} | {f(r['decode_wall_ms'])} | "
                     f"{f(r['decode_gpu_ms'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--preset", default=None, help="random weights of this shape (bench/decode.py presets)")
    p.add_argument("--model", default=None, help="a local HF checkpoint (default: models/tiny-llama)")
    p.add_argument("--decodes", default=None, type=lambda s: [int(x) for x in s.split(",")],
                   help="default 1,63,255 on CUDA, 1,15 on CPU")
    p.add_argument("--chunks", default=None, type=lambda s: [int(x) for x in s.split(",")],
                   help="default 16,256,1024 on CUDA, 16,64 on CPU")
    p.add_argument("--reps", type=int, default=None, help="arrivals per point (default 12 CUDA, 3 CPU)")
    p.add_argument("--mixed-graphs", default="off", choices=("off", "on", "both"),
                   help="steps with a prefill chunk: eager, CUDA graphs (cuda_graph_mixed), or both in turn")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--profile", default=None, help="D,C: profile that point's mixed steps (CUDA)")
    p.add_argument("--sync-debug", action="store_true", help="with --profile: also warn on every sync")
    p.add_argument("--profile-out", default=None, help="the profiler's chrome trace here")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.decodes = args.decodes or ([1, 63, 255] if cuda else [1, 15])
    args.chunks = args.chunks or ([16, 256, 1024] if cuda else [16, 64])
    args.reps = args.reps or (12 if cuda else 3)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.mixed_graphs]
    name = args.preset or Path(args.model or "tiny-llama").name
    all_rows, tables = [], []
    for graphs in modes:
        eng = build_engine(args, graphs)
        timer = StepTimer(eng, cuda)
        vocab = eng.vocab_size
        rows = []
        for d in args.decodes:
            for c in args.chunks:
                rows.append(measure(eng, timer, d, c, args, vocab))
                print(json.dumps(rows[-1]), flush=True)
        tables.append(table(rows, f"{name}, {args.device}, sync engine, {args.reps} arrivals a point; cuda graphs "
                                  f"for decode-only steps; mixed steps {'as CUDA graphs' if graphs else 'eager'}"))
        print(tables[-1], flush=True)
        all_rows += rows
        if args.profile:
            profile_point(eng, timer, args, vocab)
        eng.close()
        del eng, timer
        # The engine gc.freeze()s its start-up heap; close() breaks the runner's own cycles,
        # and unfrozen, a collection also frees any other cycle there before the next engine
        # sizes its KV cache from what is free.
        import gc
        gc.unfreeze()
        gc.collect()
        if cuda:
            import torch
            torch.cuda.empty_cache()
    if len(tables) > 1:
        print("\n\n".join(tables))
    if args.out:
        Path(args.out).write_text(json.dumps(all_rows, indent=1))


def profile_point(eng, timer: StepTimer, args, vocab: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    d, c = (int(x) for x in args.profile.split(","))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    if args.sync_debug and args.device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    with profile(activities=acts) as prof:
        measure(eng, timer, d, c, args, vocab)
    if args.sync_debug and args.device == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    print(f"\nprofile of decodes {d} + chunk {c} ({args.reps} arrivals; whole loop, warm-up included)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    if args.profile_out:
        prof.export_chrome_trace(args.profile_out)


if __name__ == "__main__":
    main()
