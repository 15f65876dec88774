"""The engine core process: LLMEngine's step loop with nothing else competing for its GIL.

    python -m backend_lib.engine_core FD PARENT_PID

started by EngineProcessClient (backend_lib/engine_client.py) with one end of a socketpair as
FD. Threads here:
  - main: the engine loop (drain commands, step, hand the step's outputs to the writer);
  - reader: receives the parent's command lists into a queue (blocks in recv, GIL released);
  - writer: encodes and sends everything the loop produced since its last write as ONE message.
The process ends when the parent says stop, when the engine loop dies (after telling the
parent), when the parent kills it, or when the parent is gone: the socket closes (reader sees
EOF) or, on Linux, the kernel's parent-death signal (SIGKILL) fires. SIGINT and SIGTERM are
ignored (they reach process groups; the parent decides).
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from . import engine_wire as wire
from .os_threads import NamedThread, name_os_thread

logger = logging.getLogger("backend_lib")

PR_SET_PDEATHSIG = 1
_PARENT_GONE = object()


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the socket's EOF still ends us
        pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


class _Writer:
    """The one thread that encodes and writes what goes to the parent; the engine loop only enqueues."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.q: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self.thread = NamedThread(target=self._main, name="core-writer", daemon=True)
        self.thread.start()

    def steps(self, outs) -> None:
        if outs:
            self.q.put(outs)  # encoded on the writer thread, while the loop waits on the device

    def control(self, msg: tuple) -> None:
        self.q.put(msg)

    def close(self, timeout: float = 10.0) -> None:
        self.q.put(None)
        self.thread.join(timeout)

    def _main(self) -> None:
        while True:
            items = [self.q.get()]
            while True:  # everything queued meanwhile goes in the same write
                try:
                    items.append(self.q.get_nowait())
                except queue.Empty:
                    break
            steps: list = []
            try:
                for item in items:
                    if isinstance(item, list):
                        steps.append([wire.encode_output(o) for o in item])
                        continue
                    if steps:
                        self.conn.send((wire.STEPS, steps))
                        steps = []
                    if item is None:
                        return
                    self.conn.send(item)
                if steps:
                    self.conn.send((wire.STEPS, steps))
            except OSError:  # the parent is gone: nobody to deliver to
                os._exit(1)


def _reader_main(conn: Connection, cmds: "queue.SimpleQueue[object]") -> None:
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            cmds.put(_PARENT_GONE)
            return
        for cmd in batch:
            cmds.put(cmd)


def _host_threads(config) -> None:
    """A CUDA engine's host work is bookkeeping on small tensors: torch's intra-op thread pool
    (one thread a core) only adds wake-ups to each parallel region. On the H200 box (16 cores)
    at 256 streams with one thread the core ran 369 steps/s against 281 with spinning workers
    and ~330 with sleeping ones (bench/RESULTS.md). A CPU engine keeps the pool (its matmuls
    run there). The user's OMP_NUM_THREADS wins."""
    if config.device == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        import torch
        torch.set_num_threads(1)


def serve(conn: Connection) -> int:
    """Build the engine from the START message, then run the loop until stop. Returns the exit code."""
    from .envs import engine_class
    from .fault_hook import fail_after_steps
    from .request import FinishReason, RequestOutput

    kind, config, fault_after_steps = conn.recv()[0]  # a command list, as every message
    assert kind == wire.START, kind
    name_os_thread("core-loop")
    _host_threads(config)
    try:
        eng = engine_class()(config)
        if fault_after_steps > 0:
            fail_after_steps(eng, fault_after_steps)
    except BaseException as e:  # noqa: BLE001 - re-raised in the parent
        conn.send((wire.STARTUP_ERROR, type(e).__name__, str(e), traceback.format_exc()))
        return 1
    conn.send((wire.READY, {"vocab_size": eng.vocab_size, "max_model_len": eng.max_model_len,
                            "eos_token_ids": tuple(eng.eos_token_ids), "pid": os.getpid()}))
    cmds: "queue.SimpleQueue[object]" = queue.SimpleQueue()
    NamedThread(target=_reader_main, args=(conn, cmds), name="core-reader", daemon=True).start()
    out = _Writer(conn)

    def drain(block: bool) -> object:
        """Apply queued commands; returns wire.STOP / _PARENT_GONE when one ends the loop."""
        try:
            cmd = cmds.get() if block else cmds.get_nowait()
        except queue.Empty:
            return None
        while True:
            if cmd is _PARENT_GONE:
                return cmd
            kind = cmd[0]
            if kind == wire.ADD:
                _, rid, prompt, params = cmd
                try:
                    eng.add_request(rid, prompt, params)
                except ValueError as e:
                    out.steps([RequestOutput(rid, [], True, FinishReason.ERROR, error=str(e))])
            elif kind == wire.ABORT:
                eng.abort(cmd[1])
            elif kind == wire.STATS:
                out.control((wire.STATS, cmd[1], eng.stats()))
            elif kind == wire.STOP:
                return wire.STOP
            try:
                cmd = cmds.get_nowait()
            except queue.Empty:
                return None

    try:
        while True:
            ended = drain(block=not eng.has_unfinished())
            if ended is _PARENT_GONE:
                return 0
            if ended == wire.STOP:
                for rid in list(eng.scheduler.requests):
                    eng.abort(rid)
                while eng.has_unfinished() or eng.scheduler.has_pending_outputs:
                    out.steps(eng.step())
                out.control((wire.STOPPED,))
                out.close()
                return 0
            out.steps(eng.step())
    except BaseException as e:  # noqa: BLE001 - engine death: the parent fails every request
        logger.exception("engine core loop died")
        out.control((wire.DIED, repr(e)))
        out.close()
        return 1
    finally:
        try:
            eng.close()  # pipeline stages: stop (or kill) the worker processes
        except Exception:  # noqa: BLE001
            logger.exception("engine close failed")


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[0]), int(argv[1])
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group, and a SIGTERM to the group or cgroup (systemd's
    # KillMode=control-group) too, while Triton's stubs ignore both and the server drains its
    # requests: the parent decides when the engine stops (it aborts the requests so that each
    # gets its final response), not the signal. The core still ends with its parent (EOF, and
    # the parent-death SIGKILL) and on the parent's kill.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        return serve(conn)
    except (EOFError, OSError):  # the parent went away during start-up
        return 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Daemon threads may sit in recv/queue waits: leave without interpreter teardown.
    os._exit(code)
