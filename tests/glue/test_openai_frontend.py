"""The OpenAI frontend's own logic without tritonserver: a scripted stand-in for the route,
the real app served by uvicorn, driven by the `openai` package (log probabilities in both
OpenAI formats from vllm_backend's `logprobs` JSON, the sampling parameters forwarded, the
route's errors as 400s naming the field)."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from backend_lib.free_port import free_port, free_ports  # noqa: E402
from openai_frontend.app import create_app  # noqa: E402
from openai_frontend.config import FrontendConfig  # noqa: E402
from openai_frontend.errors import from_upstream  # noqa: E402
from openai_frontend.logprobs import parse_route_logprobs  # noqa: E402
from openai_frontend.triton_stream import Piece  # noqa: E402

# vllm_backend's logprobs JSON for two tokens, logprobs=2: the sampled token first (vLLM's
# order), then the top-2 by rank. "llo" was sampled although " there" ranks higher.
STEP1 = json.dumps([{"10": {"logprob": -0.5, "rank": 1, "decoded_token": "He"},
                     "11": {"logprob": -1.5, "rank": 2, "decoded_token": "Hi"}}])
STEP2 = json.dumps([{"21": {"logprob": -2.0, "rank": 3, "decoded_token": "llo"},
                     "22": {"logprob": -0.7, "rank": 1, "decoded_token": " there"},
                     "23": {"logprob": -1.1, "rank": 2, "decoded_token": "y"}}])


class ScriptedRoute:
    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.error: str | None = None

    async def generate(self, prompt, sampling, prompt_param="prompt"):
        self.calls.append((prompt, dict(sampling)))
        if self.error:
            raise from_upstream(self.error, prompt_param)
        want = sampling.get("logprobs") is not None
        yield Piece("He", 1, 3, None, parse_route_logprobs(STEP1) if want else None)
        yield Piece("llo", 1, 3, "length", parse_route_logprobs(STEP2) if want else None)

    async def ready(self):
        return True

    async def close(self):
        pass


class TemplateTokenizer:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kw):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


@contextlib.contextmanager
def frontend_serving(route, tokenizer, **config):
    """The real app on a free port in a thread, and an `openai` client of it."""
    port = free_port()
    cfg = FrontendConfig(host="127.0.0.1", port=port, **config)
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, tokenizer, route), host="127.0.0.1",
                                           port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
    finally:
        server.should_exit = True
        t.join(10)


@pytest.fixture(scope="module")
def served():
    route = ScriptedRoute()
    with frontend_serving(route, TemplateTokenizer()) as client:
        yield route, client


def test_completion_logprobs(served):
    route, client = served
    r = client.completions.create(model="vllm_model", prompt="Say", max_tokens=2, logprobs=2)
    assert route.calls[-1] == ("Say", {"max_tokens": 2, "logprobs": 2})
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "Hello"
    assert lp.tokens == ["He", "llo"]
    assert lp.token_logprobs == [-0.5, -2.0]  # the sampled token's, not the best-ranked one's
    assert lp.top_logprobs == [{"He": -0.5, "Hi": -1.5}, {"llo": -2.0, " there": -0.7, "y": -1.1}]
    assert lp.text_offset == [0, 2]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="vllm_model", prompt="Say", max_tokens=2, logprobs=2, stream=True)]
    assert [s.tokens for s in streamed] == [["He"], ["llo"]] and [s.text_offset for s in streamed] == [[0], [2]]


def test_chat_logprobs(served):
    route, client = served
    msgs = [{"role": "user", "content": "Say"}]
    r = client.chat.completions.create(model="vllm_model", messages=msgs, max_tokens=2, logprobs=True,
                                       top_logprobs=2)
    assert route.calls[-1] == ("<user>Say<assistant>", {"max_tokens": 2, "logprobs": 2})
    content = r.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [("He", -0.5, [72, 101]),
                                                                ("llo", -2.0, [108, 108, 111])]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [("He", -0.5), ("Hi", -1.5)], [(" there", -0.7), ("y", -1.1)]]
    chunks = list(client.chat.completions.create(model="vllm_model", messages=msgs, max_tokens=2,
                                                 logprobs=True, stream=True))
    tokens = [[c.token for c in ch.choices[0].logprobs.content] for ch in chunks if ch.choices[0].logprobs]
    assert tokens == [["He"], ["llo"]]
    assert route.calls[-1][1]["logprobs"] == 0  # logprobs without top_logprobs: the sampled token only
    plain = client.chat.completions.create(model="vllm_model", messages=msgs, max_tokens=2)
    assert plain.choices[0].logprobs is None and "logprobs" not in route.calls[-1][1]


def test_route_errors_are_400_naming_the_field(served):
    route, client = served
    route.error = "Error generating stream: return_logprobs: log probabilities are not available in this engine yet"
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="vllm_model", prompt="Say", max_tokens=2, logprobs=1)
        assert e.value.param == "logprobs" and "not available" in e.value.message
        route.error = "sampling_parameters.presence_penalty: is not supported by this engine"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="vllm_model", messages=[{"role": "user", "content": "x"}],
                                           presence_penalty=1.0, stream=True)
        assert e.value.param == "presence_penalty"
    finally:
        route.error = None


def test_sampling_parameters_forwarded(served):
    route, client = served
    client.completions.create(model="vllm_model", prompt="Say", max_tokens=5, temperature=0.5, top_p=0.9,
                              seed=7, n=2, stop=["x", "yz"], presence_penalty=0.25, frequency_penalty=0.5,
                              extra_body={"top_k": 4, "min_tokens": 1, "repetition_penalty": 1.1,
                                          "ignore_eos": True})
    base = {"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_tokens": 1,
            "presence_penalty": 0.25, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
            "stop": ["x", "yz"], "ignore_eos": True}
    assert [c[1] for c in route.calls[-2:]] == [{**base, "seed": 7}, {**base, "seed": 8}]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="vllm_model", prompt="Say", logprobs=1, echo=True)
    assert e.value.param == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="vllm_model", messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)
    assert e.value.param == "top_logprobs"


def test_server_down_is_503(tmp_path):
    """A frontend whose tritonserver is not there answers 503 naming it (not an internal error)."""
    from openai_frontend.triton_stream import TritonRoute

    dead, port = free_ports(2)
    cfg = FrontendConfig(host="127.0.0.1", port=port, grpc_url=f"127.0.0.1:{dead}")
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, TemplateTokenizer(), TritonRoute(cfg.grpc_url)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as e:
                r = client.completions.create(model="vllm_model", prompt="hi", max_tokens=2, stream=stream)
                list(r) if stream else None
            assert e.value.status_code == 503, e.value
            assert f"tritonserver at 127.0.0.1:{dead} is unavailable" in e.value.message
    finally:
        server.should_exit = True
        t.join(10)


def test_null_means_the_default(served):
    """The OpenAI SDK sends null for a parameter passed as None; OpenAI's API and vLLM take it
    as the default (n 1, no stream, no echo, no logprobs, vLLM's extras at theirs)."""
    route, client = served
    r = client.completions.create(model="vllm_model", prompt="Say", max_tokens=2, n=None, stream=None, echo=None,
                                  extra_body={"ignore_eos": None, "skip_special_tokens": None,
                                              "include_stop_str_in_output": None})
    assert len(r.choices) == 1 and r.choices[0].text == "Hello"
    assert route.calls[-1][1] == {"max_tokens": 2}
    r = client.chat.completions.create(model="vllm_model", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       n=None, stream=None, logprobs=None,
                                       extra_body={"add_generation_prompt": None})
    assert len(r.choices) == 1 and r.choices[0].message.content == "Hello" and r.choices[0].logprobs is None
    assert route.calls[-1][0] == "<user>x<assistant>"  # add_generation_prompt at its default, true
    with pytest.raises(openai.BadRequestError) as e:  # a required field's null is still an error naming it
        client.chat.completions.create(model="vllm_model", messages=None)
    assert e.value.param == "messages"


class CharTokenizer(TemplateTokenizer):
    """A token per character, after a BOS."""
    def encode(self, text, add_special_tokens=True):
        return [1] * add_special_tokens + [ord(c) for c in text]


def test_prompt_plus_max_tokens_past_the_window_is_vllms_400():
    """vLLM's OpenAI server refuses a request whose prompt and max_tokens pass max_model_len
    (its engine would end it at the window, as the route does); one that fits goes through."""
    route = ScriptedRoute()
    with frontend_serving(route, CharTokenizer(), max_model_len=64) as client:
        # "<user>" + 40 + "<assistant>" = 57 chars + BOS = 58 tokens
        msgs = [{"role": "user", "content": "a" * 40}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="vllm_model", prompt="a" * 40, max_tokens=24, stream=stream)
            assert e.value.param == "max_tokens"
            assert e.value.body["message"] == (
                "'max_tokens' or 'max_completion_tokens' is too large: 24. This model's maximum context "
                "length is 64 tokens and your request has 41 input tokens (24 > 64 - 41).")
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="vllm_model", messages=msgs, max_completion_tokens=7,
                                               stream=stream)
            assert e.value.param == "max_completion_tokens" and "(7 > 64 - 58)" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:  # one prompt of a list is enough
            client.completions.create(model="vllm_model", prompt=["a", "a" * 60], max_tokens=4)
        assert "has 61 input tokens (4 > 64 - 61)" in e.value.body["message"]
        assert route.calls == []  # nothing refused reached the route
        assert client.completions.create(model="vllm_model", prompt="a" * 40, max_tokens=23).choices[0].text
        assert client.chat.completions.create(model="vllm_model", messages=msgs, max_tokens=6).choices
        # chat without max_tokens: the route ends it at the window (vLLM gives the rest of it)
        assert client.chat.completions.create(model="vllm_model", messages=msgs).choices
        assert [c[1]["max_tokens"] for c in route.calls] == [23, 6, 16]
        # a prompt that alone fills the window is the route's to refuse (its error names the prompt)
        client.completions.create(model="vllm_model", prompt="a" * 70, max_tokens=1)
        assert route.calls[-1][0] == "a" * 70
        assert client.models.list().data[0].max_model_len == 64
        # max_tokens null on completions: the rest of the window, per prompt (vLLM's)
        client.completions.create(model="vllm_model", prompt=["a" * 10, "a" * 50], max_tokens=None)
        assert [c[1]["max_tokens"] for c in route.calls[-2:]] == [64 - 11, 64 - 51]


