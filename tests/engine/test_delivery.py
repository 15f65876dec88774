"""Delivery behind a lagging callback (backend_lib/delivery.py, as AsyncEngine's dispatcher and
EngineProcessClient's reader use it): outputs that arrive while a backlog is being delivered
are merged in, and a first token overtakes the backlog queued before it, instead of waiting
for a turn of every stream (Triton's stub sends ~4 responses a request at concurrency 256:
a turn is hundreds of sends)."""
import queue
import threading

from backend_lib import AsyncEngine, EngineProcessClient
from backend_lib import engine_wire as wire
from backend_lib.request import RequestOutput

BACKLOG = [RequestOutput(f"s{i}", [7], False, num_prompt_tokens=3, num_output_tokens=5) for i in range(12)]
FIRST = RequestOutput("p", [9], False, num_prompt_tokens=3, num_output_tokens=1)
LATER = RequestOutput("s0", [8], False, num_prompt_tokens=3, num_output_tokens=6)
# the new first token comes after the backlog's first callback; s0's next token after the fifth
WANT = ["s0", "p"] + [f"s{i}" for i in range(1, 12)] + ["s0"]


class _ScriptedConn:
    """The core's socket: each message becomes readable once `after` callbacks have run; then
    end of file (readable, and recv raises), as a closed socket."""

    def __init__(self, script, delivered):
        self.script, self.delivered = list(script), delivered

    def poll(self, timeout=0.0):
        return not self.script or len(self.delivered) >= self.script[0][0]

    def recv(self):
        if not self.script:
            raise EOFError
        return self.script.pop(0)[1]


def _steps(*outs):
    return (wire.STEPS, [[wire.encode_output(o) for o in outs]])


def test_the_engine_process_reader_lets_a_first_token_overtake_the_backlog():
    delivered = []
    c = EngineProcessClient.__new__(EngineProcessClient)
    c._conn = _ScriptedConn([(0, _steps(*BACKLOG)), (1, _steps(FIRST)), (5, _steps(LATER))], delivered)
    c._merge_queued, c._stall_s, c._sinks, c._lock = True, 60.0, {}, threading.Lock()
    c._deliver = delivered.append
    c._core_gone = lambda: None
    c._reader_main()
    assert [o.request_id for o in delivered] == WANT
    assert [o.new_token_ids for o in delivered][-1] == [8]


def test_the_in_process_dispatcher_lets_a_first_token_overtake_the_backlog():
    from backend_lib.async_engine import _STOP
    delivered = []
    a = AsyncEngine.__new__(AsyncEngine)
    a._outs, a._merge_queued = queue.Queue(), True
    later = {1: [FIRST], 5: [LATER], 14: _STOP}

    def deliver(out):
        delivered.append(out)
        if len(delivered) in later:
            a._outs.put(later[len(delivered)])

    a._deliver = deliver
    a._outs.put(list(BACKLOG))
    a._dispatch_main()
    assert [o.request_id for o in delivered] == WANT


def test_a_stats_reply_does_not_flush_the_backlog():
    """The llm model asks for stats every 200 ms: a reply (counters only) is handled where it
    comes, without delivering the whole backlog first (which would hold the first token behind
    a turn of every stream five times a second); DIED and STOPPED still come after the outputs
    before them."""
    delivered, controls = [], []
    c = EngineProcessClient.__new__(EngineProcessClient)
    c._conn = _ScriptedConn([(0, _steps(*BACKLOG)), (1, (wire.STATS, 7, None)), (1, _steps(FIRST)),
                             (5, _steps(LATER)), (6, (wire.STOPPED,))], delivered)
    c._merge_queued, c._stall_s, c._sinks, c._lock = True, 60.0, {}, threading.Lock()
    c._deliver = delivered.append
    c._control = lambda msg: controls.append((msg[0], len(delivered)))
    c._core_gone = lambda: None
    c._reader_main()
    assert [o.request_id for o in delivered] == WANT
    assert controls == [(wire.STATS, 1), (wire.STOPPED, len(WANT))]
