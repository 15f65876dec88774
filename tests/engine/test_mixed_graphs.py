"""CUDA-graph mixed steps (backend_lib/mixed_graphs.py) on CPU, through EagerGraph stand-ins
that replay the captured mixed program eagerly on the graphs' static buffers: bucket choice,
the padded metadata layout, lazy capture of the rarer sampling variants, the eager fallback
(no bucket fits, a capture failed), and whole workloads (chunked prefill, prefix-cache hits,
relay-fed first tokens, every sampling program, aborts, preemption, async handoff) that must
be token-identical to the eager mixed step and to HF.
"""
import logging
import random

import numpy as np
import pytest
import torch

from backend_lib import EngineConfig, SamplingParams
from backend_lib.decode_graphs import GRAPH_VARIANTS
from backend_lib.mixed_pack import MixedRows, pack_rows
from backend_lib.graph_buckets import mixed_buckets, parse_token_buckets, seq_buckets
from backend_lib.mixed_graphs import STARTUP_VARIANTS, MixedGraphs, MixedMeta
from engine_helpers import expected_from_reference, hf_greedy, make_engine, random_prompt, run_specs
from test_async_vs_sync import ENGINE_KW, _check, workload  # noqa: F401  (the randomized workload fixture)
from test_blocks import check_block_invariants
from test_decode_graphs import _churn_specs, _run_churn


# ---- buckets ----------------------------------------------------------------------------------

