import json

import numpy as np
import pytest

from triton_glue.inputs import InputError, SamplingFields
from triton_glue.stops import StopStringMatcher
from triton_glue.vllm_compat import parse_sampling_parameters, parse_vllm_request


def feed_all(m, pieces):
    out, stopped = [], False
    for p in pieces:
        r = m.feed(p)
        out.append(r.text)
        if r.stopped:
            stopped = True
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


@pytest.mark.parametrize("pieces", [["Hello wor", "ld STOP here"], ["Hello world S", "T", "OP"],
                                    list("Hello world STOP here")])
def test_stop_string_split_across_chunks_never_leaks(pieces):
    m = StopStringMatcher(["STOP"])
    text, stopped = feed_all(m, pieces)
    assert stopped and text == "Hello world "


def test_partial_match_released_when_not_a_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST").text == "abc "
    assert m.feed("ART").text == "START"
    assert feed_all(StopStringMatcher(["xyz"]), ["ab", "cx"]) == ("abcx", False)


def test_earliest_and_include():
    m = StopStringMatcher(["b", "abc"], include_stop_str=True)
    r = m.feed("zzabcd")
    assert r.stopped and r.text == "zzabc" and r.stop_string == "abc"  # earliest start wins


def test_vllm_sampling_parameters_coercion():
    samp, extra = parse_sampling_parameters(json.dumps(
        {"max_tokens": "5", "temperature": "0", "top_p": "0.5", "ignore_eos": "false",
         "stop": "END", "n": "1", "seed": None, "stop_token_ids": "[3, 4]"}))
    assert (samp.max_tokens, samp.temperature, samp.top_p, samp.ignore_eos) == (5, 0.0, 0.5, False)
    assert extra["stop"] == ["END"] and samp.stop_token_ids == [3, 4] and samp.seed is None
    for bad, field in [({"foo": 1}, "sampling_parameters.foo"),
                       ({"max_tokens": "five"}, "sampling_parameters.max_tokens"),
                       ({"n": 17}, "sampling_parameters.n: must be in [1, 16] (got 17)"),
                       ({"n": "0"}, "sampling_parameters.n: must be in [1, 16] (got 0)"),
                       ({"logprobs": 21}, "sampling_parameters.logprobs: must be in [0, 20] (got 21)"),
                       ({"min_p": "x"}, "sampling_parameters.min_p: must be float"),
                       ({"best_of": 2}, "sampling_parameters.best_of"),
                       ({"ignore_eos": "maybe"}, "ignore_eos")]:
        with pytest.raises(InputError) as e:
            parse_sampling_parameters(json.dumps(bad))
        assert str(e.value).startswith(field), str(e.value)
    with pytest.raises(InputError, match="^sampling_parameters: is not valid JSON"):
        parse_sampling_parameters("{")
    # the sampler keys, numbers as strings as genai-perf sends them, reach SamplingParams
    samp, _ = parse_sampling_parameters(json.dumps(
        {"n": "4", "logprobs": "2", "presence_penalty": "0.5", "frequency_penalty": -0.25,
         "repetition_penalty": "1.2", "min_p": "0.05"}))
    p = samp.to_params()
    assert (p.n, p.logprobs, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == \
        (4, 2, 0.5, -0.25, 1.2, 0.05)


def test_range_errors_name_the_engine_limits_they_do_not_know():
    # the text routes check ranges before `llm`, whose max_model_len and vocabulary they do not
    # know: the message names the limit (the engine's own message gives its value)
    for bad, message in [({"max_tokens": 0}, "sampling_parameters.max_tokens: max_tokens must be an integer in "
                                             "[1, max_model_len] (got 0)"),
                         ({"stop_token_ids": [-1]}, "sampling_parameters.stop_token_ids: stop_token_ids must hold "
                                                    "token ids in [0, vocab_size) (got [-1])")]:
        with pytest.raises(InputError) as e:
            parse_sampling_parameters(json.dumps(bad))
        assert str(e.value) == message
    with pytest.raises(InputError) as e:  # llm_bls / ensemble (triton_glue/trtllm.py)
        SamplingFields(max_tokens=0).check_ranges()
    assert str(e.value) == "max_tokens: max_tokens must be an integer in [1, max_model_len] (got 0)"


def test_deeply_nested_sampling_parameters_are_a_client_error():
    for text in ("[" * 100000, '{"max_tokens": ' + "[" * 100000, '{"stop_token_ids": "' + "[" * 100000 + '"}'):
        with pytest.raises(InputError) as e:
            parse_sampling_parameters(text)
        assert str(e.value) == "sampling_parameters: is nested too deeply"
    with pytest.raises(InputError) as e:
        parse_vllm_request({"text_input": np.array([b"hi"], dtype=object),
                            "sampling_parameters": np.array([b"[" * 100000], dtype=object)})
    assert str(e.value) == "Error generating stream: sampling_parameters: is nested too deeply"


def test_vllm_request_defaults():
    t = {"text_input": np.array([b"hi"], dtype=object)}
    assert parse_vllm_request(t).exclude_input is True is not False or True
    assert parse_vllm_request(t).exclude_input is False  # non-streaming: prompt prepended
    s = parse_vllm_request({**t, "stream": np.array([True])})
    assert s.stream and s.exclude_input
    with pytest.raises(InputError) as e:  # vllm_backend's words (its enabled_stream test checks them)
        parse_vllm_request({**t, "stream": np.array([True]), "exclude_input_in_output": np.array([False])})
    assert str(e.value) == ("Error generating stream: When streaming, `exclude_input_in_output` = False "
                            "is not allowed.") and e.value.field == "exclude_input_in_output"
    r = parse_vllm_request({**t, "return_logprobs": np.array([True]), "return_cumulative_logprob": np.array([True])})
    assert r.return_logprobs and r.return_cumulative_logprob and r.wants_logprobs
    assert not parse_vllm_request(t).wants_logprobs


class _FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created = []

    def __init__(self, name, description, kind):
        _FakeMetricFamily.created.append(name)

    def Metric(self, labels, buckets=None):
        return type("M", (), {"observe": lambda s, v: None, "increment": lambda s, v: None,
                              "set": lambda s, v: None})()


class _FakePb:
    MetricFamily = _FakeMetricFamily
    Logger = type("L", (), {"log_info": staticmethod(lambda m: None)})


def test_vllm_metrics_honour_report_custom_metrics():
    from triton_glue.vllm_metrics import VllmRouteHooks, buckets_1_2_5, report_custom_metrics
    assert not report_custom_metrics({}) and not report_custom_metrics({"REPORT_CUSTOM_METRICS": "false"})
    assert report_custom_metrics({"REPORT_CUSTOM_METRICS": "True"})
    _FakeMetricFamily.created.clear()
    VllmRouteHooks(_FakePb, {"model": "m", "version": "1"}, metrics=False).request(None).finished("stop", 3, 4)
    assert _FakeMetricFamily.created == []
    VllmRouteHooks(_FakePb, {"model": "m", "version": "1"}, metrics=True)
    assert {"vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
            "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens", "vllm:request_params_n", "vllm:request_success_total",
            "vllm:num_requests_running", "vllm:num_requests_waiting"} == set(_FakeMetricFamily.created)
    assert buckets_1_2_5(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
