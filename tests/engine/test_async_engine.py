"""AsyncEngine: streaming (callback / iterator) equals LLMEngine.generate, abort by id,
shutdown with requests in flight, start-up errors, synchronous input validation."""
import random
import threading
import time

import pytest

from backend_lib import AsyncEngine, EngineConfig, SamplingParams
from engine_helpers import CallbackLog, greedy, make_engine, random_prompt

KW = dict(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=120, max_num_batched_tokens=48,
          max_num_seqs=16)


def _workload(n=40, seed=3):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append(random_prompt(rng, rng.randint(1, 200)))
        sampled = i % 5 == 0
        params.append(SamplingParams(max_tokens=rng.randint(1, 32), temperature=0.7 if sampled else 0.0,
                                     seed=i if sampled else None, ignore_eos=i % 2 == 0,
                                     stop_token_ids=[rng.randrange(4, 768) for _ in range(3)]))
    return prompts, params


@pytest.fixture(scope="module")
def generate_reference(path):
    prompts, params = _workload()
    outs = make_engine(path, **{k: v for k, v in KW.items() if k not in ("device", "dtype")}).generate(prompts, params)
    assert sum(o.finish_reason == "stop" for o in outs) >= 3
    return prompts, params, [(o.token_ids, o.finish_reason) for o in outs]


def _wait(pred, timeout=60.0):
    t0 = time.time()
    while not pred():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.005)


def assert_abort_by_id(engine, path, p: list) -> list:
    """A stream aborted by id after its first token: it ends with one final 'abort' output,
    its tokens a prefix of generate's; a second abort and an unknown id are no-ops. Returns
    the aborted stream's tokens."""
    full = make_engine(path).generate([p], greedy(40, ignore_eos=True))[0].token_ids
    first_token = threading.Event()
    outs = []

    def cb(out):
        outs.append(out)
        first_token.set()

    engine.add_request("victim", p, greedy(400, ignore_eos=True), callback=cb)
    assert first_token.wait(60)
    engine.abort("victim")
    _wait(lambda: outs and outs[-1].finished)
    toks = [t for o in outs for t in o.new_token_ids]
    assert str(outs[-1].finish_reason) == "abort" and 0 < len(toks) < 400
    assert sum(o.finished for o in outs) == 1
    n = min(len(toks), len(full))
    assert toks[:n] == full[:n]
    engine.abort("victim")
    engine.abort("never-added")
    return toks


def assert_a_stall_fails_the_streams(engine, stall, at_least_s: float, message: str) -> None:
    """Three long streams; once they produce tokens, stall() stops the engine making progress:
    every stream ends, between at_least_s and 10 s later, with an error output holding message."""
    finals, first = {}, threading.Event()

    def cb(out):
        first.set()
        if out.finished:
            finals[out.request_id] = out

    for i in range(3):
        engine.add_request(f"r{i}", [5, 6, 7 + i], greedy(400, ignore_eos=True), callback=cb)
    assert first.wait(60)
    stall()
    t0 = time.monotonic()
    _wait(lambda: len(finals) == 3, 20)
    assert at_least_s < time.monotonic() - t0 < 10
    for out in finals.values():
        assert str(out.finish_reason) == "error" and message in out.error, out.error


def assert_streams_equal_generate(engine, reference) -> None:
    """Half the requests by callback, half by iterator, arriving staggered: every stream's
    outputs (no empty one before the final, one final last) add up to generate's tokens and
    finish reason; one thread, not the caller's, runs the callbacks; nothing stays in flight."""
    prompts, params, ref = reference
    got: dict[str, list] = {}
    threads = set()
    done = threading.Event()
    lock = threading.Lock()
    half = len(prompts) // 2

    def cb(out):
        threads.add(threading.get_ident())
        with lock:
            got.setdefault(out.request_id, []).append(out)
            if sum(1 for v in got.values() if v[-1].finished) == half:
                done.set()

    streams = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if i < half:
            engine.add_request(f"cb-{i}", p, sp, callback=cb)
        else:
            streams.append(engine.add_request(f"it-{i}", p, sp))
        if i % 7 == 0:
            time.sleep(0.01)  # staggered arrivals
    iterated = [list(s) for s in streams]
    assert done.wait(120)
    assert len(threads) == 1 and threading.get_ident() not in threads
    for i in range(len(prompts)):
        outs = got[f"cb-{i}"] if i < half else iterated[i - half]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        toks = [t for o in outs for t in o.new_token_ids]
        assert all(o.new_token_ids for o in outs[:-1])
        assert (toks, str(outs[-1].finish_reason)) == ref[i], i
        assert outs[-1].num_output_tokens == len(toks) and outs[-1].num_prompt_tokens == len(prompts[i])
    _wait(lambda: engine.num_inflight() == 0)


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_streamed_equals_generate(path, generate_reference, async_mode):
    aeng = AsyncEngine(EngineConfig(model_path=path, async_token_handoff=async_mode, **KW))
    try:
        assert aeng.engine.async_enabled is (async_mode == "on")
        assert_streams_equal_generate(aeng, generate_reference)
        assert aeng.stats().kv_blocks_used == 0
    finally:
        aeng.shutdown()


