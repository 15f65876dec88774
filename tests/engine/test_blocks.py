"""KV block accounting: every block returns to the pool however a request ends (finish,
stop, abort while waiting / mid-prefill / decoding, with steps in flight, preempted)."""
import random

import pytest

from engine_helpers import Spec, greedy, make_engine, random_prompt, run_specs


def check_block_invariants(eng, _step=None):
    """Every block is held (reference count == number of live requests holding it), free, or
    cached and evictable, exactly once; the pool counts as used exactly the distinct held
    blocks; the null block 0 is never handed out."""
    lists = [r.block_ids for r in eng.scheduler.requests.values()]
    eng.scheduler.blocks.check_consistency(lists)
    owned = {b for bl in lists for b in bl}
    st = eng.stats()
    assert st.kv_blocks_used == len(owned), (st.kv_blocks_used, len(owned))
    assert 0 <= st.kv_blocks_used <= st.kv_blocks_total


def _finish_all(eng):
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_abort_waiting_running_and_mid_prefill(path, async_mode):
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=16, max_num_seqs=2)
    rng = random.Random(0)
    long_p, p1, p2, p3 = (random_prompt(rng, n) for n in (120, 5, 6, 7))
    ref = {o.request_id: o.token_ids for o in []}
    full = eng.generate([p1], greedy(20, ignore_eos=True))[0].token_ids

    # Mid-prefill: 120-token prompt, 16-token budget: after 2 steps its prefill is partial.
    eng.add_request("long", long_p, greedy(8))
    eng.step(), eng.step()
    req = eng.scheduler.requests["long"]
    assert 0 < req.num_computed_tokens < len(long_p) and req.block_ids
    # Running (decoding) and waiting (max_num_seqs=2 keeps "w" waiting).
    eng.add_request("dec", p1, greedy(20, ignore_eos=True))
    eng.add_request("w", p2, greedy(5))
    for _ in range(12):
        eng.step()
    assert eng.scheduler.requests["w"] in eng.scheduler.waiting
    dec = eng.scheduler.requests["dec"]
    assert dec in eng.scheduler.running and len(dec.output_token_ids) > 0
    if async_mode == "on":
        assert eng._inflight, "a step should be in flight"
    check_block_invariants(eng)
    assert eng.abort("long") and eng.abort("w") and eng.abort("dec")
    assert not eng.abort("dec") and not eng.abort("unknown")
    check_block_invariants(eng)
    assert eng.stats().kv_blocks_used == 0
    eng.add_request("after", p3, greedy(3, ignore_eos=True))
    outs = _finish_all(eng)
    finals = {o.request_id: o for o in outs if o.finished}
    assert set(finals) >= {"long", "w", "dec", "after"}
    for rid in ("long", "w", "dec"):
        assert str(finals[rid].finish_reason) == "abort"
    # Nothing of "dec" arrives after its abort, and what it produced is the greedy prefix.
    got = [t for o in outs if o.request_id == "dec" for t in o.new_token_ids]
    assert finals["dec"].num_output_tokens == len(dec.output_token_ids)
    assert dec.output_token_ids == full[:len(dec.output_token_ids)] and not got
    assert str(finals["after"].finish_reason) == "length" and finals["after"].num_output_tokens == 3
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_abort_of_the_last_request_is_still_delivered(path, async_mode):
    """`while has_unfinished(): step()` must deliver the final "abort" output of a request
    aborted when it was the only one."""
    eng = make_engine(path, async_token_handoff=async_mode)
    eng.add_request("only", [5, 6, 7], greedy(30, ignore_eos=True))
    eng.step(), eng.step()
    eng.abort("only")
    outs = _finish_all(eng)
    assert [(o.request_id, o.finished, str(o.finish_reason)) for o in outs if o.finished] == [("only", True, "abort")]
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_abort_storm_with_preemption(path, async_mode):
    """Randomized arrivals and aborts (right after add, mid-prefill, mid-decode, preempted)
    on a pool small enough to preempt; the block invariants hold after every step."""
    rng = random.Random(11)
    specs = []
    for i in range(60):
        arrival = rng.randrange(0, 80)
        abort_at = rng.choice([None, arrival, arrival + 1, arrival + rng.randrange(2, 40)])
        specs.append(Spec(f"r{i}", random_prompt(rng, rng.randint(1, 120)),
                          greedy(rng.randint(1, 24), ignore_eos=rng.random() < 0.5), arrival, abort_at))
    eng = make_engine(path, async_token_handoff=async_mode, max_num_batched_tokens=32, num_kv_blocks=40,
                      block_size=8, max_model_len=256, max_num_seqs=16)
    info = run_specs(eng, specs, order_rng=random.Random(3), on_step=check_block_invariants)
    assert all(r.finish_reason is not None for r in info.results.values())
    n_abort = sum(r.finish_reason == "abort" for r in info.results.values())
    assert n_abort >= 15
    st = info.stats
    assert st.num_preemptions > 0
    assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_waiting == 0
    assert not eng.scheduler.requests and eng.scheduler.slots.num_free == eng.config.max_num_seqs
