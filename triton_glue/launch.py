"""Locate the tritonserver bundled in the nvidia-pytriton wheel and build the argv/env that
starts it on a model repository, so that the Python-backend stub imports this project
(`backend_lib`, `triton_glue`) and the venv's packages.

One module for both launches: `scripts/serve.sh` (foreground, `make serve`) and the test
fixture in tests/server/ call the same functions.

    python -m triton_glue.launch serve  [--model-repository DIR] [--http-port N] ...
    python -m triton_glue.launch env    # print the environment as shell exports
    python -m triton_glue.launch check  # exit 0 if tritonserver can be found and run

Environment variables read here (all of them, in one place):
    TRITONSERVER            path of a tritonserver binary to use instead of the bundled one
    TRITON_BACKEND_DIR      a backends directory to use instead of build/triton_backends
    HTTP_PORT, GRPC_PORT, METRICS_PORT   (serve only; defaults 8000, 8001, 8002)
    TRITON_BIND_ADDRESS     address the HTTP, gRPC and metrics ports listen on (serve only;
                            default 127.0.0.1: loopback; 0.0.0.0 exposes them, e.g. in a container)
    HTTP_MAX_BODY_BYTES     largest HTTP request body accepted (serve only; default 16 MiB);
                            larger ones get 413 from the HTTP front (triton_glue/http_front.py)
                            before they reach tritonserver; 0: no front, tritonserver's own HTTP
                            endpoint on HTTP_PORT (2.51 crashes on bodies of ~half its stack size)
    TRITON_EXIT_TIMEOUT_SECS  --exit-timeout-secs (serve only; default 10); the supervisor kills
                            the server's process group 3 s after it (triton_glue/supervisor.py)
    TRITON_STARTUP_TIMEOUT_SECS  the supervisor stops a tritonserver not ready this long after
                            it started (serve only; default 900; 0: no bound): 2.51's Python
                            backend can hang a model load for good (triton_glue/supervisor.py)
    TRITON_ACCESS_KEY       value of the `triton-access-key` header that unlocks the restricted
                            APIs (model-repository, shared-memory, logging); unset: a random key
                            is generated, i.e. the APIs stay closed
    TRITON_OPEN_RESTRICTED_APIS=1   opt in: leave those APIs open (no key)
    TRITON_LOG_VERBOSE      tritonserver --log-verbose level (default 0)
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_BACKEND_DIR = REPO_ROOT / "build" / "triton_backends"
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging")
ACCESS_KEY_HEADER = "triton-access-key"


class TritonNotFound(RuntimeError):
    pass


@dataclass
class TritonInstall:
    server: Path                 # tritonserver binary
    backends_src: Path           # the wheel's backends/ (python backend .so + utils)
    stub: Optional[Path]         # triton_python_backend_stub for this Python
    lib_dirs: list[Path] = field(default_factory=list)


def _pytriton_home() -> Optional[Path]:
    try:
        import importlib.util
        spec = importlib.util.find_spec("pytriton")
    except Exception:  # noqa: BLE001
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    home = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return home if home.is_dir() else None


def find_triton() -> TritonInstall:
    """Find tritonserver: $TRITONSERVER, then the nvidia-pytriton wheel, then /opt/tritonserver
    (the NGC container)."""
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    explicit = os.environ.get("TRITONSERVER")
    home = _pytriton_home()
    if home is not None and not explicit:
        server = home / "bin" / "tritonserver"
        stub = home / "python_backend_stubs" / pyver / "triton_python_backend_stub"
        libs = [home.parent.parent / "nvidia_pytriton.libs", home / "lib"]
        if server.exists():
            return TritonInstall(server, home / "backends", stub if stub.exists() else None,
                                 [p for p in libs if p.is_dir()])
    candidates = [explicit] if explicit else []
    candidates += ["/opt/tritonserver/bin/tritonserver", shutil.which("tritonserver") or ""]
    for c in candidates:
        if c and Path(c).exists():
            server = Path(c).resolve()
            root = server.parent.parent
            stub = root / "backends" / "python" / "triton_python_backend_stub"
            return TritonInstall(server, root / "backends", stub if stub.exists() else None,
                                 [p for p in (root / "lib",) if p.is_dir()])
    raise TritonNotFound(
        "tritonserver not found: install the Triton pieces with `make setup` "
        "(pip install -r requirements-triton.txt brings nvidia-pytriton==0.7.0, which bundles "
        "tritonserver 2.51), or set TRITONSERVER=/path/to/tritonserver" + _venv_hint())


def _venv_hint() -> str:
    from .venv_hint import venv_hint
    return venv_hint()


def prepare_backend_dir(inst: TritonInstall, dest: Optional[Path] = None) -> Path:
    """A backends directory whose python/ holds the backend library, its utils and the stub
    for the running Python. Rebuilt when the source files change (cheap: a few MB)."""
    env_dir = os.environ.get("TRITON_BACKEND_DIR")
    if env_dir:
        return Path(env_dir)
    if inst.stub is None and (inst.backends_src / "python" / "triton_python_backend_stub").exists():
        return inst.backends_src  # the NGC layout already has the stub next to the backend
    if inst.stub is None:
        raise TritonNotFound(f"no Python-backend stub for Python {sys.version_info.major}."
                             f"{sys.version_info.minor} next to {inst.server}")
    dest = Path(dest or DEFAULT_BACKEND_DIR)
    py_dir = dest / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    srcs = [p for p in (inst.backends_src / "python").iterdir() if p.is_file()] + [inst.stub]
    for src in srcs:
        dst = py_dir / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size \
                or dst.stat().st_mtime < src.stat().st_mtime:
            tmp = dst.with_suffix(dst.suffix + ".tmp")
            shutil.copy2(src, tmp)
            os.replace(tmp, dst)
    return dest


def server_env(inst: TritonInstall, base: Optional[dict] = None) -> dict:
    """Environment for tritonserver and the stub it spawns: the venv's bin first on PATH (the
    stub's embedded Python finds its prefix, hence the venv's site-packages, from there), this
    Python's libpython on LD_LIBRARY_PATH, the repo root on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([venv_bin] + [p for p in env.get("PATH", "").split(os.pathsep)
                                                 if p and p != venv_bin])
    if sys.prefix != sys.base_prefix:
        env.setdefault("VIRTUAL_ENV", sys.prefix)
    libdirs = [sysconfig.get_config_var("LIBDIR") or ""] + [str(p) for p in inst.lib_dirs]
    old = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys([p for p in libdirs if p] + old))
    old_pp = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(REPO_ROOT)] + old_pp))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclass
class ServerOptions:
    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "127.0.0.1"           # HTTP, gRPC and metrics
    http_address: Optional[str] = None    # None: `address`
    model_control: str = "none"           # none | explicit (tests only)
    load_models: tuple[str, ...] = ()     # with explicit: models to load at start
    access_key: Optional[str] = None      # None: generated; "" : restricted APIs open
    log_verbose: int = 0
    exit_timeout_s: int = 30
    startup_timeout_s: int = 900          # 0: none
    extra_args: tuple[str, ...] = ()


def server_argv(inst: TritonInstall, backend_dir: Path, opts: ServerOptions) -> list[str]:
    argv = [
        str(inst.server),
        f"--model-repository={opts.model_repository}",
        f"--backend-directory={backend_dir}",
        f"--http-port={opts.http_port}", f"--grpc-port={opts.grpc_port}",
        f"--metrics-port={opts.metrics_port}",
        f"--http-address={opts.http_address or opts.address}", f"--grpc-address={opts.address}",
        f"--metrics-address={opts.address}",
        "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
        "--metrics-interval-ms=1000",
        f"--model-control-mode={opts.model_control}",
        f"--log-verbose={opts.log_verbose}",
        f"--exit-timeout-secs={opts.exit_timeout_s}",
        # The Python backend's shared memory: grow on demand; default_max_batch off.
        "--backend-config=python,shm-default-byte-size=4194304",
        "--backend-config=python,shm-growth-byte-size=4194304",
        "--strict-readiness=true",
    ]
    if opts.model_control == "explicit":
        argv += [f"--load-model={m}" for m in opts.load_models]
    if opts.access_key != "":
        key = opts.access_key or secrets.token_hex(16)
        apis = ",".join(RESTRICTED_APIS)
        argv += [f"--http-restricted-api={apis}:{ACCESS_KEY_HEADER}={key}",
                 f"--grpc-restricted-protocol={apis}:{ACCESS_KEY_HEADER}={key}"]
    return argv + list(opts.extra_args)


