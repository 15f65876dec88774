"""TensorRT-LLM's interface against the real server: the tensors its clients send and read
(inflight_batcher_llm/client, tools/inflight_batcher_llm), compared with the in-process engine."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from backend_lib import SamplingParams
from triton_glue.detokenizer import full_text
from triton_glue.trtllm import STOP_WITHOUT_ID, parse_word_list

from .conftest import BOTH_ENGINES, start_server
from .util import StreamClient, grpc_stream_one, wait_for

PROMPT = "The quick brown fox"
N = 10


def tensor(mod, name, a):
    t = mod.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
    t.set_data_from_numpy(a)
    return t


def one(v, dtype):
    return np.array([[v]], dtype=dtype)


@pytest.fixture(scope="module")
def ref(tokenizer, reference_engine):
    ids = tokenizer.encode(PROMPT)
    out = reference_engine.generate([ids], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0]
    return ids, list(out.token_ids)


def greedy_of(reference_engine, ids, n=N, **kw):
    return list(reference_engine.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, **kw))[0].token_ids)


@BOTH_ENGINES
def test_llm_streaming_speaks_tensorrt_llm_tensors_and_never_streams_the_prompt(server, ref):
    ids, gen = ref
    # inflight_batcher_llm_client.py's request: no sampling knobs but top_k=1/top_p=0 -> greedy
    c = grpc_stream_one(server.grpc_url, "llm", {
        "input_ids": np.array([ids], np.int32), "input_lengths": one(len(ids), np.int32),
        "request_output_len": one(N, np.int32), "streaming": one(True, bool), "end_id": one(-1, np.int32),
        "pad_id": one(3, np.int32), "beam_width": one(1, np.int32), "temperature": one(1.0, np.float32),
        "runtime_top_k": one(1, np.int32), "runtime_top_p": one(0.0, np.float32),
        "exclude_input_in_output": one(False, bool), "ignore_eos": one(True, bool)})
    assert not c.errors and c.finals == 1
    chunks = [r.as_numpy("output_ids") for r in c.responses]
    assert all(a.dtype == np.int32 and a.ndim == 3 and a.shape[:2] == (1, 1) for a in chunks)
    lens = [int(r.as_numpy("sequence_length")[0][0]) for r in c.responses]
    assert lens == [a.shape[2] for a in chunks]
    assert sum((a[0][0].tolist() for a in chunks), []) == gen  # no prompt, even with exclude false
    assert len(chunks) >= 2


def test_tensorrt_llm_non_decoupled_infer_over_http_and_grpc(server, ref):
    ids, gen = ref
    for mod, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
        cl = mod.InferenceServerClient(url)
        r = cl.infer("tensorrt_llm", [tensor(mod, "input_ids", np.array([ids], np.int32)),
                                      tensor(mod, "input_lengths", one(len(ids), np.int32)),
                                      tensor(mod, "request_output_len", one(N, np.int32)),
                                      tensor(mod, "ignore_eos", one(True, bool))])
        out = r.as_numpy("output_ids")
        assert out.shape == (1, 1, len(ids) + N) and out[0][0].tolist() == ids + gen  # prompt leads
        assert r.as_numpy("sequence_length").tolist() == [[len(ids) + N]]
        with pytest.raises(InferenceServerException, match="Streaming is only supported in decoupled mode"):
            cl.infer("tensorrt_llm", [tensor(mod, "input_ids", np.array([ids], np.int32)),
                                      tensor(mod, "request_output_len", one(N, np.int32)),
                                      tensor(mod, "streaming", one(True, bool))])


def test_llm_batch_rows_each_get_their_result_and_one_final(server, tokenizer, reference_engine):
    prompts = ["Hello world", "The quick brown fox jumps", "naïve café"]
    rows = [tokenizer.encode(p) for p in prompts]
    width = max(map(len, rows))
    ids = np.array([r + [3] * (width - len(r)) for r in rows], np.int32)
    refs = [greedy_of(reference_engine, r, 6, ignore_eos=True) for r in rows]
    for stream in (False, True):
        c = grpc_stream_one(server.grpc_url, "llm", {
            "input_ids": ids, "input_lengths": np.array([[len(r)] for r in rows], np.int32),
            "request_output_len": np.full((3, 1), 6, np.int32), "streaming": np.full((3, 1), stream),
            "ignore_eos": np.full((3, 1), True)})
        assert not c.errors and c.finals == 1
        got = {0: [], 1: [], 2: []}
        for r in c.responses:
            got[int(r.as_numpy("batch_index")[0][0])] += r.as_numpy("output_ids")[0][0].tolist()
        for b in range(3):
            assert got[b] == (refs[b] if stream else rows[b] + refs[b]), (stream, b)
    # the non-decoupled name merges the rows into one [B, 1, N] response
    r = grpcclient.InferenceServerClient(server.grpc_url).infer("tensorrt_llm", [
        tensor(grpcclient, "input_ids", ids), tensor(grpcclient, "input_lengths", np.array([[len(r)] for r in rows], np.int32)),
        tensor(grpcclient, "request_output_len", np.full((3, 1), 6, np.int32)),
        tensor(grpcclient, "exclude_input_in_output", np.full((3, 1), True)),
        tensor(grpcclient, "ignore_eos", np.full((3, 1), True))])
    assert r.as_numpy("output_ids")[:, 0, :].tolist() == refs


def test_text_output_is_one_string_per_sequence_and_batches_give_b_results(server, tokenizer, reference_engine):
    prompts = ["Hello world", "The quick brown fox"]
    refs = [full_text(tokenizer, tokenizer.encode(p), greedy_of(reference_engine, tokenizer.encode(p), 8)) for p in prompts]
    for model in ("ensemble", "llm_bls"):
        c = grpc_stream_one(server.grpc_url, model, {"text_input": np.array([[p.encode()] for p in prompts], object),
                                                     "max_tokens": np.full((2, 1), 8, np.int32),
                                                     "exclude_input_in_output": np.full((2, 1), True)})
        assert not c.errors and c.finals == 1, c.errors
        got = {}
        for r in c.responses:
            t = r.as_numpy("text_output")
            assert t.shape == (1,)  # TensorRT-LLM clients call output[0].decode()
            got[int(r.as_numpy("batch_index")[0][0])] = t[0].decode()
        assert got == {0: refs[0], 1: refs[1]}, model
    # one prompt, streaming: text pieces, no prompt, 1-D each
    for model in ("ensemble", "llm_bls"):
        c = grpc_stream_one(server.grpc_url, model, {"text_input": np.array([[prompts[1].encode()]], object),
                                                     "max_tokens": one(8, np.int32), "stream": one(True, bool)})
        assert not c.errors and all(r.as_numpy("text_output").shape == (1,) for r in c.responses)
        assert "".join(c.texts()) == refs[1], model


def _two_token_stop_word(tokenizer, gen):
    """A word that tokenizes, on its own, into two consecutive generated tokens."""
    for i in range(1, len(gen) - 1):
        word = tokenizer.decode(gen[i:i + 2])
        if word and tokenizer.encode(word, add_special_tokens=False) == gen[i:i + 2]:
            return i, word
    pytest.skip("no re-encodable two-token window in the greedy output")


def test_multi_token_stop_words_stop_and_stay_in_the_output_on_ensemble_and_bls(server, tokenizer, reference_engine):
    ids = tokenizer.encode(PROMPT)
    gen = greedy_of(reference_engine, ids, 30, ignore_eos=True)
    i, word = _two_token_stop_word(tokenizer, gen)
    cut = next(j for j in range(1, len(gen)) if gen[j - 1:j + 1] == gen[i:i + 2])
    expect = full_text(tokenizer, ids, gen[:cut + 1])
    assert expect.endswith(word)
    body = {"text_input": PROMPT, "max_tokens": 30, "stop_words": [word, "never-generated-zzzz"],
            "exclude_input_in_output": True, "ignore_eos": True}
    for model in ("ensemble", "llm_bls"):
        for stream in (False, True):
            c = grpc_stream_one(server.grpc_url, model, {**body, "stream": stream})
            assert not c.errors, c.errors
            assert "".join(c.texts()) == expect, (model, stream)
    # the word list preprocessing sends is TensorRT-LLM's [2, -1] layout
    r = grpcclient.InferenceServerClient(server.grpc_url).infer("preprocessing", [
        tensor(grpcclient, "QUERY", np.array([[PROMPT.encode()]], object)),
        tensor(grpcclient, "REQUEST_OUTPUT_LEN", one(30, np.int32)),
        tensor(grpcclient, "STOP_WORDS_DICT", np.array([[word.encode(), b"ab"]], object))])
    sw = r.as_numpy("STOP_WORDS_IDS")
    assert sw.dtype == np.int32 and sw.shape[:2] == (1, 2)
    assert parse_word_list("x", sw) == [gen[i:i + 2], tokenizer.encode("ab", add_special_tokens=False)]
    assert r.as_numpy("INPUT_ID").dtype == np.int32 and r.as_numpy("INPUT_ID")[0].tolist() == ids
    assert r.as_numpy("OUT_END_ID").tolist() == [[tokenizer.eos_token_id]]
    assert r.as_numpy("DECODER_INPUT_ID").shape == (1, 1)


def test_postprocessing_decodes_tensorrt_llm_token_batches(server, tokenizer, ref):
    ids, gen = ref
    toks = np.array([[ids + gen + [0, 0]]], np.int32)  # padded; SEQUENCE_LENGTH trims
    r = grpcclient.InferenceServerClient(server.grpc_url).infer("postprocessing", [
        tensor(grpcclient, "TOKENS_BATCH", toks), tensor(grpcclient, "SEQUENCE_LENGTH", one(len(ids) + N, np.int32))])
    out = r.as_numpy("OUTPUT")
    assert out.shape == (1,) and out[0].decode() == tokenizer.decode(ids + gen, skip_special_tokens=True)


@pytest.mark.parametrize("batch,beams", [(1, 1), (2, 1)])
def test_postprocessing_turns_an_empty_chunk_into_empty_text(server, batch, beams):
    """The FINAL `llm` aborts an ensemble stream with (at shutdown) carries no new tokens:
    postprocessing must answer "" per sequence, not fail the stream."""
    r = grpcclient.InferenceServerClient(server.grpc_url).infer("postprocessing", [
        tensor(grpcclient, "TOKENS_BATCH", np.zeros((batch, beams, 0), np.int32)),
        tensor(grpcclient, "SEQUENCE_LENGTH", np.zeros((batch, beams), np.int32))])
    assert r.as_numpy("OUTPUT").tolist() == [b""] * (batch * beams)


@pytest.mark.parametrize("model,name,value", [
    ("ensemble", "beam_width", one(2, np.int32)),
    ("ensemble", "return_context_logits", one(True, bool)),
    ("ensemble", "lora_task_id", one(5, np.uint64)),
    ("llm_bls", "embedding_bias_words", np.array([[b"foo"]], object)),
    ("llm", "guided_decoding_guide_type", np.array([[b"json"]], object)),
    ("llm", "len_penalty", one(1.3, np.float32)),
])
def test_unsupported_inputs_are_refused_by_name_neutral_ones_accepted(server, model, name, value):
    base = ({"input_ids": np.array([[1, 300, 301]], np.int32), "request_output_len": one(3, np.int32)}
            if model == "llm" else {"text_input": np.array([[b"Hello"]], object), "max_tokens": one(3, np.int32)})
    c = grpc_stream_one(server.grpc_url, model, {**base, name: value})
    assert c.finals == 1 and len(c.errors) == 1 and name in c.errors[0], c.errors
    neutral = {"beam_width": one(1, np.int32), "return_log_probs": one(False, bool), "num_return_sequences": one(1, np.int32),
               "repetition_penalty": one(1.0, np.float32), "presence_penalty": one(0.0, np.float32),
               "frequency_penalty": one(0.0, np.float32)}
    c = grpc_stream_one(server.grpc_url, model, {**base, **neutral})
    assert not c.errors and c.finals == 1


@BOTH_ENGINES
def test_tensorrt_llm_stop_request_ends_the_stream_with_that_id(server):
    """As TensorRT-LLM's executor ends a cancelled request (finish reason CANCELLED, no error):
    the stopped stream's last response is a plain FINAL, and the stop request gets an empty one."""
    sc = StreamClient(server.grpc_url)
    try:
        c = sc.send("llm", {"input_ids": np.array([[1, 300, 301]], np.int32), "request_output_len": one(1500, np.int32),
                            "streaming": one(True, bool), "ignore_eos": one(True, bool)}, "stop-me")
        deadline = time.monotonic() + 60
        while not c.responses and time.monotonic() < deadline:
            time.sleep(0.05)
        # TensorRT-LLM's stop signal: a request with the SAME request id and stop=true
        ctl = StreamClient(server.grpc_url)
        try:
            stop = ctl.send("llm", STOP_BODY, "stop-me")
            assert c.done.wait(60)
            assert stop.done.wait(10) and not stop.errors and stop.finals == 1, stop.errors
        finally:
            ctl.close()
        n = sum(r.as_numpy("output_ids").shape[2] for r in c.responses if r.as_numpy("output_ids") is not None)
        assert 1 <= n < 1500 and c.finals == 1 and not c.errors, c.errors
        # TensorRT-LLM's client asks for no empty finals and still reads the stop's reply
        # ("Got cancellation response from server"); without an id the stop is an error
        assert stop_replies(server.grpc_url, "stop-me") == [None]
        assert stop_replies(server.grpc_url, "") == [STOP_WITHOUT_ID]
    finally:
        sc.close()


