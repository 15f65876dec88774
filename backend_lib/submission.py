"""Who launches a scheduled step (EngineConfig.step_submission): the engine thread itself
("inline"), or a dedicated submission thread fed through a bounded queue ("thread", issue 13
item 3), so that a step's launch is not delayed while the engine thread waits on the
previous step's tokens, builds outputs or collects garbage.

Both take a SchedulerOutput on the engine thread and return a ticket; `launched(ticket)`
gives the step's StepHandle. In thread mode the host packing stays on the engine thread
(ModelRunner.plan builds a StepPlan that holds no Request, so the engine may go on mutating
requests) and only the device side (ModelRunner.launch) runs on the submission thread, in
plan order. On CUDA that thread launches on the stream the engine was built on.

A launch that raises fails its step and every step queued behind it (their plans assume it
ran); the engine thread gets the error from its next submit or launched() and LLMEngine.step
raises it, so AsyncEngine ends the requests with an error and goes unhealthy; nothing waits
forever on a thread that is gone.

The launch is Python code, so the submission thread needs the GIL: it runs while the engine
thread is blocked (its wait on a step's event) or once sys.getswitchinterval() has passed.
When the engine thread is the bottleneck (host-bound steps) it rarely blocks, launches then
happen later than inline ones would, and thread mode loses (bench/host_loop.py --device-us on
CPU); what it can win is the GIL-free part of a launch (graph replay, copies) overlapping the
engine thread's Python. Hence inline stays the default until a GPU run says otherwise.
"""
from __future__ import annotations

import contextlib
import queue
from concurrent.futures import Future
from typing import Any, Optional

import torch

from .handoff import StepHandle
from .os_threads import NamedThread
from .scheduler import SchedulerOutput

THREAD_NAME = "step-submission"
_POLL_S = 0.5       # how often a blocked engine thread checks that the submission thread lives
_STOP = object()


class InlineSubmission:
    """Plan and launch on the engine thread, in one call (the ticket is the handle)."""

    def __init__(self, runner: Any, eos_ids: tuple[int, ...]):
        self._runner = runner  # ModelRunner or PipelineExecutor: anything with execute()
        self._eos = eos_ids

    def submit(self, sched: SchedulerOutput) -> StepHandle:
        return self._runner.execute(sched, self._eos)

    def launched(self, ticket: StepHandle) -> StepHandle:
        return ticket

    def close(self) -> None:
        pass

    def is_alive(self) -> bool:
        return False


class SubmissionThread:
    """Plans on the calling (engine) thread; launches on its own thread, in order."""

    def __init__(self, runner: Any, eos_ids: tuple[int, ...], queue_depth: int = 2):
        self._runner = runner
        self._eos = eos_ids
        # Bounded: the engine thread may run at most queue_depth plans ahead of the launches.
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._error: Optional[BaseException] = None
        self._closed = False
        device = runner.device
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._thread = NamedThread(target=self._main, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # ---- engine thread ------------------------------------------------------------------
    def submit(self, sched: SchedulerOutput) -> Future:
        if self._error is not None:
            raise RuntimeError(f"step submission failed: {self._error!r}") from self._error
        if self._closed:
            raise RuntimeError("step submission is closed")
        plan = self._runner.plan(sched, self._eos)
        ticket: Future = Future()
        self._put((plan, ticket))
        return ticket

    def launched(self, ticket: Future) -> StepHandle:
        """The step's handle once the submission thread has launched it; re-raises its error."""
        while True:
            try:
                return ticket.result(timeout=_POLL_S)
            except TimeoutError:
                if not self._thread.is_alive() and not ticket.done():
                    raise RuntimeError("the step submission thread is gone; the step was never launched") from None

    def close(self, timeout: float = 30.0) -> None:
        """Launch what is queued, stop the thread, join it; idempotent."""
        self._closed = True
        if self._thread.is_alive():
            self._put(_STOP)
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        """Still launching (a close() whose join timed out)."""
        return self._thread.is_alive()

    def _put(self, item: object) -> None:
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    raise RuntimeError("the step submission thread is gone") from self._error

    # ---- submission thread --------------------------------------------------------------
    def _main(self) -> None:
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        if self._stream is not None:
            torch.cuda.set_device(self._stream.device)
        with torch.inference_mode(), stream:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                plan, ticket = item
                if self._error is not None:
                    ticket.set_exception(RuntimeError(f"step not launched: an earlier launch failed: {self._error!r}"))
                    continue
                try:
                    ticket.set_result(self._runner.launch(plan))
                except BaseException as e:  # noqa: BLE001 - handed to the engine thread through the ticket
                    self._error = e
                    ticket.set_exception(e)


def make_submission(mode: str, runner: Any, eos_ids: tuple[int, ...]):
    if mode == "thread":
        return SubmissionThread(runner, eos_ids)
    return InlineSubmission(runner, eos_ids)
