"""The bad-input matrix: each request gets an error naming the field, with FINAL (the call
returns); the model stays READY and the next valid request succeeds."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from .util import grpc_stream_one, http_post, joined

GOOD = {
    "ensemble": {"text_input": "Hello", "max_tokens": 3, "temperature": 0.0},
    "llm_bls": {"text_input": "Hello", "max_tokens": 3, "temperature": 0.0},
    "vllm_model": {"text_input": "Hello", "sampling_parameters": json.dumps({"max_tokens": "3", "temperature": "0"})},
    "llm": {"input_ids": [1, 2, 3], "max_tokens": 3, "temperature": 0.0},
}

LONG = "word " * 2100   # > max_model_len (2048) tokens


def sp(**kw):
    return json.dumps({"max_tokens": "3", **kw})


# (route, name, body, text the error must contain)
HTTP_CASES = [
    ("ensemble", "missing text_input", {"max_tokens": 3}, "text_input"),
    ("llm_bls", "missing text_input", {"max_tokens": 3}, "text_input"),
    # optional in llm_bls's config (a control request carries cancel_request_id alone)
    ("llm_bls", "missing max_tokens", {"text_input": "Hi"}, "max_tokens"),
    ("vllm_model", "missing text_input", {"sampling_parameters": sp()}, "text_input"),
    ("ensemble", "empty prompt", {"text_input": "", "max_tokens": 3}, "text_input"),
    ("llm_bls", "empty prompt", {"text_input": "", "max_tokens": 3}, "text_input"),
    ("vllm_model", "empty prompt", {"text_input": "", "sampling_parameters": sp()}, "text_input"),
    ("llm", "empty prompt", {"input_ids": [], "max_tokens": 3}, "input_ids"),
    ("ensemble", "max_tokens 0", {"text_input": "Hi", "max_tokens": 0}, "max_tokens"),
    ("llm_bls", "max_tokens 0", {"text_input": "Hi", "max_tokens": 0}, "max_tokens"),
    ("vllm_model", "max_tokens 0", {"text_input": "Hi", "sampling_parameters": sp(max_tokens=0)}, "max_tokens"),
    ("llm", "max_tokens 0", {"input_ids": [1, 2], "max_tokens": 0}, "max_tokens"),
    ("ensemble", "max_tokens 1e9", {"text_input": "Hi", "max_tokens": 10**9}, "max_tokens"),
    ("llm_bls", "max_tokens 1e9", {"text_input": "Hi", "max_tokens": 10**9}, "max_tokens"),
    ("vllm_model", "max_tokens 1e9", {"text_input": "Hi", "sampling_parameters": sp(max_tokens=10**9)}, "max_tokens"),
    ("llm", "max_tokens 1e9", {"input_ids": [1, 2], "max_tokens": 10**9}, "max_tokens"),
    ("ensemble", "temperature -1", {"text_input": "Hi", "max_tokens": 3, "temperature": -1.0}, "temperature"),
    ("llm_bls", "temperature -1", {"text_input": "Hi", "max_tokens": 3, "temperature": -1.0}, "temperature"),
    ("vllm_model", "temperature -1", {"text_input": "Hi", "sampling_parameters": sp(temperature="-1")}, "temperature"),
    ("llm", "temperature -1", {"input_ids": [1], "max_tokens": 3, "temperature": -1.0}, "temperature"),
    ("ensemble", "top_p 1.5", {"text_input": "Hi", "max_tokens": 3, "top_p": 1.5}, "top_p"),
    ("llm_bls", "top_p 1.5", {"text_input": "Hi", "max_tokens": 3, "top_p": 1.5}, "top_p"),
    ("vllm_model", "top_p 1.5", {"text_input": "Hi", "sampling_parameters": sp(top_p="1.5")}, "top_p"),
    ("vllm_model", "unknown key", {"text_input": "Hi", "sampling_parameters": sp(frobnicate="1")},
     "sampling_parameters.frobnicate"),
    ("vllm_model", "bad JSON", {"text_input": "Hi", "sampling_parameters": "{not json"}, "sampling_parameters"),
    ("ensemble", "prompt > max_model_len", {"text_input": LONG, "max_tokens": 3}, "max_model_len"),
    ("llm_bls", "prompt > max_model_len", {"text_input": LONG, "max_tokens": 3}, "max_model_len"),
    ("vllm_model", "prompt > max_model_len", {"text_input": LONG, "sampling_parameters": sp()}, "max_model_len"),
    ("llm", "prompt > max_model_len", {"input_ids": [5] * 2100, "max_tokens": 3}, "max_model_len"),
    ("llm", "token id out of vocab", {"input_ids": [10**6], "max_tokens": 3}, "input_ids"),
    ("ensemble", "beam_width 2", {"text_input": "Hi", "max_tokens": 3, "beam_width": 2}, "beam_width"),
    # stop words may be several tokens (TensorRT-LLM); bad words must be one token each
    ("ensemble", "multi-token bad word", {"text_input": "Hi", "max_tokens": 3,
                                          "bad_words": ["a whole sentence here"]}, "bad_words"),
    # HTTP generate passes keys that are not inputs on as request parameters: a misspelt knob
    ("ensemble", "unknown key", {"text_input": "Hi", "max_tokens": 3, "temprature": -5}, "temprature"),
    ("llm_bls", "unknown key", {"text_input": "Hi", "max_tokens": 3, "temprature": -5}, "temprature"),
    ("llm", "unknown key", {"input_ids": [1, 2], "max_tokens": 3, "temprature": -5}, "temprature"),
    ("vllm_model", "unknown key", {"text_input": "Hi", "sampling_parameters": sp(), "temprature": -5},
     "temprature"),
    ("ensemble", "unknown string key", {"text_input": "Hi", "max_tokens": 3, "stop_word": "x"}, "stop_word"),
]


def assert_ready_and_serving(server, route):
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{route}/ready", timeout=10) as r:
        assert r.status == 200
    status, text = http_post(server.http_url, f"/v2/models/{route}/generate", GOOD[route], timeout=60)
    assert status == 200, text
    out = json.loads(text)
    assert joined(out.get("text_output", "")) != "" or out.get("output_ids") not in (None, [])


# llm's cases also with its engine loop in a process of its own (validation stays in the stub)
HTTP_RUNS = [c + ("engine-process",) for c in HTTP_CASES] + [c + ("in-process",) for c in HTTP_CASES if c[0] == "llm"]


@pytest.mark.parametrize("route,name,body,needle,server", HTTP_RUNS, indirect=["server"],
                         ids=[f"{c[0]}-{c[1]}-{c[4]}" for c in HTTP_RUNS])
def test_bad_input_http(server, route, name, body, needle):
    status, text = http_post(server.http_url, f"/v2/models/{route}/generate", body, timeout=60)
    assert status == 400, (status, text)
    err = json.loads(text)["error"]
    assert needle in err, err
    assert_ready_and_serving(server, route)


def test_non_utf8_prompt(server):
    for route, batched, extra in (("ensemble", True, {"max_tokens": 3}), ("llm_bls", True, {"max_tokens": 3}),
                                  ("vllm_model", False, {})):
        c = grpc_stream_one(server.grpc_url, route, {"text_input": b"\xff\xfe bad", **extra}, batched=batched)
        assert c.finals == 1 and len(c.errors) == 1, (route, c.errors)
        assert "text_input" in c.errors[0] and "UTF-8" in c.errors[0]
        assert_ready_and_serving(server, route)


@pytest.mark.parametrize("route,server", [("ensemble", "engine-process"), ("llm_bls", "engine-process"),
                                          ("llm", "engine-process"), ("llm", "in-process")], indirect=["server"])
def test_wrong_dtype_and_shape(server, route):
    base = {"text_input": "Hi"} if route != "llm" else {"input_ids": np.array([[1, 2]], dtype=np.int32)}
    cases = [
        ({**base, "max_tokens": np.array([[3.0]], dtype=np.float32)}, "max_tokens"),       # dtype
        ({**base, "max_tokens": np.array([[3, 4]], dtype=np.int32)}, "max_tokens"),        # shape
    ]
    if route == "llm":
        cases.append(({"input_ids": np.array([[1.0, 2.0]], dtype=np.float32),
                       "max_tokens": np.array([[3]], dtype=np.int32)}, "input_ids"))
    for body, needle in cases:
        c = grpc_stream_one(server.grpc_url, route, body)
        assert c.finals == 1 and len(c.errors) == 1, c.errors
        assert needle in c.errors[0], c.errors[0]
    assert_ready_and_serving(server, route)


def test_5mb_http_body_does_not_kill_the_server(server):
    """tritonserver 2.51's HTTP frontend died (Signal 11) on this body with the default 8 MiB
    stack; the launcher (and this fixture) raise the stack limit."""
    body = b'{"max_tokens": 2, "input_ids": [1, 2], "padding": "' + b"a" * 5_000_000 + b'"}'
    # curl -d's content type: with it (not with application/json) 2.51 died on this body
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    try:
        urllib.request.urlopen(req, timeout=120)
        status, text = 200, ""
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    assert status == 400 and "padding" in text, (status, text[:300])
    assert server.proc.poll() is None
    assert_ready_and_serving(server, "llm")
