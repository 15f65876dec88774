"""TensorRT-LLM's interface (triton_glue/trtllm.py, the llm / ensemble / BLS configs) without
Triton: batched rows, the greedy rule, [2, -1] word lists, neutral-only inputs, and every
declared input handled."""
import re
from pathlib import Path

import numpy as np
import pytest

from triton_glue.inputs import InputError
from triton_glue.trtllm import (IGNORED, parse_text_requests, parse_token_requests,
                                parse_word_list, to_word_list, word_list_batch)

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def arr(v, dtype):
    return np.array([[v]], dtype=dtype)


def config_io(model, section):
    """[(name, data_type, dims)] of a config.pbtxt section."""
    txt = (REPO / model / "config.pbtxt").read_text()
    block = re.search(r"\n" + section + r" \[(.*?)\n\]", txt, re.S).group(1)
    return re.findall(r'name: "([^"]+)"\s+data_type: (\w+)\s+dims: \[ ([^\]]*) \]', block)


def test_word_list_round_trip_matches_trtllm_layout():
    # TensorRT-LLM's preprocessing: ids concatenated (pad 0), end offsets (pad -1)
    wl = to_word_list([[5, 6], [7], [8, 9, 10]])
    assert wl.tolist() == [[5, 6, 7, 8, 9, 10], [2, 3, 6, -1, -1, -1]] and wl.dtype == np.int32
    assert parse_word_list("stop_words_list", wl) == [[5, 6], [7], [8, 9, 10]]
    b = word_list_batch([[[1]], [[2, 3, 4]], []])
    assert b.shape == (3, 2, 3)
    assert [parse_word_list("x", r) for r in b] == [[[1]], [[2, 3, 4]], []]
    for bad in (np.array([[1, 2], [3, -1]], np.int32), np.array([[1, 2, 3]], np.int32),
                np.array([[1, 2], [2, 1]], np.int32)):
        with pytest.raises(InputError, match="^x:"):
            parse_word_list("x", bad)


def test_ignore_eos_also_ignores_end_id():
    """ignore_eos runs to max_tokens: the end_id the ensemble's preprocessing fills in (the
    tokenizer's EOS) must not stop it; without ignore_eos end_id replaces the model's EOS."""
    base = {"input_ids": np.array([[1, 2, 3]], np.int32), "max_tokens": arr(8, np.int32),
            "end_id": arr(2, np.int32), "stop_token_ids": np.array([[7]], np.int32)}
    (r,) = parse_token_requests(dict(base, ignore_eos=arr(True, bool)))
    assert r.sampling.ignore_eos and r.sampling.stop_token_ids == [7]
    (r,) = parse_token_requests(dict(base, ignore_eos=arr(False, bool)))
    assert r.sampling.ignore_eos and r.sampling.stop_token_ids == [7, 2]


def test_token_rows_batch_trim_and_trtllm_names():
    rows = parse_token_requests({
        "input_ids": np.array([[1, 2, 3, 0], [4, 5, 6, 7]], np.int32),
        "input_lengths": np.array([[3], [4]], np.int32),
        "request_output_len": np.array([[5], [6]], np.int32),
        "streaming": arr(True, bool), "end_id": arr(2, np.int32),
        "stop_words_list": np.stack([to_word_list([[9, 10], [11]])] * 2)})
    assert [r.prompt_ids for r in rows] == [[1, 2, 3], [4, 5, 6, 7]]
    assert [r.sampling.max_tokens for r in rows] == [5, 6]
    assert [(r.batch_index, r.batch_size) for r in rows] == [(0, 2), (1, 2)]
    r = rows[0]
    assert r.stream and r.exclude_input  # TensorRT-LLM never streams the prompt
    assert r.sampling.stop_sequences == [[9, 10], [11]]
    assert r.sampling.stop_token_ids == [2] and r.sampling.ignore_eos  # end_id replaces EOS
    with pytest.raises(InputError, match="^request_output_len: is required"):
        parse_token_requests({"input_ids": np.ones((1, 3), np.int32)})
    with pytest.raises(InputError, match="^input_ids: prompt must not be empty"):
        parse_token_requests({"input_ids": np.zeros((1, 0), np.int32), "max_tokens": arr(4, np.int32)})
    with pytest.raises(InputError, match="^temperature: batch size 3"):
        parse_token_requests({"input_ids": np.ones((2, 3), np.int32), "max_tokens": arr(4, np.int32),
                              "temperature": np.ones((3, 1), np.float32)})
    with pytest.raises(InputError, match="^min_tokens: and its alias min_length disagree"):
        parse_token_requests({"input_ids": np.ones((1, 3), np.int32), "max_tokens": arr(4, np.int32),
                              "min_tokens": arr(1, np.int32), "min_length": arr(2, np.int32)})
    # non-streaming: the prompt leads unless exclude_input_in_output
    r = parse_token_requests({"input_ids": np.ones((1, 3), np.int32), "max_tokens": arr(4, np.int32)})[0]
    assert not r.stream and not r.exclude_input


