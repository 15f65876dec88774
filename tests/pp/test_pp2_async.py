"""PP=2 with the async token handoff vs PP=1 (budgets 1/4/16), no object collectives on the
token path, rounds with no sampled rows; layer split and PP size bounds. See conftest.py."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from backend_lib import LLMEngine
from backend_lib import envs
from backend_lib.pipeline import split_layers
from pp_workload import _cfg, assert_same, drive, make_workload


@pytest.fixture(scope="module")
def pp2_async(tiny_llama_path):
    # Every stage runs with the object collectives replaced by functions that raise.
    mp = pytest.MonkeyPatch()
    mp.setenv(envs.PP_FORBID_OBJECTS_ENV, "1")
    eng = LLMEngine(_cfg(tiny_llama_path, pp=2, async_mode="on"))
    yield eng
    eng.close()
    mp.undo()



def test_split_layers():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(4, 3) == [(0, 2), (2, 3), (3, 4)]
    assert split_layers(5, 5) == [(i, i + 1) for i in range(5)]


def test_pp_larger_than_layer_count_is_rejected(tiny_llama_path):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLMEngine(_cfg(tiny_llama_path, pp=5))
    assert not dist.is_initialized()


@pytest.mark.parametrize("budget,seed", [(1, 11), (4, 12), (16, 13)])
def test_pp2_async_matches_pp1(pp2_async, reference, budget, seed):
    eng = pp2_async
    assert eng.async_enabled and eng._max_inflight == 2
    eng.scheduler.token_budget = budget
    ex = eng.runner
    quiet_before = ex.num_steps_without_samples
    events, _ = make_workload(seed, eng.vocab_size)
    assert_same(reference(seed), drive(eng, events))
    # Tokens came back only for steps with a sampling row; all-prefill rounds sent none.
    assert ex.num_token_recvs + ex.num_steps_without_samples == ex.num_steps
    if budget <= 4:
        assert ex.num_steps_without_samples > quiet_before


def test_no_object_collectives_on_the_token_path(pp2_async):
    # The guard is live in stage 0 (and, through the env, in the worker stages, which would
    # have died on first use: the workloads above ran through them).
    with pytest.raises(RuntimeError, match="forbidden"):
        dist.send_object_list([1], dst=1)
    with pytest.raises(RuntimeError, match="forbidden"):
        dist.broadcast_object_list([1], src=0)
    assert pp2_async.runner.is_healthy()
    assert pp2_async.runner.num_token_recvs > 0