def options_from_env(args: argparse.Namespace) -> ServerOptions:
    open_apis = os.environ.get("TRITON_OPEN_RESTRICTED_APIS", "0").lower() in ("1", "true", "yes")
    key = "" if open_apis else (os.environ.get("TRITON_ACCESS_KEY") or None)
    return ServerOptions(
        model_repository=Path(args.model_repository).resolve(),
        http_port=int(args.http_port or os.environ.get("HTTP_PORT", 8000)),
        grpc_port=int(args.grpc_port or os.environ.get("GRPC_PORT", 8001)),
        metrics_port=int(args.metrics_port or os.environ.get("METRICS_PORT", 8002)),
        address=os.environ.get("TRITON_BIND_ADDRESS", "").strip() or "127.0.0.1",
        access_key=key,
        log_verbose=int(os.environ.get("TRITON_LOG_VERBOSE", "0")),
        exit_timeout_s=int(os.environ.get("TRITON_EXIT_TIMEOUT_SECS", "10")),
        startup_timeout_s=_non_negative_int("TRITON_STARTUP_TIMEOUT_SECS", "900"),
        extra_args=tuple(args.extra),
    )


def _non_negative_int(name: str, default: str) -> int:
    raw = os.environ.get(name, default).strip()
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise SystemExit(f"error: {name} must be a whole number of seconds >= 0 (0: no bound), not {raw!r}")
    return value


CPU_NOTE = ("note: no CUDA driver on this machine; tritonserver (a GPU build) logs \"CudaDriverHelper "
            "has not been initialized\" and \"unable to create stream for ensemble: CUDA driver "
            "version is insufficient\" at error level, and a pinned-memory warning: all harmless "
            "here, every model runs on CPU")


def cuda_driver_present() -> bool:
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m triton_glue.launch")
    ap.add_argument("command", choices=["serve", "env", "check", "argv"])
    ap.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    ap.add_argument("--http-port", type=int)
    ap.add_argument("--grpc-port", type=int)
    ap.add_argument("--metrics-port", type=int)
    ap.add_argument("extra", nargs="*", help="extra tritonserver arguments (after --)")
    args = ap.parse_args(argv)
    try:
        inst = find_triton()
        backend_dir = prepare_backend_dir(inst)
    except TritonNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = server_env(inst)
    if args.command == "check":
        # `tritonserver --help` prints its usage and exits 1: that is the success case here
        r = subprocess.run([str(inst.server), "--help"], env=env, capture_output=True)
        ok = r.returncode in (0, 1) and b"--model-repository" in (r.stdout + r.stderr)
        print(f"tritonserver: {inst.server} ({'runs' if ok else f'does not run: exit {r.returncode}'})"
              f"\nbackends: {backend_dir}")
        return 0 if ok else 1
    if args.command == "serve" and not cuda_driver_present():
        print(CPU_NOTE, file=sys.stderr)
    if args.command == "env":
        for k in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH"):
            print(f"export {k}={env[k]!r}".replace("'", '"'))
        return 0
    opts = options_from_env(args)
    max_body = int(os.environ.get("HTTP_MAX_BODY_BYTES", str(DEFAULT_MAX_BODY_BYTES)))
    if args.command == "argv":
        print(" ".join(server_argv(inst, backend_dir, opts)))
        return 0
    if opts.access_key is None:
        print("note: model-repository, shared-memory and logging APIs are restricted; set "
              f"TRITON_ACCESS_KEY to use them (header '{ACCESS_KEY_HEADER}'), or "
              "TRITON_OPEN_RESTRICTED_APIS=1 to open them", file=sys.stderr)
    return serve(inst, backend_dir, opts, env, max_body)


DEFAULT_MAX_BODY_BYTES = 16 << 20


