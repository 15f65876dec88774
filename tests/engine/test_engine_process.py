"""EngineProcessClient: the engine core in its own process behaves as AsyncEngine does: the
same tokens as LLMEngine.generate (greedy, seeded sampling, stop ids; callback and iterator),
merged outputs behind a slow callback, abort and shutdown finals, the same synchronous
validation messages, start-up errors re-raised with the child's type and message, engine
death and a killed core (every request ends with an error, unhealthy), and no core left
behind: after shutdown, after the parent is killed, after SIGINT to the group."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from backend_lib import AsyncEngine, EngineConfig, EngineProcessClient, SamplingParams
from backend_lib.core_clients import COUNTER_FIELDS
from engine_helpers import CallbackLog, greedy, make_engine, process_alive
from test_async_engine import KW, _wait, assert_abort_by_id, assert_streams_equal_generate, generate_reference  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# the core is a fresh process: the conftest's torch.set_num_threads(1) does not reach it
pytestmark = pytest.mark.usefixtures("single_thread_core")


@pytest.fixture(scope="module")
def client(path):
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    yield c
    c.shutdown()
    assert not process_alive(c.pid)


def test_streamed_equals_generate(client, generate_reference):
    assert_streams_equal_generate(client, generate_reference)
    ref = generate_reference[2]
    st = client.stats()
    assert st.kv_blocks_used == 0 and st.num_running == 0
    assert st.generation_tokens_total >= sum(len(t) for t, _ in ref)


def test_logprobs_and_n_cross_the_process(client, path):
    """Parallel sampling (n = 3, seeded) and logprobs: what generate gives, per sequence index."""
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=11, n=3, logprobs=2, ignore_eos=True)
    ref = make_engine(path, **{k: v for k, v in KW.items() if k not in ("device", "dtype")}).generate([[5, 6, 7]], sp)
    outs = list(client.add_request("n3", [5, 6, 7], sp))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    for r in ref:
        mine = [o for o in outs if o.index == r.index]
        assert [t for o in mine for t in o.new_token_ids] == r.token_ids
        lps = [d for o in mine for d in (o.new_logprobs or [])]
        assert lps == r.logprobs
        assert mine[-1].cumulative_logprob == pytest.approx(r.cumulative_logprob)


def test_validation_messages_match_the_engine(client, path):
    eng = make_engine(path, **{k: v for k, v in KW.items() if k not in ("device", "dtype")})
    cases = [([], greedy(3)), ([5, 768], greedy(3)), ([5], SamplingParams(max_tokens=3, top_p=0.0)),
             ([5], greedy(0)), ([5] * 512, greedy(3)), ([5], greedy(3, min_tokens=4)),
             ([5], greedy(3, stop_token_ids=[9999])), ([5], greedy(3, stop_token_ids=list(range(4, 30)))),
             ([5], SamplingParams(max_tokens=3, n=17)), ([5], SamplingParams(max_tokens=3, logprobs=21))]
    for prompt, sp in cases:
        with pytest.raises(ValueError) as want:
            eng.validate(prompt, sp)
        with pytest.raises(ValueError) as got:
            client.add_request("bad", prompt, sp)
        assert str(got.value) == str(want.value)
    s = client.add_request("dup", [5, 6], greedy(30, ignore_eos=True))
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        client.add_request("dup", [5], greedy(3))
    assert len(s.result()[0]) == 30
    toks, reason = client.add_request("bad", [5, 6, 7], greedy(2, ignore_eos=True)).result()
    assert len(toks) == 2 and client.is_healthy()


def test_abort_by_id(client, path):
    assert_abort_by_id(client, path, [5, 6, 7, 8, 9])
    _wait(lambda: client.stats().kv_blocks_used == 0, 10)


def test_batched_adds_reach_the_core_as_one_message(client, generate_reference, monkeypatch):
    """A Triton execute()'s requests go to the core in one write (batched_adds): the same tokens
    as generate, and an abort made in the block after its add ends that request (the core sees
    the ADD first: same message, in order)."""
    prompts, params, ref = generate_reference
    sent = []
    real_send = client._send
    monkeypatch.setattr(client, "_send", lambda cmds, timeout=None: (sent.append([c[0] for c in cmds]),
                                                                     real_send(cmds, timeout))[1])
    with client.batched_adds():
        streams = [client.add_request(f"bat{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        doomed = client.add_request("bat-aborted", [5, 6, 7], greedy(500, ignore_eos=True))
        client.abort("bat-aborted")
        assert sent == []  # nothing before the block ends
    assert sent == [["add"] * (len(prompts) + 1) + ["abort"]]
    assert [s.result() for s in streams] == [(t, r) for t, r in ref]
    toks, reason = doomed.result()
    assert str(reason) == "abort" and len(toks) < 500


def test_batched_adds_that_cannot_be_sent_end_each_request_with_an_error(client, monkeypatch):
    """A block's message that fails to go out for another reason than a dead core (here a
    stand-in error): its requests end with the reason, the engine stays healthy and serves on."""
    def broken_send(cmds, timeout=None):
        raise ValueError("stand-in pickling failure")

    real_send = client._send
    monkeypatch.setattr(client, "_send", broken_send)
    with client.batched_adds():
        streams = [client.add_request(f"unsent{i}", [5, 6, 7], greedy(4, ignore_eos=True)) for i in range(3)]
    monkeypatch.setattr(client, "_send", real_send)
    for s in streams:
        outs = list(s)
        assert len(outs) == 1 and str(outs[0].finish_reason) == "error"
        assert outs[0].error == "engine process send failed: ValueError('stand-in pickling failure')"
    assert client.is_healthy() and client.num_inflight() == 0
    toks, reason = client.add_request("after-unsent", [5, 6, 7], greedy(4, ignore_eos=True)).result()
    assert len(toks) == 4 and str(reason) == "length"


def test_batched_adds_to_a_dead_core_end_each_request_once(path):
    """The core dies before the block's message goes out: every request of the block gets one
    final output, an error (from the fail-all or from the block's end, never both)."""
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    try:
        finals: dict[str, list] = {}

        def cb(out):
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)

        with c.batched_adds():
            for i in range(5):
                c.add_request(f"dead{i}", [5, 6, 7], greedy(8, ignore_eos=True), callback=cb)
            os.kill(c.pid, signal.SIGKILL)
            _wait(lambda: not c.is_healthy(), 10)
        _wait(lambda: len(finals) == 5, 10)
        time.sleep(0.2)  # a second final would come now
        assert sorted(finals) == [f"dead{i}" for i in range(5)]
        for outs in finals.values():
            assert len(outs) == 1 and str(outs[0].finish_reason) == "error" and outs[0].error
    finally:
        c.shutdown(timeout=5)
    assert not process_alive(c.pid)


