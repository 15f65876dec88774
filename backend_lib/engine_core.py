"""The engine core process: LLMEngine's step loop with nothing else competing for its GIL.

    python -m backend_lib.engine_core FD PARENT_PID [LISTEN_FD SERVER_PID]

started by EngineProcessClient (backend_lib/engine_client.py) with one end of a socketpair as
FD; a shared core also takes clients on LISTEN_FD (backend_lib/core_clients.py). Threads here:
  - main: the engine loop (drain commands, step, hand the step's outputs to the writer);
  - a reader per client: receives its command lists into a queue (blocks in recv, GIL released);
  - writer: encodes and sends everything the loop produced since its last write, one message a
    client.
The process ends when the last client says stop, when the engine loop dies (after telling the
clients), when the parent kills it, or when the clients are gone: the sockets close (readers see
EOF) or, on Linux, the kernel's parent-death signal (SIGKILL) fires (a shared core: the server's
end). SIGINT and SIGTERM are ignored (they reach process groups; the clients decide).
"""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import queue
import signal
import socket
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Optional

from . import engine_wire as wire
from .core_clients import GONE, Clients, Writer
from .envs import core_profile_path, core_switch_interval_s
from .process_lifetime import die_with_process
from .os_threads import name_os_thread

logger = logging.getLogger("backend_lib")

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the socket's EOF still ends us
        pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _host_threads(config) -> None:
    """A CUDA engine's host work is bookkeeping on small tensors: torch's intra-op thread pool
    (one thread a core) only adds wake-ups to each parallel region. On the H200 box (16 cores)
    at 256 streams with one thread the core ran 369 steps/s against 281 with spinning workers
    and ~330 with sleeping ones (bench/RESULTS.md). A CPU engine keeps the pool (its matmuls
    run there). The user's OMP_NUM_THREADS wins."""
    if config.device == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        import torch
        torch.set_num_threads(1)


def serve(conn: Connection, listener: Optional[socket.socket] = None) -> int:
    """Build the engine from the START message, then run the loop until stop. Returns the exit
    code. listener: a shared core's socket for more clients (core_clients)."""
    from .envs import engine_class
    from .fault_hook import fail_after_steps
    from .request import FinishReason, final_row

    kind, config, fault_after_steps = conn.recv()[0]  # a command list, as every message
    assert kind == wire.START, kind
    name_os_thread("core-loop")
    _host_threads(config)
    try:
        switch_s = core_switch_interval_s()
        if switch_s is not None:
            # how long the writer or a reader may hold the GIL while the loop waits for it
            sys.setswitchinterval(switch_s)
        eng = engine_class()(config)
        if fault_after_steps > 0:
            fail_after_steps(eng, fault_after_steps)
    except BaseException as e:  # noqa: BLE001 - re-raised in the parent
        conn.send((wire.STARTUP_ERROR, type(e).__name__, str(e), traceback.format_exc()))
        return 1
    info = {"vocab_size": eng.vocab_size, "max_model_len": eng.max_model_len,
            "eos_token_ids": tuple(eng.eos_token_ids), "pid": os.getpid(),
            "switch_interval_s": sys.getswitchinterval()}
    conn.send((wire.READY, info))
    cmds: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
    clients = Clients(cmds, shared=listener is not None)
    out = Writer(clients, on_last_client_lost=lambda: os._exit(1))  # nobody to deliver to
    clients.attach(conn)
    if listener is not None:
        clients.listen(listener, info)

    def detach(cid: int, gone: bool) -> Optional[str]:
        """The client leaves (STOP) or is gone (EOF): its requests end. "stop" when it was the
        last client that asked (the engine stops), "exit" when the last one is gone."""
        rids, ending = clients.detach(cid, gone)
        for rid in rids:
            eng.abort(rid)
        if ending is None:
            out.wake()
            return None
        clients.close_listener()
        return ending

    def refuse(cid: int, rid: str, reason: FinishReason, why: Optional[str]) -> None:
        out.control((wire.STEPS, [[final_row(rid, reason, why)]]), cid)

    def apply(cid: int, batch) -> Optional[str]:
        """One client's command list, in order."""
        if batch is GONE:
            return detach(cid, gone=True)
        owner = clients.owner
        for cmd in batch:
            kind = cmd[0]
            if kind == wire.ADD:
                _, rid, prompt, params, *key = cmd
                if rid in owner:  # another client's (or a live) request: its routing stays
                    refuse(cid, rid, FinishReason.ERROR, f"request_id {rid!r} is already in use")
                    continue
                if cid in clients.detaching:  # sent behind its STOP: ends as its other requests do
                    refuse(cid, rid, FinishReason.ABORT, None)
                    continue
                owner[rid] = cid  # before the engine can make an output for it
                if key:
                    clients.key_of[rid] = key[0]
                try:
                    eng.add_request(rid, prompt, params)
                except ValueError as e:
                    out.steps([final_row(rid, FinishReason.ERROR, str(e))])
            elif kind == wire.ABORT:
                if owner.get(cmd[1]) == cid:  # a client ends its own requests only (by id)
                    eng.abort(cmd[1])
            elif kind == wire.ABORT_KEY:  # by key: any client's (rare: a scan is fine)
                for rid, k in list(clients.key_of.items()):
                    if k == cmd[1]:
                        eng.abort(rid)
            elif kind == wire.STATS:
                out.control((wire.STATS, cmd[1], clients.share(cid, eng.stats())), cid)
            elif kind == wire.STOP:
                return detach(cid, gone=False)
        return None

    def drain(block: bool) -> Optional[str]:
        """Apply queued commands; "stop" / "exit" when one ends the loop."""
        try:
            item = cmds.get() if block else cmds.get_nowait()
        except queue.Empty:
            return None
        while True:
            ended = apply(*item)
            if ended:
                return ended
            try:
                item = cmds.get_nowait()
            except queue.Empty:
                return None

    try:
        with _loop_profiled():
            return _loop(eng, drain, out)
    except BaseException as e:  # noqa: BLE001 - engine death: the clients fail every request
        logger.exception("engine core loop died")
        clients.close_listener()
        try:
            for cid, share in clients.last_stats(eng.stats()):
                out.control((wire.STATS, wire.UNASKED_STATS, share), cid)
        except Exception:  # noqa: BLE001 - the counters are lost; the requests still fail below
            logger.exception("engine stats after the loop died")
        out.control((wire.DIED, repr(e)))
        out.close()
        return 1
    finally:
        try:
            eng.close()  # pipeline stages: stop (or kill) the worker processes
        except Exception:  # noqa: BLE001
            logger.exception("engine close failed")


