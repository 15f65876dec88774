"""Every route, streaming over gRPC and HTTP, token-identical to the in-process engine."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend_lib import SamplingParams
from triton_glue.detokenizer import full_text

from .conftest import BOTH_ENGINES
from .util import grpc_stream_one, http_post, http_stream_events, joined

PROMPTS = ["Hello world", "The quick brown fox", "naïve café 😀 中文"]
MAX_TOKENS = 8
TEXT_ROUTES = ["ensemble", "llm_bls", "vllm_model"]


@pytest.fixture(scope="module")
def refs(tokenizer, reference_engine):
    """prompt -> (prompt ids, greedy output ids, finish reason, text)."""
    out = {}
    for p in PROMPTS:
        ids = tokenizer.encode(p)
        c = reference_engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
        out[p] = (ids, list(c.token_ids), str(c.finish_reason), full_text(tokenizer, ids, c.token_ids))
    return out


def body_for(route: str, prompt: str, stream: bool, **extra) -> dict:
    if route == "vllm_model":
        b = {"text_input": prompt, "stream": stream, "return_finish_reason": True,
             "return_num_output_tokens": True, "return_num_input_tokens": True,
             "sampling_parameters": json.dumps({"max_tokens": str(MAX_TOKENS), "temperature": "0"})}
        if not stream:
            b["exclude_input_in_output"] = True
        return {**b, **extra}
    return {"text_input": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream,
            "exclude_input_in_output": True, "return_num_output_tokens": True,
            "return_num_input_tokens": True, **extra}


@pytest.mark.parametrize("prompt", PROMPTS)
@BOTH_ENGINES
def test_llm_grpc_stream_token_identical(server, refs, prompt):
    ids, ref_tokens, ref_reason, _ = refs[prompt]
    c = grpc_stream_one(server.grpc_url, "llm", {
        "input_ids": np.array([ids], dtype=np.int32), "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "stream": True, "exclude_input_in_output": True, "return_num_output_tokens": True})
    assert not c.errors and c.finals == 1
    chunks = c.ids("output_ids")
    assert sum(chunks, []) == ref_tokens
    assert len(chunks) >= 2  # streamed, not one block
    reasons = [r.as_numpy("finish_reason").reshape(-1)[0].decode() for r in c.responses]
    assert reasons[-1] == ref_reason and all(r == "" for r in reasons[:-1])
    assert [int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in c.responses] == [len(x) for x in chunks]


@BOTH_ENGINES
def test_llm_sends_the_outputs_asked_for(server, refs):
    """A client naming its outputs (TensorRT-LLM's do; the BLS routes ask for output_ids and
    finish_reason) gets the same tokens and its finish reason; llm builds only those
    (tests/engine/test_llm_model_outputs.py checks what the stub sends)."""
    ids, ref_tokens, ref_reason, _ = refs[PROMPTS[1]]
    c = grpc_stream_one(server.grpc_url, "llm", {
        "input_ids": np.array([ids], dtype=np.int32), "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "stream": True, "exclude_input_in_output": True}, outputs=["output_ids", "finish_reason"])
    assert not c.errors and c.finals == 1
    assert sum(c.ids("output_ids"), []) == ref_tokens
    assert all(r.as_numpy("prefix_ids") is None and r.as_numpy("sequence_length") is None for r in c.responses)
    assert c.responses[-1].as_numpy("finish_reason").reshape(-1)[0].decode() == ref_reason


@BOTH_ENGINES
def test_llm_prompt_included_by_default(server, refs):
    ids, ref_tokens, _, _ = refs[PROMPTS[0]]
    c = grpc_stream_one(server.grpc_url, "llm", {
        "input_ids": np.array([ids], dtype=np.int32), "max_tokens": MAX_TOKENS, "temperature": 0.0})
    assert not c.errors and c.finals == 1 and len(c.responses) == 1  # stream defaults to false
    assert c.ids()[0] == ids + ref_tokens


@pytest.mark.parametrize("prompt", PROMPTS[:2])
@BOTH_ENGINES
def test_llm_http_stream_token_identical(server, refs, prompt):
    ids, ref_tokens, ref_reason, _ = refs[prompt]
    events = http_stream_events(server.http_url, "llm", {
        "input_ids": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
        "exclude_input_in_output": True})
    toks = []
    for e in events:
        v = e["output_ids"]
        toks += v if isinstance(v, list) else [v]
    assert toks == ref_tokens
    assert events[-1]["finish_reason"] == ref_reason


@pytest.mark.parametrize("route", TEXT_ROUTES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_route_grpc_stream(server, refs, route, prompt):
    ids, ref_tokens, ref_reason, ref_text = refs[prompt]
    batched = route != "vllm_model"
    c = grpc_stream_one(server.grpc_url, route, body_for(route, prompt, True), batched=batched)
    assert not c.errors, c.errors
    assert c.finals == 1
    pieces = c.texts()
    assert "".join(pieces) == ref_text
    assert len(pieces) >= 2
    n_out = [int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in c.responses]
    assert sum(n_out) == len(ref_tokens)
    assert int(c.last("num_input_tokens")[0]) == len(ids)
    if route == "vllm_model":
        assert c.last("finish_reason")[0].decode() == ref_reason


@pytest.mark.parametrize("route", TEXT_ROUTES)
def test_text_route_http_stream_and_non_stream(server, refs, route):
    prompt = PROMPTS[2]
    _, ref_tokens, _, ref_text = refs[prompt]
    events = http_stream_events(server.http_url, route, body_for(route, prompt, True))
    assert "".join(joined(e["text_output"]) for e in events) == ref_text
    status, text = http_post(server.http_url, f"/v2/models/{route}/generate", body_for(route, prompt, False))
    assert status == 200, text
    assert joined(json.loads(text)["text_output"]) == ref_text  # stream text == non-stream text


def test_exclude_input_false_prepends_prompt(server, refs):
    prompt = PROMPTS[0]
    _, _, _, ref_text = refs[prompt]
    for route in ("ensemble", "llm_bls"):
        status, text = http_post(server.http_url, f"/v2/models/{route}/generate",
                                 body_for(route, prompt, False, exclude_input_in_output=False))
        assert status == 200, text
        assert joined(json.loads(text)["text_output"]) == prompt + ref_text
    status, text = http_post(server.http_url, "/v2/models/vllm_model/generate",
                             {**body_for("vllm_model", prompt, False), "exclude_input_in_output": False})
    assert status == 200 and joined(json.loads(text)["text_output"]) == prompt + ref_text


def test_client_cli(server, refs, capsys):
    from client.generate import main
    prompt = PROMPTS[1]
    ref_text = refs[prompt][3]
    for model in TEXT_ROUTES:
        for http in (False, True):
            url = server.http_url if http else server.grpc_url
            argv = [prompt, "--model", model, "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
                    "--url", url] + (["--http"] if http else [])
            assert main(argv) == 0
            assert capsys.readouterr().out == ref_text + "\n"


@pytest.mark.parametrize("route", ["ensemble", "llm_bls"])
def test_ignore_eos_runs_past_the_eos_to_max_tokens(server, tokenizer, reference_engine, route):
    """ignore_eos on the TensorRT-LLM-style routes: the ensemble's preprocessing fills end_id in
    from the tokenizer on every request, which must not end the stream at the first EOS."""
    prompt, n = "Once upon a time 0", 200
    ids = tokenizer.encode(prompt)
    plain = reference_engine.generate([ids], SamplingParams(max_tokens=n, temperature=0.0))[0]
    assert str(plain.finish_reason) == "stop" and len(plain.token_ids) < n  # greedy meets the EOS first
    ref = reference_engine.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
    assert len(ref.token_ids) == n
    events = http_stream_events(server.http_url, route, body_for(route, prompt, True, max_tokens=n, ignore_eos=True))
    assert sum(int(np.asarray(e["num_output_tokens"]).reshape(-1)[0]) for e in events) == n
    assert "".join(joined(e["text_output"]) for e in events) == full_text(tokenizer, ids, ref.token_ids)