STOP_BODY = {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": one(0, np.int32),
             "request_output_len": one(0, np.int32), "stop": one(True, bool)}


def stop_replies(url, request_id, model="llm"):
    """What a stop request under request_id gets over a stream that asks for no empty finals:
    one entry per response, None for a success, else the error text."""
    got, done = [], threading.Event()

    def cb(result, error):
        got.append(None if error is None else str(error.message() if hasattr(error, "message") else error))
        done.set()

    cl = grpcclient.InferenceServerClient(url)
    cl.start_stream(callback=cb)
    try:
        cl.async_stream_infer(model, [tensor(grpcclient, k, v) for k, v in STOP_BODY.items()], request_id=request_id)
        done.wait(20)
        time.sleep(0.3)  # nothing else may follow
    finally:
        cl.stop_stream()
    return got


def test_tensorrt_llm_non_decoupled_stop_returns_the_partial_output(server):
    """TensorRT-LLM's non-decoupled stop (inflight_batcher_llm_client.py --stop-after-ms without
    --streaming, README's --request-id 1): the stop request gets an empty success, the stopped
    request the tokens generated so far; a stop without an id is TensorRT-LLM's error."""
    cl = grpcclient.InferenceServerClient(server.grpc_url)
    result = {}

    def run():
        result["r"] = cl.infer("tensorrt_llm", [
            tensor(grpcclient, "input_ids", np.array([[1, 300, 301]], np.int32)),
            tensor(grpcclient, "request_output_len", one(1500, np.int32)),
            tensor(grpcclient, "ignore_eos", one(True, bool))], request_id="1", client_timeout=120)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert wait_for(lambda: server.metric("llm_num_requests_running") == 1, 30)
        time.sleep(0.3)
        reply = grpcclient.InferenceServerClient(server.grpc_url).infer(
            "tensorrt_llm", [tensor(grpcclient, k, v) for k, v in STOP_BODY.items()], request_id="1")
        assert reply.get_response().outputs == []
    finally:
        t.join(120)
    ids = result["r"].as_numpy("output_ids")
    assert ids.shape[:2] == (1, 1) and 1 <= int(result["r"].as_numpy("sequence_length")[0, 0]) < 1500
    with pytest.raises(InferenceServerException, match=STOP_WITHOUT_ID):
        cl.infer("tensorrt_llm", [tensor(grpcclient, k, v) for k, v in STOP_BODY.items()])
    assert wait_for(server.idle, 10)


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls"])
def test_non_decoupled_proxies_survive_repeated_errors(server, model):
    """Each failed request gets its error text (carried in-band from the decoupled model, see
    triton_glue/sync_proxy.py) and no in-band output leaks to the client; the proxy stays usable."""
    cl = grpcclient.InferenceServerClient(server.grpc_url)
    if model == "tensorrt_llm":
        bad = [tensor(grpcclient, "input_ids", np.array([[1, 2, 3]], np.int32)),
               tensor(grpcclient, "request_output_len", one(10 ** 6, np.int32))]
        good = [tensor(grpcclient, "input_ids", np.array([[1, 2, 3]], np.int32)),
                tensor(grpcclient, "request_output_len", one(4, np.int32))]
        field = "max_tokens|request_output_len"
    else:
        bad = [tensor(grpcclient, "text_input", np.array([["Hello"]], object)),
               tensor(grpcclient, "max_tokens", one(10 ** 6, np.int32))]
        good = [tensor(grpcclient, "text_input", np.array([["Hello"]], object)),
                tensor(grpcclient, "max_tokens", one(4, np.int32))]
        field = "max_tokens"
    for _ in range(30):
        with pytest.raises(InferenceServerException, match=field):
            cl.infer(model, bad, client_timeout=30)
    r = cl.infer(model, good, client_timeout=60)
    out = r.as_numpy("output_ids" if model == "tensorrt_llm" else "text_output")
    assert out.size > 0
    assert "error_message" not in {o.name for o in r.get_response().outputs}


