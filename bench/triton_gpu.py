"""Helpers of bench/triton_gpu.sh: TPOT through Triton (perf_analyzer, streaming) vs in-process.

    python -m bench.triton_gpu write-model DIR            # Qwen2.5-0.5B-shaped config (dummy weights)
    python -m bench.triton_gpu make-repo DIR MODEL_DIR [--set KEY=VALUE ...]
                                                          # DIR/llm: model_repository/llm with the
                                                          # engine parameters of this benchmark
    python -m bench.triton_gpu input-data FILE            # perf_analyzer --input-data JSON
    python -m bench.triton_gpu inproc MODEL_DIR --concurrency 1,64 --out FILE.json
    python -m bench.triton_gpu parse PROFILE.json --label NAME --out FILE.json
    python -m bench.triton_gpu table FILE.json ...         # the summary table

One engine configuration for both paths (ENGINE_PARAMS below: written into the llm model's
config.pbtxt for Triton, EngineConfig.from_parameters for in-process), one request shape
(PROMPT_LEN prompt tokens, OUTPUT_LEN output tokens, greedy, ignore_eos), one driver shape:
closed loop at a fixed concurrency (a finished request is replaced at once, as perf_analyzer's
--concurrency-range does).

TPOT per request = (time of the last token - time of the first token) / (OUTPUT_LEN - 1), as
seen by the client: the perf_analyzer profile export's response timestamps through Triton, the
AsyncEngine output callback in-process (the thread Triton's sender runs on). Reported: the mean
over requests, p50/p90, TTFT mean, output tokens/s, responses per request.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PROMPT_LEN = int(os.environ.get("BENCH_PROMPT_LEN", "256"))
OUTPUT_LEN = int(os.environ.get("BENCH_OUTPUT_LEN", "128"))
N_PROMPTS = 16
PRESET = "qwen2.5-0.5b"


def engine_params(model_dir: str) -> dict[str, str]:
    """The engine config of this benchmark, as llm model parameters (strings)."""
    return {
        "model_path": str(Path(model_dir).resolve()),
        "load_format": "dummy",
        "device": os.environ.get("BENCH_DEVICE", "cuda"),
        "dtype": os.environ.get("BENCH_DTYPE", "bfloat16"),
        "async_token_handoff": "auto",
        "max_num_seqs": "64",
        "max_num_batched_tokens": "2048",
        "max_model_len": "1024",
        "num_kv_blocks": "4096",          # 64 x (256 + 128) / 16 = 1536 needed
        "block_size": "16",
        "enable_chunked_prefill": "true",
        "enable_cuda_graph": "true",
        "cuda_graph_max_batch": "64",
        "seed": "0",
    }


def prompts() -> list[list[int]]:
    # deterministic, distinct prompts; ids well inside any vocab used here
    return [[(i * 7919 + j * 104729) % 30000 + 10 for j in range(PROMPT_LEN)] for i in range(N_PROMPTS)]


# ---- setup --------------------------------------------------------------------------------------

def cmd_write_model(a):
    spec = __import__("importlib.util").util.spec_from_file_location("make_model", REPO_ROOT / "scripts" / "make_model.py")
    mm = __import__("importlib.util").util.module_from_spec(spec)
    sys.modules["make_model"] = mm
    spec.loader.exec_module(mm)
    from transformers import GenerationConfig
    arch = dict(mm.RANDOM_PRESETS[PRESET])
    arch.update(json.loads(os.environ.get("BENCH_SHAPE_OVERRIDES", "{}")))  # local smoke tests only
    cfg = mm.make_hf_config(arch, arch["vocab_size"])
    out = Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    mm._add_legacy_rope_keys(out / "config.json", arch["rope_theta"], arch.get("rope_scaling"))
    GenerationConfig(bos_token_id=mm.BOS_ID, eos_token_id=mm.EOS_ID, pad_token_id=mm.PAD_ID).save_pretrained(out)
    print(f"wrote {out}/config.json ({PRESET} shape, dummy weights)")


def cmd_make_repo(a):
    dst = Path(a.dir) / "llm"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(REPO_ROOT / "model_repository" / "llm", dst,
                    ignore=shutil.ignore_patterns("__pycache__"))
    params = engine_params(a.model_dir)
    for kv in a.set or []:
        k, v = kv.split("=", 1)
        params[k] = v
    cfg = (dst / "config.pbtxt").read_text()
    for k, v in params.items():
        line = f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}'
        pat = re.compile(r'^parameters \{ key: "' + re.escape(k) + r'" .*$', re.M)
        cfg, n = pat.subn(line.replace("\\", "\\\\"), cfg)
        if n == 0:
            cfg += line + "\n"
    (dst / "config.pbtxt").write_text(cfg)
    print("\n".join(l for l in cfg.splitlines() if l.startswith("parameters")))


def cmd_input_data(a):
    data = [{"input_ids": {"content": p, "shape": [len(p)]}, "max_tokens": [OUTPUT_LEN], "stream": [True],
             "exclude_input_in_output": [True], "ignore_eos": [True], "temperature": [0.0]}
            for p in prompts()]
    Path(a.file).write_text(json.dumps({"data": data}))


# ---- in-process ---------------------------------------------------------------------------------

def _summary(label, conc, recs, wall_s, responses):
    tpot = sorted(r["tpot_s"] * 1e3 for r in recs)
    q = lambda p: tpot[min(len(tpot) - 1, int(p * len(tpot)))]  # noqa: E731
    return {"label": label, "concurrency": conc, "requests": len(recs),
            "tpot_ms_mean": statistics.fmean(tpot), "tpot_ms_p50": q(0.5), "tpot_ms_p90": q(0.9),
            "ttft_ms_mean": statistics.fmean(r["ttft_s"] for r in recs) * 1e3,
            "tok_s": sum(r["ntok"] for r in recs) / wall_s if wall_s > 0 else 0.0,
            "responses_per_req": statistics.fmean(responses) if responses else 0.0}


def _closed_loop(eng, conc, total, SamplingParams):
    ps = prompts()
    lock, done = threading.Lock(), threading.Event()
    state, recs, nxt = {}, [], [0]

    def submit():
        i = nxt[0]
        nxt[0] += 1
        rid = f"r{conc}-{i}-{time.monotonic_ns()}"
        state[rid] = {"t0": time.perf_counter(), "times": [], "ntok": 0}
        eng.add_request(rid, ps[i % len(ps)], SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True),
                        callback=cb)

    def cb(out):
        now = time.perf_counter()
        with lock:
            s = state[out.request_id]
            if out.new_token_ids:
                s["times"].append(now)
                s["ntok"] += len(out.new_token_ids)
            if out.finished:
                if out.error or s["ntok"] != OUTPUT_LEN:
                    print(f"  request {out.request_id}: {s['ntok']} tokens, error={out.error}", file=sys.stderr)
                recs.append({"ttft_s": s["times"][0] - s["t0"], "ntok": s["ntok"], "n_resp": len(s["times"]),
                             "tpot_s": (s["times"][-1] - s["times"][0]) / max(1, s["ntok"] - 1)})
                if nxt[0] < total:
                    submit()
                elif len(recs) == total:
                    done.set()

    t = time.perf_counter()
    with lock:
        for _ in range(min(conc, total)):
            submit()
    if not done.wait(600):
        raise TimeoutError("in-process run did not finish")
    return recs, time.perf_counter() - t


def cmd_inproc(a):
    from backend_lib import AsyncEngine, EngineConfig, SamplingParams
    cfg = EngineConfig.from_parameters(engine_params(a.model_dir))
    t = time.perf_counter()
    eng = AsyncEngine(cfg)
    print(f"in-process engine ready in {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    try:
        for conc in [int(c) for c in a.concurrency.split(",")]:
            _closed_loop(eng, conc, max(conc, a.warmup), SamplingParams)  # warm-up, same shape
            n = max(a.requests, conc * a.rounds)
            recs, wall = _closed_loop(eng, conc, n, SamplingParams)
            row = _summary("in-process AsyncEngine", conc, recs, wall, [r["n_resp"] for r in recs])
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        eng.shutdown()
    Path(a.out).write_text(json.dumps(rows, indent=1))


# ---- perf_analyzer profile export -----------------------------------------------------------------

def cmd_parse(a):
    d = json.loads(Path(a.profile).read_text())
    rows = []
    for exp in d.get("experiments", []):
        conc = exp.get("experiment", {}).get("value")
        recs, responses, t_lo, t_hi = [], [], None, None
        for r in exp.get("requests", []):
            ts = r.get("response_timestamps") or []
            if not ts:
                continue
            t0 = r["timestamp"]
            recs.append({"ttft_s": (ts[0] - t0) / 1e9, "ntok": OUTPUT_LEN,
                         "tpot_s": (ts[-1] - ts[0]) / 1e9 / (OUTPUT_LEN - 1)})
            responses.append(len(ts))
            t_lo = t0 if t_lo is None else min(t_lo, t0)
            t_hi = ts[-1] if t_hi is None else max(t_hi, ts[-1])
        if not recs:
            print(f"no requests with responses at concurrency {conc}", file=sys.stderr)
            continue
        row = _summary(a.label, conc, recs, (t_hi - t_lo) / 1e9, responses)
        rows.append(row)
        print(json.dumps(row))
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(old + rows, indent=1))


def cmd_table(a):
    rows = []
    for f in a.files:
        if Path(f).exists():
            rows += json.loads(Path(f).read_text())
    base = {r["concurrency"]: r["tpot_ms_mean"] for r in rows if r["label"].startswith("in-process")}
    print(f"prompt {PROMPT_LEN}, output {OUTPUT_LEN}, greedy, ignore_eos; TPOT = (last - first token) / {OUTPUT_LEN - 1}")
    print("| path | concurrency | requests | TPOT ms mean | p50 | p90 | x in-process | TTFT ms mean | output tok/s | responses/request |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["concurrency"], not r["label"].startswith("in-process"), r["label"])):
        ratio = r["tpot_ms_mean"] / base[r["concurrency"]] if base.get(r["concurrency"]) else float("nan")
        print(f"| {r['label']} | {r['concurrency']} | {r['requests']} | {r['tpot_ms_mean']:.3f} | {r['tpot_ms_p50']:.3f} | "
              f"{r['tpot_ms_p90']:.3f} | {ratio:.2f} | {r['ttft_ms_mean']:.1f} | {r['tok_s']:.0f} | {r['responses_per_req']:.1f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.triton_gpu")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("write-model"); p.add_argument("dir"); p.set_defaults(f=cmd_write_model)
    p = sub.add_parser("make-repo"); p.add_argument("dir"); p.add_argument("model_dir")
    p.add_argument("--set", action="append"); p.set_defaults(f=cmd_make_repo)
    p = sub.add_parser("input-data"); p.add_argument("file"); p.set_defaults(f=cmd_input_data)
    p = sub.add_parser("inproc"); p.add_argument("model_dir"); p.add_argument("--concurrency", default="1,64")
    p.add_argument("--requests", type=int, default=16); p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4); p.add_argument("--out", required=True); p.set_defaults(f=cmd_inproc)
    p = sub.add_parser("parse"); p.add_argument("profile"); p.add_argument("--label", required=True)
    p.add_argument("--out", required=True); p.set_defaults(f=cmd_parse)
    p = sub.add_parser("table"); p.add_argument("files", nargs="+"); p.set_defaults(f=cmd_table)
    a = ap.parse_args(argv)
    a.f(a)


if __name__ == "__main__":
    main()