class _ConfigClient:
    def __init__(self, configs):
        self.configs = configs

    async def get_model_config(self, name, as_json=False, client_timeout=None):
        return {"config": {"name": name, "parameters": {k: {"string_value": v}
                                                        for k, v in self.configs[name].items()}}}


@pytest.mark.parametrize("llm_params,env,window", [
    ({"model_path": "models/tiny-llama", "max_model_len": "0"}, {}, 2048),   # config.json's
    ({"model_path": "models/tiny-llama", "max_model_len": "512"}, {}, 512),
    ({"model_path": "models/tiny-llama", "max_model_len": "512"}, {"LLM_PARAM_MAX_MODEL_LEN": "300"}, 300),
])
def test_the_window_is_the_llm_models(monkeypatch, llm_params, env, window):
    """The window the engine resolves: the route's llm model's max_model_len (its LLM_PARAM_
    override included), 0 meaning the checkpoint's max_position_embeddings."""
    import asyncio
    import types

    from openai_frontend.context_window import ContextWindow

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    route = types.SimpleNamespace(model="vllm_model", client=_ConfigClient(
        {"vllm_model": {"llm_model": "llm2"}, "llm2": llm_params}))
    assert asyncio.run(ContextWindow(route, CharTokenizer()).size()) == window
    # a route with no llm model behind it has no window to check against
    route.client.configs["vllm_model"] = {}
    assert asyncio.run(ContextWindow(route, CharTokenizer()).size()) is None


