"""A bounded perf_analyzer run (streaming, gRPC) against the server: it must complete with
zero errors. perf_analyzer comes from scripts/install_triton.sh (build/bin/perf_analyzer)."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from .conftest import ROOT

PA = ROOT / "build" / "bin" / "perf_analyzer"


@pytest.mark.parametrize("model", ["llm", "ensemble"])
def test_perf_analyzer_streaming_zero_errors(server, tmp_path, model):
    if not PA.exists():
        pytest.skip(f"perf_analyzer not installed at {PA} (scripts/install_triton.sh)")
    data = json.loads((ROOT / "client" / f"perf_data_{model}.json").read_text())
    for entry in data["data"]:
        entry["max_tokens"] = [6]  # keep the run short
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps(data))
    cmd = [str(PA), "-m", model, "-u", server.grpc_url, "-i", "grpc", "--streaming",
           "--input-data", str(path), "--concurrency-range", "2", "--request-count", "8"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "error" not in out.lower() and "failed" not in out.lower(), out
    count = int(re.search(r"Request count: (\d+)", out).group(1))
    assert count >= 8
    ok = int(re.search(r"Successful request count: (\d+)", out).group(1))
    assert ok >= count
