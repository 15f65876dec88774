"""triton_glue.supervisor without tritonserver: a stand-in server that leaves behind a
stand-in Python stub (named triton_python_backend_stub, ignoring SIGINT/SIGTERM like 2.51's,
holding a /dev/shm region named by its 2nd argument). The supervisor forwards the signal,
kills what outlives the server, reaps it and removes the region."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STUB = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open("/dev/shm/" + sys.argv[1], "wb").write(b"x" * 4096)
    time.sleep(600)
""")

SERVER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    stub, model_py, region, mode = sys.argv[1:5]
    stub_proc = subprocess.Popen([stub, model_py, region, "0", "0", str(os.getpid()), "lib", "0", "llm_0_0", "DEFAULT"])
    if mode == "exit-on-int":      # a server that exits on SIGINT, orphaning its stub
        signal.signal(signal.SIGINT, lambda *a: os._exit(0))
    elif mode == "hang":           # a server whose exit hangs
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    elif mode == "unload-then-hang":   # its models unload (the stub exits), an ensemble never does
        signal.signal(signal.SIGINT, lambda *a: stub_proc.kill())
    elif mode == "crash":          # a server that dies on its own
        time.sleep(1.0)
        os._exit(11)
    elif mode == "killed":         # a server killed by a signal (a crash, an OOM kill)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
