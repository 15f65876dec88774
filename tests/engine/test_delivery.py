"""Delivery behind a lagging callback (backend_lib/delivery.py, as AsyncEngine's dispatcher and
EngineProcessClient's reader use it): outputs that arrive while a backlog is being delivered
are merged in, and a first token overtakes the backlog queued before it, instead of waiting
for a turn of every stream (Triton's stub sends ~4 responses a request at concurrency 256:
a turn is hundreds of sends)."""
import queue
import threading

from backend_lib import AsyncEngine, EngineProcessClient
from backend_lib import engine_wire as wire
from backend_lib.request import RequestOutput, output_row

BACKLOG = [RequestOutput(f"s{i}", [7], False, num_prompt_tokens=3, num_output_tokens=5) for i in range(12)]
FIRST = RequestOutput("p", [9], False, num_prompt_tokens=3, num_output_tokens=1)
LATER = RequestOutput("s0", [8], False, num_prompt_tokens=3, num_output_tokens=6)
# the new first token comes after the backlog's first callback; s0's next token after the fifth
WANT = ["s0", "p"] + [f"s{i}" for i in range(1, 12)] + ["s0"]


class _ScriptedFrames:
    """The core's socket as wire_reader.FrameReader reads it: each message becomes readable once
    `after` callbacks have run; then the end (readable; a read finds nothing and sees it)."""

    def __init__(self, script, delivered):
        self.script, self.delivered, self.eof = list(script), delivered, False

    def _readable(self):
        return bool(self.script) and len(self.delivered) >= self.script[0][0]

    def ready(self, timeout=0.0):
        return not self.script or self._readable()

    def read(self, max_messages):
        if not self.script:
            self.eof = True
        msgs = []
        while len(msgs) < max_messages and self._readable():
            msgs.append(self.script.pop(0)[1])
        return msgs

    def ended(self):
        return self.eof


def _steps(*outs):
    return (wire.STEPS, [[output_row(o) for o in outs]])


def test_the_engine_process_reader_lets_a_first_token_overtake_the_backlog():
    delivered = []
    c = EngineProcessClient.__new__(EngineProcessClient)
    frames = _ScriptedFrames([(0, _steps(*BACKLOG)), (1, _steps(FIRST)), (5, _steps(LATER))], delivered)
    c._frame_reader = lambda: frames
    c._merge_queued, c._delivery_threads, c._stall_s, c._sinks, c._lock = True, 1, 60.0, {}, threading.Lock()
    c._deliver = delivered.append
    c._core_gone = lambda: None
    c._reader_main()
    assert [o.request_id for o in delivered] == WANT
    assert [o.new_token_ids for o in delivered][-1] == [8]


def test_the_in_process_dispatcher_lets_a_first_token_overtake_the_backlog():
    from backend_lib.async_engine import _STOP
    delivered = []
    a = AsyncEngine.__new__(AsyncEngine)
    a._outs, a._merge_queued, a._delivery_threads = queue.Queue(), True, 1
    later = {1: [output_row(FIRST)], 5: [output_row(LATER)], 14: _STOP}

    def deliver(out):
        delivered.append(out)
        if len(delivered) in later:
            a._outs.put(later[len(delivered)])

    a._deliver = deliver
    a._outs.put([output_row(o) for o in BACKLOG])
    a._dispatch_main()
    assert [o.request_id for o in delivered] == WANT


def test_a_stats_reply_does_not_flush_the_backlog():
    """The llm model asks for stats every 200 ms: a reply (counters only) is handled where it
    comes, without delivering the whole backlog first (which would hold the first token behind
    a turn of every stream five times a second); DIED and STOPPED still come after the outputs
    before them."""
    delivered, controls = [], []
    c = EngineProcessClient.__new__(EngineProcessClient)
    frames = _ScriptedFrames([(0, _steps(*BACKLOG)), (1, (wire.STATS, 7, None)), (1, _steps(FIRST)),
                              (5, _steps(LATER)), (6, (wire.STOPPED,))], delivered)
    c._frame_reader = lambda: frames
    c._merge_queued, c._delivery_threads, c._stall_s, c._sinks, c._lock = True, 1, 60.0, {}, threading.Lock()
    c._deliver = delivered.append
    c._control = lambda msg: controls.append((msg[0], len(delivered)))
    c._core_gone = lambda: None
    c._reader_main()
    assert [o.request_id for o in delivered] == WANT
    assert controls == [(wire.STATS, 1), (wire.STOPPED, len(WANT))]


def _script(requests=12, steps=10):
    """Step lists of `requests` streams: request i starts at step i % 3 and ends at its last step."""
    out = []
    for s in range(steps):
        step = []
        for i in range(requests):
            k = s - i % 3
            if 0 <= k < steps - 2:
                done = k == steps - 3
                step.append(RequestOutput(f"r{i}", [100 * i + k], done, "length" if done else None,
                                          num_prompt_tokens=3, num_output_tokens=k + 1))
        out.append(step)
    return out


