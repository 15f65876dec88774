"""The step-submission thread (EngineConfig.step_submission="thread", backend_lib/submission.py):
steps planned on the engine thread (ModelRunner.plan: a StepPlan holding no Request) and
launched on the submission thread must give exactly the tokens of inline submission and of
the synchronous path: under churn with aborts and forced preemption, through the stand-in
decode and mixed graphs (whose "reuse the saved metadata" decision is made at plan time),
with logprobs, penalties and seeded sampling. A launch error ends as an engine error (step()
raises; AsyncEngine fails the requests and goes unhealthy), never as a hang, and closing the
engine leaves no thread behind.
"""
import gc
import itertools
import random
import threading
import weakref

import pytest

from backend_lib import AsyncEngine, EngineConfig, SamplingParams
from backend_lib.submission import THREAD_NAME
from engine_helpers import expected_from_reference, greedy, make_engine, random_prompt, run_specs
from test_async_engine import KW as ASYNC_KW, assert_streams_equal_generate, generate_reference  # noqa: F401
from test_async_vs_sync import ENGINE_KW, GROUPS, _check, workload  # noqa: F401
from test_blocks import check_block_invariants
import test_decode_graphs
from test_decode_graphs import _churn_specs, _run_churn

MODES = {"sync": dict(async_token_handoff="off"),
         "inline": dict(async_token_handoff="on"),
         "thread": dict(async_token_handoff="on", step_submission="thread"),
         "thread_sync": dict(async_token_handoff="off", step_submission="thread")}


def _submission_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _within(seconds: float, fn, *args):
    """fn(*args) on a helper thread; fails the test (instead of hanging it) after `seconds`."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still blocked after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Recorder:
    """Wraps runner.plan / runner.launch: on which thread each step launched, and how many
    steps were planned while an earlier step was still unread (the overlap)."""

    def __init__(self, eng):
        self.plans = self.plans_with_inflight = self.plans_with_two_inflight = 0
        self.launch_threads: list[str] = []
        runner = eng.runner
        plan, launch = runner.plan, runner.launch

        def recording_plan(sched, eos):
            self.plans += 1
            self.plans_with_inflight += bool(eng._inflight)
            self.plans_with_two_inflight += len(eng._inflight) >= 2
            return plan(sched, eos)

        def recording_launch(p):
            self.launch_threads.append(threading.current_thread().name)
            return launch(p)

        runner.plan, runner.launch = recording_plan, recording_launch


@pytest.fixture
def closing():
    """Registers engines to close at the end of the test (their submission threads stop)."""
    engines = []
    yield engines.append
    for e in engines:
        e.close()


def _assert_thread_mode_ran(rec: _Recorder, info) -> None:
    assert rec.plans == len(rec.launch_threads) == info.stats.async_steps_total > 0
    assert set(rec.launch_threads) == {THREAD_NAME}
    assert rec.plans_with_inflight >= 0.6 * rec.plans, (rec.plans_with_inflight, rec.plans)


# ---- the knob --------------------------------------------------------------------------------

def test_knob_default_parsing_and_errors():
    assert EngineConfig().step_submission == "inline"
    assert EngineConfig.from_parameters({"step_submission": "thread"}).step_submission == "thread"
    with pytest.raises(ValueError, match="EngineConfig.step_submission"):
        EngineConfig(step_submission="threaded")
    with pytest.raises(ValueError, match="EngineConfig.step_submission"):
        EngineConfig.from_parameters({"step_submission": "async"})
    with pytest.raises(ValueError, match="EngineConfig.step_submission"):
        EngineConfig(step_submission="thread", pipeline_parallel_size=2)
    assert EngineConfig().step_lookahead == 1
    assert EngineConfig.from_parameters({"step_lookahead": "2"}).step_lookahead == 2
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="EngineConfig.step_lookahead"):
            EngineConfig(step_lookahead=bad)


# ---- token identity ----------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [4, 16])
def test_randomized_workload_thread_equals_inline_and_sync(tiny_llama_path, workload, budget, closing):  # noqa: F811
    """test_async_vs_sync's workload (staggered arrivals, stops, min_tokens, seeded sampling,
    aborts in scrambled order, preemption): thread runs the same steps as inline (and with the
    async handoff off, as sync), so every request's stream is identical, aborted ones included."""
    groups, ref = workload
    specs = groups[budget]
    runs = {}
    for mode, kw in MODES.items():
        eng = make_engine(tiny_llama_path, max_num_batched_tokens=budget, **ENGINE_KW, **kw)
        closing(eng)
        rec = _Recorder(eng)
        info = run_specs(eng, specs, order_rng=random.Random(budget), on_step=check_block_invariants)
        assert _check(specs, ref, info) >= max(2, len(specs) // 12)
        runs[mode] = (info, rec)
    (sync, _), (inline, _), (thread, rec) = runs["sync"], runs["inline"], runs["thread"]
    _assert_thread_mode_ran(rec, thread)
    assert set(runs["inline"][1].launch_threads) == {"MainThread"}
    streams = {m: {rid: (r.tokens, r.finish_reason, r.num_outputs) for rid, r in info.results.items()}
               for m, (info, _) in runs.items()}
    assert streams["thread"] == streams["inline"] and streams["thread_sync"] == streams["sync"]
    assert set(runs["thread_sync"][1].launch_threads) == {THREAD_NAME} and runs["thread_sync"][1].plans_with_inflight == 0
    assert (thread.steps, thread.stats.num_preemptions) == (inline.steps, inline.stats.num_preemptions)
    if budget >= 16:
        assert thread.stats.num_preemptions > 0
    for s in specs:  # against sync: equal where not aborted, a common prefix where aborted
        a, b = sync.results[s.rid], thread.results[s.rid]
        n = min(len(a.tokens), len(b.tokens))
        assert a.tokens[:n] == b.tokens[:n], s.rid
        if s.abort_at is None and s.abort_after_tokens is None:
            assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason), s.rid