""")


def _setup(tmp_path: Path):
    stub = tmp_path / "triton_python_backend_stub"
    stub.symlink_to(os.path.realpath(sys.executable))
    model_py = tmp_path / "repo" / "llm" / "1" / "model.py"
    model_py.parent.mkdir(parents=True)
    model_py.write_text(STUB)
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    return stub, model_py, server


def _run_supervised(tmp_path: Path, mode: str, exit_timeout_s: int = 1, extra: str = ""):
    stub, model_py, server = _setup(tmp_path)
    region = f"test_supervisor_{uuid.uuid4().hex}"
    code = ("import sys; from triton_glue.supervisor import Supervisor; "
            f"sys.exit(Supervisor({[sys.executable, str(server), str(stub), str(model_py), region, mode]!r}, "
            f"dict(__import__('os').environ), exit_timeout_s={exit_timeout_s}, grace_s=0.5, poll_s=0.1{extra}).run())")
    sup = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shm = Path("/dev/shm") / region
    deadline = time.monotonic() + 30
    while not shm.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shm.exists(), "the stand-in stub did not start"
    time.sleep(0.3)  # the supervisor has seen the stub
    return sup, shm, stub


def _stub_pids(stub: Path) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            argv0 = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, IndexError):
            continue
        if argv0 == str(stub):
            out.append(int(d))
    return out


@pytest.mark.parametrize("mode", ["exit-on-int", "hang"])
def test_sigint_leaves_no_stub_and_no_shm_region(tmp_path, mode):
    sup, shm, stub = _run_supervised(tmp_path, mode)
    try:
        t0 = time.monotonic()
        sup.send_signal(signal.SIGINT)
        out, _ = sup.communicate(timeout=15)
        # a hanging server is killed exit_timeout (1 s) + grace (0.5 s) after the signal
        assert time.monotonic() - t0 < 6, out
        assert not _stub_pids(stub), out
        assert not shm.exists(), out
        assert f"removed {shm}" in out, out
        if mode == "exit-on-int":   # the orphaned stub, reparented to the supervisor, killed
            assert "killing leftover process" in out and "(stub of 'llm')" in out, out
        else:                       # the server's whole process group, stub included
            assert "killing its process group" in out, out
    finally:
        for pid in _stub_pids(stub):
            os.kill(pid, signal.SIGKILL)
        shm.unlink(missing_ok=True)


@pytest.mark.parametrize("only_stub_models", [True, False])
def test_a_shutdown_ends_once_every_stub_model_unloaded(tmp_path, only_stub_models):
    """tritonserver 2.51 can keep an ensemble from unloading after a client cancelled its
    stream at the wrong moment, and waits out its exit timeout: with a repository of Python
    models and ensembles only, the supervisor ends it once every stub has exited, as a clean
    shutdown; with other models it cannot know they unloaded, and waits."""
    sup, shm, stub = _run_supervised(tmp_path, "unload-then-hang", exit_timeout_s=8,
                                     extra=f", only_stub_models={only_stub_models}, unloaded_grace_s=0.5")
    try:
        t0 = time.monotonic()
        sup.send_signal(signal.SIGINT)
        out, _ = sup.communicate(timeout=30)
        took = time.monotonic() - t0
        if only_stub_models:
            assert sup.returncode == 0 and took < 5, (took, out)
            assert "every Python model unloaded" in out, out
        else:
            assert sup.returncode == 128 + 9 and took >= 8, (took, out)
            assert "killing its process group" in out, out
        assert not shm.exists() and not _stub_pids(stub), out
    finally:
        for pid in _stub_pids(stub):
            os.kill(pid, signal.SIGKILL)
        shm.unlink(missing_ok=True)


@pytest.mark.parametrize("mode,rc,words", [("crash", 11, "exited with status 11"),
                                           ("killed", 128 + 9, "died of SIGKILL")])
def test_a_crashed_server_leaves_no_stub_and_no_shm_region(tmp_path, mode, rc, words):
    sup, shm, stub = _run_supervised(tmp_path, mode)
    try:
        out, _ = sup.communicate(timeout=15)
        assert sup.returncode == rc, out
        assert f"[serve] error: tritonserver {words} without being asked to stop" in out, out
        assert not _stub_pids(stub) and not shm.exists(), out
    finally:
        for pid in _stub_pids(stub):
            os.kill(pid, signal.SIGKILL)
        shm.unlink(missing_ok=True)


class _RunningServer:
    """Supervisor.child: a tritonserver that runs and takes signals."""
    pid = 1

    def poll(self):
        return None

    def send_signal(self, sig):
        pass


def test_an_instance_stub_dead_before_the_first_ready_poll_is_a_death(monkeypatch):
    """The llm stub killed between the server's start and the supervisor's first "ready" poll
    (a client can be that fast) still counts as a stub death; auto-complete stubs, which exit
    during loading, do not."""
    from triton_glue import supervisor as sv

    table = {11: sv.StubInfo(11, "llm", "r11", instance=False),      # auto-complete, exited
             12: sv.StubInfo(12, "llm", "r12", instance=True),       # instance, killed
             13: sv.StubInfo(13, "vllm_model", "r13", instance=True)}
    alive = {11, 12, 13}
    monkeypatch.setattr(sv, "processes_of", lambda pgid, also_children_of=None: sorted(alive))
    monkeypatch.setattr(sv, "stub_info", lambda pid, server_pid=None: table.get(pid))

    deaths = []
    s = sv.Supervisor(argv=[], env={}, exit_timeout_s=1, on_stub_death=deaths.append,
                      server_state=lambda: "ready")
    s.child = _RunningServer()
    s._watch_stubs("loading")       # all three seen while the models load
    alive -= {11, 12}               # auto-complete stub exits; llm's instance stub is killed
    s._watch_stubs("ready")         # the first poll that sees the server ready
    assert s._stub_died is not None and s._stub_died.pid == 12 and s._stub_died.model == "llm"
    assert len(deaths) == 1 and "'llm' (pid 12) died" in deaths[0]
    s._stop_if_due()
    assert s._stop_reason is None   # the BLS routes first end their streams with the error


def _dead_stub_supervisor(inflight: list):
    """A supervisor that has just seen llm's stub die; the BLS routes' in-flight gauge reads
    inflight[0]."""
    from triton_glue import supervisor as sv

    s = sv.Supervisor(argv=[], env={}, exit_timeout_s=1, server_state=lambda: "ready",
                      bls_inflight=lambda: inflight[0])
    s.child = _RunningServer()
    s._stub_died = sv.StubInfo(12, "llm", "r12", instance=True)
    s._died = "stub of 'llm'"
    s._death_at = time.monotonic()
    return s


def test_a_dead_engine_stops_the_server_as_a_dead_stub_does():
    """llm_engine_healthy 0 (the engine process killed, the engine thread failed) while the
    server reports ready: every later request would fail, so the server is stopped the same
    bounded way, also when no poll saw it healthy before (the gauge only exists once the
    engine was up: killed right after the start, it reads 0 at the first poll); the gauges
    read while the server is not ready are not looked at."""
    from triton_glue import supervisor as sv

    health = [[]]
    deaths = []
    s = sv.Supervisor(argv=[], env={}, exit_timeout_s=1, on_stub_death=deaths.append,
                      server_state=lambda: "ready", engines_healthy=lambda: health[0], bls_inflight=lambda: 0.0)
    s.child = _RunningServer()
    s._watch_engines("ready")
    assert s._died is None                       # no engine exported yet
    health[0] = [1.0, 1.0]
    s._watch_engines("ready")
    health[0] = None
    s._watch_engines("ready")                    # metrics endpoint busy: unknown
    health[0] = [1.0, 0.0]
    s._watch_engines("loading")
    assert s._died is None
    s._watch_engines("ready")
    assert s._died == "engine of 'llm'" and len(deaths) == 1 and "engine of model 'llm' died" in deaths[0]
    s._death_at -= s.stub_death_min_s
    s._stop_if_due()
    s._drained_at -= s.stub_death_flush_s
    s._stop_if_due()
    assert s._stop_reason == "engine of 'llm' died"
    # an engine killed before any poll read its 1
    s = sv.Supervisor(argv=[], env={}, exit_timeout_s=1, server_state=lambda: "ready",
                      engines_healthy=lambda: [0.0], bls_inflight=lambda: 0.0)
    s.child = _RunningServer()
    s._watch_engines("ready")
    assert s._died == "engine of 'llm'"


def test_stub_death_stops_the_server_once_the_bls_routes_drained():
    """The stop waits for the BLS routes' streams to end with the error (gauge 0), plus the
    flush time; it never comes before stub_death_min_s."""
    inflight = [0.0]
    s = _dead_stub_supervisor(inflight)
    s._stop_if_due()
    assert s._stop_reason is None  # drained at once, but the minimum wait is not over
    inflight[0] = 3.0
    s._death_at -= s.stub_death_min_s
    s._stop_if_due()
    assert s._stop_reason is None and s._drained_at is None  # 3 requests still wait on llm
    s._death_at -= 2.0  # still inside the grace
    s._stop_if_due()
    assert s._stop_reason is None
    inflight[0] = 0.0
    s._stop_if_due()
    assert s._stop_reason is None and s._drained_at is not None  # drained: the flush time first
    s._drained_at -= s.stub_death_flush_s
    s._stop_if_due()
    assert s._stop_reason == "stub of 'llm' died"


@pytest.mark.parametrize("gauge", [None, 2.0])
def test_stub_death_stops_the_server_after_the_grace(gauge, capsys):
    """A gauge that cannot be read (None) or never drains: the stop comes stub_death_grace_s
    after the death, and the log says what was still in flight."""
    s = _dead_stub_supervisor([gauge])
    s._death_at -= s.stub_death_grace_s - 0.5
    s._stop_if_due()
    assert s._stop_reason is None
    s._death_at -= 0.5
    s._stop_if_due()
    assert s._stop_reason == "stub of 'llm' died"
    assert "still had requests in flight" in capsys.readouterr().err


def test_gauge_sum_reads_every_series_of_a_gauge():
    """launch._gauge_sum: the BLS routes' in-flight gauges summed from the metrics text; 0 with
    none; None when the endpoint does not answer."""
    import http.server
    import threading

    from triton_glue.launch import _gauge_sum

    body = {"text": ""}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = body["text"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        body["text"] = ('# HELP bls_inflight_requests x\n# TYPE bls_inflight_requests gauge\n'
                        'bls_inflight_requests{model="llm_bls",route="llm_bls",version="1"} 3\n'
                        'bls_inflight_requests{model="vllm_model",route="vllm_model",version="1"} 2\n'
                        'bls_inflight_requests_other{route="x"} 7\n'
                        'nv_inference_count{model="llm"} 9\n')
        assert _gauge_sum("127.0.0.1", port, "bls_inflight_requests") == 5.0
        body["text"] = 'nv_inference_count{model="llm"} 9\n'
        assert _gauge_sum("127.0.0.1", port, "bls_inflight_requests") == 0.0
    finally:
        srv.shutdown()
        srv.server_close()
    assert _gauge_sum("127.0.0.1", port, "bls_inflight_requests") is None


def test_a_process_forked_by_a_stub_is_no_stub(tmp_path):
    """A child forked by a stub carries the stub's argv until it execs (or exits): with the
    server's pid, stub_info counts only the stubs that server started, so that child's exit
    (seen on a loaded 2-core machine right after the server got ready) is no stub death."""
    from triton_glue import supervisor as sv

    stub = tmp_path / "triton_python_backend_stub"
    stub.symlink_to(os.path.realpath(sys.executable))
    code = ("import os, time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    time.sleep(30); os._exit(0)\n"
            "print(pid, flush=True); time.sleep(30)\n")
    model_py = tmp_path / "repo" / "llm" / "1" / "model.py"
    model_py.parent.mkdir(parents=True)
    model_py.write_text(code)
    argv = [str(stub), str(model_py), "region_x", "0", "0", "1", "lib", "0", "llm_0_0"]
    parent = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        me = os.getpid()
        assert sv.stub_info(parent.pid) is not None and sv.stub_info(child) is not None  # same argv
        info = sv.stub_info(parent.pid, server_pid=me)
        assert info is not None and info.instance and info.model == "llm" and info.shm_region == "region_x"
        assert sv.stub_info(child, server_pid=me) is None
    finally:
        parent.kill()
        parent.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def _run_script(code: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """Run a supervisor script in a session of its own; killed (with what it started) at the timeout."""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


SHUTDOWN_SOON_AFTER_READY = textwrap.dedent("""
    import signal, subprocess, sys, time
    from triton_glue.supervisor import Supervisor
    # the server: ignores SIGINT (its exit hangs, as 2.51's can after its exit timeout)
    server = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "print('up', flush=True); time.sleep(60)"]
    t0 = time.monotonic()
    def state():
        # not listening for 0.55 s, ready for 0.4 s, then down: a SIGINT sent to it right after
        # "ready" (polls every 0.5 s from the start would only ever see it down)
        return "ready" if 0.55 <= time.monotonic() - t0 < 0.95 else "down"
    sys.exit(Supervisor(server, {}, exit_timeout_s=1, server_state=state).run())