def test_token_buckets_default_list_and_errors():
    assert parse_token_buckets("", 2048) == (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert parse_token_buckets("", 3000) == (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3000)
    assert parse_token_buckets("", 8192)[-4:] == (3072, 4096, 6144, 8192)
    assert parse_token_buckets("", 100) == (16, 32, 64, 100)
    assert parse_token_buckets("", 5) == (5,)
    assert parse_token_buckets(" 256, 16,64,64 ", 512) == (16, 64, 256)
    for bad in ("0,16", "16,4096", "a,b", ","):
        with pytest.raises(ValueError, match="cuda_graph_mixed_tokens"):
            parse_token_buckets(bad, 2048)
    with pytest.raises(ValueError, match=r"cuda_graph_mixed_tokens.*max_num_batched_tokens \(2048\)"):
        EngineConfig(cuda_graph_mixed_tokens="4096")
    assert EngineConfig().cuda_graph_mixed is True  # the default: with CUDA graphs, mixed steps too
    assert EngineConfig.from_parameters({"cuda_graph_mixed": "true", "cuda_graph_mixed_tokens": "64,128",
                                         "max_num_batched_tokens": "128"}).cuda_graph_mixed is True


def test_seq_buckets_and_bucket_choice():
    assert seq_buckets(16, 64) == (4, 16)
    assert seq_buckets(8, 64) == (4, 8)
    assert seq_buckets(1024, 64) == (4, 16, 64)
    assert seq_buckets(8192, 257) == (4, 16, 64, 256, 257)
    assert seq_buckets(5, 2) == (2,)
    graphs = MixedGraphs(lambda m, *v: torch.zeros(m.seqs, dtype=torch.int64), torch.device("cpu"),
                         mixed_buckets((16, 64, 256), 64), scratch_slot=64, stand_in=True)
    assert graphs.buckets == ((16, 4), (16, 16), (64, 4), (64, 16), (64, 64), (256, 4), (256, 16), (256, 64))
    assert graphs.bucket(1, 1) == (16, 4)
    assert graphs.bucket(16, 5) == (16, 16)
    assert graphs.bucket(17, 3) == (64, 4)
    assert graphs.bucket(17, 17) == (64, 64)
    assert graphs.bucket(65, 64) == (256, 64)
    assert graphs.bucket(257, 1) is None and graphs.bucket(20, 65) is None
    # Started with the argmax, temperature and full-filter programs of every bucket; logprobs lazily.
    assert STARTUP_VARIANTS == GRAPH_VARIANTS[:3]
    assert set(graphs.graphs) == {(t, s, v) for t, s in graphs.buckets for v in STARTUP_VARIANTS}


def test_metadata_layout_and_padding():
    # A 3-token chunk of slot 2 at positions 5..7 (host ids, does not sample), and a decode
    # row of slot 0 whose input id comes from the relay; bucket (8 tokens, 4 rows), scratch 9.
    tok = [[11, 12, 13, 0], [-1, -1, -1, 0], [5, 6, 7, 20], [2, 2, 2, 0]]
    row = [[2, 0], [8, 21], [2, 3], [0, 1]]
    flat = MixedMeta.host_flat(MixedRows(np.array(tok), np.array(row), np.array([0, 3, 4])), 8, 4, scratch_slot=9)
    assert len(flat) == MixedMeta.size(8, 4)
    m = MixedMeta(torch.from_numpy(flat), 8, 4)
    assert m.ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert m.relay_src.tolist() == [-1, -1, -1, 0, -1, -1, -1, -1]
    assert m.pos.tolist() == [5, 6, 7, 20, 0, 0, 0, 0]
    assert m.tok_slot.tolist() == [2, 2, 2, 0, 9, 9, 9, 9]
    assert m.row_slot.tolist() == [2, 0, 9, 9]
    assert m.seq_len.tolist() == [8, 21, 0, 0]
    assert m.last_idx.tolist() == [2, 3, 0, 0]
    assert m.samples.tolist() == [0, 1, 0, 0]
    assert m.cu.tolist() == [0, 3, 4, 4, 4]
    empty = MixedMeta.empty(8, 4, 9, torch.device("cpu"))
    assert empty.cu.tolist() == [0] * 5 and empty.tok_slot.tolist() == [9] * 8 and empty.row_slot.tolist() == [9] * 4


def _pack_by_row(rows):
    """The mixed step's arrays by their definition, one row and one token at a time."""
    tok, row, cu = [[], [], [], []], [[], [], [], []], [0]
    for req, start, n, samples, ids, from_relay in rows:
        for j in range(n):
            tok[0].append(ids[j])
            tok[1].append(req.slot if from_relay and j == 0 else -1)
            tok[2].append(start + j)
            tok[3].append(req.slot)
        cu.append(cu[-1] + n)
        for k, v in enumerate((req.slot, start + n, cu[-1] - 1, int(samples))):
            row[k].append(v)
    return tok, row, cu


@pytest.mark.parametrize("seed", range(20))
def test_packed_rows_match_their_definition(seed):
    """pack_rows (numpy, per row only where it reads a row) against the per-token expansion:
    relay decode rows, host-known single tokens, prefill chunks, a relay row with a chunk
    behind it (recomputation after preemption), in random order and sizes."""
    from backend_lib.scheduler import ScheduledRow
    rng = random.Random(seed)

    class Req:
        def __init__(self, slot):
            self.slot = slot

    rows = []
    for slot in rng.sample(range(300), rng.randint(1, 60)):
        kind = rng.choice(("relay", "relay", "relay", "host1", "chunk", "relay-chunk"))
        start = rng.randint(0, 900)
        n = 1 if kind in ("relay", "host1") else rng.randint(2, 300)
        ids = [rng.randint(1, 30000) for _ in range(n)]
        if kind.startswith("relay"):
            ids[0] = 0
        rows.append(ScheduledRow(Req(slot), start, n, rng.random() < 0.8, ids, kind.startswith("relay")))
    packed = pack_rows(rows, [r.request.slot for r in rows])
    tok, row, cu = _pack_by_row(rows)
    assert packed.tok.dtype == packed.row.dtype == packed.cu.dtype == np.int64
    assert packed.tok.tolist() == tok and packed.row.tolist() == row and packed.cu.tolist() == cu
    assert packed.seq_lens == row[1] and packed.q_lens == [r.num_new_tokens for r in rows]
    assert packed.num_tokens == cu[-1]


def test_packing_no_rows_gives_empty_arrays():
    packed = pack_rows([], [])
    assert packed.tok.shape == (4, 0) and packed.row.shape == (4, 0) and packed.cu.tolist() == [0]
    assert packed.seq_lens == [] and packed.q_lens == [] and packed.num_tokens == 0


# ---- whole workloads through the stand-in graphs -------------------------------------------

class _MetaLog:
    """Wraps the runner's mixed program (before the stand-ins capture it): checks every
    replay's padding and records what the real rows looked like."""

    def __init__(self, runner):
        self.scratch = runner.scratch_slot
        self.replays = 0
        self.non_sampling_rows = 0   # non-final chunks
        self.mid_prompt_chunks = 0   # prefill rows starting past position 0 (cache hit, later chunk)
        self.relay_rows = 0          # rows whose first input id comes from the relay
        self.padded_tokens = 0
        self.padded_rows = 0
        program = runner._mixed_program

        def logged(m, *variant):
            if m.cu[-1] > 0:   # not a warm-up on the all-padding metadata
                self._check(m)
            return program(m, *variant)

        runner._mixed_program = logged

    def _check(self, m: MixedMeta) -> None:
        self.replays += 1
        real_t = int(m.cu[-1])
        real_s = int((m.seq_len > 0).sum())
        q_lens = (m.cu[1:] - m.cu[:-1]).tolist()
        assert all(q > 0 for q in q_lens[:real_s]) and all(q == 0 for q in q_lens[real_s:])
        assert (m.tok_slot[real_t:] == self.scratch).all() and (m.relay_src[real_t:] == -1).all()
        assert (m.row_slot[real_s:] == self.scratch).all() and (m.samples[real_s:] == 0).all()
        assert m.last_idx[:real_s].tolist() == [c - 1 for c in m.cu[1:real_s + 1].tolist()]
        self.padded_tokens += m.tokens - real_t
        self.padded_rows += m.seqs - real_s
        for i in range(real_s):
            first = int(m.cu[i])
            self.non_sampling_rows += int(m.samples[i]) == 0
            self.relay_rows += int(m.relay_src[first]) >= 0
            self.mid_prompt_chunks += q_lens[i] > 1 and int(m.pos[first]) > 0


def _mixed_engine(path, mode="off", **kw):
    eng = make_engine(path, async_token_handoff=mode, cuda_graph_mixed=True, **kw)
    log = _MetaLog(eng.runner)
    eng.runner.use_stand_in_graphs()
    return eng, log


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_greedy_chunks_cache_hits_equal_eager_and_hf(path, async_mode):
    rng = random.Random(31)
    shared = random_prompt(rng, 37)   # two full 16-token blocks: later prompts hit the cache
    prompts = [random_prompt(rng, n) for n in (1, 5, 60, 23)] + [shared + random_prompt(rng, n) for n in (3, 30)]
    prompts.insert(1, shared + [9])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=24, max_num_seqs=8)
    eager = make_engine(path, async_token_handoff=async_mode, **kw).generate(prompts, params)
    eng, log = _mixed_engine(path, async_mode, **kw)
    graphed = eng.generate(prompts, params)
    for p, a, b in zip(prompts, eager, graphed):
        assert b.token_ids == a.token_ids == hf_greedy(path, p, 10)
    mg = eng.runner.mixed_graphs
    assert mg.steps_eager == 0 and mg.steps_graphed == log.replays > 5
    assert log.non_sampling_rows > 0 and log.mid_prompt_chunks > 0
    # Async: decode rows of mixed steps take their input id from the relay (sync: host ids).
    assert (log.relay_rows > 0) == (async_mode == "on")
    assert log.padded_tokens > 0 and log.padded_rows > 0
    assert eng.stats().prefix_cache_hit_tokens_total > 0 and eng.stats().kv_blocks_used == 0