def serve(inst: TritonInstall, backend_dir: Path, opts: ServerOptions, env: dict, max_body: int) -> int:
    """tritonserver under the supervisor, behind the HTTP front when max_body > 0."""
    from dataclasses import replace

    from .config import reachable_host
    from .supervisor import Supervisor

    front = None
    if max_body > 0:
        from backend_lib.free_port import free_port

        from .http_front import BodyLimitProxy
        private = free_port()
        front = BodyLimitProxy(opts.address, opts.http_port, private, max_body)
        try:
            front.start()
        except OSError as e:
            print(f"error: cannot listen on {opts.address}:{opts.http_port} (HTTP_PORT): {e}", file=sys.stderr)
            return 1
        # tritonserver's own HTTP endpoint: loopback only, reached through the front
        opts = replace(opts, http_port=private, http_address="127.0.0.1")
    cmd = server_argv(inst, backend_dir, opts)
    http_host = reachable_host(opts.http_address or opts.address)
    env["TRITON_HTTP_PORT"] = str(opts.http_port)  # the llm model watches readiness there
    env["TRITON_HTTP_HOST"] = http_host
    sys.stdout.flush()
    metrics_host = reachable_host(opts.address)
    # readiness is watched over HTTP: with HTTP off (an extra argument) the supervisor cannot
    # see it, so it neither bounds the start-up nor watches for a shutdown or a dead stub
    http_on = not any(a.replace(" ", "") in ("--allow-http=false", "--allow-http=0") for a in opts.extra_args)
    sup = Supervisor(cmd, env, exit_timeout_s=opts.exit_timeout_s,
                     startup_timeout_s=(opts.startup_timeout_s or None) if http_on else None,
                     startup_poll_s=Supervisor.startup_poll_s if http_on else Supervisor.poll_s,
                     on_stop=front.stop if front is not None else None,
                     on_stub_death=front.fail_inflight if front is not None else None,
                     server_state=(lambda: _http_state(http_host, opts.http_port)) if http_on else (lambda: "unknown"),
                     bls_inflight=lambda: _gauge_sum(metrics_host, opts.metrics_port, "bls_inflight_requests"),
                     engines_healthy=lambda: _gauge_values(metrics_host, opts.metrics_port, "llm_engine_healthy"),
                     only_stub_models=only_stub_models(opts.model_repository))
    return sup.run()


def only_stub_models(model_repository: Path) -> bool:
    """Every model of the repository is a Python-backend model or an ensemble (by its
    config.pbtxt): once its Python stubs have exited, only ensembles are left to unload."""
    import re

    configs = list(Path(model_repository).glob("*/config.pbtxt"))
    python_or_ensemble = re.compile(r'^\s*(backend\s*:\s*"python"|platform\s*:\s*"ensemble")', re.M)
    return bool(configs) and all(python_or_ensemble.search(c.read_text(errors="replace")) for c in configs)


def _http_state(host: str, port: int) -> str:
    """"ready", "down" (connection reset or refused) or "unknown" (not ready, slow, ...)."""
    import http.client
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v2/health/ready", timeout=2) as r:
            return "ready" if r.status == 200 else "unknown"
    except (ConnectionError, http.client.RemoteDisconnected):
        return "down"
    except urllib.error.URLError as e:
        return "down" if isinstance(e.reason, ConnectionError) else "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def _gauge_sum(host: str, port: int, name: str) -> Optional[float]:
    """The sum of a gauge's series on tritonserver's metrics endpoint (0 when it has none:
    no model reports it), None when the endpoint does not answer."""
    values = _gauge_values(host, port, name)
    return None if values is None else sum(values)


def _gauge_values(host: str, port: int, name: str) -> Optional[list]:
    """The values of a gauge's series on tritonserver's metrics endpoint ([] when no model
    reports it), None when the endpoint does not answer."""
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=2) as r:
            text = r.read().decode(errors="replace")
    except Exception:  # noqa: BLE001 - unknown, the caller waits its bound
        return None
    values = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            try:
                values.append(float(line.rsplit(" ", 1)[1]))
            except ValueError:
                return None
    return values


if __name__ == "__main__":
    sys.exit(main())
