"""Run tritonserver so that it always ends, and ends alone: `make serve` / `launch serve`.

tritonserver 2.51 facts this works around (measured):
  - its Python stubs ignore SIGINT and SIGTERM; a stub whose server is gone hangs in any
    stub-to-server call (metrics, is_cancelled, send) and keeps its memory and its /dev/shm
    region: after a crash, a failed start-up (port in use) or an exit timeout, stubs stay;
  - on SIGINT/SIGTERM it first waits, up to --exit-timeout-secs, for every HTTP connection to
    close, then for in-flight requests; an expired timeout exits mid-request (or crashes);
  - it neither restarts a stub that died nor answers the requests that were waiting on it, and
    keeps reporting the model ready.

So the supervisor
  - starts tritonserver in a session of its own (Ctrl-C at the terminal reaches only us) with
    PR_SET_PDEATHSIG (it dies with us) and a raised stack limit (see http_front.py);
  - is a child subreaper: stubs orphaned by a dying server are reparented to us, not to init;
  - forwards the first SIGINT/SIGTERM/SIGHUP to tritonserver, kills its whole process group
    if it has not exited `grace_s` after its exit timeout (a second signal kills at once);
  - watches the stubs: one that dies while the server runs makes the server unusable (see
    above), so it is logged and the server is stopped the same bounded way (exit status 1),
    once the BLS routes have ended the streams that waited on the dead stub with the error
    naming it (their `bls_inflight_requests` gauges read 0), at most `stub_death_grace_s`
    after the death: stopping sooner would break those gRPC streams with no reason given;
  - watches the llm engines' health (the `llm_engine_healthy` gauges): an engine that died
    (its process killed, its thread failed) fails every later request while tritonserver keeps
    reporting ready, so it stops the server the same way as a stub death;
  - logs a tritonserver exit it did not ask for (a crash: the Python backend of 2.51 can
    abort the whole server when a stub dies, see tests/server/test_faults.py);
  - stops a server that is not ready `startup_timeout_s` after it started (exit status 1):
    2.51's Python backend can hang a model load for good (its stub launcher, having judged a
    stub unhealthy while its model initialised on a loaded machine, waits for that stub to
    exit, and the stub, initialised, waits for work: seen once, in a test run beside others);
  - ends a shutdown once every model has unloaded: when the repository holds only Python
    models and ensembles (`only_stub_models`), every instance stub gone means nothing but the
    ensembles is left, and 2.51's gRPC frontend can keep an ensemble from ever unloading (a
    client that cancels its stream as the FINAL response is written, or after a request was
    refused, leaves a request state that is never freed and holds the ensemble's request);
    tritonserver would then wait out its exit timeout and exit with an error, so it is
    stopped `unloaded_grace_s` after the last stub left, and the shutdown counts as clean;
  - after tritonserver exits, kills what is left of its group, reaps the orphans and removes
    the /dev/shm regions of every stub it saw (the region name is the stub's 2nd argument).
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from backend_lib.process_lifetime import signal_name

STUB_NAME = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _prctl(option: int, arg: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def raise_stack_limit(stack_bytes: int) -> None:
    """Soft RLIMIT_STACK to at least stack_bytes (capped by the hard limit). Thread stacks
    default to it (glibc), and tritonserver's HTTP crash threshold is about half of it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    if soft == resource.RLIM_INFINITY or soft >= stack_bytes:
        return
    want = stack_bytes if hard == resource.RLIM_INFINITY else min(stack_bytes, hard)
    resource.setrlimit(resource.RLIMIT_STACK, (want, hard))


def child_preexec(stack_bytes: int) -> Callable[[], None]:
    """preexec_fn for tritonserver: bigger stacks; SIGKILL when the process that started it dies."""
    def pre() -> None:
        raise_stack_limit(stack_bytes)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return pre


@dataclass(frozen=True)
class StubInfo:
    pid: int
    model: str
    shm_region: str
    # serves a model instance (argv[8] is the instance name, e.g. llm_0_0); the other stubs
    # only auto-complete a config during loading (argv[8] is the model name) and then exit
    instance: bool = False