def test_several_delivery_threads_keep_each_request_in_order_and_overlap():
    """delivery_threads > 1: callbacks of different requests run at the same time (Triton's
    send() waits on the server with the GIL released), never two of one request at once; every
    token arrives once, in order, the final last; close() ends the helper threads."""
    import random
    import time
    from backend_lib.delivery import Delivery

    lock = threading.Lock()
    got: dict[str, list] = {}
    running: dict[str, int] = {}
    overlap = {"max": 0, "same_request": 0}
    rng = random.Random(7)

    def deliver(out):
        with lock:
            running[out.request_id] = running.get(out.request_id, 0) + 1
            overlap["same_request"] = max(overlap["same_request"], running[out.request_id])
            overlap["max"] = max(overlap["max"], sum(running.values()))
        time.sleep(rng.uniform(0.001, 0.004))
        with lock:
            running[out.request_id] -= 1
            got.setdefault(out.request_id, []).append(out)

    d = Delivery(deliver, threads=4, name="test-delivery")
    assert not d.reader_has_work()  # the helpers deliver; the filling thread only fills
    for step in _script():
        d.add(step)
        time.sleep(0.002)
    d.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-delivery")]
    assert overlap["same_request"] == 1 and overlap["max"] >= 2, overlap
    for i in range(12):
        outs = got[f"r{i}"]
        assert [t for o in outs for t in o.new_token_ids] == [100 * i + k for k in range(8)], outs
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[0].new_token_ids == [100 * i]  # the first token alone


def test_one_delivery_thread_is_the_filling_thread():
    from backend_lib.delivery import Delivery
    seen = []
    d = Delivery(lambda o: seen.append(threading.current_thread().name), threads=1)
    d.add(_script()[0])
    assert d.reader_has_work()
    while d.deliver_one():
        pass
    d.close()
    assert seen and set(seen) == {threading.current_thread().name}


def test_delivery_threads_out_of_range_name_the_parameter():
    import pytest
    from backend_lib.engine import EngineConfig  # noqa: F401 - the engines' constructors check it
    from backend_lib.output_sinks import checked_delivery_threads
    for bad in (0, 17, 2.0, True, "4"):
        with pytest.raises(ValueError, match="delivery_threads must be an integer from 1 to 16"):
            checked_delivery_threads(bad)
    from triton_glue.config import delivery_threads
    cfg = {"parameters": {"delivery_threads": {"string_value": "0"}}}
    with pytest.raises(ValueError, match="parameter 'delivery_threads' must be an integer from 1 to 16, not '0'"):
        delivery_threads(cfg)
    assert delivery_threads({"parameters": {"delivery_threads": {"string_value": "4"}}}) == 4


def test_outputs_added_as_rows_come_out_as_added_as_outputs():
    """DeliveryQueue.add_row (the engines' dispatchers: rows merged without decoding) hands
    out what add of the decoded outputs does, pop for pop: first tokens, merged tokens and
    logprobs of n > 1 sequences, finish reasons, errors, aborts, the final output last, nothing
    after it (a stray output after the final is dropped); pops interleaved with the adds at random points."""
    import random
    from backend_lib.delivery import DeliveryQueue
    from backend_lib.request import FinishReason
    rng = random.Random(5)
    for trial in range(40):
        made = {}
        outs = []
        for step in range(30):
            for r in range(6):
                rid = f"t{trial}-{r}"
                if rid in made and made[rid] is None:  # ended: a stray output is dropped
                    if rng.random() < 0.2:
                        outs.append(RequestOutput(rid, [99], False, None, 3, 99, index=rng.randrange(2)))
                    continue
                n = made.setdefault(rid, 0)
                index = rng.randrange(2)
                roll = rng.random()
                lps = [{7 + n: -0.5}] if r % 2 else None
                if roll < 0.05:
                    out = RequestOutput(rid, [], True, FinishReason.ABORT, 3, n)
                elif roll < 0.08:
                    out = RequestOutput(rid, [], True, FinishReason.ERROR, 3, n, error="engine failed")
                elif roll < 0.15 and n > 2:
                    out = RequestOutput(rid, [7 + n], True, FinishReason.LENGTH, 3, n + 1, None, lps, -1.0 * n, index)
                elif roll < 0.2 and n > 2:  # one sequence of n > 1 ends, the request goes on
                    out = RequestOutput(rid, [7 + n], False, FinishReason.STOP, 3, n + 1, None, lps, -1.0 * n, index)
                else:
                    out = RequestOutput(rid, [7 + n], False, None, 3, n + 1, None, lps, -1.0 * n, index)
                made[rid] = None if out.finished else n + 1
                outs.append(out)
            outs.append("pop")
        by_output, by_wire = DeliveryQueue(), DeliveryQueue()
        got_output, got_wire = [], []
        for o in outs:
            if o == "pop":
                for _ in range(rng.randrange(4)):
                    got_output.append(by_output.pop())
                    got_wire.append(by_wire.pop())
                continue
            by_output.add(o)
            by_wire.add_row(output_row(o))
        got_output += by_output.drain()
        got_wire += by_wire.drain()
        assert got_wire == got_output
        assert any(o is not None and len(o.new_token_ids) > 1 for o in got_wire)  # merges happened
