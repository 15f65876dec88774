"""The OpenAI-compatible frontend (`python -m openai_frontend`) in front of a real tritonserver,
driven by the official `openai` package: text and token counts are compared with the
in-process engine (greedy) and with what `vllm_model` itself returns for the same prompt."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the openai package is not installed (requirements.txt)")
pytest.importorskip("fastapi", reason="fastapi is not installed (requirements-triton.txt)")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (requirements-triton.txt)")

from backend_lib import SamplingParams
from triton_glue.detokenizer import full_text

from .conftest import MODEL_DIR, ROOT, free_ports
from .hf_reference import hf, hf_logprobs, hf_top  # noqa: F401 - hf: a fixture
from .util import grpc_stream_one, wait_for

MODEL = "vllm_model"
PROMPTS = ["Hello world", "The quick brown fox", "naïve café 😀 中文"]
MAX_TOKENS = 8
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story"}]


class Frontend:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc, self.port, self.log_path = proc, port, log_path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def post(self, path: str, body, timeout: float = 60) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


def start_frontend(tmp_dir: Path, grpc_url: str, extra_env: dict | None = None) -> Frontend:
    (port,) = free_ports(1)
    env = dict(os.environ, OPENAI_PORT=str(port), OPENAI_HOST="127.0.0.1", TRITON_GRPC_URL=grpc_url,
               TOKENIZER_PATH=str(MODEL_DIR), PYTHONPATH=str(ROOT), **(extra_env or {}))
    log_path = tmp_dir / f"openai-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "openai_frontend", "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    fe = Frontend(proc, port, log_path)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except Exception:  # noqa: BLE001
            return False

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not healthy():
        time.sleep(0.2)
    if not healthy():
        proc.kill()
        raise RuntimeError(f"openai frontend not healthy:\n{fe.log_tail()}")
    return fe


@pytest.fixture(scope="module")
def frontend(shared_server, tmp_path_factory):
    fe = start_frontend(tmp_path_factory.mktemp("openai"), shared_server.srv.grpc_url)
    yield fe
    fe.proc.terminate()
    try:
        fe.proc.wait(15)
    except subprocess.TimeoutExpired:
        fe.proc.kill()
        fe.proc.wait(5)
    assert "Traceback" not in fe.log_path.read_text(errors="replace"), fe.log_tail(80)


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def refs(tokenizer, reference_engine):
    """prompt -> (prompt ids, greedy ids, finish reason, text) from the in-process engine."""
    out = {}
    for p in PROMPTS + [tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)]:
        ids = tokenizer.encode(p)
        c = reference_engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
        out[p] = (ids, list(c.token_ids), str(c.finish_reason), full_text(tokenizer, ids, c.token_ids))
    return out


def vllm_model_text(server, prompt: str, **sampling) -> tuple[str, str]:
    """(text, finish_reason) of the vllm_model route itself, non-streamed."""
    c = grpc_stream_one(server.grpc_url, MODEL, {
        "text_input": prompt, "stream": False, "exclude_input_in_output": True,
        "return_finish_reason": True,
        "sampling_parameters": json.dumps({k: str(v) for k, v in sampling.items()})}, batched=False)
    assert not c.errors, c.errors
    return "".join(c.texts()), c.last("finish_reason")[0].decode()


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model" and models.data[0].owned_by
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.code == "model_not_found"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_matches_engine_and_route(client, server, refs, prompt):
    ids, ref_ids, ref_reason, ref_text = refs[prompt]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert abs(r.created - time.time()) < 120
    (choice,) = r.choices
    assert choice.index == 0 and choice.logprobs is None
    assert choice.text == ref_text
    assert choice.finish_reason == ref_reason
    assert (choice.text, choice.finish_reason) == vllm_model_text(server, prompt, max_tokens=MAX_TOKENS,
                                                                  temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref_ids)
    assert r.usage.total_tokens == len(ids) + len(ref_ids)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_completion_stream_with_usage(client, refs, prompt):
    ids, ref_ids, ref_reason, ref_text = refs[prompt]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    *text_chunks, usage_chunk = chunks
    assert len(text_chunks) >= 2  # streamed, not one block
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == ref_text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + [ref_reason]
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == []
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens) == (len(ids), len(ref_ids))


def test_completion_stream_without_usage_option(client, refs):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == refs[PROMPTS[0]][3]


def test_completion_echo_and_prompt_list(client, refs):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0,
                                  echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [p + refs[p][3] for p in PROMPTS[:2]]
    assert r.usage.prompt_tokens == sum(len(refs[p][0]) for p in PROMPTS[:2])
    assert r.usage.completion_tokens == sum(len(refs[p][1]) for p in PROMPTS[:2])


def test_chat_greedy_matches_route(client, server, tokenizer, refs):
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    prompt_ids = prompt_ids["input_ids"] if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "keys") else prompt_ids
    _, ref_ids, ref_reason, ref_text = refs[rendered]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == ref_text
    assert choice.finish_reason == ref_reason and choice.logprobs is None
    assert (ref_text, ref_reason) == vllm_model_text(server, rendered, max_tokens=MAX_TOKENS, temperature=0)
    assert r.usage.prompt_tokens == len(prompt_ids) == len(tokenizer.encode(rendered))
    assert r.usage.completion_tokens == len(ref_ids)


def test_chat_stream(client, tokenizer, refs):
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids, ref_ids, ref_reason, ref_text = refs[rendered]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    *body, usage_chunk = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert body[0].choices[0].delta.role == "assistant" and body[0].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in body) == ref_text
    assert body[-1].choices[0].finish_reason == ref_reason and body[-1].choices[0].delta.content is None
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.prompt_tokens == len(ids)
    assert usage_chunk.usage.completion_tokens == len(ref_ids)


def test_max_tokens_length_and_stop(client, tokenizer, reference_engine):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    ref = reference_engine.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    text = full_text(tokenizer, ids, ref.token_ids)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24
    assert r.choices[0].text == text
    # a stop string from the middle of that text: the reply ends just before it
    at = next(i for i in range(len(text) // 3, len(text) - 2)
              if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
    stop = text[at:at + 2]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n(client):
    kw = dict(model=MODEL, prompt="The weather today", max_tokens=12, temperature=1.0)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    assert client.completions.create(seed=1234, **kw).choices[0].text == a
    many = client.completions.create(seed=1234, n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    # choice i is the request with seed + i (vLLM's parallel sampling)
    assert many.choices[0].text == a
    for i in (1, 2):
        assert many.choices[i].text == client.completions.create(seed=1234 + i, **kw).choices[0].text
    assert len({c.text for c in many.choices}) >= 2
    again = client.completions.create(seed=1234, n=3, **kw)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]
    # streamed n: every choice opens, streams and finishes under its own index
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0,
                                                 seed=99, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finished = []
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            finished.append(ch.index)
    assert sorted(finished) == [0, 1]
    single = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0,
                                             seed=99 + i) for i in (0, 1)]
    assert [texts[0], texts[1]] == [s.choices[0].message.content for s in single]
    assert chunks[-1].usage.completion_tokens == sum(s.usage.completion_tokens for s in single)
    assert chunks[-1].usage.prompt_tokens == single[0].usage.prompt_tokens


def test_n_usage_counts_every_choice(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=1.0, seed=5,
                                  n=4, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[1]))  # once, not once per choice
    assert r.usage.completion_tokens == 4 * 5
    assert all(c.finish_reason == "length" for c in r.choices)


def test_32_concurrent_streams(frontend, refs):
    async def main():
        ac = openai.AsyncOpenAI(base_url=frontend.base_url, api_key="unused", max_retries=0, timeout=300)

        async def one(i: int):
            prompt = PROMPTS[i % len(PROMPTS)]
            if i % 2:
                stream = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True)
                return prompt, "".join([c.choices[0].text async for c in stream])
            stream = await ac.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
                temperature=0, stream=True)
            return None, "".join([c.choices[0].delta.content or "" async for c in stream])

        try:
            return await asyncio.gather(*[one(i) for i in range(32)])
        finally:
            await ac.close()

    results = asyncio.run(main())
    assert len(results) == 32
    for prompt, text in results:
        if prompt is not None:
            assert text == refs[prompt][3]
    chat_texts = [t for p, t in results if p is None]
    # the same conversation gives the same greedy reply however many run at once
    for k in range(len(PROMPTS)):
        assert len({t for i, (p, t) in enumerate(results) if p is None and i % len(PROMPTS) == k}) == 1
    assert len(chat_texts) == 16


def _open_stream(frontend, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", frontend.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(frontend, server, stream):
    assert wait_for(server.idle, 20)
    aborted0 = server.metric("llm_requests_finished_total", reason="abort")
    body = {"model": MODEL, "prompt": "A very long story:", "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    conn, resp = _open_stream(frontend, "/v1/completions", body) if stream else (None, None)
    if stream:
        assert resp.status == 200
        lines = [resp.fp.readline() for _ in range(6)]
        assert any(l.startswith(b"data: {") for l in lines), lines
    else:
        conn = http.client.HTTPConnection("127.0.0.1", frontend.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert wait_for(lambda: server.metric("llm_kv_blocks_used") > 0, 20)
    conn.sock.close()  # the client goes away mid-generation
    conn.close()
    assert wait_for(lambda: server.metric("llm_requests_finished_total", reason="abort") == aborted0 + 1, 20), \
        frontend.log_tail()
    assert wait_for(server.idle, 10)
    assert server.metric("llm_kv_blocks_used") == 0


BAD = [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 5}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", ""]}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "bogus": 1}, "bogus"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 3000, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_completion_tokens": -3},
     "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.rsplit('/', 1)[1]}-{f}" for p, _, f in BAD])
def test_bad_input_is_400_naming_the_field(frontend, client, path, body, param):
    for stream in (False, True):
        if stream and "stream_options" in body:
            continue
        status, err = frontend.post(path, {**body, "stream": True} if stream else body)
        assert status == 400, (status, err)
        assert err["error"]["param"] == param, err
        assert err["error"]["message"].lstrip("'").startswith(param), err  # vLLM quotes it
        assert err["error"]["type"] == "invalid_request_error"
    # the server stays healthy: the next request succeeds
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_bad_input_through_openai_package(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=9.0)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.param == "model" and e.value.code == "model_not_found"


def test_prompt_plus_max_tokens_past_the_window_is_400(frontend, client, tokenizer):
    """vLLM's OpenAI server's 400 for a prompt + max_tokens past max_model_len, the window read
    from tritonserver (the llm model's max_model_len 0: tiny-llama's 2048)."""
    assert [m.max_model_len for m in client.models.list().data] == [2048]
    prompt = "x " * 1000
    n = len(tokenizer.encode(prompt))
    assert n == 2000
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=49, stream=stream)
        assert e.value.param == "max_tokens"
        assert e.value.body["message"] == (
            "'max_tokens' or 'max_completion_tokens' is too large: 49. This model's maximum context "
            "length is 2048 tokens and your request has 2000 input tokens (49 > 2048 - 2000).")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 2000 and r.usage.completion_tokens == 48
    assert r.choices[0].finish_reason == "length"


SAMPLER_PROMPT = "The capital of France is"
SAMPLER_TOKENS = 12
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.3}
REPETITION = 1.3  # vLLM's extra parameter (extra_body)


@pytest.fixture(scope="module")
def penalised(tokenizer, reference_engine):
    ids = tokenizer.encode(SAMPLER_PROMPT)
    out = reference_engine.generate([ids], SamplingParams(max_tokens=SAMPLER_TOKENS, temperature=0.0, ignore_eos=True,
                                                          repetition_penalty=REPETITION, **PENALTIES))[0]
    plain = reference_engine.generate([ids], SamplingParams(max_tokens=SAMPLER_TOKENS, temperature=0.0,
                                                            ignore_eos=True))[0]
    assert list(out.token_ids) != list(plain.token_ids), "the penalties must change this greedy run"
    return ids, list(out.token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_penalties_and_logprobs(client, tokenizer, hf, penalised, stream):
    ids, gen = penalised
    kw = dict(model=MODEL, prompt=SAMPLER_PROMPT, max_tokens=SAMPLER_TOKENS, temperature=0, logprobs=2,
              extra_body={"repetition_penalty": REPETITION, "ignore_eos": True}, **PENALTIES)
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = sum((lp.tokens for lp in lps), [])
        token_lps = sum((lp.token_logprobs for lp in lps), [])
        tops = sum((lp.top_logprobs for lp in lps), [])
        offsets = sum((lp.text_offset for lp in lps), [])
    else:
        choice = client.completions.create(**kw).choices[0]
        text, lp = choice.text, choice.logprobs
        tokens, token_lps, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    assert text == tokenizer.decode(gen, skip_special_tokens=True)
    assert tokens == [tokenizer.decode([t]) for t in gen]
    want = hf_logprobs(hf, ids, gen)
    assert len(token_lps) == len(gen) and all(abs(a - b) < 1e-4 for a, b in zip(token_lps, want))
    for i, (top, (vals, idx)) in enumerate(zip(tops, hf_top(hf, ids, gen, 2))):
        # OpenAI's top_logprobs: the sampled token and the top 2, by their text
        assert tokens[i] in top and len(top) <= 3
        for v, t in zip(vals.tolist(), idx.tolist()):
            assert abs(top[tokenizer.decode([t])] - v) < 1e-4
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_chat_logprobs(client, tokenizer, hf):
    # the frontend renders the template; the route tokenizes the text
    ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert content
    # greedy: each sampled token is HF's top 1 after the ones before it
    seq = []
    for c in content:
        (vals, idx), = hf_top(hf, ids, seq + [0], 2)[len(seq):len(seq) + 1]
        assert abs(c.logprob - float(vals[0])) < 1e-4 and c.token == tokenizer.decode([int(idx[0])])
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode([int(t)]) for t in idx]
        assert all(abs(t.logprob - float(v)) < 1e-4 for t, v in zip(c.top_logprobs, vals))
        assert c.bytes == list(c.token.encode("utf-8"))
        seq.append(int(idx[0]))
    assert tokenizer.decode(seq, skip_special_tokens=True) == r.choices[0].message.content


def test_n_choices_seeded_distinct_and_reproducible(client, tokenizer, reference_engine):
    ids = tokenizer.encode(SAMPLER_PROMPT)
    ref = reference_engine.generate([ids], SamplingParams(max_tokens=SAMPLER_TOKENS, temperature=1.0, seed=11, n=4,
                                                          ignore_eos=True))
    want = [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in ref]
    assert len(set(want)) == 4
    kw = dict(model=MODEL, prompt=SAMPLER_PROMPT, max_tokens=SAMPLER_TOKENS, temperature=1.0, seed=11, n=4,
              extra_body={"ignore_eos": True})
    for _ in range(2):
        r = client.completions.create(**kw)
        assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
        assert r.usage.completion_tokens == 4 * SAMPLER_TOKENS
    texts = {i: "" for i in range(4)}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(4)] == want
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=1.0, seed=3, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]


def test_invalid_json_and_unknown_route(frontend):
    status, err = frontend.post("/v1/completions", b"{not json")
    assert status == 400 and "JSON" in err["error"]["message"]
    status, err = frontend.post("/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404 and "error" in err


GENAI_PERF = ROOT / "build" / "genai-venv" / "bin" / "genai-perf"
PERF_ANALYZER = ROOT / "build" / "bin" / "perf_analyzer"
GENAI_REQUESTS = 8


@pytest.mark.skipif(not GENAI_PERF.exists() or not PERF_ANALYZER.exists(),
                    reason="genai-perf (scripts/install_genai_perf.sh) or perf_analyzer "
                           "(scripts/install_triton.sh) is not installed")
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_genai_perf_openai_endpoint(frontend, server, tmp_path, endpoint):
    """genai-perf's OpenAI endpoint types against the frontend (perf_analyzer's openai service kind)."""
    success0 = server.metric("nv_inference_request_success", model=MODEL)
    failure0 = server.metric("nv_inference_request_failure", model=MODEL)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="150",
               PATH=f"{PERF_ANALYZER.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    art = tmp_path / "artifacts"
    # (--output-tokens-mean-deterministic is for Triton service kinds only: ignore_eos instead)
    cmd = [str(GENAI_PERF), "profile", "-m", MODEL, "--endpoint-type", endpoint, "--streaming",
           "-u", f"127.0.0.1:{frontend.port}", "--tokenizer", str(MODEL_DIR),
           "--num-dataset-entries", str(GENAI_REQUESTS), "--synthetic-input-tokens-mean", "16",
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", "8",
           "--extra-inputs", "ignore_eos:true", "--concurrency", "2",
           "--request-count", str(GENAI_REQUESTS), "--warmup-request-count", "0", "--random-seed", "0",
           "--artifact-dir", str(art)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (summary_path,) = art.glob("*/profile_export_genai_perf.json")
    summary = json.loads(summary_path.read_text())
    assert summary["request_count"]["avg"] == GENAI_REQUESTS
    assert summary["input_sequence_length"]["avg"] == 16
    assert summary["output_sequence_length"]["min"] > 0 and summary["time_to_first_token"]["avg"] > 0
    (export_path,) = art.glob("*/profile_export.json")
    requests = json.loads(export_path.read_text())["experiments"][0]["requests"]
    assert len(requests) == GENAI_REQUESTS
    for req in requests:
        payload = json.loads(req["request_inputs"]["payload"])
        assert payload["model"] == MODEL and payload["max_tokens"] == 8 and payload["stream"] is True
        events = [o["response"] for o in req["response_outputs"]]
        assert events[-1].strip() == "data: [DONE]" and len(events) >= 3, events
        last = json.loads(events[-2].strip()[len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length", last  # 8 tokens, ignore_eos
    assert server.metric("nv_inference_request_success", model=MODEL) - success0 == GENAI_REQUESTS
    assert server.metric("nv_inference_request_failure", model=MODEL) == failure0
