"""EngineProcessClient: AsyncEngine's interface over an engine core in its own OS process.

In the Triton model's process the response sender, cancellation polling and Triton's own
threads share one GIL; with the engine loop among them, a fast model's step (~1.3 ms) waits
for that GIL and the GPU idles. Here the loop runs in `python -m backend_lib.engine_core`
(vLLM's AsyncLLM / EngineCore split) and this process only validates, forwards and delivers.

Threads here: the callers' (add_request / abort / stats send one small message each) and ONE
reader thread that forks the core, then receives the core's messages (each holds every engine
step finished since the core's last write) and runs the callbacks, in order, as AsyncEngine's
dispatcher does.

Shared (share_key): several clients, e.g. the stubs of an llm model's instances, attach to one
core; each streams its own requests (backend_lib/core_clients.py routes them) and its shutdown
detaches it; the core ends with its last client or with the server that started the stubs.

Lifecycle: the child is started with this process's venv python (not sys.executable, which
inside Triton's stub is the stub binary), dies with this process (parent-death signal, and EOF
on its socket), re-raises its start-up error here with its message, and when it dies mid-run
every in-flight request ends with an error output and is_healthy() turns False. This process
never initializes CUDA.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional, Sequence

from . import engine_wire as wire
from . import envs, shared_core
from .config import EngineConfig
from .delivery import Delivery
from .engine_stats import EngineStats
from .interpreter import python_executable
from .os_threads import NamedThread
from .process_lifetime import signal_name
from .output_sinks import STALL_POLL_S, Callback, OutputSinks, RequestStream, checked_delivery_threads
from .request import FinishReason, RequestOutput, SamplingParams, validate_request
from .wire_reader import FrameReader

logger = logging.getLogger("backend_lib")

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)  # the folder holding backend_lib/
STATS_TIMEOUT_S = 2.0   # a stats() call waits this long for the core's reply, then gives the last one
# The core's reader thread does nothing but take commands off the socket: a send blocked this
# long on a full socket means the core is wedged (stopped, or stuck holding its GIL). It is
# then killed and every request fails, rather than Triton's execute thread blocking for ever.
SEND_TIMEOUT_S = 30.0
# Messages the reader takes off the socket at once before it delivers again.
MAX_MESSAGES_PER_PASS = 64


class EngineProcessClient(OutputSinks):
    def __init__(self, config: EngineConfig, startup_timeout: float = 600.0, merge_queued_outputs: bool = False,
                 fault_after_steps: int = 0, delivery_threads: int = 1, share_key: Optional[str] = None):
        """merge_queued_outputs, delivery_threads: as AsyncEngine's. fault_after_steps: test
        hook, the core's engine loop raises after that many steps. share_key: clients of the
        same key (in any process of this machine) share one core (`_join_shared_core`): the
        llm model's instances; their request ids must differ, and the core runs the config of
        the client that started it (the llm model's key names its whole configuration)."""
        self.config = config
        self._merge_queued = merge_queued_outputs
        self._delivery_threads = checked_delivery_threads(delivery_threads)
        self.error: Optional[BaseException] = None
        self._sinks: dict[str, tuple[RequestStream, Optional[Callback]]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._batch = threading.local()  # .cmds: the commands batched_adds() holds on this thread
        self._stopping = False
        self._stopped_cleanly = False
        self._ready = False  # the start-up handshake succeeded: the reader thread reads
        self._stats_seq = itertools.count()
        self._stats_waiting: dict[int, list] = {}   # seq -> [Event, EngineStats | None]
        self._last_stats = EngineStats()
        self._stall_s = envs.engine_stall_timeout_s()
        self._proc: Optional[subprocess.Popen] = None  # the core, when this client started it
        self._shared = share_key is not None
        self._spawned, self._handshake = threading.Event(), threading.Event()
        self._spawn_error: Optional[BaseException] = None
        if share_key is None:
            info = self._start_core(config, fault_after_steps, startup_timeout, listener=None)
        else:
            info = self._join_shared_core(share_key, config, fault_after_steps, startup_timeout)
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]
        self.eos_token_ids = info["eos_token_ids"]
        self.core_switch_interval_s = info["switch_interval_s"]  # the core's sys.getswitchinterval()
        self._ready = True
        self._handshake.set()

    def _start_core(self, config: EngineConfig, fault_after_steps: int, startup_timeout: float,
                    listener: Optional[socket.socket]) -> dict:
        """Spawn the core and wait for its READY. listener: a shared core's listening socket
        (the core takes it; the server it watches is this process's parent)."""
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S),
                                                                         int(SEND_TIMEOUT_S % 1 * 1e6)))
        env = dict(os.environ)
        # The core shares the machine's cores with this process's sender. Spinning OpenMP
        # workers (Intel OpenMP spins 200 ms after each parallel region) starve it: on 2 cores
        # a CPU engine streamed 50x slower through Triton than with passive workers (sleeping
        # at once). The user's own setting wins.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                                  if p and p != _PACKAGE_PARENT])
        argv = [python_executable(), "-m", "backend_lib.engine_core", str(theirs.fileno()), str(os.getpid())]
        fds = [theirs.fileno()]
        if listener is not None:
            argv += [str(listener.fileno()), str(os.getppid())]
            fds.append(listener.fileno())
        # The core's parent-death signal fires when the THREAD that forked it ends, not this
        # process: the reader thread, which lives as long as the core, forks it (a client built
        # on a short-lived thread would otherwise lose its core with that thread).
        self._reader = NamedThread(target=self._reader_thread, args=(argv, tuple(fds), env),
                                    name="engine-proc-reader", os_name="engine-reader", daemon=True)
        self._reader.start()
        self._spawned.wait()
        theirs.close()
        if listener is not None:
            listener.close()  # the core's now: the name goes with the core
        if self._spawn_error is not None:
            ours.close()
            raise self._spawn_error
        self.pid = self._proc.pid
        self._conn = Connection(ours.detach())
        # A client dropped without shutdown() (or an interpreter exit) must not leave the core
        # running; a shared core ends when its last client's socket closes.
        self._finalizer = weakref.finalize(self, _close, self._conn) if listener is not None else \
            weakref.finalize(self, _kill, self._proc)
        try:
            self._send([(wire.START, config, int(fault_after_steps))])
            return self._await_ready(startup_timeout)
        except BaseException:
            self._finalizer()
            if listener is not None:  # a shared core that did not start serves nobody
                _kill(self._proc)
            self._conn.close()
            self._handshake.set()  # the reader thread ends without reading
            raise

    def _join_shared_core(self, share_key: str, config: EngineConfig, fault_after_steps: int,
                          startup_timeout: float) -> dict:
        """Attach to the core of `share_key`, or spawn it when nobody holds its name
        (backend_lib/shared_core.py). A core that fails to start, or stops while a client
        connects, releases the name: the client tries again (and, binding it, raises the
        start-up error itself)."""
        name = shared_core.socket_name(share_key)
        deadline = time.monotonic() + startup_timeout
        while True:
            listener = shared_core.bind(name)
            if listener is not None:
                return self._start_core(config, fault_after_steps, deadline - time.monotonic(), listener)
            attached = shared_core.connect(name, deadline, SEND_TIMEOUT_S)
            if attached is not None:
                self._conn, info = attached
                self.pid = info["pid"]
                self._finalizer = weakref.finalize(self, _close, self._conn)
                self._reader = NamedThread(target=self._reader_thread, args=(None, (), None),
                                            name="engine-proc-reader", os_name="engine-reader", daemon=True)
                self._reader.start()
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine did not start within {startup_timeout} s")
            time.sleep(0.05)

    def _await_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self._proc.poll() is not None:
                raise RuntimeError(f"engine process (pid {self.pid}) exited during start-up "
                                   f"({_exit_text(self._proc.returncode)}); its log has the reason")
            if time.monotonic() > deadline and not self._conn.poll(0):
                raise TimeoutError(f"engine did not start within {timeout} s")
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait(10)
            raise RuntimeError(f"engine process (pid {self.pid}) exited during start-up "
                               f"({_exit_text(code)}); its log has the reason") from None
        if msg[0] == wire.STARTUP_ERROR:
            _, type_name, message, tb = msg
            logger.debug("engine process start-up failed:\n%s", tb)
            self._proc.wait(30)
            raise wire.rebuild_startup_error(type_name, message)
        assert msg[0] == wire.READY, msg[0]
        return msg[1]

    # ---- caller side ----------------------------------------------------------------------
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The engine's synchronous request checks, here (same function, same messages)."""
        return validate_request(prompt_token_ids, params, self.max_model_len, self.vocab_size,
                                self.config.max_stop_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    callback: Optional[Callback] = None, validated: bool = False, key: str = "") -> RequestStream:
        """validated: as AsyncEngine.add_request's; key: a name abort_key() ends the request by,
        from any client of the core."""
        if not self._usable():
            raise RuntimeError(f"engine is not healthy: {self.error!r}")
        # errors raise here, synchronously
        ids = prompt_token_ids if validated else self.validate(prompt_token_ids, params)
        stream = self._register(request_id, callback)
        cmd = (wire.ADD, request_id, ids, params, key) if key else (wire.ADD, request_id, ids, params)
        batch = getattr(self._batch, "cmds", None)
        if batch is not None:
            batch.append(cmd)
            return stream
        try:
            self._send([cmd])
            sent = True
        except OSError:
            sent = False
        if not sent or not self._usable():
            # Died meanwhile. Either the fail-all has already given this request its final
            # (error) output, or it never will: then raise, and the caller answers it.
            with self._lock:
                sink = self._sinks.pop(request_id, None)
            if sink is not None:
                raise RuntimeError("engine is shutting down" if self._stopped_by_us()
                                   else f"engine is not healthy: {self.error!r}")
        return stream

    @contextlib.contextmanager
    def batched_adds(self):
        """The add_request() and abort() calls this thread makes inside the block reach the core
        as ONE message when it ends, in order: one socket write for all the requests of a Triton
        execute(). Each write releases the stub's GIL, and taking it back waits behind the
        stub's busy threads (up to the switch interval, 5 ms): one per request made execute()
        hold a batch of requests for milliseconds each. Should that message not reach a healthy
        core, each of its requests gets an error final output through its callback (its caller
        has moved on)."""
        if getattr(self._batch, "cmds", None) is not None:  # nested: the outer block sends
            yield
            return
        cmds: list = []
        self._batch.cmds = cmds
        try:
            yield
        finally:
            self._batch.cmds = None
            if cmds:
                self._send_batch(cmds)

    def _send_batch(self, cmds: list) -> None:
        try:
            self._send(cmds)
            if self._usable():
                return
            why = f"engine is not healthy: {self.error!r}"
        except OSError:
            why = f"engine is not healthy: {self.error!r}"
        except Exception as e:  # noqa: BLE001 - not sent at all: its requests must still end
            logger.exception("sending %d commands to the engine process failed", len(cmds))
            why = f"engine process send failed: {e!r}"
        # Behind this client's own STOP (the core may have closed the socket already) the
        # requests end aborted, as the core ends an ADD behind the STOP and _core_gone the rest.
        reason, error = (FinishReason.ABORT, None) if self._stopped_by_us() else (FinishReason.ERROR, why)
        for cmd in cmds:  # the fail-all may have ended some already: _deliver ends each once
            if cmd[0] == wire.ADD:
                self._deliver(RequestOutput(cmd[1], [], True, reason, error=error))

    def _stopped_by_us(self) -> bool:
        with self._lock:
            return self._stopping and self.error is None

    def abort(self, request_id: str) -> None:
        self._abort_command((wire.ABORT, request_id))

    def abort_key(self, key: str) -> None:
        """Abort the requests added under `key` by any client of the core (another model
        instance's too)."""
        self._abort_command((wire.ABORT_KEY, key))

    def _abort_command(self, cmd: tuple) -> None:
        if not self._usable():
            return  # the core is gone: every request ends with the fail-all (a send could block)
        batch = getattr(self._batch, "cmds", None)
        if batch is not None:
            batch.append(cmd)
            return
        try:
            self._send([cmd])
        except OSError:
            pass  # the core is gone: every request ends with the fail-all

    def is_healthy(self) -> bool:
        return self.error is None and self._reader_alive() and (self._proc is None or self._proc.poll() is None)

    def _usable(self) -> bool:
        """is_healthy() without its waitpid, for the per-request paths: a system call releases
        the stub's GIL, and taking it back waits behind its busy threads. Enough where the
        request is registered before the check: a core that died unseen has not failed every
        request yet (the reader sets `error` before its fail-all, or the stop's `_stopping`
        refuses registrations), and its reader will fail this one too."""
        return self.error is None and self._reader_alive()

    def _reader_alive(self) -> bool:
        r = getattr(self, "_reader", None)
        return r is not None and r.is_alive()

    def stats(self) -> EngineStats:
        """The core's stats, fresh (a round trip, behind the outputs already sent); the last
        ones seen when the core is gone or does not answer within STATS_TIMEOUT_S."""
        if not self.is_healthy() or threading.current_thread() is self._reader:
            return self._take_last_stats()  # (a callback asking would wait for its own thread's reply)
        seq = next(self._stats_seq)
        slot = [threading.Event(), None]
        with self._lock:
            self._stats_waiting[seq] = slot
        try:
            self._send([(wire.STATS, seq)])
            slot[0].wait(STATS_TIMEOUT_S)
        except OSError:
            pass
        finally:
            with self._lock:
                self._stats_waiting.pop(seq, None)
        return slot[1] if slot[1] is not None else self._take_last_stats()

    def _take_last_stats(self) -> EngineStats:
        """The last stats seen, marked stale, with the idle gaps nobody was given yet (each is
        given once: the core takes them, and the caller observes them into a histogram)."""
        with self._lock:
            st = self._last_stats
            self._last_stats = dataclasses.replace(st, gpu_idle_gap_us=[])
        return dataclasses.replace(st, stale=True)

    def backlog(self) -> int:
        return 0  # the core's writer merges what the reader has not taken into its next message

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._sinks)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each request still gets its final output), stop the core;
        within `timeout` seconds in all. Callbacks only run on the reader thread: if it is stuck
        in one past the timeout, the requests it has not finished get their final output once
        it is free (from the messages already received), none from this thread."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._stopping = True
        try:  # within the timeout: another caller may be blocked sending to a wedged core
            self._send([(wire.STOP,)], timeout=max(0.0, deadline - time.monotonic()))
        except OSError:
            pass
        if not self._shared:
            try:
                self._proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("engine process (pid %d) did not stop within %.1f s; killing it", self.pid, timeout)
                _kill(self._proc)
        # (a shared core answers STOPPED once this client's requests have ended, closes this
        # client's socket, and goes on for the others: the reader ends at that EOF)
        self._reader.join(max(0.0, deadline - time.monotonic()))
        if self._reader.is_alive():
            logger.error("engine output reader still busy in a callback after %.1f s", timeout)
            if self._shared:  # a shared core must not count this client any more
                try:
                    with socket.socket(fileno=os.dup(self._conn.fileno())) as s:
                        s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        else:
            self._conn.close()
        self._finalizer.detach()

    # ---- reader thread ----------------------------------------------------------------------
    def _send(self, cmds: list, timeout: Optional[float] = None) -> None:
        """Raises OSError when the core is gone or wedged (SEND_TIMEOUT_S), or TimeoutError
        (an OSError) when `timeout` is given and the socket does not take the message in time."""
        if not self._send_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("engine process socket busy")
        try:
            if timeout is not None and not select.select([], [self._conn], [], timeout)[1]:
                raise TimeoutError("engine process socket full")
            self._conn.send(cmds)
        except BlockingIOError:  # SO_SNDTIMEO: the core took nothing for SEND_TIMEOUT_S
            self._core_wedged(f"it took no command for {SEND_TIMEOUT_S:g} s")
            raise
        finally:
            self._send_lock.release()

    def _core_wedged(self, why: str) -> None:
        if self.error is None:
            self.error = wire.EngineCoreError(f"EngineProcessWedged('engine process (pid {self.pid}) is wedged: "
                                              f"{why}')")
        logger.error("engine process (pid %d) is wedged (%s); killing it", self.pid, why)
        self._kill_core()  # the reader then sees EOF and fails every request with self.error

    def _kill_core(self) -> None:
        if self._proc is not None:
            _kill(self._proc)
            return
        try:  # a shared core another client started
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass

    def _reader_thread(self, argv: Optional[list], fds: tuple, env: Optional[dict]) -> None:
        """Fork the core (argv None: attached to a running one), wait for the constructor's
        start-up handshake, then read."""
        if argv is not None:
            try:
                self._proc = subprocess.Popen(argv, pass_fds=fds, env=env, stdin=subprocess.DEVNULL, close_fds=True)
            except BaseException as e:  # noqa: BLE001 - raised by the constructor
                self._spawn_error = e
                return
            finally:
                self._spawned.set()
        self._handshake.wait()
        if self._ready:
            self._reader_main()

    def _reader_main(self) -> None:
        # merge_queued_outputs: outputs wait merged, most urgent first (delivery.Delivery), and
        # go out one at a time, the socket read again between two callbacks (one delivery
        # thread: this one; more: helpers, and this thread only reads).
        waiting = self._delivery()
        frames = self._frame_reader()
        heard = time.monotonic()  # the core's last message, or the last moment with nothing in flight
        try:
            while True:
                ready = frames.ready(0 if waiting.reader_has_work() else STALL_POLL_S)
                if not ready:
                    if waiting.reader_has_work():
                        waiting.deliver_one()
                    else:
                        heard = self._check_wedged(heard)
                    continue
                heard = time.monotonic()
                self._take(frames.read(MAX_MESSAGES_PER_PASS), waiting)
                if frames.ended():
                    break
                if waiting.reader_has_work():  # one callback per read at least, however fast messages come
                    waiting.deliver_one()
        finally:
            waiting.close()  # what the core sent before it went away
        self._core_gone()

    def _frame_reader(self) -> FrameReader:
        return FrameReader(self._conn.fileno())

    def _take(self, msgs: list, waiting: Delivery) -> None:
        for msg in msgs:
            if msg[0] == wire.STATS:
                self._control(msg)  # counters only: the outputs before it need not go first
                continue
            if msg[0] != wire.STEPS:
                waiting.flush()  # the outputs before DIED / STOPPED go first
                self._control(msg)
                continue
            for step in msg[1]:
                self._accept(step, waiting)

    def _check_wedged(self, heard: float) -> float:
        """Nothing from the core: kill it once it has been silent for the stall timeout with
        requests in flight. Returns the new `heard`."""
        now = time.monotonic()
        if not self.num_inflight():
            return now
        if now - heard > self._stall_s:
            self._core_wedged(f"no output for {now - heard:.0f} s with requests in flight "
                              f"({envs.ENGINE_STALL_TIMEOUT_ENV}={self._stall_s:g})")
            return float("inf")  # once; its EOF follows
        return heard

    def _control(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == wire.STATS:
            _, seq, stats = msg
            with self._lock:
                # gaps of a reply nobody waited for (timed out) go with the next answer
                stats.gpu_idle_gap_us = self._last_stats.gpu_idle_gap_us + list(stats.gpu_idle_gap_us or ())
                slot = self._stats_waiting.get(seq)
                if slot is not None:
                    slot[1] = stats
                self._last_stats = dataclasses.replace(stats, gpu_idle_gap_us=[] if slot is not None else
                                                       stats.gpu_idle_gap_us)
            if slot is not None:
                slot[0].set()
        elif kind == wire.DIED:
            self.error = wire.EngineCoreError(msg[1])
            logger.error("engine process (pid %d) loop died: %s", self.pid, msg[1])
            # Nothing follows DIED but the core's clean-up (LLMEngine.close: pipeline stages,
            # process groups), which may be slow or hang: fail every request now, as in-process.
            self._fail_all(FinishReason.ERROR, f"engine failed: {self.error!r}")
        elif kind == wire.STOPPED:
            self._stopped_cleanly = True

    def _core_gone(self) -> None:
        """The core's socket closed: after a stop every request the core took has had its final
        output, and any left (sent behind the STOP, or the stop did not finish) ends as aborted,
        as the core ends one that reaches it behind the STOP and as AsyncEngine ends requests
        at shutdown; otherwise the core died and every request ends with an error."""
        if self.error is None and not (self._stopped_cleanly or self._stopping):
            try:
                code = self._proc.wait(5) if self._proc is not None else None
            except subprocess.TimeoutExpired:
                code = None
            self.error = wire.EngineCoreError(f"EngineProcessDied('engine process (pid {self.pid}) "
                                              f"{_exit_text(code)}')")
            logger.error("engine process (pid %d) died: %s", self.pid, _exit_text(code))
        for ev in list(self._stats_waiting.values()):
            ev[0].set()
        if self.error is not None:
            self._fail_all(FinishReason.ERROR, f"engine failed: {self.error!r}")
        else:
            self._fail_all(FinishReason.ABORT, None)
        if not self._shared:
            _kill(self._proc)  # a core that closed its socket but lingers
        elif self._proc is not None:  # it serves others on: reaped when it ends
            NamedThread(target=self._proc.wait, name="engine-proc-reaper", daemon=True).start()


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "is not answering"
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with code {code}"


def _close(conn: Connection) -> None:
    try:
        conn.close()
    except OSError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
