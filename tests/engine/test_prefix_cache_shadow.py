"""The prefix cache under 0, 1 and 2 steps in flight, on a shadow KV cache (no model).

A stand-in runner executes SchedulerOutputs the way ModelRunner does (block-table entries
written from `grown`, input ids from the host or from the relay by slot, KV written at each
row's positions) but each KV slot records the (position, token id) written there, and a
row's "sampled" token is a hash of everything it reads through its block table. A request
that is handed a block holding other KV (a placeholder, an overshoot past a stop, a stale
or evicted block) then diverges from the reference, which samples from the true sequence.
Two steps in flight (pipeline parallel) is where a step computes KV for a token *past* a
stop, which must never reach the cache.
"""
import random
import zlib

import pytest

from backend_lib.kv_cache import BlockPool
from backend_lib.request import Request, SamplingParams, output_of_row
from backend_lib.scheduler import Scheduler

VOCAB = 64


def _sample(seen) -> int:
    return 4 + zlib.crc32(repr(seen).encode()) % (VOCAB - 4)


def reference(prompt, max_tokens, stop_ids) -> list[int]:
    seq = [(p, t) for p, t in enumerate(prompt)]
    out = []
    while len(out) < max_tokens:
        tok = _sample(tuple(seq))
        out.append(tok)
        if tok in stop_ids:
            break
        seq.append((len(seq), tok))
    return out


