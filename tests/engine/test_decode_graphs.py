"""The CUDA-graph decode control logic on CPU, through EagerGraph stand-ins that replay the
captured decode program eagerly on the graphs' static buffers: bucketing, sampling variants,
the relay sources and the "only positions changed, reuse the saved metadata" decision.

The async path (input ids gathered from the relay, metadata reused) must be token-identical
to the synchronous path (every input id uploaded from the host) and to HF / a plain
eager reference run, also when preemption makes a recomputed request finish its prefill
with a 1-token chunk inside a decode-only step (a host-known id in a graph step).
"""
import random
from types import SimpleNamespace

import pytest
import torch

from backend_lib import SamplingParams
from backend_lib.decode_graphs import DecodeGraphs, graph_variant
from backend_lib.scheduler import ScheduledRow
from engine_helpers import (Spec, expected_from_reference, hf_greedy, make_engine, preempt_when_scheduling_output,
                            random_prompt, run_specs)
from test_blocks import check_block_invariants


def _graph_engine(path, mode, **kw):
    eng = make_engine(path, async_token_handoff=mode, **kw)
    eng.runner.use_stand_in_graphs()
    return eng


class _LaunchLog:
    """Records every graph launch: which rows used a host-known id, and whether the step
    reused the saved metadata."""

    def __init__(self, eng):
        self.runner = eng.runner
        self.graphs = eng.runner.decode_graphs
        self.entries = []   # (slots, [first_from_relay per row], reused)
        self.rows = []      # per launch: [(request id, start position, first_from_relay)]
        self.variants = set()
        orig = self.graphs.plan

        def plan(rows, greedy, masks, logprobs=False, **kw):
            before = self.graphs.steps_reused
            out = orig(rows, greedy, masks, logprobs, **kw)
            self.variants.add(graph_variant(greedy, masks, logprobs))
            self.rows.append([(r.request.request_id, r.start_pos, r.first_from_relay) for r in rows])
            self.entries.append(([r.request.slot for r in rows], [r.first_from_relay for r in rows],
                                 self.graphs.steps_reused > before))
            return out

        self.graphs.plan = plan

    def host_id_then_same_rows(self) -> int:
        """Graph steps with a host-known id followed by a graph step of the same slots in
        which every id comes from the relay: the case a stale saved id would corrupt."""
        n = 0
        for (slots, relay, _), (slots2, relay2, _) in zip(self.entries, self.entries[1:]):
            n += (not all(relay)) and slots == slots2 and all(relay2)
        return n


# ---- the reuse decision itself, with a recording program ------------------------------------------

def _row(slot, pos, host_id=None):
    """A decode row of the request in `slot` at `pos`; host_id None: its id is in the relay."""
    return ScheduledRow(SimpleNamespace(slot=slot), pos, 1, True, [0 if host_id is None else host_id],
                        host_id is None)


def test_reuse_only_after_an_all_relay_upload():
    seen = []

    def program(meta, greedy, masks, logprobs=False):  # records what the graph reads; keeps the contract
        seen.append(meta.packed.clone())
        meta.pos.add_(meta.slot >= 0)
        return torch.zeros(meta.slot.shape[0], dtype=torch.int64)

    graphs = DecodeGraphs(program, torch.device("cpu"), (1, 2, 4), stand_in=True)
    uploads = []

    def upload(meta):
        uploads.append(meta)
        return meta

    def step(rows, greedy=True, masks=False):
        n = len(uploads)
        with torch.inference_mode():  # as ModelRunner.execute runs it
            graphs.launch(rows, greedy, masks, upload)
        return len(uploads) > n, seen[-1]

    # Row a's final prefill chunk is a host-known id: uploaded, relay source -1.
    up, m = step([_row(3, 10, host_id=77), _row(5, 20)])
    assert up and m[1].tolist() == [-1, 5] and m[0, 0] == 77 and m[2].tolist() == [10, 20]
    # Same rows, all from the relay now: the saved metadata still says "host id 77" -> upload.
    up, m = step([_row(3, 11), _row(5, 21)])
    assert up and m[1].tolist() == [3, 5] and m[2].tolist() == [11, 21]
    # Again all relay, after an all-relay upload: reused, positions advanced by the program.
    up, m = step([_row(3, 12), _row(5, 22)])
    assert not up and m[1].tolist() == [3, 5] and m[2].tolist() == [12, 22] and graphs.steps_reused == 1
    # Padding rows (bucket 4 for 3 rows) keep slot -1 and position 0.
    up, m = step([_row(3, 13), _row(5, 23), _row(6, 4)])
    assert up and m[3].tolist() == [3, 5, 6, -1] and m[2].tolist() == [13, 23, 4, 0]
    up, m = step([_row(3, 14), _row(5, 24), _row(6, 5)])
    assert not up and m[2].tolist() == [14, 24, 5, 0]
    # Anything else that changed: the sampling variant, the slots or their order, a step
    # outside the graphs.
    assert step([_row(3, 15), _row(5, 25), _row(6, 6)], greedy=False)[0]
    assert step([_row(5, 26), _row(3, 16), _row(6, 7)], greedy=False)[0]
    assert not step([_row(5, 27), _row(3, 17), _row(6, 8)], greedy=False)[0]
    graphs.invalidate()
    assert step([_row(5, 28), _row(3, 18), _row(6, 9)], greedy=False)[0]
    assert graphs.steps_reused == 3 and graphs.steps_uploaded == 6


