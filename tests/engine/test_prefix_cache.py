"""Automatic prefix caching (issue 11) on the tiny models, against HF transformers.

- a workload of prompts sharing long prefixes (and multi-turn prompts that extend an earlier
  request's prompt + output): greedy outputs identical with caching on and off and equal to
  HF, async on/off, chunk budgets 1/4/16, a pool small enough to preempt;
- a stop with an overshoot step in flight: the next request with the same prefix hits
  exactly the blocks whose KV was computed for confirmed tokens, and its output equals HF;
- eviction under KV pressure (LRU, tail blocks first) before any preemption;
- block accounting after every step of an abort storm over shared prefixes;
- n = 4 forks share the prompt's full blocks (block counts asserted), caching on and off.
"""
import random

import pytest

from backend_lib.request import Request
from engine_helpers import EOS, Spec, greedy, hf_greedy, make_engine, random_prompt, run_specs
from test_blocks import check_block_invariants


def _all_free_or_cached(eng):
    """After every request ended: nothing held, every block free or cached-evictable."""
    pool = eng.scheduler.blocks
    pool.check_consistency([])
    assert pool.num_used == 0 and pool.num_free == pool.num_usable
    assert not eng.scheduler.requests


# ---- shared-prefix workload: caching on == off == HF -------------------------------------------

BS = 8
MAX_LEN = 144
NEW = 8


def _shared_prefix_workload(path):
    """Specs: three system prefixes (24, 40, 57 tokens) x short suffixes, plus multi-turn
    requests whose prompt is an earlier prompt + its HF output + a new turn; and their
    HF greedy references (EOS stops on for half of them)."""
    rng = random.Random(5150)
    prefixes = [random_prompt(rng, n) for n in (24, 40, 57)]
    specs, refs = [], {}
    t = 0
    for i in range(10):
        pre = prefixes[i % 3]
        prompt = pre + random_prompt(rng, rng.randint(1, 8))
        stop_eos = i % 2 == 0
        specs.append(Spec(f"r{i}", prompt, greedy(NEW, ignore_eos=not stop_eos), arrival=t))
        refs[f"r{i}"] = hf_greedy(path, prompt, NEW, stop_at_eos=stop_eos)
        t += rng.choice([0, 1, 3, 8])
    for j, base in enumerate(specs[:3]):
        prompt = base.prompt + refs[base.rid] + random_prompt(rng, 5)
        specs.append(Spec(f"turn{j}", prompt, greedy(NEW, ignore_eos=True), arrival=t))
        refs[f"turn{j}"] = hf_greedy(path, prompt, NEW)
        t += 6
    return specs, refs


@pytest.fixture(scope="module")
def workload(path):
    return _shared_prefix_workload(path)


def _invariants_and_forced_preemption(every: int, limit: int):
    """on_step hook: the block invariants, and a preemption of the newest running request
    every `every` steps (at most `limit`): small budgets run too few requests at once for
    the pool to preempt by itself. Between steps is where schedule() preempts too (a victim
    may have rows in the step in flight)."""
    done = []

    def hook(eng, step):
        check_block_invariants(eng)
        s = eng.scheduler
        if step % every == every - 1 and len(done) < limit and s.running:
            s._preempt(s.running[-1])
            done.append(step)
            check_block_invariants(eng)
    return hook