PENALTIES = [dict(), dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
             dict(top_k=5, top_p=0.8), dict(min_p=0.1, bad_token_ids=[7, 8]), dict(min_tokens=3)]


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_every_sampling_program_and_logprobs_equal_eager(path, async_mode):
    rng = random.Random(8)
    prompts = [random_prompt(rng, rng.randint(1, 90)) for _ in range(12)]  # long ones: non-final chunks
    params = [SamplingParams(max_tokens=9, temperature=[0.0, 1.3][i % 2], seed=i, ignore_eos=True,
                             logprobs=[None, 2, 5][i % 3], **PENALTIES[i % len(PENALTIES)]) for i in range(12)]
    kw = dict(max_num_batched_tokens=40, max_num_seqs=6)
    eager = make_engine(path, async_token_handoff=async_mode, **kw).generate(prompts, params)
    eng, _ = _mixed_engine(path, async_mode, **kw)
    graphed = eng.generate(prompts, params)
    worst = 0.0
    for a, b in zip(eager, graphed):
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys()
            worst = max([worst] + [abs(x[t] - y[t]) for t in x])
    assert worst < 1e-4, worst
    mg = eng.runner.mixed_graphs
    assert mg.steps_eager == 0 and mg.steps_graphed > 0
    # The logprobs program was captured on first use.
    assert {k[2] for k in mg.graphs} == set(GRAPH_VARIANTS)
    assert len([k for k in mg.graphs if k[2] == GRAPH_VARIANTS[3]]) < len(mg.buckets)