def _loop(eng, drain, out) -> int:
    """Step while there is work, applying the clients' commands between steps; 0 at the end."""
    while True:
        ended = drain(block=not eng.has_unfinished())
        if ended == "exit":
            return 0
        if ended == "stop":
            for rid in list(eng.scheduler.requests):
                eng.abort(rid)
            while eng.has_unfinished() or eng.scheduler.has_pending_outputs:
                out.steps(eng.step_rows())
            out.control((wire.STOPPED,))  # to any client not released yet
            out.close()
            return 0
        out.steps(eng.step_rows())


def main(argv: list[str]) -> int:
    """argv: FD PARENT_PID [LISTEN_FD SERVER_PID] (the second pair: a shared core)."""
    fd, parent_pid = int(argv[0]), int(argv[1])
    listener = None
    if len(argv) >= 4:
        # Shared by several clients: it outlives the one that spawned it (each client's socket
        # closing detaches that client; the last one gone ends the core), not the server.
        listener = socket.socket(fileno=int(argv[2]))
        die_with_process(int(argv[3]), "core-watch")
    else:
        _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group, and a SIGTERM to the group or cgroup (systemd's
    # KillMode=control-group) too, while Triton's stubs ignore both and the server drains its
    # requests: the clients decide when the engine stops (they abort their requests so that each
    # gets its final response), not the signal. The core still ends with its parent (EOF, and
    # the parent-death SIGKILL) and on the parent's kill.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # `kill -USR1 <core pid>`: every thread's Python stack into the server log (a core that
    # does not exit, or does not answer, says where it waits)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    conn = Connection(fd)
    try:
        return serve(conn, listener)
    except (EOFError, OSError):  # the parent went away during start-up
        return 1


@contextlib.contextmanager
def _loop_profiled():
    """cProfile on this (the loop's) thread when BACKEND_LIB_CORE_PROFILE names a file."""
    path = core_profile_path()
    if not path:
        yield
        return
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        profile.dump_stats(path)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Daemon threads may sit in recv/queue waits: leave without interpreter teardown.
    os._exit(code)
