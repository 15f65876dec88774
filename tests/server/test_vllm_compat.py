"""vllm_backend's interface details against the real server: its error wording, its
cancellation log lines, its vllm:* metrics (names, labels, exact counts)."""
from __future__ import annotations

import json
import time

import numpy as np

from .util import StreamClient, grpc_stream_one, wait_for

LABELS = {"model": "vllm_model", "version": "1"}


def vllm_body(prompt, stream=False, **sp):
    return {"text_input": prompt, "stream": stream, "sampling_parameters": json.dumps(sp)}


def test_stream_with_prompt_is_refused_in_vllm_backend_words(server):
    c = grpc_stream_one(server.grpc_url, "vllm_model", {**vllm_body("Hi", True, max_tokens="3"),
                                                         "exclude_input_in_output": False}, batched=False)
    assert c.finals == 1 and c.errors and c.errors[0].endswith(
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."), c.errors
    c = grpc_stream_one(server.grpc_url, "vllm_model", vllm_body("Hi", max_tokens="3", best_of="2"), batched=False)
    assert c.finals == 1 and c.errors[0].startswith("Error generating stream: sampling_parameters.best_of"), c.errors


def test_vllm_metrics_count_every_request_exactly(server, tokenizer):
    prompts = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]
    names = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
             "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
             "vllm:request_prompt_tokens_sum", "vllm:request_generation_tokens_sum", "vllm:request_params_n_count"]
    before = {n: server.metric(n, **LABELS) for n in names}
    # (a cancelled BLS request can stay counted as running on 2.51 until the route's worker
    # ends: compare with the gauges' values before, not with zero)
    gauges0 = [server.metric(g, **LABELS) for g in ("vllm:num_requests_running", "vllm:num_requests_waiting")]
    ok0 = server.metric("vllm:request_success_total", finished_reason="length", **LABELS)
    m = 7
    for p in prompts:
        c = grpc_stream_one(server.grpc_url, "vllm_model",
                            vllm_body(p, max_tokens=str(m), temperature="0", ignore_eos="true"), batched=False)
        assert not c.errors and c.finals == 1
    n_prompt = sum(len(tokenizer.encode(p)) for p in prompts)
    delta = {n: server.metric(n, **LABELS) - before[n] for n in names}
    assert delta == {"vllm:prompt_tokens_total": n_prompt, "vllm:generation_tokens_total": 3 * m,
                     "vllm:time_to_first_token_seconds_count": 3, "vllm:time_per_output_token_seconds_count": 3 * (m - 1),
                     "vllm:e2e_request_latency_seconds_count": 3, "vllm:request_prompt_tokens_sum": n_prompt,
                     "vllm:request_generation_tokens_sum": 3 * m, "vllm:request_params_n_count": 3}
    assert server.metric("vllm:request_success_total", finished_reason="length", **LABELS) == ok0 + 3
    assert wait_for(lambda: [server.metric(g, **LABELS) for g in ("vllm:num_requests_running",
                                                                   "vllm:num_requests_waiting")] == gauges0)


def test_cancellation_is_logged_as_vllm_backend_logs_it(server):
    sc = StreamClient(server.grpc_url)
    c = sc.send("vllm_model", vllm_body("Write a poem", max_tokens="1500", temperature="0", ignore_eos="true"),
                "cancel-me", batched=False)
    time.sleep(1.0)
    sc.close(cancel=True)
    assert wait_for(lambda: "[vllm] Successfully cancelled the request" in server.log_path.read_text(errors="replace"), 30)
    log = server.log_path.read_text(errors="replace")
    assert log.index("[vllm] Cancelling the request") < log.index("[vllm] Successfully cancelled the request")
    assert wait_for(server.idle, 30)
    assert not c.responses  # non-streaming: nothing was sent before the cancel