class ShadowRunner:
    def __init__(self, pool: BlockPool, num_slots: int):
        self.bs = pool.block_size
        self.kv = [[None] * self.bs for _ in range(pool.num_blocks)]
        self.table = [[0] * 64 for _ in range(num_slots)]
        self.relay = [0] * num_slots

    def execute(self, sched) -> list[int]:
        bs = self.bs
        for req, first in sched.grown:
            for i, b in enumerate(req.block_ids[first:], start=first):
                self.table[req.slot][i] = b
        sampled = []
        for row in sched.rows:
            tbl = self.table[row.request.slot]
            ids = list(row.host_token_ids)
            if row.first_from_relay:
                ids[0] = self.relay[row.request.slot]
            for j, t in enumerate(ids):
                p = row.start_pos + j
                self.kv[tbl[p // bs]][p % bs] = (p, t)
            end = row.start_pos + row.num_new_tokens
            tok = _sample(tuple(self.kv[tbl[q // bs]][q % bs] for q in range(end)))
            if row.samples:
                self.relay[row.request.slot] = tok
            sampled.append(tok)
        return sampled


def _owners(sched):
    return [r.block_ids for r in sched.requests.values()]


def run(depth, caching, budget, specs, num_blocks=24, bs=4, max_seqs=6, max_len=120, force_every=9, force_limit=25):
    pool = BlockPool(num_blocks, bs, enable_caching=caching)
    sched = Scheduler(max_seqs, budget, max_len, True, pool)
    runner = ShadowRunner(pool, max_seqs)
    inflight, outputs, finals = [], {}, {}
    step = forced = 0
    pending = sorted(specs, key=lambda s: s[0])
    aborts = {s[1]: s[5] for s in specs if s[5] is not None}
    while pending or sched.has_unfinished() or inflight or sched.has_pending_outputs:
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens, stop_ids, _ = pending.pop(0)
            sched.add(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                          stop_token_ids=stop_ids)))
        for rid, at in aborts.items():
            if at == step:
                sched.abort(rid)
        out = sched.schedule()
        if not out.is_empty:
            inflight.append((out, runner.execute(out)))
        results = sched.take_finished()
        while inflight and (len(inflight) > depth or out.is_empty):
            done, tokens = inflight.pop(0)
            results += sched.update(done, tokens)
            if out.is_empty:
                break
        for o in map(output_of_row, results):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = str(o.finish_reason)
        if step % force_every == force_every - 1 and sched.running and forced < force_limit:
            forced += 1
            # Preempt between steps as well (small budgets run too few requests at once to
            # exhaust the pool); a victim may have rows in the steps in flight.
            sched._preempt(sched.running[-1])
        pool.check_consistency(_owners(sched))
        step += 1
        assert step < 100000
    pool.check_consistency([])
    assert pool.num_used == 0
    return outputs, finals, sched.stats


def workload(seed, n=120):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    specs, t = [], 0
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randrange(4, VOCAB) for _ in range(rng.randint(0, 12))]
        max_tokens = rng.randint(1, 24)
        ref = reference(prompt, max_tokens, ())
        # A stop id that fires mid-stream (the first occurrence of a token of the output).
        stop_ids = [rng.choice(ref)] if rng.random() < 0.6 else []
        abort_at = t + rng.randint(0, 30) if rng.random() < 0.15 else None
        specs.append((t, f"r{i}", prompt, max_tokens, stop_ids, abort_at))
        t += rng.choice([0, 0, 1, 2, 4])
    return specs


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("budget", [1, 4, 16])
def test_shadow_kv_outputs_match_reference(depth, budget):
    specs = workload(100 + budget)
    for caching in (True, False):
        outputs, finals, stats = run(depth, caching, budget, specs)
        assert stats.num_preemptions > 0
        if caching:
            assert stats.prefix_cache_hit_tokens_total > 0
        for _, rid, prompt, max_tokens, stop_ids, abort_at in specs:
            want = reference(prompt, max_tokens, stop_ids)
            if finals[rid] == "abort":
                assert outputs.get(rid, []) == want[:len(outputs.get(rid, []))], rid
            else:
                assert outputs[rid] == want, (caching, rid)
                assert finals[rid] == ("stop" if want[-1] in stop_ids else "length")


def test_overshoot_kv_exists_and_is_never_cached():
    """Two steps in flight: when the stop is seen, the step after the lookahead has already
    written KV for the discarded token past the stop, in the stop token's block; a rule that
    trusted num_computed_tokens would cache that block (the stop sits 2 before a boundary)."""
    bs = 4
    prompt = [7, 8, 9, 10, 11, 12]
    ref = reference(prompt, 20, ())
    k = next(i for i in range(1, 19) if ref[i] not in ref[:i] and (len(prompt) + i) % bs == 2)
    pool = BlockPool(40, bs, enable_caching=True)
    sched = Scheduler(4, 64, 120, True, pool)
    runner = ShadowRunner(pool, 4)
    req = Request("a", prompt, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[ref[k]]))
    sched.add(req)
    inflight, slot, table = [], None, None
    while not req.is_finished:
        out = sched.schedule()
        inflight.append((out, runner.execute(out)))
        slot = req.slot if req.slot >= 0 else slot
        table = list(req.block_ids) or table
        if len(inflight) > 2:
            done, toks = inflight.pop(0)
            sched.update(done, toks)
    stop_pos = len(prompt) + k
    assert req.output_token_ids == ref[:k + 1] and req.finish_reason == "stop"
    assert req.num_computed_tokens == stop_pos + 2
    past = stop_pos + 1
    assert runner.kv[table[past // bs]][past % bs] == (past, ref[k + 1]), "no overshoot KV was written"
    assert pool.num_cached == (stop_pos + 1) // bs == (stop_pos + 2) // bs - 1
    for out, toks in inflight:
        sched.update(out, toks)

    # The next turn hits exactly the confirmed blocks and continues like the reference.
    prompt_b = prompt + req.output_token_ids + [5, 6]
    b = Request("b", prompt_b, SamplingParams(max_tokens=6, temperature=0.0))
    sched.add(b)
    got = []
    while not b.is_finished:
        out = sched.schedule()
        got += [t for row in sched.update(out, runner.execute(out)) for t in output_of_row(row).new_token_ids]
    assert sched.stats.prefix_cache_hit_tokens_total == (stop_pos + 1) // bs * bs
    assert got == reference(prompt_b, 6, ())


def test_requests_compare_by_identity():
    """A request is an entity: two built alike are not equal, and the scheduler's removals at
    finish find the very object by identity (a field-by-field dataclass equality made each
    removal compare every request queued before it)."""
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    a, b = Request("r", [1, 2, 3], sp, arrival=0), Request("r", [1, 2, 3], sp, arrival=0)
    assert a == a and a != b
    pool = BlockPool(40, 4, enable_caching=False)
    sched = Scheduler(4, 64, 120, True, pool)
    reqs = [Request(f"q{i}", [5, 6, 7], sp) for i in range(3)]
    for r in reqs:
        sched.add(r)
    sched.schedule()
    sched.abort("q1")
    assert [r.request_id for r in sched.running] == ["q0", "q2"]