@pytest.mark.parametrize("async_mode", ["off", "on"])
@pytest.mark.parametrize("budget", [1, 4, 16])
def test_shared_prefixes_on_off_and_hf(path, workload, async_mode, budget):
    specs, refs = workload
    results = {}
    for caching in (True, False):
        # 19 usable blocks of 8 tokens for up to 8 requests of ~30-90 tokens: budget 16
        # preempts by itself; smaller budgets get forced preemptions.
        eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=budget,
                          block_size=BS, num_kv_blocks=20, max_model_len=MAX_LEN, max_num_seqs=8,
                          enable_prefix_caching=caching)
        info = run_specs(eng, specs, on_step=_invariants_and_forced_preemption(every=7, limit=8))
        st = info.stats
        assert st.num_preemptions >= 4, st
        if caching:
            assert st.prefix_cache_hit_tokens_total >= 24 * 4, st
            assert st.prefill_tokens_total < st.prefix_cache_queried_tokens_total
        else:
            assert st.prefix_cache_hit_tokens_total == 0 and st.kv_blocks_cached == 0
        _all_free_or_cached(eng)
        results[caching] = {rid: r.tokens for rid, r in info.results.items()}
        for s in specs:
            r = info.results[s.rid]
            assert r.tokens == refs[s.rid], (caching, s.rid)
            want = "stop" if refs[s.rid][-1:] == [EOS] and not s.params.ignore_eos else "length"
            assert r.finish_reason == want, (s.rid, r.finish_reason)
    assert results[True] == results[False]


# ---- a stop with an overshoot step in flight donates only confirmed, computed blocks ------------

def _stop_case(path, rng, block_pos):
    """(prompt, reference, k): the greedy continuation's token k is new in it (so a stop id
    on it fires there) and sits at offset block_pos of its KV block."""
    for _ in range(50):
        prompt = random_prompt(rng, rng.randint(30, 60))
        ref = hf_greedy(path, prompt, 24)
        for k in range(2, 20):
            if (len(prompt) + k) % BS == block_pos and ref[k] not in ref[:k]:
                return prompt, ref, k
    raise AssertionError("no usable stop position found")


@pytest.mark.parametrize("async_mode", ["off", "on"])
@pytest.mark.parametrize("block_pos", [BS - 1, 3])  # the stop token ends a block / sits mid-block
def test_cache_hit_after_a_stop_with_overshoot(path, async_mode, block_pos):
    prompt, ref, k = _stop_case(path, random.Random(77 + block_pos), block_pos)
    eng = make_engine(path, async_token_handoff=async_mode, block_size=BS, max_model_len=MAX_LEN)
    overshoot = []
    orig_update = eng.scheduler.update

    def watch_update(sched, sampled, logprobs=None):
        # The stop is found while the next step (the lookahead past it) is in flight.
        live = [r.request for r in sched.rows if not r.request.is_finished]
        outs = orig_update(sched, sampled, logprobs)
        overshoot.extend((bool(eng._inflight), r.num_computed_tokens, r.num_tokens) for r in live if r.is_finished)
        return outs

    eng.scheduler.update = watch_update
    a = eng.generate([prompt], greedy(24, stop_token_ids=[ref[k]]))[0]
    assert a.token_ids == ref[:k + 1] and a.finish_reason == "stop"
    in_flight, computed, known = overshoot[0]
    assert known == len(prompt) + k + 1
    if async_mode == "on":
        # The lookahead step computed the stop token's KV and sampled one token past it.
        assert in_flight and computed == known
    else:
        assert not in_flight and computed == known - 1   # the stop token's KV was never computed
    donated = min(computed, known) // BS
    assert eng.stats().kv_blocks_cached == donated

    # The next turn extends prompt + output: it hits exactly the donated blocks.
    prompt_b = prompt + a.token_ids + random_prompt(random.Random(3), 5)
    before = eng.stats().prefix_cache_hit_tokens_total
    b = eng.generate([prompt_b], greedy(10, ignore_eos=True))[0]
    assert eng.stats().prefix_cache_hit_tokens_total - before == donated * BS
    want = hf_greedy(path, prompt_b, 10)
    assert b.token_ids == want
    uncached = make_engine(path, async_token_handoff=async_mode, block_size=BS, max_model_len=MAX_LEN,
                           enable_prefix_caching=False)
    assert uncached.generate([prompt_b], greedy(10, ignore_eos=True))[0].token_ids == want
    _all_free_or_cached(eng)


# ---- eviction under KV pressure, before preemption ----------------------------------------------

