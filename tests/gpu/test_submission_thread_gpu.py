"""step_submission=thread on CUDA: the submission thread launches on the engine's stream
(captured decode and mixed graphs, the staging ring, the token events), token-identical to
inline submission under churn with preemption, at lookahead 1 and 2; close() stops it.
(Written without a GPU at hand: the CPU counterpart is tests/engine/test_submission_thread.py.)
"""
import random
import threading

import pytest

from backend_lib import EngineConfig, LLMEngine
from backend_lib.submission import THREAD_NAME
from gpu_helpers import run_churn

pytestmark = pytest.mark.gpu


def churn(path, device="cuda", seed=0, n=120, **kw):
    """Requests arriving in bursts, greedy and seeded sampling, stop ids, a pool small
    enough to preempt: {request id: (tokens, finish reason)}, the engine's stats."""
    base = dict(model_path=path, device=device, dtype="float32", max_num_seqs=16, max_model_len=256,
                max_num_batched_tokens=48, num_kv_blocks=60, block_size=16, async_token_handoff="on",
                cuda_graph_mixed=True)
    base.update(kw)
    eng = LLMEngine(EngineConfig(**base))
    try:
        return run_churn(eng, random.Random(seed), n, max_prompt=120, max_tokens=40, max_adds=3,
                         logprobs_every=7)
    finally:
        eng.close()


@pytest.mark.parametrize("lookahead", [1, 2])
def test_gpu_thread_submission_equals_inline_under_churn(tiny_llama_path, lookahead):
    before = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    inline, i_stats = churn(tiny_llama_path, step_lookahead=lookahead)
    thread, t_stats = churn(tiny_llama_path, step_lookahead=lookahead, step_submission="thread")
    assert t_stats.async_steps_total > 0 and t_stats.num_preemptions > 0
    assert thread == inline
    assert (t_stats.num_preemptions, t_stats.generation_tokens_total) == \
        (i_stats.num_preemptions, i_stats.generation_tokens_total)
    assert [t for t in threading.enumerate() if t.name == THREAD_NAME] == before
