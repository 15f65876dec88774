"""AsyncEngine: the step loop on one background thread, a dispatcher thread that delivers
each request's outputs in order (callback or blocking iterator), abort by request id.

Threads: the caller's (add_request/abort only enqueue), the engine thread (owns LLMEngine,
all torch work), the dispatcher thread (runs callbacks, e.g. Triton's response sender).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from . import envs
from .config import EngineConfig
from .delivery import Delivery
from .engine import EngineStats, LLMEngine
from .fault_hook import fail_after_steps
from .os_threads import NamedThread
from .output_sinks import (STALL_POLL_S, Callback, OutputSinks, RequestStream,  # noqa: F401 (RequestStream: re-exported)
                           checked_delivery_threads)
from .request import FinishReason, OutputRow, SamplingParams, final_row

logger = logging.getLogger("backend_lib")


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str


_STOP = object()


@dataclass
class _FailAll:
    reason: FinishReason
    error: Optional[str]


# Step lists the dispatcher takes off its queue before it delivers again.
MAX_ITEMS_PER_PASS = 64


class EngineStalled(RuntimeError):
    """An engine step ran past BACKEND_LIB_ENGINE_STALL_TIMEOUT_S."""


class AsyncEngine(OutputSinks):
    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0, merge_queued_outputs: bool = False,
                 fault_after_steps: int = 0, delivery_threads: int = 1):
        """merge_queued_outputs: when the callbacks fall behind the engine loop, what waits is
        merged per sequence (delivery.DeliveryQueue: one output carries every token the
        sequence made meanwhile) and delivered most urgent first: a slow sink (Triton's
        response sender) pays its per-output cost once per turn instead of once per step,
        first tokens and finals overtake the backlog, and streams take turns.
        delivery_threads (with merge_queued_outputs): threads that run the callbacks, each
        request on one at a time; 1 is the dispatcher thread itself.
        fault_after_steps: test hook, > 0 makes the engine loop fail after that many steps."""
        self.config = config
        self._fault_after_steps = fault_after_steps
        self._merge_queued = merge_queued_outputs
        self._delivery_threads = checked_delivery_threads(delivery_threads)
        self.error: Optional[BaseException] = None
        self._stall_s = envs.engine_stall_timeout_s()
        self._step_began: Optional[float] = None  # monotonic start of the step in progress
        self._cmds: "queue.Queue[object]" = queue.Queue()
        self._outs: "queue.Queue[object]" = queue.Queue()
        self._sinks: dict[str, tuple[RequestStream, Optional[Callback]]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._ready = threading.Event()
        self.engine: Optional[LLMEngine] = None
        self._thread = NamedThread(target=self._engine_main, name="engine-loop", daemon=True)
        self._dispatcher = NamedThread(target=self._dispatch_main, name="engine-dispatch", daemon=True)
        self._dispatcher.start()
        self._thread.start()
        # Start-up handshake: the engine is built on its own thread; its errors surface here.
        if not self._ready.wait(startup_timeout):
            raise TimeoutError(f"engine did not start within {startup_timeout} s")
        if self.error is not None:
            self._outs.put(_STOP)
            raise self.error
        eng = self.engine
        self.vocab_size, self.max_model_len, self.eos_token_ids = eng.vocab_size, eng.max_model_len, eng.eos_token_ids

    # ---- caller side ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    callback: Optional[Callback] = None, validated: bool = False, key: str = "") -> RequestStream:
        """validated: the caller passes what validate() returned for these params (not checked
        again). key: EngineProcessClient's (abort_key); unused here."""
        if not self.is_healthy():
            raise RuntimeError(f"engine is not healthy: {self.error!r}")
        # errors raise here, synchronously
        ids = prompt_token_ids if validated else self.engine.validate(prompt_token_ids, params)
        stream = self._register(request_id, callback)
        if not self.is_healthy():  # died while we registered: _FailAll may have run already
            with self._lock:
                self._sinks.pop(request_id, None)
            raise RuntimeError(f"engine is not healthy: {self.error!r}")
        self._cmds.put(_Add(request_id, ids, params))
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Abort(request_id))

    def abort_key(self, key: str) -> None:
        """EngineProcessClient's cancel by key across the clients of a shared core: an
        in-process engine has no other clients, so its caller's own requests are all there is."""

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The synchronous request checks (ValueError names the field); the prompt as a list."""
        return self.engine.validate(prompt_token_ids, params)

    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.stats() if self.engine is not None else EngineStats()

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._sinks)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each request still gets its final output), stop; within
        `timeout` seconds in all. Callbacks only ever run on the dispatcher thread: if it is
        stuck in one past the timeout, the requests it has not finished get no callback."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopping = True
        self._cmds.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.1f s; failing what is in flight", timeout)
        if not self._dispatcher.is_alive():
            self._fail_all(FinishReason.ABORT, None)
            return
        # Through the dispatcher, behind the outputs already queued: anything the engine never
        # finished ends as aborted; outputs the engine emits later find no sink.
        self._outs.put(_FailAll(FinishReason.ABORT, None))
        self._outs.put(_STOP)
        self._dispatcher.join(max(0.0, deadline - time.monotonic()))
        if self._dispatcher.is_alive():
            logger.error("output dispatcher still busy in a callback after %.1f s", timeout)

    # ---- engine thread ----------------------------------------------------------------------
    def _engine_main(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
            if self._fault_after_steps > 0:
                fail_after_steps(self.engine, self._fault_after_steps)
        except BaseException as e:  # noqa: BLE001 - re-raised by the constructor
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        eng = self.engine
        try:
            while True:
                stop = self._drain_commands(block=not eng.has_unfinished())
                if stop:
                    for rid in list(eng.scheduler.requests):
                        eng.abort(rid)
                    while eng.has_unfinished() or eng.scheduler.has_pending_outputs:
                        self._emit(self._step())
                    return
                self._emit(self._step())
                if self.error is not None:  # declared stalled meanwhile: its requests have failed
                    return
        except BaseException as e:  # noqa: BLE001 - engine death: fail every request, go unhealthy
            logger.exception("engine thread died")
            self.error = e
            # Through the dispatcher, after the outputs already queued: callbacks stay on one
            # thread and the final error never overtakes a request's earlier tokens.
            self._outs.put(_FailAll(FinishReason.ERROR, f"engine failed: {e!r}"))
        finally:
            try:
                eng.close()  # pipeline stages: stop (or kill) the worker processes
            except Exception:  # noqa: BLE001
                logger.exception("engine close failed")

    def _step(self) -> list[OutputRow]:
        self._step_began = time.monotonic()
        try:
            return self.engine.step_rows()
        finally:
            self._step_began = None

    def _drain_commands(self, block: bool) -> bool:
        eng = self.engine
        cmd = self._cmds.get() if block else self._next_cmd()
        while cmd is not None:
            if cmd is _STOP:
                return True
            if isinstance(cmd, _Add):
                try:
                    eng.add_request(cmd.request_id, cmd.prompt, cmd.params)
                except ValueError as e:
                    self._emit([final_row(cmd.request_id, FinishReason.ERROR, str(e))])
            elif isinstance(cmd, _Abort):
                eng.abort(cmd.request_id)
            cmd = self._next_cmd()
        return False

    def _next_cmd(self):
        try:
            return self._cmds.get_nowait()
        except queue.Empty:
            return None

    def _emit(self, outs: list[OutputRow]) -> None:
        if outs:
            self._outs.put(outs)

    # ---- dispatcher thread ------------------------------------------------------------------
    def _dispatch_main(self) -> None:
        # merge_queued_outputs: outputs wait in a Delivery (merged per sequence, most urgent
        # first) and go out one at a time, the queued steps taken in between (one delivery
        # thread: this one; more: helpers, and this thread only takes steps).
        waiting = self._delivery()
        while True:
            items: list = []
            try:
                items.append(self._outs.get_nowait() if waiting.reader_has_work()
                             else self._outs.get(timeout=STALL_POLL_S))
                while len(items) < MAX_ITEMS_PER_PASS:
                    items.append(self._outs.get_nowait())
            except queue.Empty:
                if not items and not waiting.reader_has_work():
                    self._check_stall(waiting)
                    continue
            for item in items:
                if isinstance(item, list):
                    self._accept(item, waiting)
                    continue
                waiting.flush()  # a control item: the outputs before it go first
                if item is _STOP:
                    waiting.close()
                    return
                self._fail_all(item.reason, item.error)
            if waiting.reader_has_work():
                waiting.deliver_one()

    def _check_stall(self, waiting: Delivery) -> None:
        """A step running for longer than the stall timeout (a hung kernel, a deadlock) fails
        every request and makes the engine unhealthy, as the engine process's client does; the
        thread itself cannot be stopped, and exits if the step ever returns."""
        began = self._step_began
        if began is None or self.error is not None:
            return
        waited = time.monotonic() - began
        if waited > self._stall_s:
            self.error = EngineStalled(f"engine step running for {waited:.0f} s "
                                       f"({envs.ENGINE_STALL_TIMEOUT_ENV}={self._stall_s:g})")
            logger.error("engine stalled: %s; failing every request", self.error)
            waiting.flush()  # the outputs before the stall go first
            self._fail_all(FinishReason.ERROR, f"engine failed: {self.error!r}")