@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_eviction_under_pressure_is_lru_tail_first(path, async_mode):
    rng = random.Random(9)
    prompt_a, prompt_c = random_prompt(rng, 120), random_prompt(rng, 200)
    # 39 usable blocks of 8 tokens (a 256-token sequence needs 32).
    eng = make_engine(path, async_token_handoff=async_mode, block_size=BS, num_kv_blocks=40,
                      max_model_len=256)
    a = eng.generate([prompt_a], greedy(1, ignore_eos=True))[0]
    st = eng.stats()
    assert st.kv_blocks_cached == 15          # 120 prompt tokens computed (the sampled one never)
    # c computes 207 positions (26 blocks) and only 24 never-cached blocks are free: two of a's
    # cached blocks are evicted, its last two (they extend the others), and nobody is preempted.
    c = eng.generate([prompt_c], greedy(8, ignore_eos=True))[0]
    assert c.token_ids == hf_greedy(path, prompt_c, 8)
    st = eng.stats()
    assert st.num_preemptions == 0
    assert st.kv_blocks_cached == 13 + 25
    before = st.prefix_cache_hit_tokens_total
    a2 = eng.generate([prompt_a], greedy(4, ignore_eos=True))[0]
    assert eng.stats().prefix_cache_hit_tokens_total - before == 13 * BS
    assert a2.token_ids[:1] == a.token_ids and a2.token_ids == hf_greedy(path, prompt_a, 4)
    _all_free_or_cached(eng)


# ---- block accounting over an abort storm with shared prefixes ----------------------------------

@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_accounting_abort_storm_shared_prefixes(path, async_mode):
    rng = random.Random(31)
    prefixes = [random_prompt(rng, n) for n in (20, 45, 70)]
    specs = []
    for i in range(50):
        arrival = rng.randrange(0, 60)
        abort_at = rng.choice([None, None, arrival, arrival + 1, arrival + rng.randrange(2, 30)])
        prompt = rng.choice(prefixes) + random_prompt(rng, rng.randint(0, 30))
        specs.append(Spec(f"r{i}", prompt, greedy(rng.randint(1, 20), ignore_eos=rng.random() < 0.5),
                          arrival, abort_at, abort_after_tokens=rng.choice([None, None, 0, 2])))
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=24, num_kv_blocks=22,
                      block_size=BS, max_model_len=MAX_LEN, max_num_seqs=12)
    info = run_specs(eng, specs, order_rng=random.Random(4), on_step=check_block_invariants)
    st = info.stats
    assert sum(r.finish_reason == "abort" for r in info.results.values()) >= 10
    assert st.num_preemptions > 0 and st.prefix_cache_hit_tokens_total > 0
    _all_free_or_cached(eng)
    assert eng.scheduler.slots.num_free == eng.config.max_num_seqs


# ---- n = 4: forks share the prompt's blocks -------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_four_forks_share_the_prompt_blocks(path, caching, async_mode):
    prompt = random_prompt(random.Random(12), 100)   # 6 full blocks of 16 shareable (99 // 16)
    eng = make_engine(path, async_token_handoff=async_mode, enable_prefix_caching=caching)
    forks = [Request(f"f{i}", list(prompt), greedy(20, ignore_eos=True), effective_seed=i) for i in range(4)]
    eng.scheduler.add_forks(forks)
    tokens = {f.request_id: [] for f in forks}
    peak_shared = 0
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        check_block_invariants(eng)
        live = [f for f in forks if not f.is_finished]
        if len(live) == 4 and all(f.num_computed_tokens > 100 for f in live):
            leader = forks[0]
            for f in forks[1:]:
                assert f.block_ids[:6] == leader.block_ids[:6]
                assert f.block_ids[6] not in leader.block_ids   # its own partial prompt block
            assert all(eng.scheduler.blocks.ref_count(b) == 4 for b in leader.block_ids[:6])
            held = sum(len(f.block_ids) for f in forks)
            assert eng.stats().kv_blocks_used == held - 3 * 6
            peak_shared = max(peak_shared, held - eng.stats().kv_blocks_used)
    assert peak_shared == 18
    want = hf_greedy(path, prompt, 20)
    assert all(t == want for t in tokens.values())
    _all_free_or_cached(eng)