def _argv(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def _stat(pid: int) -> Optional[tuple[str, int, int]]:
    """(state, ppid, pgid) of a live process, None if gone."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = s[s.rindex(")") + 2:].split()
    return f[0], int(f[1]), int(f[2])


def processes_of(pgid: int, also_children_of: Optional[int] = None) -> list[int]:
    """Live members of a process group, plus (subreaper) live children of also_children_of."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = _stat(int(d))
        if st is None or st[0] == "Z":
            continue
        if st[2] == pgid or (also_children_of is not None and st[1] == also_children_of):
            out.append(int(d))
    return out


def stub_info(pid: int, server_pid: Optional[int] = None) -> Optional[StubInfo]:
    """The stub's model and region; None for another process. With server_pid: only a stub
    that server started (a process a stub forked carries the stub's argv until it execs, and
    on a loaded machine lives long enough to be seen: its exit is no stub death)."""
    argv = _argv(pid)
    if len(argv) < 9 or os.path.basename(argv[0]) != STUB_NAME:
        return None  # not a stub, or its argv not readable in full yet
    if server_pid is not None:
        st = _stat(pid)
        if st is None or st[1] != server_pid:
            return None
    parts = Path(argv[1]).parts  # <repository>/<model>/<version>/model.py
    model = parts[-3] if len(parts) >= 3 else "?"
    return StubInfo(pid, model, argv[2], instance=argv[8] != model)


def exit_words(rc: int) -> str:
    """A Popen return code in words: "died of SIGABRT" or "exited with status 3"."""
    if rc < 0:
        return f"died of {signal_name(-rc)}"
    return f"exited with status {rc}"


def log(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


@dataclass
class Supervisor:
    argv: list[str]
    env: dict
    exit_timeout_s: int
    grace_s: float = 2.0        # after the exit timeout, before the process group is killed
    stub_grace_s: float = 1.0   # after tritonserver exited, before its leftover stubs are killed
    # After a stub died, before the server is stopped: the BLS routes check their upstream's
    # stub about every half second and end their streams with an error naming it; a server
    # already stopping would break those gRPC streams first ("Socket closed", no reason
    # given). The stop waits until `bls_inflight()` reads 0 (then `stub_death_flush_s` more, for
    # the gRPC frontend to write the errors out), at least `stub_death_min_s`, at most
    # `stub_death_grace_s` (a 2-core machine under load took over 3 s).
    stub_death_grace_s: float = 10.0
    stub_death_min_s: float = 1.0
    stub_death_flush_s: float = 0.5
    # requests in flight in the BLS routes (the sum of their gauges), None when unknown
    bls_inflight: Callable[[], Optional[float]] = lambda: None
    # the llm engines' health gauges (1 alive, 0 dead), None when unknown
    engines_healthy: Callable[[], Optional[list]] = lambda: None
    poll_s: float = 0.5
    # until the server is first seen ready: "down" then means "not listening yet", so a SIGINT
    # sent to tritonserver right after it got ready is only recognised as a shutdown if one
    # poll saw it ready (a test did it 0.35 s after ready, between two 0.5 s polls)
    startup_poll_s: float = 0.05
    startup_timeout_s: Optional[float] = None  # not ready this long after the start: stop it
    # once tritonserver has exited, with words for the streams it left open ("tritonserver died
    # of SIGKILL before this stream's final response"): e.g. end them and close the HTTP front
    on_stop: Optional[Callable[[str], None]] = None
    on_stub_death: Optional[Callable[[str], None]] = None  # e.g. end the HTTP front's streams
    # tritonserver's HTTP health: "ready", "down" (the endpoint resets or refuses connections:
    # after it served, a shutdown, e.g. SIGINT sent to tritonserver itself) or "unknown"
    server_state: Callable[[], str] = lambda: "unknown"
    _was_ready: bool = False
    _serving: Optional[set] = None   # pids of the instance stubs, taken when the server got ready
    # every model is a Python one or an ensemble: no stub left means every model unloaded
    # but the ensembles (see the module docstring)
    only_stub_models: bool = False
    unloaded_grace_s: float = 1.0
    stack_bytes: int = 256 << 20
    stubs: dict[int, StubInfo] = field(default_factory=dict)
    child: Optional[subprocess.Popen] = None
    _kill_at: Optional[float] = None
    _stop_reason: Optional[str] = None
    _signalled: bool = False             # we sent tritonserver a signal (its exit status is ours)
    _stub_died: Optional[StubInfo] = None
    _died: Optional[str] = None          # what died (a stub, an engine): the server is stopped for it
    _next_stub_scan: float = 0.0
    _never_ready: bool = False
    _death_at: Optional[float] = None    # when a stub death was seen: a stop is due
    _drained_at: Optional[float] = None  # when the BLS routes were first seen with nothing in flight
    _unloaded_at: Optional[float] = None  # stopping, when the last instance stub was seen gone
    _ended_unloaded: bool = False        # stopped by us after every model had unloaded

    def run(self) -> int:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        for s in FORWARDED:
            signal.signal(s, self._on_signal)
        self.child = subprocess.Popen(self.argv, env=self.env, preexec_fn=child_preexec(self.stack_bytes),
                                      start_new_session=True)
        started = time.monotonic()
        rc = None
        try:
            while rc is None:
                try:
                    rc = self.child.wait(self.poll_s if self._was_ready else self.startup_poll_s)
                except subprocess.TimeoutExpired:
                    state = self.server_state() if self._stop_reason is None else "stopping"
                    self._watch_server(state)
                    if time.monotonic() >= self._next_stub_scan:  # a /proc scan: at poll_s
                        self._next_stub_scan = time.monotonic() + self.poll_s
                        self._watch_stubs(state)
                        self._watch_engines(state)
                    self._stop_if_due()
                    self._stop_if_never_ready(started)
                    self._end_if_unloaded()
                    if self._kill_at is not None and time.monotonic() >= self._kill_at:
                        log(f"tritonserver did not exit within {self.exit_timeout_s + self.grace_s:.0f} s "
                            f"of {self._stop_reason}: killing its process group")
                        self._killpg(signal.SIGKILL)
                        self._kill_at = None
        finally:
            self._watch_stubs("exited")
            # killed by a signal we did not send (also when a poll saw the crash as "down"),
            # or an error status while nothing asked it to stop (a failed start-up, too)
            crashed = rc is not None and (rc < 0 and not self._signalled or rc > 0 and self._stop_reason is None)
            if crashed:
                log(f"error: tritonserver {exit_words(rc)} without being asked to stop"
                    + ("; its clients' streams ended there" if self._was_ready else " (before it was ready)"))
            if self.on_stop is not None:
                self.on_stop(f"tritonserver {exit_words(rc) if rc is not None else 'was lost'} "
                             f"before this stream's final response")
            self._cleanup()
        if (self._died is not None or self._never_ready) and not crashed:
            return 1
        if self._ended_unloaded:
            return 0
        return rc if rc >= 0 else 128 - rc  # a crash is reported as such, even after a stub death

    # ---- stopping -----------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self._stop_reason is None:
            self.stop(name)
        else:
            log(f"{name} again: killing tritonserver's process group now")
            self._killpg(signal.SIGKILL)

    def stop(self, reason: str) -> None:
        """Ask tritonserver to exit (SIGINT); kill its group if it is still there after the
        exit timeout plus grace."""
        if self._stop_reason is not None or self.child is None:
            return
        self._stop_reason = reason
        log(f"{reason}: stopping tritonserver (exit timeout {self.exit_timeout_s} s)")
        self._kill_at = time.monotonic() + self.exit_timeout_s + self.grace_s
        self._signalled = True
        try:
            self.child.send_signal(signal.SIGINT)
        except ProcessLookupError:
            pass

    def _end_if_unloaded(self) -> None:
        if not self.only_stub_models or self._stop_reason is None or self._ended_unloaded:
            return
        instances = {pid for pid, info in self.stubs.items() if info.instance}
        if not instances or instances & set(processes_of(self.child.pid, also_children_of=os.getpid())):
            return
        now = time.monotonic()
        if self._unloaded_at is None:
            self._unloaded_at = now
        elif now - self._unloaded_at >= self.unloaded_grace_s:
            log(f"every Python model unloaded {now - self._unloaded_at:.1f} s ago and tritonserver still "
                "waits (for an ensemble request its gRPC frontend never released): ending it")
            self._ended_unloaded = True
            self._kill_at = None
            self._killpg(signal.SIGKILL)

    def _killpg(self, sig: int) -> None:
        self._signalled = True
        try:
            os.killpg(self.child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _watch_server(self, state: str) -> None:
        """A shutdown we were not told about still ends within the same bound."""
        if self._stop_reason is not None:
            return
        if state == "ready":
            self._was_ready = True
        elif state == "down" and self._was_ready:
            # its exit timeout started before we saw the endpoint close (a poll and up to a
            # 2 s health request ago): no grace on top of it
            self._stop_reason = "tritonserver shutting down"
            self._kill_at = time.monotonic() + self.exit_timeout_s
            log("tritonserver is shutting down (its HTTP endpoint closed)")

    # ---- stubs --------------------------------------------------------------------------
    def _watch_stubs(self, state: str) -> None:
        """Remember every stub (for its /dev/shm region). The stubs alive when the server first
        reports ready, and those seen earlier, serve its model instances (by their argv; the
        auto-complete stubs exit during loading): one of them gone while the server reports
        ready has died, and stops the server."""
        if self.child is None:
            return
        live = set()
        for pid in processes_of(self.child.pid, also_children_of=os.getpid()):
            live.add(pid)
            if pid not in self.stubs:
                info = stub_info(pid, server_pid=self.child.pid)
                if info is not None:
                    self.stubs[pid] = info
        live &= set(self.stubs)
        if state != "ready" or self._stop_reason is not None or self.child.poll() is not None:
            return
        if self._serving is None:
            # every instance stub seen so far, also one that died before this first "ready"
            self._serving = {pid for pid, info in self.stubs.items() if info.instance}
        gone = sorted(self._serving - live)
        if gone and self._died is None and self.server_state() == "ready":
            info = self.stubs[gone[0]]
            self._stub_died = info
            self._death(f"stub of '{info.model}'", f"the Python stub of model '{info.model}' (pid {info.pid}) died; "
                        "tritonserver 2.51 neither restarts it nor answers the requests waiting on it")

    def _watch_engines(self, state: str) -> None:
        # a gauge exists only from the engine's first export, when it was up: any 0 is a death
        # (waiting to see a 1 first would miss an engine killed before a poll read it)
        if state != "ready" or self._stop_reason is not None or self._died is not None:
            return
        values = self.engines_healthy()
        if values and min(values) <= 0:
            self._death("engine of 'llm'", "an engine of model 'llm' died (llm_engine_healthy 0; the log above "
                        "says why); every request to it fails while tritonserver keeps reporting ready")

    def _death(self, what: str, message: str) -> None:
        """Something the server cannot serve without died: stop it (see _stop_if_due)."""
        self._died = what
        log(f"error: {message}")
        if self.on_stub_death is not None:
            self.on_stub_death(f"{message}: the server is stopping")
        self._death_at = time.monotonic()

    def _stop_if_due(self) -> None:
        """After a death: stop once the BLS routes have drained (and the flush time has
        passed), or when the grace is over."""
        if self._death_at is None:
            return
        now = time.monotonic()
        waited = now - self._death_at
        if waited >= self.stub_death_min_s and self._drained_at is None and self.bls_inflight() == 0:
            self._drained_at = now
        drained = self._drained_at is not None and now - self._drained_at >= self.stub_death_flush_s
        if drained or waited >= self.stub_death_grace_s:
            self._death_at = None
            if not drained:
                log(f"the BLS routes still had requests in flight {waited:.1f} s after the {self._died} died")
            self.stop(f"{self._died} died")

    def _stop_if_never_ready(self, started: float) -> None:
        if (self.startup_timeout_s is None or self._was_ready or self._stop_reason is not None
                or time.monotonic() - started < self.startup_timeout_s):
            return
        self._never_ready = True
        log(f"error: tritonserver is not ready {self.startup_timeout_s:.0f} s after it started "
            "(TRITON_STARTUP_TIMEOUT_SECS); a model load may hang: see the log above")
        self.stop("start-up timeout")

    def _cleanup(self) -> None:
        """After tritonserver exited: its stubs get a moment to exit on their own (they notice
        their parent is gone within ~0.3 s unless stuck in a call to it), then SIGKILL; reap;
        remove the /dev/shm regions left behind."""
        deadline = time.monotonic() + self.stub_grace_s
        left = processes_of(self.child.pid, also_children_of=os.getpid())
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            self._reap()
            left = processes_of(self.child.pid, also_children_of=os.getpid())
        for pid in left:
            info = self.stubs.get(pid) or stub_info(pid)
            what = f"stub of '{info.model}'" if info else " ".join(_argv(pid)[:2])
            log(f"killing leftover process {pid} ({what})")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 5
        while processes_of(self.child.pid, also_children_of=os.getpid()) and time.monotonic() < end:
            self._reap()
            time.sleep(0.05)
        self._reap()
        for info in self.stubs.values():
            region = SHM_DIR / info.shm_region
            if region.exists():
                try:
                    region.unlink()
                    log(f"removed {region} (stub of '{info.model}')")
                except OSError as e:
                    log(f"could not remove {region}: {e}")

    @staticmethod
    def _reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
