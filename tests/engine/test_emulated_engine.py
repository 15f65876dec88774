"""The engine class the engine process builds (BACKEND_LIB_ENGINE_CLASS) and the emulated engine
bench.serve --emulated-step-us runs behind Triton: through EngineProcessClient every request gets
max_tokens tokens (never an EOS), one per step, finish reason "length"; a prompt that leaves less
room ends at max_model_len; abort ends a request with "abort"; the engine's validation errors
still come synchronously; a malformed class spec fails the start-up naming the variable."""
import time

import pytest

from backend_lib import EngineConfig, EngineProcessClient, SamplingParams
from backend_lib.envs import ENGINE_CLASS_ENV, engine_class, overridden
from backend_lib.request import FinishReason
from bench.emulated_engine import STEP_US_ENV

STEP_US = 2000


@pytest.fixture(scope="module")
def emulated(path):
    with overridden({ENGINE_CLASS_ENV: "bench.emulated_engine:EmulatedEngine", STEP_US_ENV: str(STEP_US)}):
        c = EngineProcessClient(EngineConfig(model_path=path, device="cpu", dtype="float32", max_num_seqs=4,
                                             max_model_len=64, num_kv_blocks=16))
    yield c
    c.shutdown()


def test_tokens_steps_and_finish(emulated):
    sp = SamplingParams(max_tokens=9)
    t0 = time.perf_counter()
    streams = [emulated.add_request(f"r{i}", [1, 2, 3 + i], sp) for i in range(6)]  # 6 > max_num_seqs 4
    results = [s.result() for s in streams]
    elapsed = time.perf_counter() - t0
    for tokens, reason in results:
        assert len(tokens) == 9 and reason == FinishReason.LENGTH
        assert not set(tokens) & set(emulated.eos_token_ids)
    # two waves of 9 one-token steps of STEP_US each, the second waiting for the first
    assert elapsed >= 2 * 9 * STEP_US / 1e6
    long_prompt = list(range(1, 61))
    tokens, reason = emulated.add_request("long", long_prompt, SamplingParams(max_tokens=50)).result()
    assert len(tokens) == 64 - 60 and reason == FinishReason.LENGTH


def test_abort_and_validation(emulated):
    stream = emulated.add_request("a", [1, 2], SamplingParams(max_tokens=60))
    emulated.abort("a")
    outs = list(stream)
    assert outs[-1].finished and outs[-1].finish_reason == FinishReason.ABORT
    assert sum(len(o.new_token_ids) for o in outs) < 60
    with pytest.raises(ValueError, match="max_tokens"):
        emulated.add_request("bad", [1, 2], SamplingParams(max_tokens=0))
    assert emulated.is_healthy()


def test_engine_class_spec(monkeypatch):
    from backend_lib.engine import LLMEngine
    monkeypatch.delenv(ENGINE_CLASS_ENV, raising=False)
    assert engine_class() is LLMEngine
    monkeypatch.setenv(ENGINE_CLASS_ENV, "bench.emulated_engine")
    with pytest.raises(ValueError, match=ENGINE_CLASS_ENV):
        engine_class()