@pytest.mark.parametrize("model", ["tensorrt_llm", "tensorrt_llm_bls"])
def test_non_decoupled_proxy_grpc_deadline_aborts_the_request_in_the_engine(server, model):
    """A non-decoupled gRPC client that gives up (its deadline passes) cancels its request: the
    proxy aborts it upstream (`llm`, or `llm_bls`, which aborts its own request to `llm`), so
    the engine frees its slot and KV blocks at once instead of generating 1900 tokens for
    nobody (triton_glue/sync_proxy.py). An HTTP client that disconnects cannot get this:
    tritonserver 2.51's HTTP front flags no cancellation."""
    assert wait_for(server.idle)
    aborted0 = server.metric("llm_requests_finished_total", reason="abort")
    if model == "tensorrt_llm":
        inputs = [tensor(grpcclient, "input_ids", np.array([[1, 300, 301]], np.int32)),
                  tensor(grpcclient, "request_output_len", one(1900, np.int32))]
    else:
        inputs = [tensor(grpcclient, "text_input", np.array([[PROMPT]], object)),
                  tensor(grpcclient, "max_tokens", one(1900, np.int32))]
    with pytest.raises(InferenceServerException, match="(?i)deadline"):
        grpcclient.InferenceServerClient(server.grpc_url).infer(
            model, inputs + [tensor(grpcclient, "ignore_eos", one(True, bool))], client_timeout=2.0)
    assert wait_for(lambda: server.metric("llm_requests_finished_total", reason="abort") == aborted0 + 1, 5), \
        server.log_tail()
    assert wait_for(server.idle, 5)
    assert wait_for(lambda: server.metric("bls_inflight_requests") == 0, 5)