def test_a_window_that_cannot_be_read_leaves_requests_unchecked(monkeypatch):
    """Settings that do not resolve (a checkpoint this process cannot see) are looked up once;
    a server not up yet is asked again after RETRY_S, not on every request."""
    import asyncio
    import types

    from openai_frontend import context_window
    from openai_frontend.context_window import ContextWindow

    calls = []

    class Client(_ConfigClient):
        async def get_model_config(self, name, as_json=False, client_timeout=None):
            calls.append((name, client_timeout))
            if self.configs is None:
                raise ConnectionError("not up")
            return await super().get_model_config(name, as_json)

    bad = types.SimpleNamespace(model="vllm_model", client=Client(
        {"vllm_model": {"llm_model": "llm"}, "llm": {"model_path": "/nonexistent/ckpt", "max_model_len": "0"}}))
    w = ContextWindow(bad, CharTokenizer())

    async def twice():
        return await w.size(), await w.size()

    assert asyncio.run(twice()) == (None, None)
    assert calls == [("vllm_model", 5.0), ("llm", 5.0)]  # once, with a deadline
    down = types.SimpleNamespace(model="vllm_model", client=Client(None))
    w = ContextWindow(down, CharTokenizer())
    calls.clear()
    assert asyncio.run(twice()) == (None, None) and len(calls) == 1
    monkeypatch.setattr(context_window, "RETRY_S", 0.0)
    w._next_try = 0.0
    asyncio.run(w.size())
    assert len(calls) == 2