@pytest.mark.parametrize("async_mode", ["off", "on"])
def test_abort_by_id_and_shutdown_deliver_finals(path, async_mode):
    aeng = AsyncEngine(EngineConfig(model_path=path, async_token_handoff=async_mode, **KW))
    p = [5, 6, 7, 8, 9]
    toks = assert_abort_by_id(aeng, path, p)

    # Shutdown with requests in flight: each gets a final output ("abort").
    streams = [aeng.add_request(f"s{i}", p + [i + 10], greedy(400, ignore_eos=True)) for i in range(4)]
    waiting = [aeng.add_request(f"w{i}", [7] * 300, greedy(400, ignore_eos=True)) for i in range(2)]
    _wait(lambda: aeng.stats().generation_tokens_total > len(toks) + 8)
    aeng.shutdown()
    for s in streams + waiting:
        toks, reason = s.result()
        assert str(reason) == "abort"
    assert aeng.engine.stats().kv_blocks_used == 0
    with pytest.raises(RuntimeError):
        aeng.add_request("late", p, greedy(3))


def test_startup_error_reraised_from_constructor(tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        AsyncEngine(EngineConfig(model_path=str(tmp_path / "no-such-model"), **KW))
    (tmp_path / "config.json").write_text('{"model_type": "llama"')  # broken checkpoint
    with pytest.raises(Exception):
        AsyncEngine(EngineConfig(model_path=str(tmp_path), **KW))


def test_add_request_bad_input_raises_synchronously(path):
    aeng = AsyncEngine(EngineConfig(model_path=path, async_token_handoff="on", **KW))
    try:
        s = aeng.add_request("ok", [5, 6, 7], greedy(6, ignore_eos=True))
        for prompt, sp, word in (([], greedy(3), "prompt"), ([5, 768], greedy(3), "input_ids"),
                                 ([5], SamplingParams(max_tokens=3, top_p=0.0), "top_p"),
                                 ([5], greedy(0), "max_tokens"), ([5] * 512, greedy(3), "max_model_len"),
                                 ([5], greedy(3, min_tokens=4), "min_tokens")):
            with pytest.raises(ValueError) as e:
                aeng.add_request("bad", prompt, sp)
            assert word in str(e.value)
        with pytest.raises(ValueError, match="request_id"):
            aeng.add_request("ok", [5], greedy(3))
        toks, reason = s.result()
        assert toks == make_engine(path).generate([[5, 6, 7]], greedy(6, ignore_eos=True))[0].token_ids
        assert str(reason) == "length"
        # After all that the engine still serves (and the rejected ids were never registered).
        toks, reason = aeng.add_request("bad", [5, 6, 7], greedy(2, ignore_eos=True)).result()
        assert len(toks) == 2 and aeng.is_healthy()
    finally:
        aeng.shutdown()


def test_engine_death_fails_inflight_requests_and_goes_unhealthy(path):
    aeng = AsyncEngine(EngineConfig(model_path=path, async_token_handoff="on", **KW))
    try:
        outs = []
        got_token = threading.Event()

        def cb(out):
            outs.append(out)
            got_token.set()

        aeng.add_request("a", [5, 6, 7], greedy(400, ignore_eos=True), callback=cb)
        stream = aeng.add_request("b", [8, 9], greedy(400, ignore_eos=True))
        assert got_token.wait(60)

        def boom():
            raise RuntimeError("injected device failure")

        aeng.engine.step_rows = boom
        toks, reason = stream.result()
        assert str(reason) == "error"
        _wait(lambda: outs and outs[-1].finished)
        assert str(outs[-1].finish_reason) == "error" and "injected device failure" in outs[-1].error
        assert not aeng.is_healthy() and isinstance(aeng.error, RuntimeError)
        with pytest.raises(RuntimeError, match="not healthy"):
            aeng.add_request("c", [5], greedy(3))
    finally:
        aeng.shutdown(timeout=5)


def test_a_failing_callback_does_not_stop_other_requests(path):
    aeng = AsyncEngine(EngineConfig(model_path=path, async_token_handoff="on", **KW))
    try:
        calls = []

        def broken(out):
            calls.append(out)
            raise RuntimeError("client went away")

        aeng.add_request("broken", [5, 6, 7], greedy(8, ignore_eos=True), callback=broken)
        toks, reason = aeng.add_request("fine", [8, 9, 10], greedy(8, ignore_eos=True)).result()
        assert len(toks) == 8 and str(reason) == "length"
        _wait(lambda: calls and calls[-1].finished)
        assert sum(len(o.new_token_ids) for o in calls) == 8 and aeng.is_healthy()
    finally:
        aeng.shutdown()


def test_shutdown_timeout_never_runs_callbacks_on_the_callers_thread(path):
    """shutdown() that times out while the dispatcher is stuck in a callback: no callback runs
    on the caller's thread (it would race the stuck one, and a response could follow FINAL);
    once the dispatcher is free, each request still gets exactly one final output."""
    aeng = AsyncEngine(EngineConfig(model_path=path, **KW))
    release = threading.Event()
    calls = []  # (request id, finished, thread ident)

    def cb(out):
        calls.append((out.request_id, out.finished, threading.get_ident()))
        if out.request_id == "stuck":
            release.wait(30)

    aeng.add_request("stuck", [5, 6, 7], greedy(400, ignore_eos=True), callback=cb)
    _wait(lambda: calls)  # the dispatcher is now blocked in the first callback
    aeng.add_request("other", [8, 9], greedy(400, ignore_eos=True), callback=cb)
    t0 = time.monotonic()
    aeng.shutdown(timeout=1.0)
    assert time.monotonic() - t0 < 5
    caller = threading.get_ident()
    assert all(t != caller for _, _, t in calls), calls
    release.set()
    _wait(lambda: sum(f for _, f, _ in calls) == 2, 10)
    time.sleep(0.2)
    finals = [r for r, f, _ in calls if f]
    assert sorted(finals) == ["other", "stuck"], calls
    assert all(t != caller for _, _, t in calls)
    assert len({t for _, _, t in calls}) == 1  # one thread delivers everything


@pytest.mark.parametrize("delivery_threads", [1, 3])
def test_merged_outputs_when_the_callback_lags(path, generate_reference, delivery_threads):
    """merge_queued_outputs with a callback slower than an engine step: each request's
    callbacks carry several steps' tokens (fewer callbacks than tokens), yet tokens keep
    coming while it runs (none held back until its end), in generate's order, one final last.
    delivery_threads 3: three threads run the callbacks, never two of one request at once."""
    prompts, params, ref = generate_reference
    aeng = AsyncEngine(EngineConfig(model_path=path, **KW), merge_queued_outputs=True,
                       delivery_threads=delivery_threads)
    log = CallbackLog()
    # Callbacks run one after another, so a request hears from it every (active requests x
    # callback) seconds: half a step each makes that several steps (merged tokens) yet shorter
    # than a long request (tokens keep coming), however loaded the machine is.
    step_s = [0.002]
    step = aeng.engine.step_rows

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            step_s.append(time.perf_counter() - t0)

    aeng.engine.step_rows = timed_step

    def cb(out):
        with log.entered(out):
            recent = sorted(step_s[-16:])
            time.sleep(max(0.001, 0.5 * recent[len(recent) // 2] * delivery_threads))

    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            aeng.add_request(f"r{i}", p, sp, callback=cb)
        _wait(lambda: log.all_finished(len(prompts)), 120)
    finally:
        aeng.shutdown()
    long_ones = 0
    for i, outs in enumerate(log.streams_match(ref)):
        toks = ref[i][0]
        if len(toks) >= 24:
            long_ones += 1
            with_tokens = [o for o in outs if o.new_token_ids]
            assert 2 <= len(with_tokens) < len(toks), (i, [len(o.new_token_ids) for o in outs])
    assert long_ones >= 3
    assert not log.overlaps and len(log.threads) == delivery_threads, (log.overlaps, log.threads)


def _out(rid, toks, total, finished=False, index=0):
    from backend_lib.request import FinishReason, RequestOutput
    return RequestOutput(rid, toks, finished, FinishReason.LENGTH if finished else None,
                         num_prompt_tokens=3, num_output_tokens=total, index=index)


def _queued(*steps):
    from backend_lib.delivery import DeliveryQueue
    q = DeliveryQueue()
    for step in steps:
        for o in step:
            q.add(o)
    return q


def test_delivery_queue_merges_a_backlog_most_urgent_first():
    """A backlog of steps merges into one output per sequence, except each sequence's first
    output, which goes out alone and first (its time to first token is the engine's); the
    requests that ended come next, in the order they ended, each final after its request's
    other sequences; then the others' merged tokens, the longest waiting first."""
    q = _queued([_out("a", [1], 1), _out("b", [7], 5), _out("f", [6], 9, index=1), _out("f", [2], 9, index=0)],
                [_out("a", [2], 2), _out("b", [8], 6), _out("c", [4], 1, index=1), _out("f", [3], 10, index=0)],
                [_out("a", [3], 3, finished=True), _out("c", [5], 2, index=1),
                 _out("f", [4], 11, finished=True, index=0)])
    got = [(o.request_id, o.index, o.new_token_ids, o.finished) for o in q.drain()]
    assert got == [("a", 0, [1], False), ("c", 1, [4], False),       # first outputs, alone
                   ("a", 0, [2, 3], True),                           # ended requests, in order:
                   ("f", 1, [6], False), ("f", 0, [2, 3, 4], True),  # other sequences, then final
                   ("b", 0, [7, 8], False), ("c", 1, [5], False)]    # the others' merged tokens
    assert not q
    # a request whose first output is also its final one is not split
    one = _queued([_out("d", [9], 1, finished=True)], [_out("e", [1], 1)]).drain()
    assert [(o.request_id, o.new_token_ids) for o in one] == [("e", [1]), ("d", [9])]


def test_delivery_queue_lets_urgent_outputs_overtake_and_streams_take_turns():
    """Outputs added while a backlog is being handed out: a first token or a final goes out
    next, ahead of the backlog queued before it; a sequence handed out waits behind the
    others for its next turn; a request id that ended can start again (ids are reused)."""
    q = _queued([_out(r, [1], 4) for r in "abc"])
    assert q.pop().request_id == "a"
    q.add(_out("new", [5], 1))
    q.add(_out("b", [2], 5, finished=True))
    q.add(_out("a", [2], 5))
    got = [(o.request_id, o.new_token_ids, o.finished) for o in q.drain()]
    assert got == [("new", [5], False), ("b", [1, 2], True), ("c", [1], False), ("a", [2], False)]
    q.add(_out("b", [9], 1))
    assert [(o.request_id, o.new_token_ids) for o in q.drain()] == [("b", [9])]


def test_a_stalled_step_fails_the_requests_and_the_engine(path, monkeypatch):
    """An engine step that does not return (a hung kernel, a deadlock: here a step blocked on
    an event) for BACKEND_LIB_ENGINE_STALL_TIMEOUT_S: every request ends with an error naming
    the stall, the engine turns unhealthy and refuses new requests; when the step returns at
    last, the engine thread exits and shutdown returns."""
    monkeypatch.setenv("BACKEND_LIB_ENGINE_STALL_TIMEOUT_S", "2")
    aeng = AsyncEngine(EngineConfig(model_path=path, **KW))
    release = threading.Event()
    try:
        time.sleep(3.0)  # idle past the timeout: no stall
        assert len(aeng.add_request("warm", [5, 6, 7], greedy(6, ignore_eos=True)).result()[0]) == 6
        step = aeng.engine.step_rows
        hang = threading.Event()

        def maybe_hang():
            if hang.is_set():
                release.wait(60)
            return step()

        aeng.engine.step_rows = maybe_hang
        assert_a_stall_fails_the_streams(aeng, hang.set, 1.5, "engine step running for")
        assert not aeng.is_healthy()
        with pytest.raises(RuntimeError, match="not healthy"):
            aeng.add_request("late", [5], greedy(2))
        release.set()
        _wait(lambda: not aeng._thread.is_alive(), 20)
    finally:
        release.set()
        aeng.shutdown(timeout=10)
    assert not aeng._dispatcher.is_alive()