def test_sigint_to_the_core_is_ignored(client):
    """Ctrl-C reaches the whole process group; the stub decides when the engine stops."""
    os.kill(client.pid, signal.SIGINT)
    toks, reason = client.add_request("after-int", [5, 6, 7], greedy(5, ignore_eos=True)).result()
    assert len(toks) == 5 and str(reason) == "length" and client.is_healthy()


def test_shutdown_with_requests_in_flight(path):
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    streams = [c.add_request(f"s{i}", [5, 6, 7, i + 10], greedy(400, ignore_eos=True)) for i in range(4)]
    waiting = [c.add_request(f"w{i}", [7] * 300, greedy(400, ignore_eos=True)) for i in range(2)]
    _wait(lambda: c.stats().generation_tokens_total > 8)
    t0 = time.monotonic()
    c.shutdown()
    assert time.monotonic() - t0 < 10
    for s in streams + waiting:
        assert str(s.result()[1]) == "abort"
    assert not process_alive(c.pid) and not c.is_healthy()
    with pytest.raises(RuntimeError):
        c.add_request("late", [5], greedy(3))


@pytest.mark.parametrize("delivery_threads", [1, 3])
def test_merged_outputs_behind_a_slow_callback(path, generate_reference, delivery_threads):
    """delivery_threads 3: the callbacks run on three threads of their own, a request on one at
    a time (its tokens stay in order), as the llm model's sends do with delivery_threads > 1."""
    prompts, params, ref = generate_reference
    c = EngineProcessClient(EngineConfig(model_path=path, **KW), merge_queued_outputs=True,
                            delivery_threads=delivery_threads)
    log = CallbackLog()
    # Callbacks run one after another. The first one stalls for a second while the engine
    # keeps stepping, so every request's outputs of those steps queue up behind it (merged
    # tokens), however fast or loaded this machine is; the later ones take half a step (a
    # step's time from a warm request: 24 tokens, 24 steps or so), so that merging goes on.
    t0 = time.perf_counter()
    list(c.add_request("warm", [5, 6, 7], greedy(24, ignore_eos=True)))
    step_s = (time.perf_counter() - t0) / 24
    stalled = threading.Event()

    def cb(out):
        with log.entered(out):
            if not stalled.is_set():
                stalled.set()
                time.sleep(1.0)
            time.sleep(max(0.001, 0.5 * step_s * delivery_threads))

    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            c.add_request(f"r{i}", p, sp, callback=cb)
        _wait(lambda: log.all_finished(len(prompts)), 120)
    finally:
        c.shutdown()
    merged = sum(any(len(o.new_token_ids) > 1 for o in outs) for outs in log.streams_match(ref))
    assert merged >= 3  # several steps' tokens in one callback
    assert not log.overlaps  # never two callbacks of one request at once
    assert len(log.threads) == delivery_threads, log.threads


def test_startup_errors_reraised_like_the_in_process_engine(tmp_path):
    missing = EngineConfig(model_path=str(tmp_path / "no-such-model"), **KW)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama"')
    broken = EngineConfig(model_path=str(tmp_path / "broken"), **KW)
    for cfg in (missing, broken):
        with pytest.raises(Exception) as want:
            AsyncEngine(cfg)
        t0 = time.monotonic()
        with pytest.raises(Exception) as got:
            EngineProcessClient(cfg)
        assert time.monotonic() - t0 < 60
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert "model_path" in str(got.value) or "config.json" in str(got.value)