def test_tensorrt_llm_bls_deadline_frees_a_request_still_queued_in_the_engine(tmp_path):
    """max_num_seqs 1, one long stream running: a tensorrt_llm_bls request waits in the
    engine's queue. Its gRPC deadline passes: llm_bls aborts its request to `llm` at once,
    not at a first token it would only get once the stream ahead of it ends."""
    srv = start_server(tmp_path, extra_env={"LLM_PARAM_max_num_seqs": "1"})
    sc = StreamClient(srv.grpc_url)
    try:
        ahead = sc.send("llm", {"input_ids": np.array([[1, 300, 301]], np.int32), "request_output_len": one(1900, np.int32),
                                "streaming": one(True, bool), "ignore_eos": one(True, bool)}, "ahead")
        assert wait_for(lambda: len(ahead.responses) >= 2, 60, 0.02), ahead.errors
        aborted0 = srv.metric("llm_requests_finished_total", reason="abort")
        with pytest.raises(InferenceServerException, match="(?i)deadline"):
            grpcclient.InferenceServerClient(srv.grpc_url).infer("tensorrt_llm_bls", [
                tensor(grpcclient, "text_input", np.array([[PROMPT]], object)),
                tensor(grpcclient, "max_tokens", one(8, np.int32))], client_timeout=2.0)
        assert wait_for(lambda: srv.metric("llm_requests_finished_total", reason="abort") == aborted0 + 1, 5), \
            srv.log_tail()
        assert srv.metric("llm_num_requests_waiting") == 0 and not ahead.done.is_set()
        assert wait_for(lambda: srv.metric("bls_inflight_requests") == 0, 5)
    finally:
        sc.close()
        srv.stop()
