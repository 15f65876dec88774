"""Each request's sink (a RequestStream, or a callback) and its delivery: what the in-process
AsyncEngine and the engine process's client (engine_client.EngineProcessClient) share.

Torch-free, as everything the client imports: the Triton stub of an engine-process `llm`
never loads torch (start-up time, memory, and garbage-collection passes over its objects).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Callable, Iterator, Optional

from .delivery import Delivery
from .request import FinishReason, OutputRow, RequestOutput, output_of_row

logger = logging.getLogger("backend_lib")

Callback = Callable[[RequestOutput], None]


class RequestStream:
    """Blocking iterator over one request's outputs; ends after the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        # SimpleQueue: no locks or conditions to build (a Queue's cost ~15 µs a request, paid
        # by every request though callback users never read it)
        self._q: "queue.SimpleQueue[RequestOutput]" = queue.SimpleQueue()

    def _put(self, out: RequestOutput) -> None:
        self._q.put(out)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self._q.get()
            yield out
            if out.finished:
                return

    def result(self) -> tuple[list[int], Optional[FinishReason]]:
        tokens: list[int] = []
        reason = None
        for out in self:
            tokens.extend(out.new_token_ids)
            reason = out.finish_reason
        return tokens, reason


class OutputSinks:
    """Each request's sink (a RequestStream, or a callback): registration and delivery, the part
    AsyncEngine and engine_client.EngineProcessClient share. Subclasses own `_sinks` {request
    id: (stream, callback)}, `_lock`, `_stopping`, `_merge_queued` and `_delivery_threads`."""
    _sinks: dict
    _lock: threading.Lock
    _stopping: bool
    _merge_queued: bool
    _delivery_threads: int

    def batched_adds(self):
        """A block whose add_request() calls may reach the engine together (EngineProcessClient:
        one message); in process each goes at once."""
        return contextlib.nullcontext()

    def _register(self, request_id: str, callback: Optional[Callback]) -> RequestStream:
        """A new request's sink (its stream, and its callback if any)."""
        stream = RequestStream(request_id)
        with self._lock:
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            if request_id in self._sinks:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._sinks[request_id] = (stream, callback)
        return stream

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
        if sink is None:
            return
        stream, callback = sink
        if callback is None:
            stream._put(out)
            return
        try:
            callback(out)
        except Exception:  # a broken sink must not stop other requests' delivery
            logger.exception("output callback failed for request %s", out.request_id)

    def _delivery(self) -> Delivery:
        """The dispatching thread's Delivery: `_delivery_threads` threads run the callbacks."""
        return Delivery(self._deliver, self._delivery_threads if self._merge_queued else 1,
                        name=f"{threading.current_thread().name}-delivery")

    def _accept(self, rows: list[OutputRow], waiting: Delivery) -> None:
        """A step's outputs (rows): into `waiting` with merge_queued_outputs (decoded as handed
        out: merged rows never are), else delivered now."""
        if self._merge_queued:
            waiting.add_rows(rows)
            return
        for row in rows:
            self._deliver(output_of_row(row))

    def _fail_all(self, reason: FinishReason, error: Optional[str]) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for rid, (stream, callback) in sinks.items():
            out = RequestOutput(rid, [], True, reason, error=error)
            if callback is None:
                stream._put(out)
            else:
                try:
                    callback(out)
                except Exception:
                    logger.exception("output callback failed for request %s", rid)


def checked_delivery_threads(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DELIVERY_THREADS:
        raise ValueError(f"delivery_threads must be an integer from 1 to {MAX_DELIVERY_THREADS}, not {n!r}")
    return n


# Threads that may run output callbacks at once (Triton's python backend serves a model's
# sends from a pool of 32 threads by default).
MAX_DELIVERY_THREADS = 16
# How often the dispatcher, waiting for outputs, checks for a stalled step.
STALL_POLL_S = 1.0