def test_core_switch_interval_from_the_environment(path, monkeypatch):
    """BACKEND_LIB_CORE_SWITCH_INTERVAL_MS (the llm model's gil_switch_interval_ms) sets the
    core's GIL switch interval; a bad value fails the start naming the variable."""
    monkeypatch.setenv("BACKEND_LIB_CORE_SWITCH_INTERVAL_MS", "0.25")
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    try:
        assert c.core_switch_interval_s == pytest.approx(0.00025)
        assert list(c.add_request("s", [5, 6, 7], greedy(3)))[-1].finished
    finally:
        c.shutdown()
    monkeypatch.setenv("BACKEND_LIB_CORE_SWITCH_INTERVAL_MS", "0")
    with pytest.raises(ValueError, match="BACKEND_LIB_CORE_SWITCH_INTERVAL_MS must be a positive number"):
        EngineProcessClient(EngineConfig(model_path=path, **KW))


def _fail_both(path, after_steps):
    """(outputs, health, error text) of one long request on an engine whose loop fails."""
    res = []
    for cls in (AsyncEngine, EngineProcessClient):
        eng = cls(EngineConfig(model_path=path, async_token_handoff="on", **KW), fault_after_steps=after_steps)
        try:
            outs = list(eng.add_request("a", [5, 6, 7], greedy(400, ignore_eos=True)))
            _wait(lambda: not eng.is_healthy(), 10)
            with pytest.raises(RuntimeError) as late:
                eng.add_request("c", [5], greedy(3))
            st = eng.stats()
            res.append((outs, str(late.value), {f: getattr(st, f) for f in COUNTER_FIELDS}))
        finally:
            eng.shutdown(timeout=5)
    return res


def test_engine_death_like_the_in_process_engine(path):
    """Outputs, the error and the late refusal as in-process; the counters of the steps the
    core ran before it died reach the client too (the core sends them with its death)."""
    (want, want_late, want_counts), (got, got_late, got_counts) = _fail_both(path, 12)
    assert want_counts["async_steps_total"] > 0 and want_counts["generation_tokens_total"] == len(
        sum((o.new_token_ids for o in want), []))
    for timed in [f for f in COUNTER_FIELDS if f.endswith("_time_s")]:  # seconds: each run its own
        assert got_counts.pop(timed) > 0 and want_counts.pop(timed) > 0
    assert got_counts == want_counts
    assert [(o.new_token_ids, o.finished, o.finish_reason, o.error) for o in got] == \
        [(o.new_token_ids, o.finished, o.finish_reason, o.error) for o in want]
    assert str(got[-1].finish_reason) == "error"
    assert got[-1].error == "engine failed: RuntimeError('injected engine fault after 12 steps')"
    assert got_late == want_late and "not healthy" in got_late


def test_killed_core_fails_every_request(path):
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    try:
        outs, got = [], threading.Event()

        def cb(out):
            outs.append(out)
            got.set()

        c.add_request("a", [5, 6, 7], greedy(500, ignore_eos=True), callback=cb)
        stream = c.add_request("b", [8, 9], greedy(500, ignore_eos=True))
        assert got.wait(60)
        os.kill(c.pid, signal.SIGKILL)
        toks, reason = stream.result()
        assert str(reason) == "error"
        _wait(lambda: outs and outs[-1].finished, 10)
        msg = f"engine failed: EngineProcessDied('engine process (pid {c.pid}) was killed by SIGKILL')"
        assert outs[-1].error == msg and str(outs[-1].finish_reason) == "error"
        assert not c.is_healthy()
        with pytest.raises(RuntimeError, match="not healthy"):
            c.add_request("c", [5], greedy(3))
        t0 = time.monotonic()
        c.stats()  # the last stats seen, at once
        assert time.monotonic() - t0 < 1
    finally:
        c.shutdown(timeout=5)
    assert not process_alive(c.pid)


PARENT = textwrap.dedent("""
    import os, sys, time
    os.environ["OMP_NUM_THREADS"] = "1"
    from backend_lib import EngineConfig, EngineProcessClient, SamplingParams
    c = EngineProcessClient(EngineConfig(model_path=sys.argv[1], max_model_len=512, num_kv_blocks=120))
    c.add_request("x", [5, 6, 7], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
                  callback=lambda out: None)
    print(c.pid, flush=True)
    sys.stdin.readline()
    os._exit(0)   # no shutdown, no atexit
""")


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_core_dies_with_its_parent(path, how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        core = int(parent.stdout.readline())
        assert process_alive(core)
        if how == "sigkill":
            parent.kill()
        else:
            parent.stdin.write(b"exit\n")
            parent.stdin.flush()
        parent.wait(30)
        _wait(lambda: not process_alive(core), 15)
    finally:
        parent.kill()
        parent.wait(10)
