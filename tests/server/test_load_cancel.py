"""Concurrency, cancellation, stop strings with upstream cancel."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from backend_lib import SamplingParams
from triton_glue.detokenizer import full_text

from .conftest import BOTH_ENGINES
from .util import StreamClient, wait_for

N_STREAMS = 32


@BOTH_ENGINES
def test_32_concurrent_streams_complete_in_order(server, tokenizer, reference_engine):
    prompts = [tokenizer.encode(f"Request number {i}: tell me about {'abc'[i % 3]}") for i in range(N_STREAMS)]
    max_toks = [4 + (i % 9) for i in range(N_STREAMS)]
    refs = [reference_engine.generate([p], SamplingParams(max_tokens=m, temperature=0.0))[0]
            for p, m in zip(prompts, max_toks)]
    sc = StreamClient(server.grpc_url)
    try:
        got = [sc.send("llm", {"input_ids": np.array([p], dtype=np.int32), "max_tokens": m,
                               "temperature": 0.0, "stream": True, "exclude_input_in_output": True},
                       f"c{i}") for i, (p, m) in enumerate(zip(prompts, max_toks))]
        for c in got:
            assert c.done.wait(120)
        time.sleep(0.1)
    finally:
        sc.close()
    for i, (c, ref) in enumerate(zip(got, refs)):
        assert not c.errors and c.finals == 1, (i, c.errors)
        assert sum(c.ids(), []) == list(ref.token_ids), i  # per-request order intact
        assert c.last("finish_reason")[0].decode() == str(ref.finish_reason)


@BOTH_ENGINES
def test_cancel_grpc_stream_frees_kv_blocks(server):
    assert wait_for(server.idle)
    aborted0 = server.metric("llm_requests_finished_total", reason="abort")
    sc = StreamClient(server.grpc_url)
    c = sc.send("llm", {"input_ids": np.array([[1, 2, 3, 4, 5]], dtype=np.int32), "max_tokens": 1900,
                        "ignore_eos": True, "temperature": 0.0, "stream": True,
                        "exclude_input_in_output": True}, "long")
    assert wait_for(lambda: len(c.responses) >= 3, 60, 0.01), "no tokens streamed"
    assert wait_for(lambda: server.metric("llm_kv_blocks_used") > 0, 5)
    sc.close(cancel=True)  # gRPC stop_stream(cancel_requests=True)
    assert wait_for(lambda: server.metric("llm_requests_finished_total", reason="abort") == aborted0 + 1, 10), \
        server.log_tail()
    assert wait_for(server.idle, 5)
    assert len(c.responses) < 1900


@pytest.mark.parametrize("route", ["llm_bls", "vllm_model"])
def test_cancel_bls_stream_aborts_upstream(server, route):
    """Client cancellation of a BLS route reaches the engine. (The `ensemble` route cannot do
    this on Triton 2.51: its scheduler checks cancellation only between steps, never for an
    in-flight decoupled step; see README.)"""
    assert wait_for(server.idle)
    aborted0 = server.metric("llm_requests_finished_total", reason="abort")
    sc = StreamClient(server.grpc_url)
    if route == "llm_bls":
        body = {"text_input": "Tell me a long story", "max_tokens": 1900, "end_id": 0,
                "temperature": 0.0, "stream": True, "exclude_input_in_output": True}
    else:
        body = {"text_input": "Tell me a long story", "stream": True, "sampling_parameters": json.dumps(
            {"max_tokens": 1900, "ignore_eos": True, "stop_token_ids": [0], "temperature": 0})}
    c = sc.send(route, body, "long", batched=route != "vllm_model")
    assert wait_for(lambda: len(c.responses) >= 3, 60, 0.01)
    sc.close(cancel=True)
    assert wait_for(lambda: server.metric("llm_requests_finished_total", reason="abort") == aborted0 + 1, 10), \
        server.log_tail()
    assert wait_for(server.idle, 5)


@pytest.fixture(scope="module")
def long_ref(tokenizer, reference_engine):
    """A greedy continuation (EOS off) and a stop string a few tokens into it."""
    ids = tokenizer.encode("Once upon a time")
    c = reference_engine.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                         stop_token_ids=[0]))[0]
    text = full_text(tokenizer, ids, c.token_ids)
    for k in range(4, len(text) - 3):
        stop = text[k:k + 3]
        if "\ufffd" not in stop and stop.strip() == stop and stop:
            return text, stop
    pytest.skip("no clean stop string in the reference text")


# vLLM's stop strings (text, excluded from the output). llm_bls follows TensorRT-LLM: stop
# words are token sequences kept in the output (tests/server/test_trtllm.py).
@pytest.mark.parametrize("route", ["vllm_model"])
@pytest.mark.parametrize("stream", [True, False])
def test_stop_string_never_reaches_client_and_cancels_upstream(server, long_ref, route, stream):
    text, stop = long_ref
    expected = text[: text.find(stop)]
    assert wait_for(server.idle)
    aborted0 = server.metric("llm_requests_finished_total", reason="abort")
    body = {"text_input": "Once upon a time", "stream": stream, "exclude_input_in_output": True,
            "return_finish_reason": True,
            "sampling_parameters": json.dumps({"max_tokens": 1900, "temperature": 0, "ignore_eos": "true",
                                               "stop_token_ids": [0], "stop": [stop]})}
    sc = StreamClient(server.grpc_url)
    try:
        c = sc.send(route, body, "s", batched=False)
        assert c.done.wait(60)
        time.sleep(0.05)
    finally:
        sc.close()
    assert not c.errors and c.finals == 1
    got = "".join(c.texts())
    assert got == expected and stop not in got
    assert c.last("finish_reason")[0].decode() == "stop"
    # the upstream llm request was aborted long before its 1900 tokens
    assert wait_for(lambda: server.metric("llm_requests_finished_total", reason="abort") == aborted0 + 1, 10)
    assert wait_for(server.idle, 5)


def test_bls_concurrent_streams(server, tokenizer, reference_engine):
    prompts = [f"Stream {i} says" for i in range(16)]
    refs = []
    for p in prompts:
        ids = tokenizer.encode(p)
        r = reference_engine.generate([ids], SamplingParams(max_tokens=6, temperature=0.0))[0]
        refs.append(full_text(tokenizer, ids, r.token_ids))
    sc = StreamClient(server.grpc_url)
    try:
        got = [sc.send("vllm_model", {"text_input": p, "stream": True, "sampling_parameters":
                                      json.dumps({"max_tokens": "6", "temperature": "0.0"})},
                       f"b{i}", batched=False) for i, p in enumerate(prompts)]
        for c in got:
            assert c.done.wait(120)
        time.sleep(0.1)
    finally:
        sc.close()
    for c, ref in zip(got, refs):
        assert not c.errors and c.finals == 1 and "".join(c.texts()) == ref


@pytest.mark.parametrize("route,server", [("llm", "engine-process"), ("vllm_model", "engine-process"),
                                          ("llm", "in-process")], indirect=["server"])
def test_http_client_disconnect_cancels(server, route):
    """Closing the HTTP generate_stream connection cancels the request in the engine."""
    import socket
    assert wait_for(server.idle)
    aborted0 = server.metric("llm_requests_finished_total", reason="abort")
    if route == "llm":
        body = {"input_ids": [1, 2, 3], "max_tokens": 1900, "ignore_eos": True, "stream": True,
                "exclude_input_in_output": True}
    else:
        body = {"text_input": "hi", "stream": True,
                "sampling_parameters": json.dumps({"max_tokens": 1900, "ignore_eos": "true"})}
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
    s.sendall(f"POST /v2/models/{route}/generate_stream HTTP/1.1\r\nHost: test\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    buf = b""
    while buf.count(b"data:") < 3:
        chunk = s.recv(4096)
        assert chunk, buf
        buf += chunk
    s.close()
    assert wait_for(lambda: server.metric("llm_requests_finished_total", reason="abort") == aborted0 + 1, 10)
    assert wait_for(server.idle, 5)