@pytest.mark.parametrize("budget,seed", [(5, 1), (9, 3)])
def test_graph_churn_forced_preemptions_thread_equals_inline(tiny_llama_path, budget, seed):
    """test_decode_graphs' churn (bursts, every sampling variant, forced preemptions whose
    recompute ends in a 1-token chunk) through the stand-in decode and mixed graphs: the
    metadata-reuse decision is made when a step is planned and must still hold when the
    submission thread replays it."""
    specs = _churn_specs(seed, 40)
    probe = make_engine(tiny_llama_path, max_model_len=64, max_num_batched_tokens=256, max_num_seqs=64)
    ref = {s.rid: o.token_ids for s, o in zip(specs, probe.generate([s.prompt for s in specs],
                                                                   [s.params for s in specs]))}
    runs = {}
    before = set(_submission_threads())
    for mode, kw in MODES.items():
        info, log = _run_churn(tiny_llama_path, kw["async_token_handoff"], specs, budget, seed,
                               cuda_graph_mixed=True, step_submission=kw.get("step_submission", "inline"))
        # _run_churn keeps no reference to its engine: dropping it stopped its thread.
        gc.collect()
        assert set(_submission_threads()) == before, mode
        for s in specs:
            exp, reason = expected_from_reference(ref[s.rid], s.params)
            assert (info.results[s.rid].tokens, info.results[s.rid].finish_reason) == (exp, reason), (mode, s.rid)
        assert info.stats.kv_blocks_used == 0 and info.stats.num_preemptions >= 5, (mode, info.stats)
        mg = log.runner.mixed_graphs
        assert mg.steps_graphed > 20 and mg.steps_eager == 0, mode
        runs[mode] = (info, log)
    (inline, inline_log), (thread, thread_log) = runs["inline"], runs["thread"]
    assert thread_log.graphs.steps_reused == inline_log.graphs.steps_reused > 30
    assert thread_log.entries == inline_log.entries and thread_log.host_id_then_same_rows() >= 1
    assert {r: x.tokens for r, x in thread.results.items()} == {r: x.tokens for r, x in inline.results.items()}
    assert runs["thread_sync"][1].entries == runs["sync"][1].entries


class _LaggingLaunches:
    """Holds each launch back as long as the engine thread allows: step k launches only once
    step k + 1 is planned (or the engine thread waits for step k's tokens). Between the plan
    and the launch the engine thread has then applied step k - 1's tokens (finishes, stops),
    run the driver's aborts and forced preemptions, and scheduled step k + 1 (slots and KV
    blocks reused by admissions): everything a plan that still read a Request would see."""

    def __init__(self, eng, timeout: float = 30.0):
        self.cond = threading.Condition()
        self.plans = self.waits = self.launches = 0
        self.lagged = 0   # launches that ran after the next step was planned
        runner, sub = eng.runner, eng.submission
        plan, launch, launched = runner.plan, runner.launch, sub.launched

        def counting_plan(sched, eos):
            p = plan(sched, eos)
            with self.cond:
                self.plans += 1
                self.cond.notify_all()
            return p

        def counting_launched(ticket):
            with self.cond:
                self.waits += 1
                self.cond.notify_all()
            return launched(ticket)

        def lagging_launch(p):
            with self.cond:
                k = self.launches
                assert self.cond.wait_for(lambda: self.plans >= k + 2 or self.waits >= k + 1, timeout)
                self.lagged += self.plans >= k + 2
                self.launches += 1
            return launch(p)

        runner.plan, runner.launch, sub.launched = counting_plan, lagging_launch, counting_launched


