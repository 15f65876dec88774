"""Bad inputs raise ValueError naming the field; the engine keeps serving afterwards."""
import random

import pytest
import torch

from backend_lib import EngineConfig, SamplingParams
from backend_lib.config import engine_parameter_names
from engine_helpers import greedy, make_engine, random_prompt

MAX_LEN = 256


@pytest.fixture(scope="module")
def eng(path):
    return make_engine(path, max_model_len=MAX_LEN, async_token_handoff="on", max_num_batched_tokens=32)


GOOD = [5, 6, 7, 8]

# (case id, prompt, params, word the message must contain)
BAD_REQUESTS = [
    ("empty prompt", [], greedy(4), "prompt"),
    ("prompt == max_model_len", [5] * MAX_LEN, greedy(4), "max_model_len"),
    ("prompt > max_model_len", [5] * (MAX_LEN + 7), greedy(4), "max_model_len"),
    ("max_tokens 0", GOOD, greedy(0), "max_tokens"),
    ("max_tokens > max_model_len", GOOD, greedy(MAX_LEN + 1), "max_tokens"),
    ("max_tokens not int", GOOD, greedy(2.5), "max_tokens"),
    ("min_tokens > max_tokens", GOOD, greedy(4, min_tokens=5), "min_tokens"),
    ("min_tokens negative", GOOD, greedy(4, min_tokens=-1), "min_tokens"),
    ("temperature -1", GOOD, SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
    ("temperature nan", GOOD, SamplingParams(max_tokens=4, temperature=float("nan")), "temperature"),
    ("top_p 0", GOOD, SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
    ("top_p 1.5", GOOD, SamplingParams(max_tokens=4, top_p=1.5), "top_p"),
    ("top_k -2", GOOD, SamplingParams(max_tokens=4, top_k=-2), "top_k"),
    ("seed negative", GOOD, SamplingParams(max_tokens=4, seed=-1), "seed"),
    ("token id == vocab", [5, 768, 6], greedy(4), "input_ids"),
    ("token id huge", [5, 10**9], greedy(4), "input_ids"),
    ("negative token id", [5, -1, 6], greedy(4), "input_ids"),
    ("token id bool", [5, True, 6], greedy(4), "input_ids"),
    ("token id float", [5, 6.0], greedy(4), "input_ids"),
    ("token id str", ["5"], greedy(4), "input_ids"),
    ("stop id outside vocab", GOOD, greedy(4, stop_token_ids=[768]), "stop_token_ids"),
    ("bad id negative", GOOD, greedy(4, bad_token_ids=[-3]), "bad_token_ids"),
    ("too many stop ids", GOOD, greedy(4, stop_token_ids=list(range(4, 30))), "stop_token_ids"),
    ("repetition_penalty 0", GOOD, greedy(4, repetition_penalty=0.0), "repetition_penalty"),
    ("repetition_penalty inf", GOOD, greedy(4, repetition_penalty=float("inf")), "repetition_penalty"),
    ("presence_penalty 2.5", GOOD, greedy(4, presence_penalty=2.5), "[-2, 2]"),
    ("frequency_penalty nan", GOOD, greedy(4, frequency_penalty=float("nan")), "frequency_penalty"),
    ("frequency_penalty -3", GOOD, greedy(4, frequency_penalty=-3.0), "[-2, 2]"),
    ("min_p 1.5", GOOD, greedy(4, min_p=1.5), "min_p"),
    ("min_p negative", GOOD, greedy(4, min_p=-0.1), "[0, 1]"),
    ("logprobs 21", GOOD, greedy(4, logprobs=21), "[0, 20]"),
    ("logprobs negative", GOOD, greedy(4, logprobs=-1), "logprobs"),
    ("logprobs bool", GOOD, greedy(4, logprobs=True), "logprobs"),
    ("n 0", GOOD, greedy(4, n=0), "[1, 16]"),
    ("n 17", GOOD, greedy(4, n=17), "[1, 16]"),
    ("n float", GOOD, greedy(4, n=2.0), "n must be"),
]


def _reference(eng, prompts):
    return [o.token_ids for o in eng.generate(prompts, greedy(12, ignore_eos=True))]


def test_bad_requests_raise_naming_the_field_and_engine_keeps_serving(eng):
    rng = random.Random(0)
    prompts = [random_prompt(rng, n) for n in (3, 40, 90)]
    ref = _reference(eng, prompts)
    for case, prompt, params, word in BAD_REQUESTS:
        # Requests in flight (one mid-prefill with a small prefix computed) while the bad one arrives.
        for i, p in enumerate(prompts):
            eng.add_request(f"ok-{i}", p, greedy(12, ignore_eos=True))
        eng.step()
        with pytest.raises(ValueError) as e:
            eng.add_request("bad", prompt, params)
        assert word in str(e.value), (case, str(e.value))
        got = {f"ok-{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished():
            for out in eng.step():
                got[out.request_id].extend(out.new_token_ids)
        assert [got[f"ok-{i}"] for i in range(len(prompts))] == ref, case
        assert eng.stats().kv_blocks_used == 0 and "bad" not in eng.scheduler.requests
    # The id of a rejected request is free to use.
    assert eng.generate([GOOD], greedy(3, ignore_eos=True))[0].finish_reason == "length"


def test_duplicate_request_id(eng):
    eng.add_request("dup", GOOD, greedy(8, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("dup", [9, 10], greedy(3))
    toks = []
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == "dup"
            toks += out.new_token_ids
    assert toks == eng.generate([GOOD], greedy(8, ignore_eos=True))[0].token_ids
    # Once finished, the id may be reused.
    eng.add_request("dup", GOOD, greedy(2, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().kv_blocks_used == 0


def test_longest_prompt_and_max_tokens_clamped_by_max_model_len(eng):
    """A prompt of max_model_len-1 tokens is valid and gets exactly one token; max_tokens =
    max_model_len is valid and ends with "length" at max_model_len."""
    out = eng.generate([[7] * (MAX_LEN - 1)], greedy(MAX_LEN, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    out = eng.generate([[7] * 200], greedy(MAX_LEN, ignore_eos=True))[0]
    assert len(out.token_ids) == MAX_LEN - 200 and out.finish_reason == "length"
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("field,value", [
    ("device", "tpu"), ("dtype", "int8"), ("max_num_seqs", 0), ("max_num_seqs", -3),
    ("async_token_handoff", "maybe"), ("max_num_batched_tokens", 0), ("block_size", 0),
    ("num_kv_blocks", 1), ("gpu_memory_utilization", 1.5), ("enable_chunked_prefill", "yes"),
    ("max_model_len", -1), ("model_path", ""),
])
def test_engine_config_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError) as e:
        EngineConfig(**{field: value})
    assert field in str(e.value)


@pytest.mark.parametrize("key,raw", [
    ("max_num_seqs", "abc"), ("max_num_seqs", "0"), ("enable_chunked_prefill", "maybe"),
    ("gpu_memory_utilization", "lots"), ("async_token_handoff", "sometimes"), ("device", "tpu"),
    ("block_size", "1.5"),
])
def test_from_parameters_bad_value_names_the_parameter(key, raw):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_parameters({"model_path": {"string_value": "models/x"}, key: {"string_value": raw}})
    assert key in str(e.value)


def test_from_parameters_parses_strings():
    cfg = EngineConfig.from_parameters({"model_path": {"string_value": "m"}, "max_num_seqs": "8",
                                        "enable_chunked_prefill": "false", "gpu_memory_utilization": "0.5",
                                        "async_token_handoff": "off", "triton_only_key": "x"})
    assert (cfg.max_num_seqs, cfg.enable_chunked_prefill, cfg.gpu_memory_utilization, cfg.async_token_handoff) \
        == (8, False, 0.5, "off")
    assert "max_num_seqs" in engine_parameter_names()


def test_engine_level_config_errors(path, tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        make_engine(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(path, max_model_len=10**6)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        make_engine(path, max_model_len=512, num_kv_blocks=8)  # cannot hold one sequence
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device"):
            make_engine(path, device="cuda")


def test_no_chunked_prefill_requires_budget_for_max_model_len(path):
    """With enable_chunked_prefill=false a prompt longer than max_num_batched_tokens could
    never be scheduled (it used to wait forever and block the queue): refused at load."""
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(path, enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=256)
    eng = make_engine(path, enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256)
    outs = eng.generate([[5] * 200, [6] * 30], greedy(4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]


def test_generate_rejects_bad_batches_without_leaving_requests_behind(eng):
    with pytest.raises(ValueError, match="params"):
        eng.generate([GOOD, GOOD], [greedy(3), greedy(3), greedy(3)])
    with pytest.raises(ValueError, match="params"):
        eng.generate([GOOD, GOOD, GOOD], [greedy(3), greedy(3)])
    with pytest.raises(ValueError, match="input_ids"):
        eng.generate([GOOD, [5, 6], [5, 99999]], greedy(3))
    with pytest.raises(ValueError, match="top_p"):
        eng.generate([GOOD, [5, 6]], [greedy(3), SamplingParams(max_tokens=3, top_p=2.0)])
    assert not eng.has_unfinished() and not eng.scheduler.requests
    assert eng.stats().kv_blocks_used == 0
    outs = eng.generate([GOOD, [5, 6]], greedy(3, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3]


def test_request_id_with_nul_is_refused(eng):
    """A NUL in an id could collide with the ids of the sequences of an n > 1 request (the
    client's id + NUL + 'n' + index): such an id is refused, naming the field."""
    eng.add_request("par", GOOD, greedy(6, ignore_eos=True, n=2, seed=1))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("par\x00n0", GOOD, greedy(3))
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request(7, GOOD, greedy(3))
    counts = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == "par"
            counts[out.index] = counts.get(out.index, 0) + len(out.new_token_ids)
    assert counts == {0: 6, 1: 6}
    assert eng.stats().kv_blocks_used == 0


def test_explicit_num_kv_blocks_that_cannot_fit_the_gpu_names_the_limit(path, monkeypatch):
    """An explicit num_kv_blocks larger than the GPU's free memory is refused before the
    allocation with the field, the sizes and the largest count that fits (the 8B shape with
    the bench's 49680 blocks asked an 80 GiB H100 for 97 GiB and died in torch's allocator)."""
    from backend_lib import engine as engine_mod
    from backend_lib.models.loader import load_hf_config
    cfg = EngineConfig(model_path=path, device="cuda", dtype="bfloat16", num_kv_blocks=11)
    hf = load_hf_config(path)
    per_block, weights = engine_mod._kv_sizes(cfg, hf)
    free = weights + engine_mod._ACTIVATIONS_BYTES + 10 * per_block
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, 2 * free))
    with pytest.raises(ValueError) as e:
        engine_mod._check_kv_fits(cfg, hf, 11)
    msg = str(e.value)
    assert msg.startswith("EngineConfig.num_kv_blocks: 11 blocks need") and "at most 10 blocks fit" in msg
    engine_mod._check_kv_fits(cfg, hf, 10)  # exactly what fits passes
