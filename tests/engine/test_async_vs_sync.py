"""Async token handoff (emulated on CPU) vs the synchronous path: token-identical over a
seeded randomized workload (issue 4's CPU correctness test), plus the capability gate.

Workload: 320 requests in four groups, one per chunk budget (1/4/16/48 tokens per step),
staggered arrivals (added between step() calls), prompts of 1..300 tokens (log-uniform),
max_tokens 1..64, EOS on for half of them, stop ids chosen from a probe run's outputs so they
fire mid-stream, a few min_tokens and seeded-sampling requests, aborts in scrambled order
(right at arrival, or while decoding with a step in flight), and a KV pool small enough to
force preemption. Expected outputs come from a probe run (ignore_eos, no stops) cut at the
first stop: both modes must produce exactly that; aborted requests a prefix of it.
"""
import math
import random

import pytest

from backend_lib import EngineConfig, SamplingParams, resolve_async_handoff
from engine_helpers import EOS, Spec, expected_from_reference, make_engine, random_prompt, run_specs
from test_blocks import check_block_invariants

GROUPS = {1: 16, 4: 40, 16: 84, 48: 180}   # chunk budget -> requests (320 in all)
MAX_LEN = 384
ENGINE_KW = dict(max_model_len=MAX_LEN, block_size=16, num_kv_blocks=40, max_num_seqs=24)


def _prompt_len(rng):
    return min(300, int(math.exp(rng.uniform(0, math.log(301)))))


def _base_specs():
    rng = random.Random(20240)
    groups = {}
    for budget, n in GROUPS.items():
        specs, t = [], 0
        for i in range(n):
            t += rng.choice([0, 0, 1, 1, 2, 3])
            sampled = rng.random() < 0.2
            sp = SamplingParams(max_tokens=rng.randint(1, 64), temperature=0.8 if sampled else 0.0,
                                top_p=0.9, seed=rng.randrange(2**31) if sampled else None, ignore_eos=True)
            specs.append(Spec(f"b{budget}-{i}", random_prompt(rng, _prompt_len(rng)), sp, arrival=t))
        groups[budget] = specs
    return groups


@pytest.fixture(scope="module")
def workload(tiny_llama_path):
    """(specs per budget, reference continuation per request id)."""
    path = str(tiny_llama_path)
    groups = _base_specs()
    probe = make_engine(path, max_model_len=MAX_LEN, max_num_batched_tokens=512, num_kv_blocks=800,
                        max_num_seqs=64)
    all_specs = [s for specs in groups.values() for s in specs]
    outs = probe.generate([s.prompt for s in all_specs], [s.params for s in all_specs])
    ref = {s.rid: o.token_ids for s, o in zip(all_specs, outs)}
    assert all(len(ref[s.rid]) == s.params.max_tokens for s in all_specs)

    rng = random.Random(777)
    n_eos_mid = n_stop_mid = 0
    for specs in groups.values():
        for s in specs:
            toks, sp = ref[s.rid], s.params
            sp.ignore_eos = rng.random() < 0.5
            if len(toks) >= 4 and rng.random() < 0.35:
                k = rng.randrange(1, len(toks) - 1)   # a stop id that first fires mid-stream
                if toks.index(toks[k]) >= 1:
                    sp.stop_token_ids = [toks[k]] + rng.sample(range(4, 768), 2)
            if len(toks) >= 6 and rng.random() < 0.15:
                sp.min_tokens = rng.randint(1, len(toks) // 2)
                stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {EOS})
                if stops & set(toks[:sp.min_tokens]):
                    sp.min_tokens = 0  # the ignore_eos reference would not apply
            exp, reason = expected_from_reference(toks, sp)
            if reason == "stop" and len(exp) < len(toks):
                if exp[-1] == EOS and EOS not in sp.stop_token_ids:
                    n_eos_mid += 1
                else:
                    n_stop_mid += 1
            r = rng.random()
            if r < 0.04:
                s.abort_at = s.arrival                                   # while waiting
            elif r < 0.08:
                s.abort_at = s.arrival + rng.randint(1, 30)              # whatever it is doing then
            elif r < 0.12:
                s.abort_after_tokens = 0                                 # mid-prefill
            elif r < 0.2 and len(toks) >= 3:
                s.abort_after_tokens = rng.randint(1, len(toks) - 1)     # decoding, step in flight
    assert n_eos_mid >= 10 and n_stop_mid >= 10, (n_eos_mid, n_stop_mid)
    return groups, ref