def test_lagging_launches_churn_equals_inline(tiny_llama_path, workload, closing):  # noqa: F811
    groups, ref = workload
    specs = groups[16]
    runs = {}
    for mode in ("inline", "thread"):
        eng = make_engine(tiny_llama_path, max_num_batched_tokens=16, **ENGINE_KW, **MODES[mode])
        closing(eng)
        lag = _LaggingLaunches(eng) if mode == "thread" else None
        info = run_specs(eng, specs, order_rng=random.Random(16), on_step=check_block_invariants)
        _check(specs, ref, info)
        runs[mode] = {rid: (r.tokens, r.finish_reason, r.num_outputs) for rid, r in info.results.items()}
    assert lag.launches > 100 and lag.lagged >= 0.6 * lag.launches, (lag.launches, lag.lagged)
    assert info.stats.num_preemptions > 0 and info.aborts_with_inflight >= 3
    assert runs["thread"] == runs["inline"]


def test_lagging_launches_graph_churn_equals_inline(tiny_llama_path, monkeypatch):
    """The same through the stand-in decode and mixed graphs: the metadata-reuse decision
    is made at plan time and must hold at a lagging replay."""
    budget, seed = 5, 1
    specs = _churn_specs(seed, 40)
    runs, lags = {}, []
    real_make = test_decode_graphs._graph_engine

    def lagging_engine(path, mode, **kw):
        eng = real_make(path, mode, **kw)
        if kw.get("step_submission") == "thread":
            lags.append(_LaggingLaunches(eng))
        return eng

    monkeypatch.setattr(test_decode_graphs, "_graph_engine", lagging_engine)
    for mode in ("inline", "thread"):
        info, log = _run_churn(tiny_llama_path, "on", specs, budget, seed, cuda_graph_mixed=True,
                               step_submission=mode)
        assert info.stats.num_preemptions >= 5 and log.runner.mixed_graphs.steps_graphed > 20
        runs[mode] = ({rid: (r.tokens, r.finish_reason) for rid, r in info.results.items()},
                      log.entries, log.graphs.steps_reused)
    (lag,) = lags
    assert lag.lagged >= 0.6 * lag.launches and runs["thread"][2] > 30
    assert runs["thread"] == runs["inline"]


def test_lookahead_2_randomized_workload_thread_equals_inline(tiny_llama_path, workload, closing):  # noqa: F811
    """Two steps launched ahead of the one being read: every request still gets exactly its
    reference tokens (aborted ones a prefix), and thread runs the same steps as inline."""
    groups, ref = workload
    specs = groups[16]
    runs = {}
    for mode in ("inline", "thread"):
        eng = make_engine(tiny_llama_path, max_num_batched_tokens=16, step_lookahead=2, **ENGINE_KW, **MODES[mode])
        closing(eng)
        rec = _Recorder(eng)
        lag = _LaggingLaunches(eng) if mode == "thread" else None
        info = run_specs(eng, specs, order_rng=random.Random(16), on_step=check_block_invariants)
        _check(specs, ref, info)
        assert rec.plans_with_two_inflight >= 0.5 * rec.plans, (rec.plans_with_two_inflight, rec.plans)
        assert info.stats.num_preemptions > 0 and info.aborts_with_inflight >= 3
        runs[mode] = {rid: (r.tokens, r.finish_reason, r.num_outputs) for rid, r in info.results.items()}
    assert lag.lagged >= 0.6 * lag.launches
    assert runs["thread"] == runs["inline"]


def test_lookahead_2_graph_churn_equals_reference(tiny_llama_path):
    budget, seed = 9, 3
    specs = _churn_specs(seed, 40)
    probe = make_engine(tiny_llama_path, max_model_len=64, max_num_batched_tokens=256, max_num_seqs=64)
    ref = {s.rid: o.token_ids for s, o in zip(specs, probe.generate([s.prompt for s in specs],
                                                                   [s.params for s in specs]))}
    results = {}
    for mode in ("inline", "thread"):
        info, log = _run_churn(tiny_llama_path, "on", specs, budget, seed, cuda_graph_mixed=True,
                               step_submission=mode, step_lookahead=2)
        for s in specs:
            exp, reason = expected_from_reference(ref[s.rid], s.params)
            assert (info.results[s.rid].tokens, info.results[s.rid].finish_reason) == (exp, reason), (mode, s.rid)
        assert info.stats.num_preemptions >= 5 and log.graphs.steps_reused > 30
        results[mode] = {rid: r.tokens for rid, r in info.results.items()}
    assert results["thread"] == results["inline"]


