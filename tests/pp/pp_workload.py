"""Shared pieces of the pipeline-parallel tests: config, seeded workload, driver, comparison."""
from __future__ import annotations

import random
from collections import defaultdict

from backend_lib import EngineConfig, FinishReason, LLMEngine, SamplingParams

MAX_LEN = 128


def _cfg(path, pp=1, async_mode="off", **kw):
    base = dict(model_path=str(path), pipeline_parallel_size=pp, async_token_handoff=async_mode,
                max_model_len=MAX_LEN, num_kv_blocks=96, block_size=8, max_num_seqs=6,
                max_num_batched_tokens=16)
    base.update(kw)
    return EngineConfig(**base)


# ---- the workload -----------------------------------------------------------------------------------
def make_workload(seed: int, vocab: int, n_req: int = 9):
    """Step-indexed events: two long prompts first (every running request mid-prefill for a
    while at small budgets), then arrivals, and aborts in scrambled order."""
    rng = random.Random(seed)
    events = defaultdict(list)
    ids = []
    for i in range(n_req):
        rid = f"r{seed}-{i}"
        ids.append(rid)
        if i < 2:
            plen, arrival = 30 + i, 0
        else:
            plen, arrival = rng.choice([1, 2, 3, 5, 8, 13, 21]), rng.randint(3, 30)
        prompt = [rng.randrange(4, vocab) for _ in range(plen)]
        greedy = rng.random() < 0.5
        sp = SamplingParams(
            max_tokens=rng.randint(1, 10), temperature=0.0 if greedy else rng.choice([0.8, 1.0, 1.3]),
            top_k=rng.choice([-1, 20]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**31),
            ignore_eos=rng.random() < 0.3, min_tokens=rng.choice([0, 0, 2]),
            stop_token_ids=rng.choice([[], [rng.randrange(4, vocab)]]),
            bad_token_ids=rng.choice([[], [rng.randrange(4, vocab)]]))
        if sp.min_tokens > sp.max_tokens:
            sp.min_tokens = 0
        events[arrival].append(("add", rid, prompt, sp))
    victims = rng.sample(ids, 3)
    rng.shuffle(victims)
    for rid in victims:
        events[rng.randint(2, 40)].append(("abort", rid))
    return events, ids


def drive(engine: LLMEngine, events) -> dict:
    events = {k: list(v) for k, v in events.items()}
    res: dict[str, list] = {}
    step = 0
    while events or engine.has_unfinished():
        for ev in events.pop(step, []):
            if ev[0] == "add":
                engine.add_request(ev[1], ev[2], ev[3])
                res[ev[1]] = [[], None]
            else:
                engine.abort(ev[1])
        for out in engine.step():
            r = res[out.request_id]
            assert r[1] is None, f"{out.request_id}: output after finish"
            r[0].extend(out.new_token_ids)
            if out.finished:
                r[1] = out.finish_reason
        step += 1
        assert step < 4000, "workload did not finish"
    s = engine.scheduler
    assert s.blocks.num_used == 0, "KV blocks leaked"
    assert s.slots.num_free == engine.config.max_num_seqs, "slots leaked"
    assert not s.requests
    return res


def assert_same(ref: dict, got: dict) -> None:
    assert ref.keys() == got.keys()
    for rid in ref:
        (rt, rr), (gt, gr) = ref[rid], got[rid]
        assert rr is not None and gr is not None, rid
        if FinishReason.ABORT in (rr, gr):  # aborted at a different point: a common prefix
            n = min(len(rt), len(gt))
            assert rt[:n] == gt[:n], f"{rid}: {rt} vs {gt}"
        else:
            assert (gt, gr) == (rt, rr), f"{rid}: PP {gt} {gr} vs PP=1 {rt} {rr}"




def reference_factory(ref_engine):
    cache = {}

    def get(seed):
        if seed not in cache:
            events, _ = make_workload(seed, ref_engine.vocab_size)
            cache[seed] = drive(ref_engine, events)
        return cache[seed]
    return get


def assert_matches_reference(engine: LLMEngine, reference, budgets_and_seeds) -> None:
    """For each (token budget, workload seed): the engine's outputs equal the reference's."""
    for budget, seed in budgets_and_seeds:
        engine.scheduler.token_budget = budget
        events, _ = make_workload(seed, engine.vocab_size)
        assert_same(reference(seed), drive(engine, events))