def test_forks_must_share_the_prompt(path):
    eng = make_engine(path)
    a = Request("a", [5, 6, 7], greedy(2))
    b = Request("b", [5, 6, 8], greedy(2))
    with pytest.raises(ValueError, match="forks of 'a' must have its prompt"):
        eng.scheduler.add_forks([a, b])


def test_bench_prefix_cache_smoke(tmp_path, path):
    """bench/prefix_cache.py end to end on CPU (tiny sizes): 4 requests x (40 common + 8 own)
    tokens; with caching on, 3 of them take the 2 full common blocks (32 tokens) from the cache."""
    import json
    from bench import prefix_cache
    out = tmp_path / "pc.json"
    assert prefix_cache.main(["--model", path, "--requests", "4", "--prefix", "40", "--suffix", "8",
                              "--output", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["off"]["prefill_tokens"] == 4 * 48 and doc["off"]["hit_tokens"] == 0
    assert doc["on"]["hit_tokens"] == 3 * 32 and doc["on"]["queried_tokens"] == 4 * 48
    assert doc["on"]["prefill_tokens"] == 4 * 48 - 3 * 32
    assert doc["identical_outputs"] == 4


@pytest.mark.parametrize("caching", [True, False])
def test_n4_request_shares_the_prompt_blocks(path, caching):
    """SamplingParams(n=4) through the engine API: the 4 sequences hold the prompt's 6 full
    blocks once (reference count 4) and each its own partial prompt block."""
    from backend_lib import SamplingParams
    prompt = random_prompt(random.Random(13), 100)
    eng = make_engine(path, enable_prefix_caching=caching)
    eng.add_request("n4", prompt, SamplingParams(n=4, max_tokens=20, temperature=0.0, ignore_eos=True))
    checked = False
    while eng.has_unfinished():
        eng.step()
        check_block_invariants(eng)
        seqs = list(eng.scheduler.requests.values())
        if len(seqs) == 4 and all(s.num_computed_tokens > 100 for s in seqs):
            shared = seqs[0].block_ids[:6]
            assert all(s.block_ids[:6] == shared for s in seqs)
            assert all(eng.scheduler.blocks.ref_count(b) == 4 for b in shared)
            assert eng.stats().kv_blocks_used == sum(len(s.block_ids) for s in seqs) - 3 * 6
            checked = True
    assert checked
    _all_free_or_cached(eng)


@pytest.mark.parametrize("prompt_len", [5, 8, 13, 16, 21])
def test_block_hashes_chain_over_prompt_and_outputs(prompt_len):
    """A request's block hashes are the chain over its known tokens, prompt then outputs,
    whatever block straddles the two: a later prompt that repeats them (the next turn of a
    chat) must find the same hashes."""
    from backend_lib.kv_cache import ROOT_HASH, BlockPool, block_hash
    from backend_lib.request import SamplingParams
    from backend_lib.scheduler import Scheduler
    sched = Scheduler(4, 64, 256, True, BlockPool(64, BS, enable_caching=True))
    rng = random.Random(prompt_len)
    tokens = [rng.randint(1, 500) for _ in range(prompt_len + 30)]
    req = Request("r", tokens[:prompt_len], SamplingParams(max_tokens=40))
    expected, parent = [], ROOT_HASH
    for i in range(len(tokens) // BS):
        parent = block_hash(parent, tokens[i * BS:(i + 1) * BS])
        expected.append(parent)
    req.output_token_ids.extend(tokens[prompt_len:prompt_len + 7])  # outputs arrive in steps
    n = (prompt_len + 7) // BS
    assert sched._hashes(req, n) == expected[:n]
    req.output_token_ids.extend(tokens[prompt_len + 7:])
    assert sched._hashes(req, len(expected)) == expected
    turn = Request("t", tokens + [1, 2], SamplingParams(max_tokens=4))
    assert sched._hashes(turn, len(expected)) == expected