PENALTIES = [dict(), dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
             dict(top_k=5, top_p=0.8), dict(min_p=0.1, bad_token_ids=[7, 8]), dict(min_tokens=3)]


@pytest.mark.parametrize("graphs", [False, True])
def test_logprobs_penalties_seeded_sampling_and_n_thread_equals_inline(path, graphs, closing):
    rng = random.Random(8)
    prompts = [random_prompt(rng, rng.randint(1, 90)) for _ in range(12)]
    params = [SamplingParams(max_tokens=9, temperature=[0.0, 1.3][i % 2], seed=i, ignore_eos=True,
                             logprobs=[None, 2, 5][i % 3], n=1 + (i % 4 == 3), **PENALTIES[i % len(PENALTIES)])
              for i in range(12)]
    outs = {}
    for mode, kw in MODES.items():
        eng = make_engine(path, max_num_batched_tokens=40, max_num_seqs=8, cuda_graph_mixed=True, **kw)
        closing(eng)
        if graphs:
            eng.runner.use_stand_in_graphs()
        rec = _Recorder(eng)
        res = eng.generate(prompts, params)
        outs[mode] = [(o.token_ids, o.logprobs, o.cumulative_logprob, o.finish_reason) for o in res]
        if mode == "thread":
            assert set(rec.launch_threads) == {THREAD_NAME} and rec.plans_with_inflight > 0.5 * rec.plans
            if graphs:
                assert eng.runner.mixed_graphs.steps_graphed > 0 and eng.runner.decode_graphs.steps_uploaded > 0
    assert len(outs["thread"]) == 15 and sum(o[1] is not None for o in outs["thread"]) >= 8
    assert all(len(o[0]) == 9 for o in outs["thread"])
    # Same programs on the same inputs: bit-identical ids and logprobs.
    assert outs["thread"] == outs["inline"] and outs["thread_sync"] == outs["sync"]
    assert [o[0] for o in outs["thread"]] == [o[0] for o in outs["sync"]]


def test_async_engine_thread_mode_streams_equal_generate(path, generate_reference):  # noqa: F811
    aeng = AsyncEngine(EngineConfig(model_path=path, async_token_handoff="on", step_submission="thread", **ASYNC_KW))
    try:
        assert_streams_equal_generate(aeng, generate_reference)
        assert len(_submission_threads()) >= 1
    finally:
        aeng.shutdown()
    assert not aeng.engine.submission._thread.is_alive()
    assert aeng.engine.submission._thread not in threading.enumerate()


# ---- the thread really decouples the launch ------------------------------------------------------

def test_step_returns_while_its_launch_is_blocked(path, closing):
    """The engine thread plans and queues a step and goes on; only waiting for that step's
    tokens waits for its launch."""
    ref = make_engine(path).generate([[5, 6, 7, 8]], greedy(6, ignore_eos=True))[0].token_ids
    eng = make_engine(path, async_token_handoff="on", step_submission="thread")
    closing(eng)
    gate, started = threading.Event(), threading.Event()
    launch = eng.runner.launch

    def gated(plan):
        started.set()
        assert gate.wait(60)
        return launch(plan)

    eng.runner.launch = gated
    eng.add_request("a", [5, 6, 7, 8], greedy(6, ignore_eos=True))
    assert _within(30, eng.step) == []          # planned, queued, not waited on
    assert started.wait(30)
    (_, ticket), = eng._inflight
    assert not ticket.done()                     # its launch is still blocked
    gate.set()
    tokens = []
    while eng.has_unfinished():
        tokens += [t for o in _within(30, eng.step) for t in o.new_token_ids]
    assert tokens == ref and len(tokens) == 6


# ---- errors and shutdown -----------------------------------------------------------------------

def _fail_launch_after(runner, n_ok: int) -> None:
    launch, calls = runner.launch, itertools.count()

    def failing(plan):
        if next(calls) >= n_ok:
            raise RuntimeError("injected launch failure")
        return launch(plan)

    runner.launch = failing


