"""Launching a step never synchronizes the host with the device.

The async token handoff only pays if `ModelRunner.execute` returns while the GPU is still busy
with earlier steps. One synchronizing call anywhere in a step's launch (a pageable host->device
copy such as `t[idx] = 0` on a CUDA tensor, `.item()`, `.tolist()`, `nonzero`) makes the host
wait for the GPU to drain, silently. torch's sync debug mode turns those calls into errors; the
workload covers every kind of step: admissions mid-decode, prefill chunks mixed with decodes,
prefix-cache hits, every sampling program (greedy, temperature, top-k/top-p/min-p, penalties,
banned ids, min_tokens, logprobs) and aborts; mixed steps eager and replayed as CUDA graphs.
"""
import random

import pytest
import torch

from backend_lib import EngineConfig, LLMEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")]


def _params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=i),
        dict(temperature=0.7, top_p=0.9, top_k=50, seed=i),
        dict(temperature=1.0, min_p=0.05, seed=i),
        dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        dict(temperature=0.0, bad_token_ids=[5, 6], min_tokens=4),
        dict(temperature=0.0, logprobs=3),
    ]
    return SamplingParams(max_tokens=12 + i % 9, ignore_eos=True, **kinds[i % len(kinds)])


@pytest.mark.parametrize("mixed_graphs", [False, True])
@pytest.mark.parametrize("async_handoff", ["on", "off"])
def test_step_launch_never_synchronizes(tiny_llama_path, async_handoff, mixed_graphs):
    tiny_llama_path = str(tiny_llama_path)
    eng = LLMEngine(EngineConfig(model_path=tiny_llama_path, device="cuda", dtype="float32",
                                 max_num_seqs=16, max_model_len=512, num_kv_blocks=512,
                                 max_num_batched_tokens=96, async_token_handoff=async_handoff,
                                 cuda_graph_mixed=mixed_graphs))
    execute = eng.runner.execute
    launched = []

    def execute_without_sync(sched, eos):
        torch.cuda.set_sync_debug_mode("error")
        try:
            handle = execute(sched, eos)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        launched.append(sched.is_decode_only)
        return handle

    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(40)]  # full blocks: prefix-cache hits
    eng.runner.execute = execute_without_sync
    done, submitted, aborted = 0, 0, 0
    for _ in range(3):  # warm-up admits and compiles before the checked steps
        eng.add_request(f"w{submitted}", shared + [7, 8], _params(submitted))
        submitted += 1
    steps = 0
    while submitted < 40 or eng.has_unfinished():
        if submitted < 40 and steps % 3 == 0:
            tail = [rng.randrange(3, 250) for _ in range(rng.randint(1, 150))]
            prompt = (shared + tail) if submitted % 2 else tail
            eng.add_request(f"r{submitted}", prompt, _params(submitted))
            submitted += 1
        if steps % 17 == 5 and submitted > 4:
            aborted += eng.abort(f"r{submitted - 2}")
        done += sum(1 for o in eng.step() if o.finished)
        steps += 1
        assert steps < 2000
    assert any(launched) and not all(launched), "the workload must mix decode-only and prefill steps"
    assert done == submitted
    stats = eng.stats()
    assert stats.kv_blocks_used == 0
    assert stats.prefix_cache_hit_tokens_total > 0, "the workload must hit the prefix cache"
    mixed = eng.runner.mixed_graphs
    if mixed_graphs:  # mixed steps replayed graphs (a first-use capture may synchronize: it is setup)
        assert mixed.steps_graphed > 0 and mixed.steps_eager == 0 and not mixed.failed, vars(mixed)
    else:
        assert mixed is None
    eng.close()