@pytest.mark.parametrize("k,p,temp,expect", [
    (None, None, 1.0, (0.0, None, None)),        # nothing sent: greedy
    (0, 0.0, 0.8, (0.0, None, None)),            # k=0, p=0: greedy whatever the temperature
    (1, 0.0, 1.0, (1.0, 1, 1.0)),                # top-k 1 (inflight_batcher_llm_client's default)
    (5, 0.0, 0.5, (0.5, 5, 1.0)),                # k > 0, p = 0: plain top-k
    (0, 0.75, 0.5, (0.5, -1, 0.75)),             # p only
    (4, 0.5, 1.25, (1.25, 4, 0.5)),
])
def test_trtllm_top_k_top_p_greedy_rule(k, p, temp, expect):
    a = {"input_ids": np.ones((1, 3), np.int32), "max_tokens": arr(4, np.int32),
         "temperature": arr(temp, np.float32)}
    if k is not None:
        a["runtime_top_k"] = arr(k, np.int32)
    if p is not None:
        a["runtime_top_p"] = arr(p, np.float32)
    s = parse_token_requests(a)[0].sampling
    params = s.to_params()
    assert (s.temperature, s.top_k, s.top_p) == expect
    if expect[0] == 0.0:
        assert params.temperature == 0.0


def test_unsupported_inputs_name_themselves_and_accept_neutral_values():
    base = {"input_ids": np.ones((1, 3), np.int32), "max_tokens": arr(4, np.int32)}
    neutral = {"beam_width": arr(1, np.int32), "return_context_logits": arr(False, bool),
               "embedding_bias": np.zeros((1, 0), np.float32),
               "decoder_input_ids": arr(3, np.int32), "lora_task_id": arr(0, np.uint64),
               "guided_decoding_guide_type": np.array([[b""]], object), "early_stopping": arr(True, bool)}
    parse_token_requests({**base, **neutral})
    for name, value in {"beam_width": arr(2, np.int32), "return_context_logits": arr(True, bool),
                        "len_penalty": arr(0.5, np.float32),
                        "embedding_bias": np.ones((1, 8), np.float32), "lora_task_id": arr(7, np.uint64),
                        "guided_decoding_guide_type": np.array([[b"json"]], object),
                        "decoder_input_ids": np.ones((1, 4), np.int32)}.items():
        with pytest.raises(InputError) as e:
            parse_token_requests({**base, name: value})
        assert e.value.field == name, str(e.value)
    with pytest.raises(InputError, match="^bad_words_list: multi-token bad words are not supported"):
        parse_token_requests({**base, "bad_words_list": to_word_list([[4], [5, 6]])[None]})
    assert parse_token_requests({**base, "bad_words_list": to_word_list([[4], [5]])[None]})[0] \
        .sampling.bad_token_ids == [4, 5]


