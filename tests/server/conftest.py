"""Fixtures that start a REAL tritonserver (the one bundled in the nvidia-pytriton wheel, see
triton_glue/launch.py) on free loopback ports, on this repository's model_repository/.

Every test here is marked `server`; they skip, with the reason, when tritonserver or the
tiny model cannot be found. One server is shared by the whole session (start-up loads six
models: ~40 s on 2 cores); tests that need another configuration start their own.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backend_lib.free_port import free_ports  # noqa: E402,F401 - the server tests import it from here
from triton_glue import launch  # noqa: E402
from . import procs  # noqa: E402
from triton_glue.supervisor import child_preexec  # noqa: E402

MODEL_DIR = ROOT / "models" / "tiny-llama"
ACCESS_KEY = "test-access-key"
START_TIMEOUT_S = float(os.environ.get("TRITON_TEST_START_TIMEOUT", "240"))


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.server)


def pytest_configure(config):
    config.addinivalue_line("markers", "server: talks to a real tritonserver started by a fixture")


@dataclass
class Server:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path
    access_key: str
    # /dev/shm regions of its stubs (seen when it got ready and when it is stopped): a stub
    # that died or was killed keeps its region; stop() removes them
    regions: set = field(default_factory=set)

    def note_regions(self) -> None:
        self.regions |= {p.shm_region for p in procs.stubs(self.proc.pid) if p.shm_region}

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total, found = 0.0, False
        for line in self.metrics_text().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            lab = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(lab.get(k) == str(v) for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found:
            raise KeyError(f"metric {name}{labels} not exported")
        return total

    def idle(self) -> bool:
        """The llm engine holds no request (running or waiting) and no KV block."""
        return all(self.metric(n) == 0 for n in ("llm_num_requests_running", "llm_num_requests_waiting",
                                                 "llm_kv_blocks_used"))

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 60) -> None:
        self.note_regions()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # The server leads its own process group: reap Python stubs (and pipeline workers) a
        # killed server left behind, so they do not spin on after the test.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + 10
        while procs.group(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        for region in self.regions:
            (procs.SHM_DIR / region).unlink(missing_ok=True)


def _ready(http_port: int, model: Optional[str] = None) -> bool:
    path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001
        return False


def start_server(tmp_dir: Path, *, model_control: str = "none", load_models: tuple = (),
                 model_repository: Path = ROOT / "model_repository", extra_env: Optional[dict] = None,
                 wait_model: Optional[str] = None) -> Server:
    try:
        inst = launch.find_triton()
        backend_dir = launch.prepare_backend_dir(inst)
    except launch.TritonNotFound as e:
        pytest.skip(f"tritonserver not available: {e}")
    if not (MODEL_DIR / "config.json").exists() and "MODEL_PATH" not in (extra_env or {}):
        pytest.skip(f"no model at {MODEL_DIR}: run `make model`")
    http, grpc, metrics = free_ports(3)
    opts = launch.ServerOptions(model_repository=model_repository, http_port=http, grpc_port=grpc,
                                metrics_port=metrics, address="127.0.0.1", model_control=model_control,
                                load_models=tuple(load_models), access_key=ACCESS_KEY, exit_timeout_s=20)
    env = launch.server_env(inst)
    env["TRITON_HTTP_PORT"] = str(http)
    env.update(extra_env or {})
    env.pop("MODEL_PATH", None) if "MODEL_PATH" not in (extra_env or {}) else None
    log_path = tmp_dir / f"tritonserver-{http}.log"
    log = open(log_path, "wb")
    # the launcher's stack limit (2.51's HTTP frontend crashes on bodies of ~half the stack)
    # and parent-death signal (no server outlives the test session)
    proc = subprocess.Popen(launch.server_argv(inst, backend_dir, opts), env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=child_preexec(256 << 20))
    srv = Server(proc, http, grpc, metrics, log_path, ACCESS_KEY)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {proc.returncode}:\n{srv.log_tail()}")
        if _ready(http, wait_model):
            srv.note_regions()
            return srv
        time.sleep(0.5)
    srv.stop()
    raise RuntimeError(f"tritonserver not ready after {START_TIMEOUT_S} s:\n{srv.log_tail()}")


class SharedServer:
    """The session's server, checked around every test that uses it: a dead tritonserver or
    Python stub fails the test it died in (at teardown) and the next test gets a fresh server,
    so one crash costs one failure instead of hanging every later test on a dead model."""

    def __init__(self, tmp_dir: Path, **start_kw):
        self.tmp_dir = tmp_dir
        self.start_kw = start_kw
        self.srv = self._start()
        self.crashes: list[str] = []

    def _start(self) -> Server:
        srv = start_server(self.tmp_dir, **self.start_kw)
        self.stub_pids = {p.pid: p.stub_model for p in procs.stubs(srv.proc.pid)}
        return srv

    def problem(self) -> Optional[str]:
        if self.srv.proc.poll() is not None:
            return f"tritonserver exited with {self.srv.proc.returncode}"
        alive = {p.pid for p in procs.stubs(self.srv.proc.pid)}
        dead = sorted(f"{model} (pid {pid})" for pid, model in self.stub_pids.items() if pid not in alive)
        return f"Python stub(s) died: {', '.join(dead)}" if dead else None

    def restart(self, why: str) -> None:
        self.crashes.append(f"{why}\n{self.srv.log_tail(40)}")
        self.srv.stop()
        self.srv = self._start()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    shared = SharedServer(tmp_path_factory.mktemp("triton"))
    yield shared
    shared.srv.stop()
    # the log must not hide Python errors from the models
    bad = [l for l in shared.srv.log_path.read_text(errors="replace").splitlines() if "Traceback" in l]
    assert not bad, shared.srv.log_tail(120)


def _checked(shared: SharedServer):
    why = shared.problem()
    if why:  # broke between tests (e.g. in a module fixture): start over
        shared.restart(why)
    yield shared.srv
    why = shared.problem()
    if why:
        log_path = shared.srv.log_path
        shared.restart(why)
        pytest.fail(f"the shared server broke during this test: {why} (log: {log_path})")


@pytest.fixture
def server(request):
    """The session's server. A test of the llm model alone runs on both engine modes with
    `@pytest.mark.parametrize("server", ENGINE_MODES, indirect=True)`: "engine-process" is the
    shared server (engine_process=on, the default), "in-process" a server of llm alone with
    engine_process=off."""
    mode = getattr(request, "param", None)
    yield from _checked(request.getfixturevalue("inproc_shared_server" if mode == "in-process"
                                                else "shared_server"))


# The llm model's two engine modes (engine_process on, the shipped default: the engine loop in
# a process of its own; off: a thread of the stub's process), as the environment override that
# selects each whatever the default.
ENGINE_MODES = ("in-process", "engine-process")


def engine_env(mode: str) -> dict:
    return {"LLM_PARAM_ENGINE_PROCESS": "on" if mode == "engine-process" else "off"}


# a test of llm alone, on both: @BOTH_ENGINES
BOTH_ENGINES = pytest.mark.parametrize("server", ENGINE_MODES, indirect=True)


@pytest.fixture(scope="session")
def inproc_shared_server(tmp_path_factory):
    """llm alone (a cheap start) with its engine in the stub's process, for the tests of llm's
    own behaviour on the other engine mode."""
    shared = SharedServer(tmp_path_factory.mktemp("triton-inproc"), model_control="explicit", load_models=("llm",),
                          wait_model="llm", extra_env=engine_env("in-process"))
    yield shared
    shared.srv.stop()
    bad = [l for l in shared.srv.log_path.read_text(errors="replace").splitlines() if "Traceback" in l]
    assert not bad, shared.srv.log_tail(120)


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="session")
def reference_engine():
    """The in-process engine with the llm model's configuration: greedy outputs to compare."""
    from backend_lib import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(model_path=str(MODEL_DIR)))
