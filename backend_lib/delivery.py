"""The order in which a lagging callback hears from the engine.

When the callbacks (the Triton stub's response sends, ~0.1-0.5 ms each) fall behind the engine
(a step every ~2 ms with hundreds of streams), outputs wait. DeliveryQueue keeps what waits
merged per sequence (one response carries every token the sequence made meanwhile) and hands
it out most urgent first:
  1. a sequence's first output, alone (time to first token stays the engine's);
  2. the requests that have ended, in the order they ended, each one's other sequences before
     its final output (a closed-loop client sends its next request when the final arrives);
  3. every other sequence, the one waiting longest first (a sequence handed out goes to the
     back: streams take turns).
Handing out one output at a time and adding new steps in between lets an urgent output overtake
a backlog that was queued before it.

Delivery shares a DeliveryQueue between the thread that fills it and the threads that run the
callbacks: the filling thread itself between reads (one deliverer), or helper threads of their own
(several: Triton's send() releases the GIL while it waits on the server, so N sends overlap).
A request is in one thread's hands at a time, which keeps its outputs in order.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict, deque
from typing import Callable, Collection, Iterable, Optional, Union

from .os_threads import NamedThread
from .request import OUTPUT_FIELDS, OutputRow, RequestOutput, output_of_row

_ROW_FINISHED = OUTPUT_FIELDS.index("finished")


@dataclasses.dataclass
class _Pending:
    # the sequence's newest output (its state and flags): a RequestOutput, or the engine's
    # row of one, decoded only when the merged output is handed out
    latest: Union[RequestOutput, OutputRow]
    tokens: list[int]
    logprobs: Optional[list]

    def merged(self) -> RequestOutput:
        latest = self.latest if isinstance(self.latest, RequestOutput) else output_of_row(self.latest)
        return dataclasses.replace(latest, new_token_ids=self.tokens, new_logprobs=self.logprobs)

    def merge(self, latest: Union[RequestOutput, OutputRow], tokens: list[int], logprobs: Optional[list]) -> None:
        """A newer output of the sequence: its state, and its tokens after those waiting."""
        self.latest = latest
        self.tokens.extend(tokens)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)

    def finished(self) -> bool:
        return self.latest.finished if isinstance(self.latest, RequestOutput) else self.latest[_ROW_FINISHED]


def _is_first(out: RequestOutput) -> bool:
    return bool(not out.finished and out.new_token_ids and out.num_output_tokens == len(out.new_token_ids))


class DeliveryQueue:
    def __init__(self) -> None:
        self._firsts: deque[RequestOutput] = deque()
        # (request id, sequence index) -> what it has waiting; insertion order is the age order
        self._pending: "OrderedDict[tuple[str, int], _Pending]" = OrderedDict()
        self._keys_of: dict[str, dict[tuple[str, int], None]] = {}  # a request's pending sequences
        self._ended: "OrderedDict[str, None]" = OrderedDict()  # requests whose final output waits

    def __len__(self) -> int:
        return len(self._firsts) + len(self._pending)

    def add(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid in self._ended:
            return  # nothing after a request's final output
        key = (rid, out.index)
        p = self._pending.get(key)
        if p is None and _is_first(out):
            self._firsts.append(out)
            return
        if p is None:
            self._pending[key] = _Pending(out, list(out.new_token_ids),
                                          list(out.new_logprobs) if out.new_logprobs is not None else None)
            self._keys_of.setdefault(rid, {})[key] = None
        else:
            p.merge(out, out.new_token_ids, out.new_logprobs)
        if out.finished:
            self._ended[rid] = None

    def add_row(self, t: OutputRow) -> None:
        """add() of an output as a row (request.OUTPUT_FIELDS). The common case behind a lagging
        sender, a sequence's next tokens merged into what already waits, takes the tokens
        without decoding the tuple (a RequestOutput per row per step cost the Triton stub's
        reader ~0.7 µs a row, holding the GIL its sender and execute() wait for)."""
        rid, toks, finished, reason, _, _, error, lps, _, index = t
        if rid in self._ended:
            return  # nothing after a request's final output
        p = self._pending.get((rid, index))
        if p is None or finished or reason is not None or error is not None:
            self.add(output_of_row(t))
            return
        p.merge(t, toks, lps)

    def pop(self, busy: Collection[str] = ()) -> Optional[RequestOutput]:
        """The most urgent waiting output of a request not in `busy` (None when there is none).
        Skipping a busy request costs one look per busy request: `busy` is a thread each."""
        for i, out in enumerate(self._firsts):
            if out.request_id not in busy:
                del self._firsts[i]
                return out
        for rid in self._ended:
            if rid in busy:
                continue
            keys = self._keys_of[rid]
            key = next((k for k in keys if not self._pending[k].finished()), None)
            if key is None:  # only the final output is left
                key = next(iter(keys))
                del self._ended[rid]
            return self._take(key)
        for key in self._pending:
            if key[0] not in busy:
                return self._take(key)
        return None

    def _take(self, key: tuple[str, int]) -> RequestOutput:
        p = self._pending.pop(key)
        keys = self._keys_of[key[0]]
        del keys[key]
        if not keys:
            del self._keys_of[key[0]]
        return p.merged()

    def drain(self) -> list[RequestOutput]:
        out = []
        while self:
            out.append(self.pop())
        return out


class Delivery:
    """A DeliveryQueue filled by one thread (AsyncEngine's dispatcher, EngineProcessClient's
    reader) and delivered to `deliver` by that thread between reads (threads=1: call
    deliver_one) or by `threads` helper threads (the filling thread then only fills). Each
    request is delivered by one thread at a time, in its queue order; close() delivers what
    waits and ends the helpers."""

    def __init__(self, deliver: Callable[[RequestOutput], None], threads: int = 1, name: str = "delivery"):
        self._deliver = deliver
        self._queue = DeliveryQueue()
        self._cond = threading.Condition()
        self._busy: set[str] = set()  # request ids being delivered
        self._closing = False
        self.inline = threads == 1
        self._helpers = [] if self.inline else [
            NamedThread(target=self._help, name=f"{name}-{i}", os_name=f"delivery-{i}", daemon=True) for i in range(threads)]
        for t in self._helpers:
            t.start()

    def add(self, outs: Iterable[RequestOutput]) -> None:
        with self._cond:
            for out in outs:
                self._queue.add(out)
            self._cond.notify(len(self._helpers))

    def add_rows(self, rows: Iterable[OutputRow]) -> None:
        """add() of outputs as rows (DeliveryQueue.add_row)."""
        with self._cond:
            for t in rows:
                self._queue.add_row(t)
            self._cond.notify(len(self._helpers))

    def reader_has_work(self) -> bool:
        """Whether the filling thread should deliver before it waits for more (inline only)."""
        return self.inline and bool(self._queue)

    def deliver_one(self) -> bool:
        """Deliver the most urgent output on this thread; False when none is ready."""
        with self._cond:
            out = self._queue.pop(self._busy)
            if out is None:
                return False
            self._busy.add(out.request_id)
        self._run(out)
        return True

    def flush(self) -> None:
        """Return once everything added so far has been delivered."""
        if self.inline:
            while self.deliver_one():
                pass
            return
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._busy)

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._helpers:
            if t is not threading.current_thread():
                t.join()

    def _run(self, out: RequestOutput) -> None:
        try:
            self._deliver(out)
        finally:
            with self._cond:
                self._busy.discard(out.request_id)
                self._cond.notify_all()  # its next output may wait; flush() may wait

    def _help(self) -> None:
        while True:
            with self._cond:
                out = self._queue.pop(self._busy)
                while out is None:
                    if self._closing:
                        return
                    self._cond.wait()
                    out = self._queue.pop(self._busy)
                self._busy.add(out.request_id)
            self._run(out)