# ---- the deterministic reproduction ------------------------------------------------------------

def _run_forced_preemption(path, mode, prompt_a, prompt_b, max_a, max_b):
    """Two greedy requests, budget 8. Request A (5-token prompt) is preempted when its third
    output is scheduled; it is re-admitted once that token has arrived (nothing in flight)
    with 8 known tokens: B's decode takes 1 of the budget, so the recompute is a 7-token
    chunk, then a 1-token final chunk in a decode-only step next to B's decode."""
    eng = _graph_engine(path, mode, max_num_batched_tokens=8, max_num_seqs=4)
    log = _LaunchLog(eng)
    forced = preempt_when_scheduling_output(eng, "a", 3)
    eng.add_request("b", prompt_b, SamplingParams(max_tokens=max_b, temperature=0.0, ignore_eos=True))
    eng.add_request("a", prompt_a, SamplingParams(max_tokens=max_a, temperature=0.0, ignore_eos=True))
    out = {"a": [], "b": []}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    assert forced, "request a was never preempted"
    assert eng.stats().kv_blocks_used == 0
    return out, log, forced[0]


def test_recomputed_one_token_final_chunk_then_reused_metadata(tiny_llama_path):
    rng = random.Random(5)
    prompt_a, prompt_b = random_prompt(rng, 5), random_prompt(rng, 3)
    max_a, max_b = 12, 24
    runs = {mode: _run_forced_preemption(tiny_llama_path, mode, prompt_a, prompt_b, max_a, max_b)
            for mode in ("off", "on")}
    ref = {"a": hf_greedy(tiny_llama_path, prompt_a, max_a), "b": hf_greedy(tiny_llama_path, prompt_b, max_b)}
    # Sync: preempted between steps with its 3 outputs known; async: with the third in flight.
    assert runs["off"][2] == (3, 0) and runs["on"][2] == (2, 1)
    # Both runs decoded a's 1-token final chunk (position 7, a host-known id) in a graph step;
    # in the async run the next graph step had the same rows, all from the relay.
    for mode, (_, log, _) in runs.items():
        assert any(("a", 7, False) in rows for rows in log.rows), (mode, log.rows)
    assert runs["on"][1].host_id_then_same_rows() >= 1, runs["on"][1].entries
    assert runs["on"][1].graphs.steps_reused > 0 and runs["off"][1].graphs.steps_reused == 0
    assert runs["off"][0] == ref
    assert runs["on"][0] == runs["off"][0]


# ---- randomized churn with forced preemptions ------------------------------------------------

def _churn_specs(seed, n):
    rng = random.Random(seed)
    specs, t = [], 0
    for i in range(n):
        t += rng.choice([0, 0, 0, 30])   # bursts, then decode-only stretches
        kind = rng.random()
        sp = SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True)
        if kind < 0.25:      # temperature sampling: the (False, False) graph variant
            sp.temperature, sp.seed = 0.9, rng.randrange(2**31)
        elif kind < 0.4:     # top-k / top-p / bans: the full (False, True) variant
            sp.temperature, sp.seed = 0.8, rng.randrange(2**31)
            sp.top_k, sp.top_p = rng.choice([0, 5, 40]), rng.choice([1.0, 0.9])
            sp.bad_token_ids = rng.sample(range(4, 768), 3)
        specs.append(Spec(f"r{i}", random_prompt(rng, rng.randint(1, 16)), sp, arrival=t))
    return specs