def test_sampler_inputs_reach_the_engine_parameters():
    base = {"input_ids": np.ones((1, 3), np.int32), "max_tokens": arr(4, np.int32)}
    row = parse_token_requests({**base, "repetition_penalty": arr(1.3, np.float32),
                                "presence_penalty": arr(-0.5, np.float32), "frequency_penalty": arr(0.25, np.float32),
                                "min_p": arr(0.125, np.float32), "num_return_sequences": arr(4, np.int32),
                                "return_log_probs": arr(True, bool)})[0]
    p = row.sampling.to_params()
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p, p.n, p.logprobs) == \
        (pytest.approx(1.3), -0.5, 0.25, 0.125, 4, 0)
    assert row.top_logprobs is None
    # neutral values and absence are the engine's defaults
    p = parse_token_requests({**base, "return_log_probs": arr(False, bool), "num_return_sequences": arr(1, np.int32)}
                             )[0].sampling.to_params()
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p, p.n, p.logprobs) == \
        (1.0, 0.0, 0.0, 0.0, 1, None)
    # ours: the top-N too (the engine is asked for the top 20, for the sampled token's rank)
    row = parse_token_requests({**base, "num_top_logprobs": arr(3, np.int32)})[0]
    assert row.top_logprobs == 3 and row.sampling.logprobs == 20
    for name, value, match in (("num_return_sequences", arr(17, np.int32), r"\[1, 16\] \(got 17\)"),
                               ("num_return_sequences", arr(0, np.int32), r"\[1, 16\] \(got 0\)"),
                               ("num_top_logprobs", arr(21, np.int32), r"\[0, 20\] \(got 21\)"),
                               ("repetition_penalty", arr(np.nan, np.float32), "finite")):
        with pytest.raises(InputError, match=f"^{name}: .*{match}"):
            parse_token_requests({**base, name: value})


class _Recording(dict):
    """Records every input name the parser looks up."""
    def __init__(self, *a):
        super().__init__(*a)
        self.seen = set()

    def get(self, k, default=None):
        self.seen.add(k)
        return super().get(k, default)

    def __contains__(self, k):
        self.seen.add(k)
        return super().__contains__(k)


def test_every_declared_llm_input_is_parsed_refused_or_documented_as_ignored():
    rec = _Recording({"input_ids": np.ones((1, 3), np.int32), "max_tokens": arr(4, np.int32)})
    parse_token_requests(rec)
    declared = {n for n, _, _ in config_io("llm", "input")}
    control = {"cancel_request_id", "stop"}  # model.py's own
    missing = declared - rec.seen - set(IGNORED) - control
    assert not missing, f"declared but never read: {sorted(missing)}"
    # and the text routes
    rec = _Recording({"text_input": np.array([[b"hi"]], object), "max_tokens": arr(4, np.int32)})
    parse_text_requests(rec)
    for model, control in (("ensemble", set()), ("llm_bls", {"cancel_request_id"})):  # model.py's own
        declared = {n for n, _, _ in config_io(model, "input")}
        missing = declared - rec.seen - set(IGNORED) - control
        assert not missing, f"{model}: declared but never read: {sorted(missing)}"


TRTLLM_ENSEMBLE_INPUTS = {  # NVIDIA/TensorRT-LLM all_models/inflight_batcher_llm/ensemble/config.pbtxt
    "text_input", "decoder_text_input", "max_tokens", "num_return_sequences", "bad_words", "stop_words",
    "exclude_input_in_output", "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty",
    "repetition_penalty", "min_tokens", "presence_penalty", "frequency_penalty", "seed", "return_log_probs",
    "return_context_logits", "return_generation_logits", "return_perf_metrics", "beam_width", "stream",
    "prompt_embedding_table", "prompt_table_extra_id", "prompt_vocab_size", "embedding_bias_words",
    "embedding_bias_weights", "lora_task_id", "lora_weights", "lora_config", "guided_decoding_guide_type",
    "guided_decoding_guide"}
