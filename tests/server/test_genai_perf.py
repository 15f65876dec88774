"""A bounded genai-perf profile (streaming, gRPC, offline: local tokenizer, HF_HUB_OFFLINE=1)
against the vllm_backend interface (`vllm_model`) and the TensorRT-LLM one (`ensemble`).

genai-perf lives in its own venv (scripts/install_genai_perf.sh -> build/genai-venv, numpy 2
et al. kept out of .venv) and drives build/bin/perf_analyzer (scripts/install_triton.sh).
The test skips when either is missing. It asserts on genai-perf's exported results and on the
server's own failure counters.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from .conftest import MODEL_DIR, ROOT

GENAI_VENV = Path(os.environ.get("GENAI_VENV", ROOT / "build" / "genai-venv"))
GENAI_PERF = GENAI_VENV / "bin" / "genai-perf"
PA = ROOT / "build" / "bin" / "perf_analyzer"
REQUESTS = 8
OSL = 8

# checked before the session server is started
pytestmark = [
    pytest.mark.skipif(not GENAI_PERF.exists(),
                       reason=f"genai-perf not installed at {GENAI_PERF} (scripts/install_genai_perf.sh"
                              " or `make genai-perf`; needs PyPI or wheels in ./.whl)"),
    pytest.mark.skipif(not PA.exists(),
                       reason=f"perf_analyzer not installed at {PA} (scripts/install_triton.sh)"),
]


@pytest.mark.parametrize("model,backend", [("vllm_model", "vllm"), ("ensemble", "tensorrtllm")])
def test_genai_perf_profile(server, tmp_path, model, backend):
    failures_before = server.metric("nv_inference_request_failure", model=model)
    success_before = server.metric("nv_inference_request_success", model=model)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="150",
               PATH=f"{PA.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    art = tmp_path / "artifacts"
    cmd = [str(GENAI_PERF), "profile", "-m", model, "--backend", backend,
           "--endpoint-type", "kserve", "--streaming", "-u", server.grpc_url,
           "--tokenizer", str(MODEL_DIR), "--num-dataset-entries", str(REQUESTS),
           "--synthetic-input-tokens-mean", "16", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(OSL), "--output-tokens-mean-deterministic",
           "--concurrency", "2", "--request-count", str(REQUESTS), "--warmup-request-count", "0",
           "--random-seed", "0", "--artifact-dir", str(art)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Thread [" not in out and "Failed" not in out, out  # perf_analyzer's error lines

    (summary_path,) = art.glob("*/profile_export_genai_perf.json")
    summary = json.loads(summary_path.read_text())
    assert summary["request_count"]["avg"] == REQUESTS, summary["request_count"]
    assert summary["input_sequence_length"]["avg"] == 16
    # genai-perf re-tokenizes the streamed text, so the count is near (not exactly) OSL
    assert summary["output_sequence_length"]["min"] > 0, summary["output_sequence_length"]
    assert summary["output_token_throughput"]["avg"] > 0
    assert summary["time_to_first_token"]["avg"] > 0

    # the raw export: every request was sent with our inputs and streamed several responses
    (export_path,) = art.glob("*/profile_export.json")
    requests = json.loads(export_path.read_text())["experiments"][0]["requests"]
    assert len(requests) == REQUESTS
    for req in requests:
        inputs = req["request_inputs"]
        assert inputs["stream"] is True
        if backend == "vllm":
            assert json.loads(inputs["sampling_parameters"]) == {"max_tokens": str(OSL),
                                                                 "min_tokens": str(OSL)}
        else:
            assert inputs["max_tokens"] == OSL and inputs["min_length"] == OSL
        texts = [o.get("text_output", "") for o in req["response_outputs"]]
        assert len(req["response_timestamps"]) >= 2, req
        assert "".join(texts), req

    assert server.metric("nv_inference_request_failure", model=model) == failures_before, \
        server.log_tail()
    assert server.metric("nv_inference_request_success", model=model) - success_before == REQUESTS