def test_launch_error_raises_from_step_not_a_hang(path, closing):
    eng = make_engine(path, async_token_handoff="on", step_submission="thread")
    closing(eng)
    _fail_launch_after(eng.runner, 3)
    for i in range(3):
        eng.add_request(f"r{i}", [5 + i, 6, 7], greedy(50, ignore_eos=True))
    tokens = 0

    def run_until_error():
        nonlocal tokens
        while True:
            tokens += sum(len(o.new_token_ids) for o in eng.step())

    with pytest.raises(RuntimeError, match="injected launch failure"):
        _within(60, run_until_error)
    assert 0 < tokens < 150
    # The engine stays failed: the next step raises at once (the error, not a hang).
    with pytest.raises(RuntimeError, match="injected launch failure"):
        _within(30, eng.step)
    thread = eng.submission._thread
    eng.close()
    assert not thread.is_alive() and thread not in threading.enumerate()


def test_async_engine_launch_error_fails_requests_and_goes_unhealthy(path):
    aeng = AsyncEngine(EngineConfig(model_path=path, async_token_handoff="on", step_submission="thread", **ASYNC_KW))
    thread = aeng.engine.submission._thread
    try:
        _fail_launch_after(aeng.engine.runner, 6)  # the engine thread is idle: no request yet
        streams = [aeng.add_request(f"r{i}", [5 + i, 6, 7], greedy(200, ignore_eos=True)) for i in range(3)]
        results = [_within(60, s.result) for s in streams]
        assert [str(reason) for _, reason in results] == ["error"] * 3
        assert len(results[0][0]) > 0 and all(len(toks) < 200 for toks, _ in results), [len(t) for t, _ in results]
        assert not aeng.is_healthy() and "injected launch failure" in repr(aeng.error)
        with pytest.raises(RuntimeError, match="not healthy"):
            aeng.add_request("late", [5], greedy(3))
    finally:
        aeng.shutdown(timeout=10)
    assert not thread.is_alive() and thread not in threading.enumerate()


def test_close_shutdown_and_drop_leave_no_thread():
    before = set(_submission_threads())
    eng = make_engine("models/tiny-llama", async_token_handoff="on", step_submission="thread")
    t1 = eng.submission._thread
    eng.generate([[5, 6, 7]], greedy(4))
    assert t1.is_alive() and t1 in threading.enumerate()
    eng.close()
    eng.close()  # idempotent
    assert not t1.is_alive() and t1 not in threading.enumerate()
    eng.add_request("x", [5], greedy(2))
    with pytest.raises(RuntimeError, match="closed"):
        eng.step()
    # Dropped without close(): the engine's finalizer stops its thread.
    eng2 = make_engine("models/tiny-llama", async_token_handoff="on", step_submission="thread")
    t2, ref = eng2.submission._thread, weakref.ref(eng2)
    eng2.generate([[5, 6, 7]], greedy(4))
    del eng2
    gc.collect()
    assert ref() is None and not t2.is_alive()
    # Inline submission starts no thread at all.
    eng3 = make_engine("models/tiny-llama", async_token_handoff="on")
    assert set(_submission_threads()) == before
    eng3.close()
    assert set(_submission_threads()) == before


def test_bench_host_loop_submission_table_smoke(tmp_path, capsys):
    """bench/host_loop.py --submission inline,thread --lookahead 1,2 --device-us: one result per
    configuration, the thread mode's launches counted on the submission thread."""
    import json
    from bench import host_loop
    out = tmp_path / "host_loop.json"
    before = set(_submission_threads())
    host_loop.main(["--submission", "inline,thread", "--lookahead", "1,2", "--device-us", "50", "--batches", "1,4",
                    "--steps", "10", "--warmup", "2", "--max-model-len", "64", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [(r["submission"], r["lookahead"]) for r in res.values()] == [("inline", 1), ("inline", 2),
                                                                          ("thread", 1), ("thread", 2)]
    for r in res.values():
        assert [row["batch"] for row in r["rows"]] == [1, 4]
        for row in r["rows"]:
            assert row["tokens_per_step"] == row["batch"] and 0.0 <= row["device_idle_pct"] <= 100.0
            assert (row["submit_thread_cpu_us"] > 0) == (r["submission"] == "thread")
            # The emulated device paces the loop; up to `lookahead` steps of device time can fall
            # outside the measured window (they started during warm-up), so 10 steps span >= 8.
            assert row["wall_us"] * 10 >= 50.0 * (10 - r["lookahead"]) * 0.95
    assert "| 4 | thread | 2 |" in capsys.readouterr().out
    assert set(_submission_threads()) == before  # the bench closed its engines
