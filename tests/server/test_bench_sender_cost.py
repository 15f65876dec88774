"""bench/sender_cost.py as a smoke test: the probe model on the real tritonserver sends every
response of every variant and the table has a row each with its phase times. No speed is
asserted. One sending thread only: concurrent send() calls from several stub threads deadlocked
tritonserver 2.51 once (bench/RESULTS.md), and a smoke test must not hang CI on that."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT


def test_sender_cost_table():
    from triton_glue import launch
    try:
        launch.find_triton()
    except launch.TritonNotFound as e:
        pytest.skip(f"tritonserver not available: {e}")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    r = subprocess.run([sys.executable, "-m", "bench.sender_cost", "--responses", "30", "--repeats", "1",
                        "--tokens", "1,8", "--concurrent", "1"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if re.match(r"\| (llm|ids\+length|ids) \|", line)]
    keys = sorted((row.split("|")[1].strip(), row.split("|")[2].strip(), row.split("|")[3].strip()) for row in rows)
    assert keys == sorted((v, k, c) for v in ("llm", "ids+length", "ids") for k in ("1", "8") for c in ("1",)), \
        r.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(x) >= 0 for x in cells[3:]), row
        assert float(cells[7]) > 0 and float(cells[8]) > 0, row  # the stub and the client took time
