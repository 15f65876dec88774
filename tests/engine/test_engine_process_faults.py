"""EngineProcessClient under faults the happy-path tests do not reach: an engine loop that dies
while its clean-up (LLMEngine.close: pipeline stages, process groups) is slow, a core that stops
reading its socket (stopped, or stuck holding its GIL), a client built on a thread that exits,
and stats() once the core is gone."""
import os
import signal
import textwrap
import threading
import time

import pytest

from backend_lib import EngineConfig, EngineProcessClient
from engine_helpers import greedy, process_alive
from test_async_engine import KW, _wait, assert_a_stall_fails_the_streams


@pytest.fixture(autouse=True)
def _single_thread_core(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the core is a fresh process


SLOW_CLOSE = textwrap.dedent("""
    # Loaded by the engine core only (this folder is on its PYTHONPATH): LLMEngine.close() is
    # slow, as a pipeline's stage shutdown or a process group's teardown can be.
    import os, time
    import backend_lib.engine as _e
    _close = _e.LLMEngine.close
    def _slow_close(self):
        time.sleep(float(os.environ["TEST_CORE_CLOSE_DELAY_S"]))
        _close(self)
    _e.LLMEngine.close = _slow_close
""")


def test_engine_death_fails_requests_before_the_core_cleans_up(path, tmp_path, monkeypatch):
    """The loop died: every request ends with its error output at once, as in-process, not
    after the core's clean-up (which may take long, or hang)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_CLOSE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("TEST_CORE_CLOSE_DELAY_S", "60")
    c = EngineProcessClient(EngineConfig(model_path=path, **KW), fault_after_steps=12)
    try:
        outs, done = [], threading.Event()

        def cb(out):
            outs.append(out)
            if out.finished:
                done.set()

        c.add_request("a", [5, 6, 7], greedy(400, ignore_eos=True), callback=cb)
        t0 = time.monotonic()
        assert done.wait(30), "the request got no final output while the core cleaned up"
        assert time.monotonic() - t0 < 20
        assert outs[-1].error == "engine failed: RuntimeError('injected engine fault after 12 steps')"
        assert str(outs[-1].finish_reason) == "error" and sum(o.finished for o in outs) == 1
        assert not c.is_healthy()
        with pytest.raises(RuntimeError, match="not healthy"):
            c.add_request("late", [5], greedy(3))
    finally:
        c.shutdown(timeout=5)
    assert not process_alive(c.pid)


def _fill_until_blocked(c, n=2000):
    """A thread adding long-prompt requests to a core that does not read: the socket fills and
    add_request blocks. Returns (thread, outcomes {rid: 'added' | the exception})."""
    res: dict = {}

    def adder():
        for i in range(n):
            try:
                c.add_request(f"r{i}", [5] * 500, greedy(3), callback=lambda out: None)
                res[f"r{i}"] = "added"
            except Exception as e:  # noqa: BLE001
                res[f"r{i}"] = e
                return

    t = threading.Thread(target=adder, daemon=True)
    t.start()
    n_added, t0 = -1, time.monotonic()
    while len(res) != n_added:  # until the adds stop: the socket is full
        assert time.monotonic() - t0 < 60 and t.is_alive(), "add_request did not block on the stopped core"
        n_added = len(res)
        time.sleep(1.0)
    assert n_added > 5 and all(v == "added" for v in res.values())
    return t, res


def test_wedged_core_is_killed_and_fails_requests(path, monkeypatch):
    """A core that takes no command for SEND_TIMEOUT_S (stopped, or stuck holding its GIL) is
    wedged: add_request raises instead of blocking Triton's execute thread forever, every
    request ends with an error, the client turns unhealthy, the core is killed."""
    from backend_lib import engine_client
    monkeypatch.setattr(engine_client, "SEND_TIMEOUT_S", 4.0)  # > the 1 s polls of _fill_until_blocked
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    finals: dict = {}
    try:
        c.add_request("early", [5, 6, 7], greedy(400, ignore_eos=True), callback=lambda out: out.finished and finals.setdefault(out.request_id, out))
        os.kill(c.pid, signal.SIGSTOP)
        t, res = _fill_until_blocked(c)
        t.join(15)
        assert not t.is_alive(), "add_request still blocked on a wedged core"
        last = res[max(res, key=lambda k: int(k[1:]))]
        assert isinstance(last, RuntimeError) and "not healthy" in str(last) and "wedged" in str(last)
        _wait(lambda: "early" in finals, 10)
        assert str(finals["early"].finish_reason) == "error" and "wedged" in finals["early"].error
        assert not c.is_healthy()
        _wait(lambda: not process_alive(c.pid), 15)
        assert c.num_inflight() == 0
    finally:
        c.shutdown(timeout=3)
    assert not process_alive(c.pid)


def test_shutdown_keeps_its_timeout_with_a_wedged_core(path):
    """shutdown(timeout) returns within its timeout though a caller is blocked sending to a
    stopped core (the stub's finalize must not hang); the blocked caller gets its error."""
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    try:
        os.kill(c.pid, signal.SIGSTOP)
        t, res = _fill_until_blocked(c)
        t0 = time.monotonic()
        s = threading.Thread(target=c.shutdown, kwargs=dict(timeout=3), daemon=True)
        s.start()
        s.join(20)
        assert not s.is_alive(), "shutdown hung on a wedged core"
        assert time.monotonic() - t0 < 10
        t.join(15)
        assert not t.is_alive()
        assert not process_alive(c.pid)
    finally:
        if process_alive(c.pid):
            os.kill(c.pid, signal.SIGKILL)


def test_core_outlives_the_thread_that_built_the_client(path):
    """The kernel's parent-death signal fires when the THREAD that forked the core ends: a
    client built on a short-lived thread (a loader thread, a pool worker) must keep its core."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", EngineProcessClient(EngineConfig(model_path=path, **KW))))
    t.start()
    t.join(120)
    c = box["c"]
    try:
        time.sleep(0.5)
        assert c.is_healthy() and process_alive(c.pid)
        toks, reason = c.add_request("a", [5, 6, 7], greedy(5, ignore_eos=True)).result()
        assert len(toks) == 5 and str(reason) == "length"
    finally:
        c.shutdown(timeout=5)
    assert not process_alive(c.pid)


GAPS = textwrap.dedent("""
    # Loaded by the engine core only: every stats() carries fresh GPU idle gaps, as on CUDA
    # (taken once: handoff.take_gaps_us).
    import backend_lib.engine as _e
    _stats = _e.LLMEngine.stats
    def _with_gaps(self):
        st = _stats(self)
        st.gpu_idle_gap_us = [7.0, 9.0]
        return st
    _e.LLMEngine.stats = _with_gaps
""")


def test_stats_hand_out_each_idle_gap_once(path, tmp_path, monkeypatch):
    """gpu_idle_gap_us are taken (each exported once, into a histogram): the stats() given when
    the core does not answer (timed out, or gone) must not repeat the gaps already given."""
    from backend_lib import engine_client
    (tmp_path / "sitecustomize.py").write_text(GAPS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(engine_client, "STATS_TIMEOUT_S", 0.5)
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    try:
        assert c.stats().gpu_idle_gap_us == [7.0, 9.0]
        fresh = c.stats()
        assert fresh.gpu_idle_gap_us == [7.0, 9.0] and not fresh.stale  # from the core
        os.kill(c.pid, signal.SIGSTOP)
        late = c.stats()  # timed out: the last stats, without the gaps already handed out
        assert late.gpu_idle_gap_us == [] and late.kv_blocks_total > 0 and late.stale
        os.kill(c.pid, signal.SIGCONT)
        time.sleep(0.5)   # the late reply arrives: its gaps were handed to nobody yet
        again = c.stats()
        assert again.gpu_idle_gap_us == [7.0, 9.0, 7.0, 9.0] and not again.stale
        os.kill(c.pid, signal.SIGKILL)
        _wait(lambda: not c.is_healthy(), 10)
        gone = [c.stats() for _ in range(3)]
        assert [g.gpu_idle_gap_us for g in gone] == [[], [], []] and all(g.stale for g in gone)
        assert gone[0].kv_blocks_total > 0
    finally:
        c.shutdown(timeout=5)


def test_sigterm_to_the_core_is_ignored(path):
    """A SIGTERM sent to the whole process group or cgroup (systemd's KillMode=control-group,
    `kill -TERM -PGID`) reaches the core too; Triton's stubs ignore it and the server drains
    its requests. The core must not die under the stub mid-drain (every stream would fail with
    'killed by SIGTERM'): the stub decides when the engine stops, as for SIGINT."""
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    try:
        outs = []
        s = c.add_request("in-flight", [5, 6, 7], greedy(200, ignore_eos=True), callback=outs.append)
        _wait(lambda: len(outs) > 2, 30)
        os.kill(c.pid, signal.SIGTERM)
        _wait(lambda: outs and outs[-1].finished, 60)
        assert str(outs[-1].finish_reason) == "length" and sum(len(o.new_token_ids) for o in outs) == 200
        assert c.is_healthy() and s is not None
    finally:
        c.shutdown(timeout=5)
    assert not process_alive(c.pid)


def test_a_stalled_core_fails_the_requests_in_flight(path, monkeypatch):
    """A core that stops producing output with requests in flight (a hung kernel, a deadlock:
    here SIGSTOP) and no new traffic to fill its socket: after the stall timeout the client
    kills it, every request in flight ends with an error naming the stall, and the client
    turns unhealthy. Idle stretches (nothing in flight) longer than the timeout are no stall."""
    monkeypatch.setenv("BACKEND_LIB_ENGINE_STALL_TIMEOUT_S", "3")
    c = EngineProcessClient(EngineConfig(model_path=path, **KW))
    try:
        time.sleep(4.5)  # idle past the timeout: no stall
        toks, reason = c.add_request("warm", [5, 6, 7], greedy(8, ignore_eos=True)).result()
        assert len(toks) == 8 and str(reason) == "length" and c.is_healthy()
        assert_a_stall_fails_the_streams(c, lambda: os.kill(c.pid, signal.SIGSTOP), 2.5, "no output for")
        assert not c.is_healthy() and c.num_inflight() == 0
        _wait(lambda: not process_alive(c.pid), 15)
    finally:
        c.shutdown(timeout=3)


def test_stall_timeout_must_be_positive(monkeypatch):
    from backend_lib import envs
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("BACKEND_LIB_ENGINE_STALL_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="BACKEND_LIB_ENGINE_STALL_TIMEOUT_S"):
            envs.engine_stall_timeout_s()
    monkeypatch.delenv("BACKEND_LIB_ENGINE_STALL_TIMEOUT_S")
    assert envs.engine_stall_timeout_s() == 300.0
