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
    subprocess.Popen([stub, model_py, region, "0", "0", str(os.getpid()), "lib", "0", "llm_0_0", "DEFAULT"])
    if mode == "exit-on-int":      # a server that exits on SIGINT, orphaning its stub
        signal.signal(signal.SIGINT, lambda *a: os._exit(0))
    elif mode == "hang":           # a server whose exit hangs
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    elif mode == "crash":          # a server that dies on its own
        time.sleep(1.0)
        os._exit(11)
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


def _run_supervised(tmp_path: Path, mode: str, exit_timeout_s: int = 1):
    stub, model_py, server = _setup(tmp_path)
    region = f"test_supervisor_{uuid.uuid4().hex}"
    code = ("import sys; from triton_glue.supervisor import Supervisor; "
            f"sys.exit(Supervisor({[sys.executable, str(server), str(stub), str(model_py), region, mode]!r}, "
            f"dict(__import__('os').environ), exit_timeout_s={exit_timeout_s}, grace_s=0.5, poll_s=0.1).run())")
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


def test_a_crashed_server_leaves_no_stub_and_no_shm_region(tmp_path):
    sup, shm, stub = _run_supervised(tmp_path, "crash")
    try:
        out, _ = sup.communicate(timeout=15)
        assert sup.returncode == 11, out
        assert not _stub_pids(stub) and not shm.exists(), out
    finally:
        for pid in _stub_pids(stub):
            os.kill(pid, signal.SIGKILL)
        shm.unlink(missing_ok=True)


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
    monkeypatch.setattr(sv, "stub_info", lambda pid: table.get(pid))

    class Child:
        pid = 1

        def poll(self):
            return None

        def send_signal(self, sig):
            pass

    deaths = []
    s = sv.Supervisor(argv=[], env={}, exit_timeout_s=1, on_stub_death=deaths.append,
                      server_state=lambda: "ready")
    s.child = Child()
    s._watch_stubs("loading")       # all three seen while the models load
    alive -= {11, 12}               # auto-complete stub exits; llm's instance stub is killed
    s._watch_stubs("ready")         # the first poll that sees the server ready
    assert s._stub_died is not None and s._stub_died.pid == 12 and s._stub_died.model == "llm"
    assert len(deaths) == 1 and "'llm' (pid 12) died" in deaths[0]
    # the stop waits stub_death_grace_s, so the BLS routes end their streams with the error first
    s._stop_if_due()
    assert s._stop_reason is None and s._stop_at is not None
    s._stop_at = time.monotonic() - 0.01
    s._stop_if_due()
    assert s._stop_reason == "stub of 'llm' died"
