"""A BLS route's wait on its upstream model (`llm`), bounded by that model's stub being alive.

tritonserver 2.51 never answers the requests that were waiting on a Python stub that died
(kill -9, OOM killer, crash): a BLS worker reading the upstream response iterator would wait
forever. The iterator has no timeout, so it is read on a helper thread, and while no response
arrives the waiting side checks, every `poll_s`, that the upstream stub process still exists
(by /proc only: no call into the server). When it is gone, the request fails with an error
naming the dead model, the death is logged once, and a gauge (`bls_upstream_alive`) drops to 0.
A live upstream that stays silent for `silence_s` (the route's `upstream_timeout_s`) ends the
wait too (UpstreamSilent); the helper thread then stays until the upstream answers.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

STUB_NAME = "triton_python_backend_stub"


class UpstreamGone(RuntimeError):
    pass


class UpstreamSilent(UpstreamGone):
    """The upstream sent nothing for the route's bound."""


def find_stub(model: str, server_pid: int) -> Optional[int]:
    """pid of the instance stub of `model` started by server_pid (its argv: stub, <repo>/<model>/
    <version>/model.py, shm region, ..., instance name), or None."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[1]) != server_pid:
                continue
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if len(argv) > 8 and os.path.basename(argv[0].decode(errors="replace")) == STUB_NAME:
            parts = Path(argv[1].decode(errors="replace")).parts
            if len(parts) >= 3 and parts[-3] == model and argv[8].decode(errors="replace") != model:
                return int(d)
    return None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] not in ("Z", "X")


class UpstreamWatch:
    """Whether the upstream model's stub is alive. The stub is looked up lazily (it may load
    after this model); until it has been seen, it counts as alive."""

    def __init__(self, model: str, *, on_death: Optional[Callable[[str], None]] = None,
                 gauge: Any = None):
        self.model = model
        self.server_pid = os.getppid()
        self.pid: Optional[int] = None
        self.dead_message: Optional[str] = None
        self._on_death = on_death
        self._gauge = gauge
        self._lock = threading.Lock()
        self._next_lookup = 0.0

    def locate(self) -> None:
        """Look the upstream stub up now, while a request shows it is serving (rate-limited)."""
        with self._lock:
            now = time.monotonic()
            if self.pid is None and now >= self._next_lookup:
                self._next_lookup = now + 1.0
                self.pid = find_stub(self.model, self.server_pid)

    def alive(self) -> bool:
        with self._lock:
            if self.dead_message is not None:
                return False
            if self.pid is None:
                now = time.monotonic()
                if now < self._next_lookup:
                    return True
                self._next_lookup = now + 1.0
                self.pid = find_stub(self.model, self.server_pid)
                return True
            if _alive(self.pid):
                return True
            self.dead_message = (f"model '{self.model}' is gone: its Python stub (pid {self.pid}) died; "
                                 "tritonserver 2.51 does not restart it")
        if self._gauge is not None:
            try:
                self._gauge.set(0)
            except Exception:  # noqa: BLE001 - reporting must not mask the error
                pass
        if self._on_death is not None:
            self._on_death(self.dead_message)
        return False

    def close(self) -> None:
        self._gauge = None  # no call into the server after finalize


class HeldIterators:
    """Decoupled BLS response iterators whose last reference must be dropped here, with the GIL.

    python_backend r24.10 (tritonserver 2.51): the stub keeps each such iterator in a map of its
    own too, and erases it on its stub-to-server thread, which holds no GIL, when the cleanup
    message queued by the iterator's final response reaches the head of that thread's queue. An
    iterator Python has dropped by then dies in that erase, with every response it returned
    and their tensors' NumPy arrays: Python objects freed without the GIL corrupt the
    allocator, and the stub dies later with SIGSEGV in _PyObject_Malloc. tritonserver then
    never completes `llm`'s sends to that stub's requests (its thread waits on the dead stub
    for good), so `llm`'s sender blocks in send() and every route stalls.

    That thread sends the stub's queued messages one at a time, in order: once an
    is_cancelled() queued after an iterator's cleanup has returned, the erase has run, and
    dropping the iterator here frees it with the GIL. hold() the iterators that have ended;
    barrier() with the batch execute() has just received (no other thread polls its first
    request yet, so that request's is_cancelled() is queued fresh, after every cleanup queued so
    far) releases the ones held before it. At most the iterators of the requests since the last execute() stay."""

    def __init__(self):
        self._lock = threading.Lock()
        self._epoch = 0
        self._held: list = []  # (epoch at hold, iterator)

    def hold(self, iterator: Any) -> None:
        with self._lock:
            self._held.append((self._epoch, iterator))

    def barrier(self, requests: Any) -> None:
        if not requests:
            return
        with self._lock:
            self._epoch += 1
            epoch = self._epoch
        try:
            requests[0].is_cancelled()
        except Exception:  # noqa: BLE001 - no round trip, no proof: keep them
            return
        with self._lock:
            done = [it for e, it in self._held if e < epoch]
            self._held = [(e, it) for e, it in self._held if e >= epoch]
        done.clear()  # the last references, here

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        """At finalize, where no request comes to barrier on: lets them go, taking their cleanups
        (queued when their streams ended, before the unload) to have run."""
        with self._lock:
            self._held = []


def cancel_upstream_request(pb: Any, model: str, key: str, iterators: HeldIterators) -> None:
    """Ask `model` (one that takes `cancel_request_id` control requests, as `llm` does) to abort
    its request `key`, and wait for the control request's FINAL. r24.10's BLS response
    iterators have no cancel() of their own."""
    ctl = pb.InferenceRequest(model_name=model, request_id=key + "-cancel",
                              inputs=[pb.Tensor("cancel_request_id", np.array([[key.encode()]], dtype=np.object_))],
                              requested_output_names=[])
    responses = ctl.exec(decoupled=True)
    try:
        for _ in responses:
            pass
    finally:
        iterators.hold(responses)


class BoundedResponses:
    """Iterates an upstream response iterator; raises UpstreamGone instead of waiting forever
    on a dead upstream. Other attributes (e.g. cancel()) are those of the wrapped iterator."""

    _END = object()

    def __init__(self, responses: Any, watch: UpstreamWatch, poll_s: float = 0.5,
                 silence_s: Optional[float] = None, silence_message: str = "upstream sent nothing"):
        self._it = responses
        self._watch = watch
        self._poll_s = poll_s if silence_s is None else min(poll_s, silence_s)
        self._silence_s = silence_s
        self._silence_message = silence_message
        self._last = time.monotonic()
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        watch.locate()
        if watch.dead_message is not None:
            # a death already seen: fail now, without sending a request nobody will answer
            # (the responses generator sends it on its first step, on the pump thread)
            raise UpstreamGone(watch.dead_message)
        self._pump = threading.Thread(target=self._pump_main, name="bls-upstream", daemon=True)
        self._pump.start()

    def _pump_main(self) -> None:
        try:
            for r in self._it:
                self._q.put((r, None))
        except BaseException as e:  # noqa: BLE001 - re-raised on the reading side
            self._q.put((None, e))
        self._q.put((self._END, None))

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                item, err = self._q.get(timeout=self._poll_s)
            except queue.Empty:
                if not self._watch.alive():
                    raise UpstreamGone(self._watch.dead_message) from None
                if self._silence_s is not None and time.monotonic() - self._last >= self._silence_s:
                    raise UpstreamSilent(self._silence_message) from None
                continue
            self._last = time.monotonic()
            if err is not None:
                raise err
            if item is self._END:
                self._q.put((self._END, None))  # stays ended
                raise StopIteration
            return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)
