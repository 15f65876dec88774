"""Penalties, min_p and logprobs through pipeline stages: the last stage holds the penalty
state and samples; ids + logprobs come back to stage 0 in one packed tensor (PP=2, async)."""
from __future__ import annotations

import random

from backend_lib import LLMEngine, SamplingParams
from pp_workload import _cfg


def test_pp2_penalties_and_logprobs_match_pp1(tiny_llama_path):
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 768) for _ in range(rng.randint(2, 40))] for _ in range(8)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, seed=i, temperature=[0.0, 1.2][i % 2],
                             top_p=[1.0, 0.9][i % 3 == 0], min_p=[0.0, 0.05][i % 4 == 1],
                             repetition_penalty=[1.0, 1.3, 0.8][i % 3], presence_penalty=[0.0, 0.7][i % 2],
                             frequency_penalty=[0.0, 1.1][i % 4 == 2], logprobs=[None, 0, 4][i % 3])
              for i in range(len(prompts))]
    ref = LLMEngine(_cfg(tiny_llama_path)).generate(prompts, params)
    eng = LLMEngine(_cfg(tiny_llama_path, pp=2, async_mode="on", num_kv_blocks=20))
    try:
        got = eng.generate(prompts, params)
        assert eng.stats().num_preemptions > 0  # the penalty state is rebuilt on re-admission
    finally:
        eng.close()
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
