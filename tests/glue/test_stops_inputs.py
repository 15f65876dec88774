import json

import numpy as np
import pytest

from triton_glue.inputs import (InputError, parse_token_request, parse_trtllm_text_request)
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


def arr(v, dtype):
    return np.array([[v]], dtype=dtype)


def test_token_request_parsing():
    r = parse_token_request({"input_ids": np.array([[1, 2, 3]], dtype=np.int64),
                             "max_tokens": arr(4, np.int32), "temperature": arr(0.0, np.float32),
                             "end_id": arr(7, np.int32)})
    assert r.prompt_ids == [1, 2, 3] and r.sampling.max_tokens == 4
    assert r.sampling.stop_token_ids == [7] and r.sampling.ignore_eos
    with pytest.raises(InputError, match="^input_ids"):
        parse_token_request({"input_ids": np.zeros((1, 0), np.int64), "max_tokens": arr(4, np.int32)})
    with pytest.raises(InputError, match="^input_ids: batch size"):
        parse_token_request({"input_ids": np.zeros((2, 3), np.int64), "max_tokens": arr(4, np.int32)})
    with pytest.raises(InputError, match="^max_tokens"):
        parse_token_request({"input_ids": np.ones((1, 3), np.int64)})


def test_text_request_parsing_errors_name_the_field():
    ok = {"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": arr(3, np.int32)}
    r = parse_trtllm_text_request({**ok, "stop_words": np.array([[b"a", b""]], dtype=object),
                                   "min_length": arr(2, np.int32)})
    assert r.stop_strings == ["a"] and r.sampling.min_tokens == 2
    cases = {
        "text_input": {"max_tokens": arr(3, np.int32)},
        "text_input: is not valid UTF-8": {**ok, "text_input": np.array([[b"\xff\xfe"]], dtype=object)},
        "text_input: prompt must not be empty": {**ok, "text_input": np.array([[b""]], dtype=object)},
        "beam_width": {**ok, "beam_width": arr(2, np.int32)},
        "temperature": {**ok, "temperature": arr(float("nan"), np.float32)},
        "max_tokens: expected exactly one": {**ok, "max_tokens": np.array([[1, 2]], np.int32)},
    }
    for prefix, arrays in cases.items():
        with pytest.raises(InputError) as e:
            parse_trtllm_text_request(arrays)
        assert str(e.value).startswith(prefix), str(e.value)


def test_vllm_sampling_parameters_coercion():
    samp, extra = parse_sampling_parameters(json.dumps(
        {"max_tokens": "5", "temperature": "0", "top_p": "0.5", "ignore_eos": "false",
         "stop": "END", "n": "1", "seed": None, "stop_token_ids": "[3, 4]"}))
    assert (samp.max_tokens, samp.temperature, samp.top_p, samp.ignore_eos) == (5, 0.0, 0.5, False)
    assert extra["stop"] == ["END"] and samp.stop_token_ids == [3, 4] and samp.seed is None
    for bad, field in [({"foo": 1}, "sampling_parameters.foo"),
                       ({"max_tokens": "five"}, "sampling_parameters.max_tokens"),
                       ({"n": 2}, "sampling_parameters.n"),
                       ({"ignore_eos": "maybe"}, "ignore_eos")]:
        with pytest.raises(InputError) as e:
            parse_sampling_parameters(json.dumps(bad))
        assert str(e.value).startswith(field), str(e.value)
    with pytest.raises(InputError, match="^sampling_parameters: is not valid JSON"):
        parse_sampling_parameters("{")


def test_vllm_request_defaults():
    t = {"text_input": np.array([b"hi"], dtype=object)}
    assert parse_vllm_request(t).exclude_input is True is not False or True
    assert parse_vllm_request(t).exclude_input is False  # non-streaming: prompt prepended
    s = parse_vllm_request({**t, "stream": np.array([True])})
    assert s.stream and s.exclude_input
    with pytest.raises(InputError, match="^exclude_input_in_output"):
        parse_vllm_request({**t, "stream": np.array([True]), "exclude_input_in_output": np.array([False])})
