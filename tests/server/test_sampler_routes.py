"""The sampler features through every route (issue 10, issue 14 item 6): penalties, min_p,
log probabilities and n > 1, in each peer's tensors, against the in-process engine on the same
checkpoint (tokens) and HF's log_softmax (log probabilities)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from backend_lib import SamplingParams

from .hf_reference import hf, hf_logprobs, hf_ranks, hf_top  # noqa: F401 - hf: a fixture
from .conftest import BOTH_ENGINES
from .util import grpc_stream_one, wait_for

PROMPT = "The capital of France is"
N = 12
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3}
TOL = 1e-4


def one(v, dtype):
    return np.array([[v]], dtype=dtype)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode(PROMPT)


def engine_run(reference_engine, ids, **kw):
    kw.setdefault("max_tokens", N)
    kw.setdefault("ignore_eos", True)
    return reference_engine.generate([ids], SamplingParams(**kw))


@pytest.fixture(scope="module")
def greedy_penalised(reference_engine, prompt_ids):
    out = engine_run(reference_engine, prompt_ids, temperature=0.0, logprobs=0, **PENALTIES)[0]
    plain = engine_run(reference_engine, prompt_ids, temperature=0.0)[0]
    assert list(out.token_ids) != list(plain.token_ids), "the penalties must change this greedy run"
    return out


# ---- the token-level model (TensorRT-LLM's tensorrt_llm tensors) ----------------------------
@pytest.mark.parametrize("streaming", [True, False])
@BOTH_ENGINES
def test_llm_penalties_and_log_probs(server, hf, prompt_ids, greedy_penalised, streaming):
    c = grpc_stream_one(server.grpc_url, "llm", {
        "input_ids": np.array([prompt_ids], np.int32), "request_output_len": one(N, np.int32),
        "streaming": one(streaming, bool), "ignore_eos": one(True, bool), "exclude_input_in_output": one(True, bool),
        "return_log_probs": one(True, bool), **{k: one(v, np.float32) for k, v in PENALTIES.items()}})
    assert not c.errors and c.finals == 1
    ids = sum((r.as_numpy("output_ids")[0][0].tolist() for r in c.responses), [])
    assert ids == list(greedy_penalised.token_ids)
    # TensorRT-LLM's shapes: output_log_probs [1, beams, T] per response, cum_log_probs [1, beams]
    lps = [r.as_numpy("output_log_probs") for r in c.responses]
    assert all(a.dtype == np.float32 and a.shape == (1, 1, r.as_numpy("output_ids").shape[2])
               for a, r in zip(lps, c.responses))
    got = np.concatenate([a.reshape(-1) for a in lps])
    assert np.allclose(got, hf_logprobs(hf, prompt_ids, ids), atol=TOL)
    cum = c.responses[-1].as_numpy("cum_log_probs")
    assert cum.shape == (1, 1) and abs(float(cum[0][0]) - float(got.astype(np.float64).sum())) < 1e-3
    assert c.responses[-1].as_numpy("sequence_index") is None  # TensorRT-LLM: only with n > 1


@BOTH_ENGINES
def test_llm_num_return_sequences_seeded(server, reference_engine, prompt_ids):
    ref = engine_run(reference_engine, prompt_ids, temperature=1.0, seed=1234, n=4)
    seqs = [list(o.token_ids) for o in ref]
    assert len({tuple(s) for s in seqs}) == 4, "4 seeded samples should differ"
    body = {"input_ids": np.array([prompt_ids], np.int32), "request_output_len": one(N, np.int32),
            "streaming": one(True, bool), "ignore_eos": one(True, bool), "num_return_sequences": one(4, np.int32),
            "runtime_top_k": one(-1, np.int32), "runtime_top_p": one(1.0, np.float32),
            "temperature": one(1.0, np.float32), "seed": one(1234, np.uint64)}
    for _ in range(2):  # reproducible
        c = grpc_stream_one(server.grpc_url, "llm", body)
        assert not c.errors and c.finals == 1
        got = {i: [] for i in range(4)}
        for r in c.responses:
            got[int(r.as_numpy("sequence_index")[0][0])] += r.as_numpy("output_ids")[0][0].tolist()
        assert [got[i] for i in range(4)] == seqs


# ---- ensemble / llm_bls (TensorRT-LLM's text interface) -------------------------------------
@pytest.mark.parametrize("model", ["ensemble", "llm_bls"])
def test_text_routes_penalties_log_probs_and_sequences(server, tokenizer, hf, reference_engine, prompt_ids,
                                                       greedy_penalised, model):
    c = grpc_stream_one(server.grpc_url, model, {
        "text_input": np.array([[PROMPT.encode()]], object), "max_tokens": one(N, np.int32),
        "stream": one(True, bool), "ignore_eos": one(True, bool), "return_log_probs": one(True, bool),
        **{k: one(v, np.float32) for k, v in PENALTIES.items()}})
    assert not c.errors and c.finals == 1
    assert "".join(c.texts()) == tokenizer.decode(greedy_penalised.token_ids, skip_special_tokens=True)
    got = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in c.responses
                          if r.as_numpy("output_log_probs") is not None])
    assert np.allclose(got, hf_logprobs(hf, prompt_ids, greedy_penalised.token_ids), atol=TOL)
    # num_return_sequences: one sequence per response, sequence_index 0..3, FINAL once
    ref = engine_run(reference_engine, prompt_ids, temperature=1.0, seed=77, n=4)
    c = grpc_stream_one(server.grpc_url, model, {
        "text_input": np.array([[PROMPT.encode()]], object), "max_tokens": one(N, np.int32),
        "stream": one(True, bool), "ignore_eos": one(True, bool), "num_return_sequences": one(4, np.int32),
        "top_k": one(-1, np.int32), "top_p": one(1.0, np.float32), "temperature": one(1.0, np.float32),
        "seed": one(77, np.uint64)})
    assert not c.errors and c.finals == 1
    texts = {i: "" for i in range(4)}
    for r in c.responses:
        texts[int(r.as_numpy("sequence_index")[0][0])] += r.as_numpy("text_output")[0].decode()
    assert [texts[i] for i in range(4)] == [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in ref]
    assert len(set(texts.values())) == 4


# ---- vllm_model (vllm_backend's interface) ---------------------------------------------------
def vllm(prompt, stream=False, outputs=(), **sp):
    body = {"text_input": prompt, "stream": stream, "sampling_parameters": json.dumps(sp)}
    body.update({name: True for name in outputs})
    return body


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_logprobs_in_vllm_backends_format(server, tokenizer, hf, prompt_ids, greedy_penalised, stream):
    sp = {"temperature": "0", "max_tokens": str(N), "ignore_eos": "true", "logprobs": "2",
          **{k: str(v) for k, v in PENALTIES.items()}}
    c = grpc_stream_one(server.grpc_url, "vllm_model", vllm(PROMPT, stream, ("return_logprobs",
                        "return_cumulative_logprob", "return_num_output_tokens"), **sp), batched=False)
    assert not c.errors and c.finals == 1
    gen = list(greedy_penalised.token_ids)
    want = hf_logprobs(hf, prompt_ids, gen)
    tops = hf_top(hf, prompt_ids, gen, 2)
    ranks = hf_ranks(hf, prompt_ids, gen)
    seen = []
    for r in c.responses:
        entries = json.loads(r.as_numpy("logprobs")[0].decode())
        assert len(entries) == int(r.as_numpy("num_output_tokens")[0])
        for d in entries:
            assert 1 <= len(d) <= 3 and all(set(v) == {"logprob", "rank", "decoded_token"} for v in d.values())
            tok = int(next(iter(d)))  # the sampled token first
            i = len(seen)
            seen.append(tok)
            # raw logprobs: the penalised greedy choice need not be the raw rank 1
            assert abs(d[str(tok)]["logprob"] - want[i]) < TOL and d[str(tok)]["rank"] == ranks[i]
            vals, idx = tops[i]
            for j in range(2):
                e = d[str(int(idx[j]))]
                assert abs(e["logprob"] - float(vals[j])) < TOL
                assert e["rank"] == (j + 1 if int(idx[j]) != tok else ranks[i])
            for t, v in d.items():  # vLLM decodes each token on its own
                assert v["decoded_token"] == tokenizer.decode([int(t)])
    assert seen == gen
    text = "".join(r.as_numpy("text_output")[0].decode() for r in c.responses)
    assert text == ("" if stream else PROMPT) + tokenizer.decode(gen, skip_special_tokens=True)
    cum = float(c.responses[-1].as_numpy("cumulative_logprob")[0])
    assert abs(cum - sum(want)) < 1e-3
    # without sampling_parameters.logprobs: "null", as vllm_backend
    c = grpc_stream_one(server.grpc_url, "vllm_model", vllm(PROMPT, stream, ("return_logprobs",),
                        max_tokens="2"), batched=False)
    assert not c.errors and all(r.as_numpy("logprobs")[0] == b"null" for r in c.responses)


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_n_sequences_as_vllm_backend_returns_them(server, tokenizer, reference_engine, prompt_ids, stream):
    ref = [tokenizer.decode(o.token_ids, skip_special_tokens=True)
           for o in engine_run(reference_engine, prompt_ids, temperature=1.0, seed=5, n=4)]
    assert len(set(ref)) == 4
    body = vllm(PROMPT, stream, ("return_finish_reason", "return_num_output_tokens"), n="4", seed="5",
                temperature="1", max_tokens=str(N), ignore_eos="true")
    labels = {"model": "vllm_model", "version": "1"}
    n_count, n_sum = (server.metric(f"vllm:request_params_n_{s}", **labels) for s in ("count", "sum"))
    for _ in range(2):
        c = grpc_stream_one(server.grpc_url, "vllm_model", body, batched=False)
        assert not c.errors and c.finals == 1
        # every response: one entry per sequence in each output
        assert all(r.as_numpy("text_output").shape == (4,) and r.as_numpy("finish_reason").shape == (4,)
                   for r in c.responses)
        texts = ["".join(r.as_numpy("text_output")[i].decode() for r in c.responses) for i in range(4)]
        prefix = "" if stream else PROMPT
        assert texts == [prefix + t for t in ref]
        assert [f.decode() for f in c.responses[-1].as_numpy("finish_reason")] == ["length"] * 4
        assert sum(int(r.as_numpy("num_output_tokens").sum()) for r in c.responses) == 4 * N
    if not stream:
        assert len(c.responses) == 1
    # vllm_backend's vllm:request_params_n: one observation of n per request (counted when the
    # route's workers end, just after the FINAL)
    assert wait_for(lambda: server.metric("vllm:request_params_n_count", **labels) - n_count == 2, 10)
    assert server.metric("vllm:request_params_n_sum", **labels) - n_sum == 8


# ---- bad values: the field and the range, one FINAL, the server still serves -----------------
@pytest.mark.parametrize("model,body,field,limit", [
    ("llm", {"repetition_penalty": one(0.0, np.float32)}, "repetition_penalty", "> 0"),
    ("llm", {"num_return_sequences": one(17, np.int32)}, "num_return_sequences", "[1, 16]"),
    ("ensemble", {"presence_penalty": one(2.5, np.float32)}, "presence_penalty", "[-2, 2]"),
    ("llm_bls", {"frequency_penalty": one(-3.0, np.float32)}, "frequency_penalty", "[-2, 2]"),
    ("llm_bls", {"num_return_sequences": one(0, np.int32)}, "num_return_sequences", "[1, 16]"),
    ("vllm_model", {"n": "17"}, "sampling_parameters.n", "[1, 16]"),
    ("vllm_model", {"logprobs": "21"}, "sampling_parameters.logprobs", "[0, 20]"),
    ("vllm_model", {"min_p": "1.5", "n": "3"}, "sampling_parameters.min_p", "[0, 1]"),
    ("vllm_model", {"presence_penalty": "3"}, "sampling_parameters.presence_penalty", "[-2, 2]"),
])
def test_bad_sampler_values_name_the_field_and_range(server, prompt_ids, model, body, field, limit):
    if model == "llm":
        full = {"input_ids": np.array([prompt_ids], np.int32), "request_output_len": one(3, np.int32), **body}
    elif model == "vllm_model":
        full = vllm(PROMPT, max_tokens="3", **body)
    else:
        full = {"text_input": np.array([[PROMPT.encode()]], object), "max_tokens": one(3, np.int32), **body}
    c = grpc_stream_one(server.grpc_url, model, full, batched=model != "vllm_model")
    assert c.finals == 1 and len(c.errors) == 1, (c.errors, c.finals)
    assert field in c.errors[0] and limit in c.errors[0], c.errors[0]
    ok = grpc_stream_one(server.grpc_url, "llm", {"input_ids": np.array([prompt_ids], np.int32),
                                                  "request_output_len": one(2, np.int32)})
    assert not ok.errors and ok.finals == 1


def test_tensorrt_llm_non_decoupled_sequences_in_one_response(server, reference_engine, prompt_ids):
    """tensorrt_llm (decoupled_mode false): the n sequences in one response, in sequence_index
    order, stacked on the batch axis as a batch's rows are."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    ref = engine_run(reference_engine, prompt_ids, temperature=1.0, seed=9, n=2, logprobs=0)
    body = {"input_ids": np.array([prompt_ids], np.int32), "request_output_len": one(N, np.int32),
            "ignore_eos": one(True, bool), "exclude_input_in_output": one(True, bool),
            "num_return_sequences": one(2, np.int32), "return_log_probs": one(True, bool),
            "runtime_top_k": one(-1, np.int32), "runtime_top_p": one(1.0, np.float32),
            "temperature": one(1.0, np.float32), "seed": one(9, np.uint64)}
    inputs = []
    for k, v in body.items():
        t = grpcclient.InferInput(k, list(v.shape), np_to_triton_dtype(v.dtype))
        t.set_data_from_numpy(v)
        inputs.append(t)
    r = grpcclient.InferenceServerClient(server.grpc_url).infer("tensorrt_llm", inputs)
    assert r.as_numpy("output_ids")[:, 0, :].tolist() == [list(o.token_ids) for o in ref]
    assert r.as_numpy("sequence_index").reshape(-1).tolist() == [0, 1]
    lps = r.as_numpy("output_log_probs")
    assert lps.shape == (2, 1, N)
    assert np.allclose(lps[:, 0, :], [[next(iter(d.values())) for d in o.logprobs] for o in ref], atol=TOL)
    assert np.allclose(r.as_numpy("cum_log_probs").reshape(-1), [o.cumulative_logprob for o in ref], atol=1e-3)