def _check(specs, ref, info):
    n_abort = 0
    for s in specs:
        res = info.results[s.rid]
        exp, reason = expected_from_reference(ref[s.rid], s.params)
        if (s.abort_at is not None or s.abort_after_tokens is not None) and res.finish_reason == "abort":
            n_abort += 1
            assert res.tokens == exp[:len(res.tokens)], s.rid
            assert len(res.tokens) < len(exp) or reason == "length", s.rid
        else:
            assert (res.tokens, res.finish_reason) == (exp, reason), s.rid
    assert info.stats.kv_blocks_used == 0 and info.stats.num_running == 0 and info.stats.num_waiting == 0
    return n_abort


@pytest.mark.parametrize("budget", list(GROUPS))
def test_async_equals_sync_randomized_workload(tiny_llama_path, workload, budget):
    groups, ref = workload
    specs = groups[budget]
    runs = {}
    for mode in ("off", "on"):
        eng = make_engine(tiny_llama_path, async_token_handoff=mode, max_num_batched_tokens=budget, **ENGINE_KW)
        assert eng.async_enabled is (mode == "on")
        runs[mode] = run_specs(eng, specs, order_rng=random.Random(budget), on_step=check_block_invariants)
        n_abort = _check(specs, ref, runs[mode])
        assert n_abort >= max(2, len(specs) // 12), n_abort
        if budget >= 16:  # a 1- or 4-token budget admits too slowly to fill the pool
            assert runs[mode].stats.num_preemptions > 0
    sync, asyn = runs["off"], runs["on"]
    # Non-aborted requests are token-identical (checked against the reference above); aborted
    # ones agree on their common prefix.
    for s in specs:
        a, b = sync.results[s.rid], asyn.results[s.rid]
        n = min(len(a.tokens), len(b.tokens))
        assert a.tokens[:n] == b.tokens[:n], s.rid
        if s.abort_at is None and s.abort_after_tokens is None:
            assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason), s.rid
    # The overlap really happens: async launches steps while the previous one is unread.
    assert sync.stats.async_steps_total == 0 and sync.launched_with_inflight == 0
    assert asyn.stats.sync_steps_total == 0 and asyn.stats.async_steps_total == asyn.launched
    assert asyn.launched_with_inflight >= 0.6 * asyn.launched, (asyn.launched_with_inflight, asyn.launched)
    print(budget, {m: (r.steps, r.launched, r.launched_with_inflight, r.aborts_with_inflight, r.stats.num_preemptions,
                       sum(x.finish_reason == "abort" for x in r.results.values())) for m, r in runs.items()})
    assert asyn.aborts_with_inflight >= (1 if budget < 16 else 3)


# ---- the capability gate ---------------------------------------------------------------------

def test_gate_auto_on_cpu_is_off_on_is_emulated(tiny_llama_path, monkeypatch):
    monkeypatch.delenv("BACKEND_LIB_FORCE_SYNC", raising=False)
    auto = make_engine(tiny_llama_path, async_token_handoff="auto")
    assert auto.async_enabled is False and any("CUDA" in r for r in auto.decision.reasons)
    on = make_engine(tiny_llama_path, async_token_handoff="on")
    assert on.async_enabled is True and on.decision.emulated is True
    off = make_engine(tiny_llama_path, async_token_handoff="off")
    assert off.async_enabled is False
    for eng in (auto, on, off):
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert auto.stats().async_steps_total == 0 and auto.stats().sync_steps_total > 0
    assert on.stats().async_steps_total > 0 and on.stats().sync_steps_total == 0


def test_kill_switch_forces_sync(tiny_llama_path, monkeypatch):
    monkeypatch.setenv("BACKEND_LIB_FORCE_SYNC", "1")
    eng = make_engine(tiny_llama_path, async_token_handoff="on")
    assert eng.async_enabled is False
    assert any("BACKEND_LIB_FORCE_SYNC" in r for r in eng.decision.reasons)
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert eng.stats().async_steps_total == 0
    # Also on a CUDA config (pure resolution, no device needed).
    assert not resolve_async_handoff(EngineConfig(device="cuda", async_token_handoff="on")).enabled


def test_gate_resolution_on_cuda_configs(monkeypatch):
    monkeypatch.delenv("BACKEND_LIB_FORCE_SYNC", raising=False)
    d = resolve_async_handoff(EngineConfig(device="cuda", async_token_handoff="auto"))
    assert d.enabled and not d.emulated
    d = resolve_async_handoff(EngineConfig(device="cuda", async_token_handoff="auto", enable_cuda_graph=False))
    assert not d.enabled and any("graph" in r.lower() for r in d.reasons)
    with pytest.raises(ValueError, match="async_token_handoff"):
        resolve_async_handoff(EngineConfig(device="cuda", async_token_handoff="on", enable_cuda_graph=False))
    assert not resolve_async_handoff(EngineConfig(device="cuda", async_token_handoff="off")).enabled