TRTLLM_TOKEN_INPUTS = {  # .../tensorrt_llm/config.pbtxt (the ones a decoder-only deployment uses)
    "input_ids", "input_lengths", "request_output_len", "num_return_sequences", "draft_input_ids",
    "decoder_input_ids", "decoder_input_lengths", "end_id", "pad_id", "stop_words_list", "bad_words_list",
    "embedding_bias", "beam_width", "temperature", "runtime_top_k", "runtime_top_p", "runtime_top_p_min",
    "runtime_top_p_decay", "runtime_top_p_reset_ids", "len_penalty", "early_stopping", "repetition_penalty",
    "min_tokens", "beam_search_diversity_rate", "presence_penalty", "frequency_penalty", "seed",
    "return_log_probs", "return_context_logits", "return_generation_logits", "return_perf_metrics",
    "exclude_input_in_output", "stop", "streaming", "prompt_embedding_table", "prompt_table_extra_ids",
    "prompt_vocab_size", "lora_task_id", "lora_weights", "lora_config", "guided_decoding_guide_type",
    "guided_decoding_guide", "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size"}


def test_configs_declare_every_trtllm_input_with_its_type():
    assert TRTLLM_ENSEMBLE_INPUTS <= {n for n, _, _ in config_io("ensemble", "input")}
    assert TRTLLM_ENSEMBLE_INPUTS <= {n for n, _, _ in config_io("llm_bls", "input")}
    llm = {n: (t, d) for n, t, d in config_io("llm", "input")}
    assert TRTLLM_TOKEN_INPUTS <= set(llm)
    assert llm["input_ids"] == ("TYPE_INT32", "-1") and llm["stop_words_list"] == ("TYPE_INT32", "2, -1")
    out = {n: (t, d) for n, t, d in config_io("llm", "output")}
    assert out["output_ids"] == ("TYPE_INT32", "-1, -1") and out["sequence_length"] == ("TYPE_INT32", "-1")
    pre = {n: (t, d) for n, t, d in config_io("preprocessing", "output")}
    assert pre["INPUT_ID"] == ("TYPE_INT32", "-1") and pre["STOP_WORDS_IDS"] == ("TYPE_INT32", "2, -1")
    assert {"DECODER_INPUT_ID", "REQUEST_DECODER_INPUT_LEN", "OUT_PAD_ID", "OUT_END_ID", "EMBEDDING_BIAS"} <= set(pre)


@pytest.mark.parametrize("wrapper,target", [("tensorrt_llm", "llm"), ("tensorrt_llm_bls", "llm_bls")])
def test_trtllm_named_wrappers_pass_every_tensor_through(wrapper, target):
    for section in ("input", "output"):
        w = set(config_io(wrapper, section))
        t = set(config_io(target, section)) - ({("cancel_request_id", "TYPE_STRING", "1")} if section == "input" else set())
        assert w == t, f"{wrapper} {section} differs from {target}: {sorted(w ^ t)}"


def test_text_rows_batch_and_stream_never_carries_prompt():
    rows = parse_text_requests({"text_input": np.array([[b"a"], [b"b c"]], object),
                                "max_tokens": np.array([[3], [4]], np.int32),
                                "stop_words": np.array([[b"x y", b""], [b"z", b"w"]], object),
                                "stream": arr(True, bool), "top_k": arr(0, np.int32)})
    assert [(r.text, r.sampling.max_tokens, r.stop_strings) for r in rows] == \
        [("a", 3, ["x y"]), ("b c", 4, ["z", "w"])]
    assert all(r.exclude_input and r.sampling.temperature == 0.0 for r in rows)
    cases = {
        "text_input: is required": {"max_tokens": arr(3, np.int32)},
        "text_input: is not valid UTF-8": {"text_input": np.array([[b"\xff\xfe"]], object), "max_tokens": arr(3, np.int32)},
        "text_input: prompt must not be empty": {"text_input": np.array([[b""]], object), "max_tokens": arr(3, np.int32)},
        "beam_width": {"text_input": np.array([[b"hi"]], object), "max_tokens": arr(3, np.int32), "beam_width": arr(2, np.int32)},
        "image_url_input": {"text_input": np.array([[b"hi"]], object), "max_tokens": arr(3, np.int32),
                            "image_url_input": np.array([[b"http://x"]], object)},
        "temperature": {"text_input": np.array([[b"hi"]], object), "max_tokens": arr(3, np.int32),
                        "temperature": arr(float("nan"), np.float32)},
    }
    for prefix, a in cases.items():
        with pytest.raises(InputError) as e:
            parse_text_requests(a)
        assert str(e.value).startswith(prefix), str(e.value)
