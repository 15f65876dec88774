"""bench/trickle.py on CPU: a closed loop of streams whose requests arrive one at a time, the
real scheduler behind the emulated device, one row per scheduler_delay_factor."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_trickle_counts_every_request_of_the_window(tmp_path):
    out = tmp_path / "trickle.json"
    r = subprocess.run([sys.executable, "-m", "bench.trickle", "--concurrency", "6", "--prompt-len", "20",
                        "--output-len", "12", "--max-model-len", "128", "--device-us", "300", "--think-us", "500",
                        "--stagger-ms", "2", "--rounds", "2", "--delay-factors", "0,3", "--repeat", "2",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [row["factor"] for row in res["rows"]] == [0.0, 3.0]
    for factor, runs in res["runs"].items():
        assert len(runs) == 2
        for run in runs:
            # every stream's two measured requests, each its 12 tokens, one token per row a step
            assert run["requests"] == 12
            assert run["output_tok_s"] > 0 and 0 < run["mixed_share"] <= 1
            assert run["tpot_p50_ms"] >= 0.3 * 0.9  # never faster than the emulated device step
    lines = r.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| scheduler_delay_factor"))
    assert [line.split(" | ")[0] for line in lines[head + 2:head + 4]] == ["| 0", "| 3"]
    assert "2 runs per factor" in r.stdout