def _known_after_inflight(req):
    """Tokens a preempted request recomputes: prompt + outputs, in-flight ones included."""
    return req.num_prompt_tokens + req.num_generated_with_placeholders


def _run_churn(path, mode, specs, budget, seed, **engine_kw):
    eng = _graph_engine(path, mode, max_num_batched_tokens=budget, max_num_seqs=8, block_size=4,
                        num_kv_blocks=60, max_model_len=64, **engine_kw)
    log = _LaunchLog(eng)
    rng = random.Random(seed)

    def preempt_at_random(engine, step):
        check_block_invariants(engine, step)
        sched = engine.scheduler
        decoding = [r for r in sched.running if r.output_token_ids]
        if not decoding:
            return
        # Targeted: the others all decode (1 token each per step) and nothing waits, so the
        # victim's recompute comes in chunks of budget - others and ends with a 1-token chunk.
        chunk = budget - (len(sched.running) - 1)
        targets = [r for r in decoding
                   if not sched.waiting and chunk > 1 and len(decoding) == len(sched.running)
                   and _known_after_inflight(r) % chunk == 1
                   and r.sampling.max_tokens - r.num_generated_with_placeholders >= 3]
        if targets and rng.random() < 0.3:
            sched._preempt(rng.choice(targets))
        elif rng.random() < 0.04:
            sched._preempt(rng.choice(decoding))

    info = run_specs(eng, specs, on_step=preempt_at_random)
    return info, log


@pytest.mark.parametrize("budget,seed", [(5, 1), (7, 2), (9, 3), (11, 4)])
def test_churn_with_forced_preemptions_async_equals_sync(tiny_llama_path, budget, seed):
    specs = _churn_specs(seed, 40)
    probe = make_engine(tiny_llama_path, max_model_len=64, max_num_batched_tokens=256, max_num_seqs=64)
    ref = {s.rid: o.token_ids for s, o in zip(specs, probe.generate([s.prompt for s in specs],
                                                                   [s.params for s in specs]))}
    runs = {mode: _run_churn(tiny_llama_path, mode, specs, budget, seed) for mode in ("off", "on")}
    for mode, (info, log) in runs.items():
        for s in specs:
            exp, reason = expected_from_reference(ref[s.rid], s.params)
            res = info.results[s.rid]
            assert (res.tokens, res.finish_reason) == (exp, reason), (mode, s.rid)
        assert info.stats.kv_blocks_used == 0 and info.stats.num_preemptions >= 5, (mode, info.stats)
    (sync, sync_log), (asyn, asyn_log) = runs["off"], runs["on"]
    # The async run replayed saved metadata, and went through the stale-id case many times.
    assert asyn_log.graphs.steps_reused > 30, asyn_log.graphs.steps_reused
    assert asyn_log.host_id_then_same_rows() >= 2, asyn_log.host_id_then_same_rows()
    # Every sampling variant ran through the graphs.
    assert asyn_log.variants == sync_log.variants == {(True, False, False), (False, False, False), (False, True, False)}
    assert {s.rid: sync.results[s.rid].tokens for s in specs} == {s.rid: asyn.results[s.rid].tokens for s in specs}


def test_relay_metadata_equals_the_row_by_row_build():
    """DecodeMeta.host_relay (numpy, for steady decode rows) builds exactly host_rows' table,
    padding included, for relay rows as the scheduler makes them (ScheduledRow)."""
    from backend_lib.decode_graphs import DecodeMeta
    from backend_lib.handoff import host_tensor
    from backend_lib.scheduler import _RELAY_IDS
    rng = random.Random(3)
    for n, bucket in ((1, 1), (3, 8), (200, 256), (256, 256)):
        slots = rng.sample(range(512), n)
        rows = [ScheduledRow(SimpleNamespace(slot=s), rng.randint(1, 4000), 1, True, _RELAY_IDS, True) for s in slots]
        want = host_tensor(DecodeMeta.host_rows(rows, bucket - n))
        got = DecodeMeta.host_relay(rows, slots, bucket)
        assert got.dtype == want.dtype and torch.equal(got, want), (n, bucket)
