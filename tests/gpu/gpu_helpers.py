"""Shared pieces of the kernel tests in tests/gpu: the module-level GPU marks and skips, and
the per-test seed (fresh, or fixed by an environment variable to reproduce a failure)."""
import os

import pytest

torch = pytest.importorskip("torch")

# A test module's pytestmark: marked gpu, skipped when CUDA is absent.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]

if torch.cuda.is_available():
    pytest.importorskip("triton")


def kernel_test_target(opt_in_var: str) -> tuple[bool, list, str]:
    """(on_cpu, pytestmark, device) of a kernel test module: CUDA (marked gpu, skipped without
    it), or the CPU under Triton's interpreter when TRITON_INTERPRET=1 and `opt_in_var`=1 are
    both set (then nothing marks or skips the module)."""
    if os.environ.get(opt_in_var) == "1" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.importorskip("triton")
        return True, [], "cpu"
    return False, GPU_MARKS, "cuda"


def seed_from_env(var: str) -> int:
    """Seed torch from $var, else from os.urandom; the seed (for failure messages)."""
    env = os.environ.get(var)
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def run_churn(eng, rng, n: int, max_prompt: int, max_tokens: int, max_adds: int,
              logprobs_every: int = 0) -> tuple[dict, object]:
    """n requests arriving 0..max_adds per step (prompts of 1..max_prompt tokens, up to
    max_tokens; greedy and seeded sampling, stop ids on every 4th, top-2 logprobs on every
    logprobs_every-th) run to the end: {request id: [tokens, finish reason]} and the stats.
    Each request finishes once, and every KV block comes back."""
    from backend_lib import SamplingParams

    pending = []
    for i in range(n):
        p = [rng.randrange(3, 250) for _ in range(rng.randint(1, max_prompt))]
        sp = SamplingParams(max_tokens=rng.randint(1, max_tokens), temperature=0.0 if i % 3 else 0.9, seed=i,
                            logprobs=2 if logprobs_every and i % logprobs_every == 0 else None,
                            stop_token_ids=[rng.randrange(3, 250)] if i % 4 == 0 else [])
        pending.append((f"r{i}", p, sp))
    res = {}
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, max_adds)):
            if pending:
                rid, p, sp = pending.pop(0)
                eng.add_request(rid, p, sp)
                res[rid] = [[], None]
        for out in eng.step():
            r = res[out.request_id]
            assert r[1] is None
            r[0] += out.new_token_ids
            if out.finished:
                r[1] = str(out.finish_reason)
    st = eng.stats()
    assert st.kv_blocks_used == 0
    return res, st
