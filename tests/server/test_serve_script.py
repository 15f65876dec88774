"""`make serve` as the README runs it (scripts/serve.sh): tritonserver and the OpenAI frontend
beside it, an engine setting changed through LLM_PARAM_<name> without editing config.pbtxt,
perf_analyzer over plain HTTP through the public port's front, and both processes gone after the
server is stopped."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from triton_glue import launch

from .conftest import ROOT, START_TIMEOUT_S, free_ports
from .util import wait_for

openai = pytest.importorskip("openai", reason="the openai package is not installed (requirements.txt)")
pytest.importorskip("fastapi", reason="fastapi is not installed (requirements-triton.txt)")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (requirements-triton.txt)")


def _group(pgid: int) -> list[str]:
    """Command lines of the live processes in process group `pgid`."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ValueError):
            continue
    return out


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except Exception:  # noqa: BLE001
        return 0


def _perf_analyzer_over_http(url: str, tmp_path: Path) -> None:
    """perf_analyzer's HTTP client sends no Accept-Encoding and cannot read a gzip answer: the
    front must not ask tritonserver for one on its behalf (every request failed with "failed to
    parse the request JSON buffer" when it did)."""
    pa = ROOT / "build" / "bin" / "perf_analyzer"
    if not pa.exists():
        return  # scripts/install_triton.sh installs it; test_perf.py skips with the reason
    data = tmp_path / "tensorrt_llm.json"
    data.write_text(json.dumps({"data": [{"input_ids": {"content": [5, 6, 7], "shape": [3]},
                                          "input_lengths": {"content": [3], "shape": [1]},
                                          "request_output_len": {"content": [4], "shape": [1]}}]}))
    r = subprocess.run([str(pa), "-m", "tensorrt_llm", "-u", url, "-i", "http", "--input-data", str(data),
                        "--concurrency-range", "2", "--request-count", "8"], capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "error" not in out.lower() and "failed" not in out.lower(), out
    assert int(re.search(r"Request count: (\d+)", out).group(1)) >= 8, out


def test_make_serve_runs_server_and_openai_frontend(tmp_path):
    try:
        launch.find_triton()
    except launch.TritonNotFound as e:
        pytest.skip(f"tritonserver not available: {e}")
    http, grpc, metrics, oa = free_ports(4)
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_PATH", "TOKENIZER_PATH")}
    env.update(HTTP_PORT=str(http), GRPC_PORT=str(grpc), METRICS_PORT=str(metrics), OPENAI_PORT=str(oa),
               LLM_PARAM_max_num_seqs="2", TRITON_BIND_ADDRESS="127.0.0.1", OPENAI_HOST="127.0.0.1")
    log_path = tmp_path / "serve.log"
    proc = subprocess.Popen(["bash", "scripts/serve.sh", "--", "--exit-timeout-secs=5"], cwd=ROOT, env=env,
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    log = lambda: log_path.read_text(errors="replace")  # noqa: E731
    try:
        assert wait_for(lambda: _get(f"http://127.0.0.1:{oa}/health") == 200 or proc.poll() is not None,
                        START_TIMEOUT_S, 0.5), log()
        assert proc.poll() is None, log()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{oa}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["vllm_model"]
        r = client.chat.completions.create(model="vllm_model", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
        text = log()
        assert "llm: parameters from LLM_PARAM_* environment variables: {'max_num_seqs': '2'}" in text
        started = next(l for l in text.splitlines() if "[llm] starting engine (engine process, 1 delivery thread(s)):" in l)
        assert '\\"max_num_seqs\\": 2,' in started or '"max_num_seqs": 2,' in started, started
        if not launch.cuda_driver_present():
            assert launch.CPU_NOTE in text  # tritonserver's CUDA error lines are explained
        _perf_analyzer_over_http(f"127.0.0.1:{http}", tmp_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        left = wait_for(lambda: not _group(proc.pid), 30)
        if not left:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left, f"processes left after the server stopped: {_group(proc.pid)}"
    assert _get(f"http://127.0.0.1:{oa}/v1/models") == 0  # the frontend went with the server
    assert "Traceback" not in log(), log()