def test_eager_fallback_no_bucket_and_failed_capture(path, caplog, monkeypatch):
    rng = random.Random(4)
    # One batch a phase: graphed (a 5-token step), a failed capture (the logprobs program),
    # no bucket (a 40-token prompt in 8-token buckets).
    phases = [([random_prompt(rng, 5)], None), ([random_prompt(rng, 3)], 2), ([random_prompt(rng, 40)], None)]
    kw = dict(max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=False)

    def run(eng):
        return [[o.token_ids for o in eng.generate(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                     logprobs=lp))] for p, lp in phases]

    eager = run(make_engine(path, **kw))

    def broken(self, meta, variant):
        if variant[2]:
            raise RuntimeError("simulated capture failure")
        return orig(self, meta, variant)

    orig = MixedGraphs._capture_stand_in
    monkeypatch.setattr(MixedGraphs, "_capture_stand_in", broken)
    eng, log = _mixed_engine(path, cuda_graph_mixed_tokens="8", **kw)
    with caplog.at_level(logging.WARNING, logger="backend_lib.mixed_graphs"):
        graphed = run(eng)
        graphed += run(eng)
    assert graphed == eager + eager
    mg = eng.runner.mixed_graphs
    # Per run: graphed the first phase's prefill and the 40-token prompt's last chunk (8
    # tokens); eager the logprobs phase's prefill and the first chunk (32 tokens).
    assert mg.steps_graphed == 4 and mg.steps_eager == 4 and list(mg.failed) == [(8, 4, (False, True, True))]
    assert "simulated capture failure" in mg.failed[(8, 4, (False, True, True))]
    no_bucket = [r for r in caplog.records if "no bucket holds" in r.getMessage()]
    failed = [r for r in caplog.records if "capture of (8, 4, (False, True, True)) failed" in r.getMessage()]
    assert len(no_bucket) == 1 and len(failed) == 1  # each reason logged once


@pytest.mark.parametrize("budget", [16])
def test_randomized_workload_aborts_preemption(tiny_llama_path, workload, budget):  # noqa: F811
    """The async-vs-sync randomized workload (stops, min_tokens, seeded sampling, aborts at
    random points, preemption), its mixed steps replayed through the stand-in graphs."""
    groups, ref = workload
    specs = groups[budget]
    for mode in ("off", "on"):
        eng, log = _mixed_engine(tiny_llama_path, mode, max_num_batched_tokens=budget, **ENGINE_KW)
        info = run_specs(eng, specs, order_rng=random.Random(budget), on_step=check_block_invariants)
        _check(specs, ref, info)
        mg = eng.runner.mixed_graphs
        assert mg.steps_graphed > 50 and mg.steps_eager == 0, (mode, mg.steps_graphed, mg.steps_eager)
        assert info.stats.num_preemptions > 0 and log.non_sampling_rows > 0


@pytest.mark.parametrize("budget,seed", [(5, 1), (9, 3)])
def test_churn_with_forced_preemptions(tiny_llama_path, budget, seed):
    """test_decode_graphs' churn (bursts, every variant, forced preemptions whose recompute
    ends in a 1-token chunk), decode and mixed steps both through stand-in graphs."""
    specs = _churn_specs(seed, 40)
    probe = make_engine(tiny_llama_path, max_model_len=64, max_num_batched_tokens=256, max_num_seqs=64)
    ref = {s.rid: o.token_ids for s, o in zip(specs, probe.generate([s.prompt for s in specs],
                                                                   [s.params for s in specs]))}
    for mode in ("off", "on"):
        info, log = _run_churn(tiny_llama_path, mode, specs, budget, seed, cuda_graph_mixed=True)
        for s in specs:
            exp, reason = expected_from_reference(ref[s.rid], s.params)
            assert (info.results[s.rid].tokens, info.results[s.rid].finish_reason) == (exp, reason), (mode, s.rid)
        mg = log.runner.mixed_graphs
        assert info.stats.kv_blocks_used == 0 and info.stats.num_preemptions >= 5
        assert mg.steps_graphed > 20 and mg.steps_eager == 0, mode
        assert (log.graphs.steps_reused > 0) == (mode == "on")


def test_bench_mixed_steps_smoke_both_modes(tmp_path, monkeypatch):
    """bench/mixed_steps.py --mixed-graphs both on CPU (stand-in graphs): one row per point and
    mode, the mixed steps of the second engine replayed through the graphs, and the first
    engine freed before the second one starts (on CUDA it sizes its KV from free memory)."""
    import json
    import weakref
    from bench import mixed_steps
    runners = []
    build = mixed_steps.build_engine

    def tracked(args, graphs=False):
        assert all(r() is None for r in runners), "the previous engine is still alive"
        eng = build(args, graphs)
        runners.append(weakref.ref(eng.runner))
        return eng

    monkeypatch.setattr(mixed_steps, "build_engine", tracked)
    out = tmp_path / "rows.json"
    mixed_steps.main(["--mixed-graphs", "both", "--decodes", "2", "--chunks", "16", "--reps", "2", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["mixed_graphs"], r["decodes"], r["chunk"]) for r in rows] == [(False, 2, 16), (True, 2, 16)]
    assert rows[0]["mixed_steps_graphed"] == 0 and rows[1]["mixed_steps_graphed"] >= 2
    assert all(r["mixed_steps"] == 2 for r in rows) and len(runners) == 2
