"""EngineProcessClient(share_key=...): clients of one key, in any process of the machine, share
ONE engine core. Concurrent clients attach to the same core (one spawns it) and each gets
generate's tokens for its own requests only; a client's shutdown detaches it (its requests end
aborted, the core serves the others on) and the last one's stops the core; a client whose
process is killed is detached in the core (its requests aborted, their KV freed); the core
outlives the process that spawned it; each client's counters are its share (the shares add up
to the engine's totals); a start-up error reaches every client and leaves no core behind."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from backend_lib import EngineConfig, EngineProcessClient
from backend_lib.request import output_of_row
from backend_lib.shared_core import socket_name
from engine_helpers import greedy, make_engine, process_alive
from test_async_engine import KW, _wait

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# the core is a fresh process: the conftest's torch.set_num_threads(1) does not reach it
pytestmark = pytest.mark.usefixtures("single_thread_core")


def _key(request) -> str:
    """A share key of this test alone (no test attaches to another's core)."""
    return f"test_shared_core-{request.node.name}-{os.getpid()}-{time.monotonic_ns()}"


def _config(path) -> EngineConfig:
    return EngineConfig(model_path=path, **KW)


@pytest.fixture(scope="module")
def reference(path):
    """reference(prompt, max_tokens): LLMEngine.generate's greedy (ignore_eos) token ids."""
    eng = make_engine(path, **{k: v for k, v in KW.items() if k not in ("device", "dtype")})
    cache: dict = {}

    def ref(prompt, max_tokens):
        k = (tuple(prompt), max_tokens)
        if k not in cache:
            out, = eng.generate([list(prompt)], greedy(max_tokens, ignore_eos=True))
            assert len(out.token_ids) == max_tokens
            cache[k] = list(out.token_ids)
        return cache[k]

    def many(prompts, max_tokens_list):
        """Several at once (one batched generate for those not cached yet)."""
        todo = [(p, n) for p, n in zip(prompts, max_tokens_list) if (tuple(p), n) not in cache]
        if todo:
            outs = eng.generate([list(p) for p, _ in todo], [greedy(n, ignore_eos=True) for _, n in todo])
            for (p, n), o in zip(todo, outs):
                assert len(o.token_ids) == n
                cache[(tuple(p), n)] = list(o.token_ids)
        return [cache[(tuple(p), n)] for p, n in zip(prompts, max_tokens_list)]

    ref.many = many
    return ref


def _concurrently(fns, timeout=60.0):
    """Run each fn on its own thread, started together; their results (or raised errors)."""
    barrier = threading.Barrier(len(fns))
    results: list = [None] * len(fns)

    def run(i, fn):
        barrier.wait()
        try:
            results[i] = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            results[i] = ("err", e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"still running after {timeout} s"
    return results


def _first_token_waiter():
    """(callback, outputs, event set at the first output)."""
    outs, got = [], threading.Event()

    def cb(out):
        outs.append(out)
        got.set()

    return cb, outs, got


def _request_outlives_kill(client, sub, prompt, max_tokens, reference):
    """A request of `client` is streaming when process `sub` is killed: it still ends with all
    of generate's tokens, one final output last."""
    cb, outs, got = _first_token_waiter()
    client.add_request(f"outlives-{sub.pid}", prompt, greedy(max_tokens, ignore_eos=True), callback=cb)
    assert got.wait(60)
    sub.kill()
    assert sub.wait(10) == -signal.SIGKILL
    _wait(lambda: outs and outs[-1].finished, 60)
    assert _tokens(outs) == reference(prompt, max_tokens) and str(outs[-1].finish_reason) == "length"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def _tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def _live_core_children() -> set:
    """Live engine-core processes that are children of this process."""
    me, found = str(os.getpid()), set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z" and b"backend_lib.engine_core" in cmd:
            found.add(int(d))
    return found


def _subprocess(script: str, *args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            cwd=ROOT, env=env, text=True)


def _read_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The subprocess's next stdout line, within timeout (it must not hang the test)."""
    line: list = []
    t = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    assert line and line[0], f"no line from the subprocess within {timeout} s (rc {proc.poll()})"
    return line[0].strip()


# ---- a pair of clients of one core, created concurrently (tests 1, 3, 5) --------------------

@pytest.fixture(scope="module")
def pair(path):
    key = f"test_shared_core-pair-{os.getpid()}-{time.monotonic_ns()}"
    made = _concurrently([lambda: EngineProcessClient(_config(path), share_key=key)] * 2, timeout=120)
    clients = [v for how, v in made if how == "ok"]
    errors = [v for how, v in made if how == "err"]
    try:
        assert not errors, errors
        yield key, clients[0], clients[1]
    finally:
        for c in clients:
            c.shutdown()
    if clients:
        _wait(lambda: not process_alive(clients[0].pid), 10)


def test_concurrent_clients_share_one_core_and_get_their_own_outputs(pair, reference):
    _, a, b = pair
    assert a.pid == b.pid and process_alive(a.pid)
    assert sum(c._proc is not None for c in (a, b)) == 1  # exactly one spawned the core
    spawner = a if a._proc is not None else b
    assert spawner._proc.pid == a.pid
    assert a.is_healthy() and b.is_healthy()

    prompts = {"a": [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 17, [40, 41]],
               "b": [[8, 6, 7], [100, 200, 300], [33] * 23, [44, 45, 46, 47]]}
    lengths = {"a": [8, 5, 10, 7], "b": [6, 9, 4, 11]}
    refs = {who: reference.many(prompts[who], lengths[who]) for who in ("a", "b")}

    # every output each client's reader takes off its socket: the core routes by owner
    received: dict[str, list] = {"a": [], "b": []}
    for who, c in (("a", a), ("b", b)):
        real = c._accept

        def spy(rows, waiting, real=real, who=who):
            received[who].extend(output_of_row(row).request_id for row in rows)
            return real(rows, waiting)

        c._accept = spy

    seen: dict[str, list] = {"a": [], "b": []}
    by_cb: dict[str, dict] = {"a": {}, "b": {}}
    lock = threading.Lock()

    def submit(who, c):
        def cb(out):
            with lock:
                seen[who].append(out.request_id)
                by_cb[who].setdefault(out.request_id, []).append(out)

        streams = {}
        for i, (p, n) in enumerate(zip(prompts[who], lengths[who])):
            rid = f"{who}-{i}"
            if i % 2:
                c.add_request(rid, p, greedy(n, ignore_eos=True), callback=cb)
            else:
                streams[rid] = c.add_request(rid, p, greedy(n, ignore_eos=True))
            time.sleep(0.005)  # the two threads' adds interleave
        return {rid: list(s) for rid, s in streams.items()}

    try:
        (ha, iter_a), (hb, iter_b) = _concurrently([lambda: submit("a", a), lambda: submit("b", b)])
        assert ha == hb == "ok", (iter_a, iter_b)
        _wait(lambda: all(len(by_cb[w]) == 2 and all(v[-1].finished for v in by_cb[w].values())
                          for w in ("a", "b")), 60)
    finally:
        for c in (a, b):
            del c._accept
    for who, iters in (("a", iter_a), ("b", iter_b)):
        outs = {**iters, **by_cb[who]}
        assert sorted(outs) == [f"{who}-{i}" for i in range(4)]
        for i, want in enumerate(refs[who]):
            got = outs[f"{who}-{i}"]
            assert all(o.request_id == f"{who}-{i}" for o in got)
            assert _tokens(got) == want, (who, i)
            assert [o.finished for o in got] == [False] * (len(got) - 1) + [True]
            assert str(got[-1].finish_reason) == "length"
        assert set(seen[who]) == {f"{who}-1", f"{who}-3"}  # its callbacks: its own requests only
        assert received[who] and all(r.startswith(f"{who}-") for r in received[who]), received[who]
    assert a.num_inflight() == 0 and b.num_inflight() == 0


def test_a_killed_client_process_is_detached_and_its_requests_aborted(pair, path, reference):
    """A client in another process attaches to this core, starts a long request and is killed:
    the core aborts that request (KV freed, no more tokens made for it) and serves this
    process's clients on, a request in flight meanwhile included."""
    key, a, b = pair
    script = textwrap.dedent("""
        import json, sys, threading, time
        from backend_lib import EngineConfig, EngineProcessClient, SamplingParams
        c = EngineProcessClient(EngineConfig(model_path=sys.argv[1], **json.loads(sys.argv[3])), share_key=sys.argv[2])
        got = threading.Event()
        c.add_request("sub-long", [5, 6, 7], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
                      callback=lambda out: got.set())
        assert got.wait(60)
        print("started", c.pid, c._proc is None, flush=True)
        time.sleep(600)
    """)
    # the engine's generated tokens so far: the sum of the clients' shares (the other process
    # never asks: its tokens go to the next asker here)
    generated = lambda: a.stats().generation_tokens_total + b.stats().generation_tokens_total  # noqa: E731
    before = generated()
    sub = _subprocess(script, path, key, json.dumps(KW))
    try:
        line = _read_line(sub, 120)
        assert line == f"started {a.pid} True", line  # attached to this core, did not spawn one
        st = a.stats()
        assert st.num_running == 1 and st.kv_blocks_used > 0  # the other process's request
        # this process's client has a request going when the other process dies
        _request_outlives_kill(b, sub, [7, 8, 9], 120, reference)
    finally:
        sub.kill()
        sub.wait(10)
        sub.stdout.close()
    assert process_alive(a.pid) and a.is_healthy() and b.is_healthy()
    toks, reason = a.add_request("a-after-kill", [11, 12, 13, 14], greedy(9, ignore_eos=True)).result()
    assert toks == reference([11, 12, 13, 14], 9) and str(reason) == "length"
    # the dead client's 500-token request was aborted in the core, not left running
    _wait(lambda: (lambda s: (s.num_running, s.num_waiting, s.kv_blocks_used))(a.stats()) == (0, 0, 0), 10)
    sub_tokens = generated() - before - 120 - 9
    assert 1 <= sub_tokens < 500, sub_tokens
    assert b.stats().num_running == 0 and a.num_inflight() == 0 and b.num_inflight() == 0


def test_counter_shares_add_up_to_the_engine_totals(pair, reference):
    """Each stats() reply holds the asker's share of the counters: the growth since any client
    last asked. The shares of all clients add up to what the engine generated."""
    _, a, b = pair
    base = {c: c.stats().generation_tokens_total for c in (a, b)}  # everything before: settled
    jobs = {a: [([5, 9, 13], 7), ([21, 22], 12)], b: [([30, 31, 32], 5), ([6] * 9, 10), ([50], 3)]}

    def run(c, tag):
        streams = [c.add_request(f"{tag}-share-{i}", p, greedy(n, ignore_eos=True)) for i, (p, n) in enumerate(jobs[c])]
        return [s.result() for s in streams]

    res = _concurrently([lambda: run(a, "a"), lambda: run(b, "b")])
    assert [h for h, _ in res] == ["ok", "ok"], res
    for c, (_, results) in zip((a, b), res):
        for (p, n), (toks, reason) in zip(jobs[c], results):
            assert toks == reference(p, n) and str(reason) == "length"
    total = sum(n for c in (a, b) for _, n in jobs[c])
    got = {c: c.stats().generation_tokens_total - base[c] for c in (a, b)}  # each asks once, at the end
    assert got[a] + got[b] == total
    assert got[a] == total and got[b] == 0  # a asked first: all the growth was a's to take
    # a second round on b alone: b's next question takes exactly its tokens, a's nothing
    toks, _ = b.add_request("b-share-solo", [60, 61], greedy(6, ignore_eos=True)).result()
    assert len(toks) == 6
    assert b.stats().generation_tokens_total - base[b] - got[b] == 6
    assert a.stats().generation_tokens_total - base[a] - got[a] == 0


# ---- cores of their own ----------------------------------------------------------------------

def test_an_id_in_use_by_another_client_is_refused_to_the_newcomer(pair, reference):
    """Two clients' ids must differ; if they do not, the second ADD gets an error final on its
    own client and the first request keeps its outputs (its routing is not taken over)."""
    _, a, b = pair
    cb, outs, got = _first_token_waiter()
    a.add_request("same-id", [5, 6, 7], greedy(40, ignore_eos=True), callback=cb)
    assert got.wait(60)
    toks, reason = b.add_request("same-id", [8, 9], greedy(5, ignore_eos=True)).result()
    assert toks == [] and str(reason) == "error"
    _wait(lambda: outs and outs[-1].finished, 60)
    assert _tokens(outs) == reference([5, 6, 7], 40) and str(outs[-1].finish_reason) == "length"
    _wait(lambda: a.num_inflight() == 0 and b.num_inflight() == 0, 10)


def test_a_client_cannot_abort_another_clients_request(pair, reference):
    _, a, b = pair
    cb, outs, got = _first_token_waiter()
    a.add_request("a-owned", [5, 6, 7], greedy(40, ignore_eos=True), callback=cb)
    assert got.wait(60)
    b.abort("a-owned")
    _wait(lambda: outs and outs[-1].finished, 60)
    assert _tokens(outs) == reference([5, 6, 7], 40) and str(outs[-1].finish_reason) == "length"


def test_a_key_aborts_its_requests_from_any_client(pair, reference):
    """A Triton request id (the key) names a request to every instance of the model: a cancel
    or a TensorRT-LLM stop that lands on another instance than the one that added it ends it."""
    _, a, b = pair
    cb, outs, got = _first_token_waiter()
    a.add_request("a-keyed", [5, 6, 7], greedy(400, ignore_eos=True), callback=cb, key="client-42")
    other_cb, other_outs, other_got = _first_token_waiter()
    a.add_request("a-other", [5, 6, 7], greedy(30, ignore_eos=True), callback=other_cb, key="client-43")
    assert got.wait(60)
    b.abort_key("client-42")
    _wait(lambda: outs and outs[-1].finished, 60)
    assert str(outs[-1].finish_reason) == "abort" and len(_tokens(outs)) < 400
    _wait(lambda: other_outs and other_outs[-1].finished, 60)  # another key runs on
    assert _tokens(other_outs) == reference([5, 6, 7], 30)
    b.abort_key("client-42")  # a key whose requests ended names nothing
    _wait(lambda: a.num_inflight() == 0 and b.num_inflight() == 0, 10)


def test_an_add_behind_a_clients_stop_is_refused(path, request):
    """An execute() thread's batched ADD that reaches the core right behind its client's STOP
    ends at once, aborted as the client's other requests at a stop (and as AsyncEngine's at
    shutdown), instead of running to completion before the client may go."""
    from backend_lib import engine_wire as wire
    key = _key(request)
    a = EngineProcessClient(_config(path), share_key=key)
    b = EngineProcessClient(_config(path), share_key=key)
    try:
        late, unsent = [], []
        b._register("late", late.append)
        b._register("unsent", unsent.append)  # the core releases b before this ADD reaches it
        with b._lock:
            b._stopping = True
        t0 = time.monotonic()
        b._send([(wire.STOP,)])
        # execute()'s batched send: the core refuses it, or has closed b's socket already
        b._send_batch([(wire.ADD, "late", [1, 2, 3, 4], greedy(500, ignore_eos=True))])
        b._reader.join(20)
        assert not b._reader.is_alive() and time.monotonic() - t0 < 5
        # Whether the core's refusal, its STOPPED or the closed socket comes first, all end alike.
        for outs in (late, unsent):
            assert [(o.finished, str(o.finish_reason), o.new_token_ids, o.error) for o in outs] == \
                [(True, "abort", [], None)]
        assert a.is_healthy()
    finally:
        a.shutdown()


def test_shutdown_detaches_a_client_and_the_last_one_stops_the_core(path, request, reference):
    key = _key(request)
    a = EngineProcessClient(_config(path), share_key=key)
    b = None
    try:
        assert a._proc is not None
        b = EngineProcessClient(_config(path), share_key=key)
        assert b._proc is None and b.pid == a.pid
        pid = a.pid
        pa, pb = [5, 6, 7], [8, 9, 10, 11]
        ref_a, ref_b = reference.many([pa, pb], [300, 300])
        cb_a, outs_a, got_a = _first_token_waiter()
        cb_b, outs_b, got_b = _first_token_waiter()
        a.add_request("a-long", pa, greedy(300, ignore_eos=True), callback=cb_a)
        b.add_request("b-long", pb, greedy(300, ignore_eos=True), callback=cb_b)
        assert got_a.wait(60) and got_b.wait(60)
        t0 = time.monotonic()
        a.shutdown()
        assert time.monotonic() - t0 < 10
        assert b.num_inflight() == 1  # b's request goes on
        # a's request: ended aborted, its last output the final one, a prefix of generate's
        assert outs_a and outs_a[-1].finished and str(outs_a[-1].finish_reason) == "abort"
        assert [o.finished for o in outs_a] == [False] * (len(outs_a) - 1) + [True]
        assert len(_tokens(outs_a)) < 300 and _tokens(outs_a) == ref_a[:len(_tokens(outs_a))]
        # detached cleanly: the core answered STOPPED, then closed a's socket (a's reader ended)
        assert a._stopped_cleanly and a.error is None and not a._reader.is_alive()
        assert a.num_inflight() == 0 and not a.is_healthy()
        with pytest.raises(RuntimeError):
            a.add_request("a-late", [5], greedy(3))
        # the core serves b on: its request completes in full
        assert process_alive(pid) and a._proc.poll() is None
        _wait(lambda: outs_b and outs_b[-1].finished, 60)
        assert _tokens(outs_b) == ref_b and str(outs_b[-1].finish_reason) == "length"
        assert [o.finished for o in outs_b] == [False] * (len(outs_b) - 1) + [True]
        assert b.is_healthy() and process_alive(pid)
        toks, reason = b.add_request("b-after", [12, 13, 14], greedy(8, ignore_eos=True)).result()
        assert toks == reference([12, 13, 14], 8) and str(reason) == "length"
        b.shutdown()
        b = None
        _wait(lambda: not process_alive(pid), 10)
        assert a._proc.wait(10) == 0  # stopped, not killed
    finally:
        for c in (a, b):
            if c is not None:
                c.shutdown(timeout=5)


SPAWNER = textwrap.dedent("""
    import json, sys, time
    from backend_lib import EngineConfig, EngineProcessClient
    c = EngineProcessClient(EngineConfig(model_path=sys.argv[1], **json.loads(sys.argv[3])), share_key=sys.argv[2])
    print(c.pid, c._proc is not None, flush=True)
    time.sleep(600)
""")


def test_the_core_outlives_the_process_that_spawned_it(path, request, reference):
    key = _key(request)
    sub = _subprocess(SPAWNER, path, key, json.dumps(KW))
    c = core = None
    try:
        pid_text, spawned = _read_line(sub, 120).split()
        core = int(pid_text)
        assert spawned == "True" and process_alive(core)
        c = EngineProcessClient(_config(path), share_key=key)
        assert c._proc is None and c.pid == core
        # the request in flight when its spawner dies completes, and the core takes new ones
        _request_outlives_kill(c, sub, [5, 6, 7], 80, reference)
        assert process_alive(core) and c.is_healthy()
        toks, reason = c.add_request("after", [15, 16, 17], greedy(10, ignore_eos=True)).result()
        assert toks == reference([15, 16, 17], 10) and str(reason) == "length"
        c.shutdown()
        c = None
        _wait(lambda: not process_alive(core), 10)
    finally:
        sub.kill()
        sub.wait(10)
        sub.stdout.close()
        if c is not None:
            c.shutdown(timeout=5)
        if core is not None and process_alive(core):
            os.kill(core, signal.SIGKILL)  # a failed test must not leave it running


def test_a_startup_error_reaches_every_client(tmp_path, request):
    """Two clients of a fresh key, a model that does not exist: both raise the start-up error
    (the in-process engine's ValueError naming the path), neither hangs, no core is left."""
    missing = str(tmp_path / "no-such-model")
    cfg = EngineConfig(model_path=missing, **KW)
    key = _key(request)
    before = _live_core_children()
    t0 = time.monotonic()
    res = _concurrently([lambda: EngineProcessClient(cfg, startup_timeout=60, share_key=key)] * 2, timeout=90)
    assert time.monotonic() - t0 < 60
    for how, err in res:
        assert how == "err", err
        assert type(err) is ValueError, repr(err)
        assert str(err) == f"model_path {missing!r} is not a local checkpoint folder"
    _wait(lambda: not (_live_core_children() - before), 10)
    # nothing holds the key's socket any more: a core would
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(socket_name(key))
    finally:
        s.close()
