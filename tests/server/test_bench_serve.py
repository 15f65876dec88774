"""`make bench-serve` as a smoke test: bench/serve.py on CPU with the tiny model and tiny sizes
runs every part (tritonserver + perf_analyzer, genai-perf where installed, the in-process
closed loop, steady decode, the mixed burst async vs sync) and its table has every row, each with the requests it was asked
for, every token of them, and zero errors. No speed is asserted."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import MODEL_DIR, ROOT

PA = ROOT / "build" / "bin" / "perf_analyzer"
GENAI_PERF = Path(os.environ.get("GENAI_VENV", ROOT / "build" / "genai-venv")) / "bin" / "genai-perf"
GENAI_POINT = ("greedy", 3)   # genai-perf starts slowly (~10 s a point): one point only
CONCURRENCY = (1, 3)
ROUNDS, MIN_REQUESTS, BURST = 2, 3, 12
PROMPT, OUTPUT = 12, 6
SAMPLINGS = ("greedy", "top_p")
STATS_INTERVAL_MS = 3000

pytestmark = [
    pytest.mark.skipif(not PA.exists(), reason=f"perf_analyzer not installed at {PA} (scripts/install_triton.sh)"),
    pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason=f"no model at {MODEL_DIR}: run `make model`"),
]


def _skip_without_triton() -> None:
    from triton_glue import launch
    try:
        launch.find_triton()
    except launch.TritonNotFound as e:
        pytest.skip(f"tritonserver not available: {e}")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    _skip_without_triton()
    out = tmp_path_factory.mktemp("bench-serve")
    cmd = [sys.executable, "-m", "bench.serve", "--smoke", "--model", str(MODEL_DIR), "--out-dir", str(out),
           "--concurrency", ",".join(map(str, CONCURRENCY)), "--rounds", str(ROUNDS),
           "--min-requests", str(MIN_REQUESTS), "--warmup", "2", "--distinct-requests", "8",
           "--prompt-len", str(PROMPT), "--output-len", str(OUTPUT), "--mixed-prompt", "4-24",
           "--mixed-output", "2-10", "--mixed-requests", str(BURST), "--perf-analyzer", str(PA),
           "--genai-perf", str(GENAI_PERF), "--genai-points", "%s:%d" % GENAI_POINT, "--core-profile",
           # the llm model's stats export, slower than a point: each point's counters must
           # still be read once they cover it
           "--set", f"stats_interval_ms={STATS_INTERVAL_MS}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads((out / "serve.json").read_text()), (out / "serve.md").read_text(), r.stdout, out


def test_every_row_with_all_its_requests_and_no_errors(report):
    data, _, _, _ = report
    rows = data["rows"]
    want = {("Triton", wl, s, c) for wl in ("fixed", "mixed") for s in SAMPLINGS for c in CONCURRENCY}
    want |= {("in-process AsyncEngine", wl, s, c) for wl in ("fixed", "mixed") for s in SAMPLINGS for c in CONCURRENCY}
    want |= {("steady decode (same engine)", "fixed", s, c) for s in SAMPLINGS for c in CONCURRENCY}
    want |= {(f"in-process, async handoff {m}", "burst", "greedy", BURST) for m in ("on", "off")}
    if GENAI_PERF.exists():  # CI installs it (.ci/run); otherwise its row is left out, logged
        want.add(("Triton genai-perf (ensemble)", "fixed") + GENAI_POINT)
    got = [(r["path"], r["workload"], r["sampling"], r["concurrency"]) for r in rows]
    assert sorted(got) == sorted(want)
    for r in rows:
        key = (r["path"], r["workload"], r["sampling"], r["concurrency"])
        assert r["errors"] == 0, (key, r)
        if r["path"].startswith("steady"):
            n = r["concurrency"]
        elif r["workload"] == "burst":
            n = BURST
        else:
            n = max(MIN_REQUESTS, r["concurrency"] * ROUNDS)
        assert r["requests"] == n, (key, r)
        if r["workload"] == "fixed" and "genai" not in r["path"]:  # ignore_eos: every request runs to max_tokens
            assert r["output_tokens"] == n * OUTPUT, (key, r)
        assert r["output_tokens"] >= n * 2, (key, r)
        assert r["tok_s"] > 0 and r["tpot_ms_p50"] > 0, (key, r)
        assert r["responses_per_req"] >= 1, (key, r)
        if not r["path"].startswith("steady"):
            assert r["ttft_ms_p50"] > 0 and r["tpot_ms_p99"] >= r["tpot_ms_p50"], (key, r)
        if r["path"] in ("Triton", "in-process AsyncEngine"):
            # Little's law over the point: never more streams open than asked for
            assert 0 < r["mean_in_flight"] <= r["concurrency"] * 1.001, (key, r)
            if r["path"] == "Triton":  # the llm model's counters read over the point were its own
                assert r["counters_cover_point"] is True, (key, r)
            # every request's prompt rides in some step: a share of the steps, not all of them
            # (outputs of OUTPUT tokens take decode steps of their own)
            assert 0 < r.get("prefill_step_share", 0) < 1 and r.get("host_us_per_step", 0) > 0, (key, r)
            # the host time by phase (from llm_step_phase_seconds_total through Triton): each
            # phase ran, and the phases are parts of the host time, not more
            phases = [r[f"{p}_us_per_step"] for p in ("schedule", "submit", "update")]
            assert min(phases) > 0 and sum(phases) <= r["host_us_per_step"] * 1.001, (key, r)
            assert 0 < r["host_cpu_us_per_step"], (key, r)
    burst = {r["path"]: r for r in rows if r["workload"] == "burst"}
    # the same requests in both modes: the same tokens, async on (CPU stand-ins) vs off
    assert burst["in-process, async handoff on"]["async_enabled"] is True
    assert burst["in-process, async handoff off"]["async_enabled"] is False
    assert burst["in-process, async handoff on"]["output_tokens"] == burst["in-process, async handoff off"]["output_tokens"]


def test_markdown_table_has_a_line_per_row(report):
    data, md, stdout, _ = report
    assert md in stdout
    main, _, hosts = md.partition("The engine thread's host work per step")
    host_lines = [l for l in hosts.splitlines() if l.startswith("| ") and not l.startswith("| workload")]
    assert len(host_lines) == sum(1 for r in data["rows"] if r.get("host_us_per_step") is not None) > 0
    lines = [l for l in main.splitlines() if l.startswith("| ") and not l.startswith("| workload") and
             not l.startswith("| path")]
    assert len(lines) == len(data["rows"])
    for r in data["rows"]:
        if r["workload"] == "burst":
            assert any(l.startswith(f"| {r['path']} | {r['requests']} | 0 |") for l in lines), r["path"]
        else:
            inflight = "n/a" if r.get("mean_in_flight") is None else f"{r['mean_in_flight']:.1f}"  # genai-perf: n/a
            prefix = (f"| {r['workload']} | {r['sampling']} | {r['concurrency']} | {r['path']} | {inflight} | "
                      f"{r['requests']} | 0 |")
            assert sum(l.startswith(prefix) for l in lines) == 1, prefix


def test_a_server_that_fails_to_load_is_reported_and_the_run_goes_on(tmp_path):
    """A variant whose llm parameters are invalid: its server never gets ready; the run records
    the load error (naming the parameter) for that part, runs the next part, exits 1."""
    _skip_without_triton()
    cmd = [sys.executable, "-m", "bench.serve", "--smoke", "--model", str(MODEL_DIR), "--out-dir", str(tmp_path),
           "--parts", "triton,burst", "--concurrency", "1", "--samplings", "greedy", "--workloads", "fixed",
           "--mixed-requests", "3", "--mixed-output", "2-4", "--warmup", "1", "--perf-analyzer", str(PA),
           "--start-timeout", "240", "--variant", "bad:gil_switch_interval_ms=fast"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "serve.json").read_text())
    (err,) = data["meta"]["part_errors"]
    assert err["part"] == "Triton bad"
    assert "parameter 'gil_switch_interval_ms' must be a number of ms in (0, 1000], not 'fast'" in err["error"]
    assert sorted((r["path"], r["requests"], r["errors"]) for r in data["rows"]) == [
        ("in-process, async handoff off", 3, 0), ("in-process, async handoff on", 3, 0)]
    assert "FAILED: Triton bad:" in (tmp_path / "serve.md").read_text().splitlines()[0]


def test_perf_analyzer_threads_one_row_each(tmp_path):
    """--pa-threads 0,1: a Triton row per perf_analyzer thread setting, each with every request;
    1 passes --max-threads 1 (one thread holds all the streams and walks the data in order), 0
    leaves perf_analyzer's own default."""
    _skip_without_triton()
    cmd = [sys.executable, "-m", "bench.serve", "--smoke", "--model", str(MODEL_DIR), "--out-dir", str(tmp_path),
           "--parts", "triton", "--concurrency", "3", "--samplings", "greedy", "--workloads", "mixed",
           "--mixed-output", "2-6", "--rounds", "2", "--min-requests", "6", "--warmup", "1", "--perf-analyzer",
           str(PA), "--pa-threads", "0,1"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert sorted((r["path"], r["requests"], r["errors"]) for r in rows) == [
        ("Triton pa-threads 1", 6, 0), ("Triton pa-threads default", 6, 0)]
    for threads, flag in (("1", True), ("default", False)):
        (pa_cmd,) = [p.read_text().splitlines()[0] for p in tmp_path.glob(f"pa-Triton_pa-threads_{threads}-*.txt")]
        assert ("--max-threads 1" in pa_cmd) == flag, pa_cmd


def test_profile_tpot_spans_first_to_last_token_response(tmp_path):
    """perf_analyzer's export with coalesced responses (several tokens in one output_ids, a bare
    number for one, an empty FINAL): TPOT = (response with the last token - response with the
    first) / (tokens - 1), TTFT to the first token-carrying response; a stream whose tokens
    all came in one response has no spread to measure (TPOT 0: the client saw one burst)."""
    from bench.serve import records_from_profile, row_from
    ms = 1_000_000
    empty = {"output_ids": "", "finish_reason": "length"}
    reqs = [  # sent at t=0; tokens at 10 ms (1), 14 ms (3), 20 ms (2), FINAL at 21 ms
        {"timestamp": 0, "request_inputs": {"max_tokens": 6},
         "response_timestamps": [10 * ms, 14 * ms, 20 * ms, 21 * ms],
         "response_outputs": [{"output_ids": 7}, {"output_ids": [1, 2, 3]}, {"output_ids": [4, 5]}, empty]},
        {"timestamp": 0, "request_inputs": {"max_tokens": [6]},  # one burst of 6, then FINAL
         "response_timestamps": [30 * ms, 31 * ms],
         "response_outputs": [{"output_ids": [1, 2, 3, 4, 5, 6]}, empty]},
    ]
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"experiments": [{"requests": reqs}]}))
    a, b = records_from_profile(p)
    assert (a.ntok, a.expected, a.responses, a.ok) == (6, 6, 4, True)
    assert (a.t_first, a.t_last) == (0.010, 0.020)
    assert (b.ntok, b.t_first, b.t_last) == (6, 0.030, 0.030)
    row = row_from("Triton", "fixed", "greedy", 2, [a, b], None)
    assert row["output_tokens"] == 12 and row["errors"] == 0
    assert (row["ttft_ms_p50"], row["ttft_ms_p99"]) == (10.0, 30.0)  # nearest-rank percentiles
    assert (row["tpot_ms_p50"], row["tpot_ms_p99"]) == (0.0, (20 - 10) / 5)  # b: one burst; a: 2 ms a token


def test_core_profile_of_the_served_engine(report):
    """--core-profile: the Triton server's engine core profiled its loop thread from READY until
    the server stopped it, and the run wrote the stats and their top functions."""
    import pstats
    data, _, _, out = report
    prof = out / "core-default.prof"
    calls = {f"{Path(file).name}:{name}": stat[1] for (file, _, name), stat in pstats.Stats(str(prof)).stats.items()}
    triton_tokens = sum(r["output_tokens"] for r in data["rows"] if r["path"] == "Triton")
    # every token the Triton points streamed came out of a step of this loop (at most a step per token
    # of the largest point's concurrency: a step serves every running request)
    assert calls["engine.py:step_rows"] >= triton_tokens / max(CONCURRENCY)
    assert calls["engine_core.py:_loop"] == 1
    text = (out / "core-default.txt").read_text()
    assert text.startswith("Triton: engine core loop thread") and "Ordered by: internal time" in text
    entries = [line for line in text.splitlines() if re.match(r"\s*\d+(/\d+)?\s+\d+\.\d+", line)]
    assert len(entries) == 30, text  # the top 30 functions by own time
