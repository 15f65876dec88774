"""The Triton `llm` model with pipeline_parallel_size: 2 (stage 0 in the Python stub, stage 1 in
a worker process it starts, gloo on CPU) streams the same tokens as the in-process PP=1 engine."""
from __future__ import annotations

import re
import shutil

import numpy as np

from backend_lib import EngineConfig, LLMEngine, SamplingParams

from .conftest import MODEL_DIR, ROOT, start_server
from .util import StreamClient


def _pp2_repository(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / "llm", repo / "llm")
    cfg = repo / "llm" / "config.pbtxt"
    text = cfg.read_text()
    for key, value in (("pipeline_parallel_size", "2"), ("async_token_handoff", "on")):
        text, n = re.subn(rf'(key: "{key}" value: {{ string_value: )"[^"]*"', rf'\1"{value}"', text)
        assert n == 1, key
    cfg.write_text(text)
    return repo


def test_llm_pp2_matches_in_process_pp1(tmp_path):
    srv = start_server(tmp_path, model_repository=_pp2_repository(tmp_path), wait_model="llm")
    prompts = [[5 + i] * (4 + 7 * i) for i in range(6)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=12, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(6)]
    sc = StreamClient(srv.grpc_url)
    try:
        calls = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            body = {"input_ids": np.array([p], dtype=np.int32), "max_tokens": sp.max_tokens, "ignore_eos": True,
                    "temperature": sp.temperature, "top_p": sp.top_p,  # top_p: sampled (TensorRT-LLM's
                    "stream": True, "exclude_input_in_output": True}       # k=0, p=0 is greedy)
            if sp.seed is not None:
                body["seed"] = np.array([[sp.seed]], dtype=np.uint64)
            calls.append(sc.send("llm", body, f"pp{i}"))
        for c in calls:
            assert c.done.wait(120), "stream did not finish"
    finally:
        sc.close()
        srv.stop()
    got = [sum(c.ids(), []) for c in calls]
    ref = LLMEngine(EngineConfig(model_path=str(MODEL_DIR), device="cpu", dtype="float32")).generate(prompts, params)
    assert got == [r.token_ids for r in ref]
    assert all(len(g) == 12 for g in got)