""")


def test_a_shutdown_right_after_ready_is_still_bounded():
    """tritonserver told to stop (by someone else) 0.4 s after it got ready, then hanging on
    exit: the supervisor saw it ready (it polls fast until then), so it recognises the
    shutdown and kills the server after the exit timeout."""
    t0 = time.monotonic()
    r = _run_script(SHUTDOWN_SOON_AFTER_READY)
    assert "tritonserver is shutting down (its HTTP endpoint closed)" in r.stderr, r.stderr
    assert "killing its process group" in r.stderr, r.stderr
    assert r.returncode == 128 + 9 and time.monotonic() - t0 < 10, (r.returncode, r.stderr)


NEVER_READY = textwrap.dedent("""
    import sys
    from triton_glue.supervisor import Supervisor
    # the server: a model load that hangs (SIGINT is only acted on after the load)
    server = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "time.sleep(60)"]
    sys.exit(Supervisor(server, {}, exit_timeout_s=1, grace_s=0.5, startup_timeout_s=1.0,
                        server_state=lambda: "down").run())
""")


def test_a_server_never_ready_is_stopped_after_the_startup_timeout():
    t0 = time.monotonic()
    r = _run_script(NEVER_READY)
    err = r.stderr
    assert "[serve] error: tritonserver is not ready 1 s after it started (TRITON_STARTUP_TIMEOUT_SECS)" in err, err
    assert "start-up timeout: stopping tritonserver" in err and "killing its process group" in err, err
    assert r.returncode == 1 and time.monotonic() - t0 < 10, (r.returncode, err)


@pytest.mark.parametrize("bind,host", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"),
                                       ("10.1.2.3", "10.1.2.3"), ("::1", "[::1]")])
def test_the_server_is_probed_where_it_listens(monkeypatch, bind, host):
    """The supervisor's and the llm model's readiness probes go to the address tritonserver
    binds (a server bound to one address does not answer on 127.0.0.1: the llm model took
    the refused probes for a shutdown and aborted every request)."""
    from triton_glue import config

    assert config.reachable_host(bind) == host
    monkeypatch.setenv("TRITON_HTTP_PORT", "8123")
    monkeypatch.setenv("TRITON_HTTP_HOST", host)
    assert config.server_http_url() == f"http://{host}:8123"
    monkeypatch.delenv("TRITON_HTTP_HOST")
    assert config.server_http_url() == "http://127.0.0.1:8123"


@pytest.mark.parametrize("raw", ["-5", "ten"])
def test_a_bad_startup_timeout_is_refused_naming_the_variable(monkeypatch, raw):
    import argparse

    from triton_glue import launch

    monkeypatch.setenv("TRITON_STARTUP_TIMEOUT_SECS", raw)
    args = argparse.Namespace(model_repository=".", http_port=None, grpc_port=None, metrics_port=None, extra=[])
    with pytest.raises(SystemExit, match=r"TRITON_STARTUP_TIMEOUT_SECS must be a whole number of seconds >= 0"):
        launch.options_from_env(args)
