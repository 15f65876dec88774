"""bench/engine_process.py with --null-math-us on CPU: the real scheduler and runner without the
model's math behind an emulated device, in process and in an engine process
(bench/null_math_engine.py through BACKEND_LIB_ENGINE_CLASS)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_null_math_engines_in_process_and_in_the_engine_process():
    r = subprocess.run([sys.executable, "-m", "bench.engine_process", "--null-math-us", "2000", "--concurrency", "4",
                        "--requests-per-stream", "2", "--prompt-len", "20", "--output-len", "12", "--sender-us", "0",
                        "--stagger-ms", "5"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "without its math, emulated device 2000 µs/step" in r.stdout
    rows = [line.split(" | ") for line in r.stdout.splitlines() if line.startswith("| in-process") or
            line.startswith("| engine process")]
    assert [row[0] for row in rows] == ["| in-process AsyncEngine", "| engine process"]
    for row in rows:
        tok_s, tpot_ms, wait_ms = float(row[3]), float(row[5]), float(row[9])
        # every token waits for its emulated 2 ms step: the emulated device, not the model, sets the pace
        assert tpot_ms >= 2.0 * 0.95 and 0 < tok_s <= 4 / 2e-3 * 1.05 and wait_ms > 0


def test_core_profile_covers_the_loop_thread_only(tmp_path):
    """--core-profile: the engine core's loop thread under cProfile from READY to its end (not its
    start-up imports), the stats written where asked and printed."""
    import pstats
    prof = tmp_path / "core.prof"
    r = subprocess.run([sys.executable, "-m", "bench.engine_process", "--null-math-us", "500", "--concurrency", "4",
                        "--requests-per-stream", "2", "--prompt-len", "20", "--output-len", "12", "--sender-us", "0",
                        "--engines", "process", "--core-profile", str(prof)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"engine core loop thread, cProfile ({prof})" in r.stdout
    calls = {f"{Path(file).name}:{name}": stat[1] for (file, _, name), stat in pstats.Stats(str(prof)).stats.items()}
    # each stream's two requests of 12 tokens run one after the other: at least 24 steps
    assert calls["engine.py:step_rows"] >= 24
    assert calls["engine_core.py:_loop"] == 1
    assert not any(k.startswith("import_utils.py") or k == "engine.py:__init__" for k in calls)
