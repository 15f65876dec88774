"""Model-config parameters -> engine config, model/tokenizer path resolution.

Environment variables read here:
    MODEL_PATH        overrides the `model_path` parameter of every model (llm, tokenizers), so
                      one variable points the whole repository at another local checkpoint.
    TOKENIZER_PATH    overrides the tokenizer folder of every model (preprocessing,
                      postprocessing, the BLS routes, the llm model's detokenizer) and of the
                      OpenAI frontend; unset: the tokenizer of MODEL_PATH / the parameters.
    LLM_PARAM_<name>  overrides the llm model's parameter <name> (an EngineConfig field or a glue
                      parameter below; the name in any case), e.g. LLM_PARAM_max_num_seqs=32, so
                      engine settings change without editing config.pbtxt. An unknown name
                      fails the load, naming the variable.
    TRITON_HTTP_PORT  the server's HTTP port, exported by triton_glue.launch (and the container
                      entrypoint) so the llm model can notice an unload (its readiness drops)
                      and abort in-flight streams instead of making the unload wait for them.
    TRITON_HTTP_HOST  the address to reach it at (default 127.0.0.1; the launcher exports the
                      bind address when tritonserver listens on one address only)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Union

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_PATH_ENV = "MODEL_PATH"
TOKENIZER_PATH_ENV = "TOKENIZER_PATH"
LLM_PARAM_PREFIX = "LLM_PARAM_"
HTTP_PORT_ENV = "TRITON_HTTP_PORT"
HTTP_HOST_ENV = "TRITON_HTTP_HOST"


def reachable_host(bind_address: str) -> str:
    """Where a local client reaches a server bound to `bind_address` (a URL's host part)."""
    host = "127.0.0.1" if bind_address in ("0.0.0.0", "::", "") else bind_address
    return f"[{host}]" if ":" in host else host


def server_http_url() -> Optional[str]:
    port = os.environ.get(HTTP_PORT_ENV, "").strip()
    host = os.environ.get(HTTP_HOST_ENV, "").strip() or "127.0.0.1"
    return f"http://{host}:{port}" if port.isdigit() else None

# Parameters of the llm model that belong to the Triton glue, not to EngineConfig.
GLUE_PARAMETERS = {
    "cancel_poll_ms": "20",        # how often in-flight requests are polled for cancellation
    "stats_interval_ms": "200",    # how often engine stats are exported to gauges
    # test hook: > 0 makes the engine thread fail after that many steps (engine-death tests)
    "test_fault_after_steps": "0",
    # streaming: "auto" merges a request's tokens into one response while the sender is behind
    # the engine (step outputs queued up), one response per step otherwise; "off": per step
    "stream_coalesce": "auto",
    # threads that build and send responses with stream_coalesce=auto (send() releases the GIL
    # while tritonserver takes the response: several overlap); 1: the engine's output thread
    "delivery_threads": "1",
    # sys.setswitchinterval for the model's process, in ms ("" keeps Python's 5 ms): how long
    # the sender thread may hold the GIL while the engine loop waits for it
    "gil_switch_interval_ms": "",
    # "on": the engine loop runs in a process of its own (backend_lib.engine_client), so this
    # process's threads (the response sender, Triton's) never hold the GIL it needs; "off": a
    # thread of this process (backend_lib.AsyncEngine)
    "engine_process": "on",
}


def engine_process(model_config: Union[str, Mapping[str, Any]]) -> bool:
    """The `engine_process` glue parameter: True for "on", False for "off", else ValueError naming it."""
    raw = glue_parameter(model_config, "engine_process").strip().lower()
    if raw not in ("on", "off"):
        raise ValueError(f"parameter 'engine_process' must be 'on' or 'off', not {raw!r}")
    return raw == "on"


def delivery_threads(model_config: Union[str, Mapping[str, Any]]) -> int:
    """The `delivery_threads` glue parameter, or ValueError naming it and its limits."""
    from backend_lib.output_sinks import MAX_DELIVERY_THREADS

    raw = glue_parameter(model_config, "delivery_threads").strip()
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_DELIVERY_THREADS:
        raise ValueError(f"parameter 'delivery_threads' must be an integer from 1 to {MAX_DELIVERY_THREADS}, "
                         f"not {raw!r}")
    return int(raw)


def positive_ms(name: str, raw: str, limit: float = 1000.0) -> float:
    """A glue parameter in milliseconds: a number in (0, limit], or ValueError naming it."""
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not 0.0 < v <= limit:  # also rejects nan
        raise ValueError(f"parameter {name!r} must be a number of ms in (0, {limit:g}], not {raw!r}")
    return v


def parameters_of(model_config: Union[str, Mapping[str, Any]]) -> dict[str, str]:
    """{key: string_value} from a model config (the JSON string Triton passes, or a dict)."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    out: dict[str, str] = {}
    for k, v in (cfg.get("parameters") or {}).items():
        out[k] = v.get("string_value", "") if isinstance(v, Mapping) else str(v)
    return out


def resolve_model_path(path: str, model_dir: Optional[str] = None) -> str:
    """Absolute path of a local checkpoint: MODEL_PATH wins; a relative path is looked up against
    the project root, then next to the model repository, then the working directory."""
    override = os.environ.get(MODEL_PATH_ENV, "").strip()
    return _resolve_local(override or path, model_dir)


def _resolve_local(path: str, model_dir: Optional[str] = None) -> str:
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    candidates = [REPO_ROOT / p]
    if model_dir:
        md = Path(model_dir).resolve()
        candidates += [md.parent.parent / p, md.parent / p]
    candidates.append(Path.cwd() / p)
    for c in candidates:
        if c.exists():
            return str(c.resolve())
    return str(candidates[0])


def resolve_tokenizer_path(path: str, model_dir: Optional[str] = None) -> str:
    """The tokenizer folder: TOKENIZER_PATH wins, then MODEL_PATH, then `path`."""
    override = os.environ.get(TOKENIZER_PATH_ENV, "").strip()
    return _resolve_local(override, model_dir) if override else resolve_model_path(path, model_dir)


def tokenizer_path_from_env(default: str) -> str:
    """The tokenizer folder a process outside the model repository (the OpenAI frontend) uses
    to agree with the server: TOKENIZER_PATH, else MODEL_PATH, else `default`."""
    return resolve_tokenizer_path(default)


def engine_config(model_config: Union[str, Mapping[str, Any]], model_dir: Optional[str] = None):
    """EngineConfig from the llm model's parameters (one-to-one with EngineConfig fields).
    Unknown parameters (other than the glue's own) fail the load, naming the parameter."""
    from backend_lib import EngineConfig
    from backend_lib.config import engine_parameter_names

    params = llm_parameters(model_config)
    overrides = parameter_overrides()
    if overrides:
        print(f"llm: parameters from {LLM_PARAM_PREFIX}* environment variables: {overrides}", flush=True)
    known = set(engine_parameter_names()) | set(GLUE_PARAMETERS)
    unknown = sorted(k for k in params if k not in known)
    if unknown:
        raise ValueError(f"parameter {unknown[0]!r} is not an EngineConfig field nor a glue parameter "
                         f"(known: {sorted(known)})")
    engine_params = {k: v for k, v in params.items() if k not in GLUE_PARAMETERS}
    engine_params["model_path"] = resolve_model_path(engine_params.get("model_path", "models/tiny-llama"),
                                                     model_dir)
    return EngineConfig.from_parameters(engine_params)


def instance_count(model_config: Union[str, Mapping[str, Any]]) -> int:
    """How many instances (stub processes) Triton runs of the model: each instance_group's count,
    times its number of GPUs when it lists some (Triton makes `count` instances per GPU)."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    groups = cfg.get("instance_group") or [{}]
    return sum(int(g.get("count", 1) or 1) * max(1, len(g.get("gpus") or [])) for g in groups)


def metric_labels(args: Mapping[str, Any], base: Mapping[str, str]) -> dict[str, str]:
    """The labels of a model instance's custom metrics: `base`, plus the instance's name when
    Triton runs several instances. Two instances that make a metric with the same name and labels
    get one Prometheus series in the server, which the first instance to unload frees while the
    others still write to it (tritonserver then aborts on a corrupt heap at unload)."""
    labels = dict(base)
    if instance_count(args["model_config"]) > 1:
        labels["instance"] = str(args["model_instance_name"])
    return labels


def _process_identity(pid: int) -> list:
    """What tells process `pid` apart from any other, past or present, on this machine: its pid
    namespace, its pid and its start time (pids are reused, and differ per namespace)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        ns, start = None, None
    return [ns, pid, start]


def _files_identity(folder: Path) -> list:
    """Names, sizes and modification times of the files in a folder."""
    if not folder.is_dir():
        return []
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(folder.iterdir()) if f.is_file()]


def engine_share_key(model_config: Union[str, Mapping[str, Any]], engine_cfg, model_name: str,
                     model_version: str) -> Optional[str]:
    """The key under which a model's instances share one engine core
    (EngineProcessClient(share_key=...)): None with one instance. It names the server (this
    stub's parent, by pid namespace, pid and start time), the model and version, the engine
    configuration, the GPUs this process sees, the checkpoint's files and the engine's code (names,
    sizes, modification times): a reload that changes none of them attaches the new instances
    to the running engine, one that changes any starts its own."""
    if instance_count(model_config) <= 1:
        return None
    code = Path(__file__).resolve().parent.parent / "backend_lib"
    return json.dumps([_process_identity(os.getppid()), model_name, str(model_version), engine_cfg.to_json(),
                       os.environ.get("CUDA_VISIBLE_DEVICES"), _files_identity(Path(engine_cfg.model_path)),
                       _files_identity(code)])


def glue_parameter(model_config: Union[str, Mapping[str, Any]], name: str) -> str:
    return llm_parameters(model_config).get(name, GLUE_PARAMETERS[name])


def parameter_overrides(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """{parameter: value} from the LLM_PARAM_<name> environment variables. A name that is no
    llm parameter raises ValueError naming the variable (a typo must not pass unnoticed)."""
    from backend_lib.config import engine_parameter_names

    env = os.environ if environ is None else environ
    known = set(engine_parameter_names()) | set(GLUE_PARAMETERS)
    out: dict[str, str] = {}
    for var, value in sorted(env.items()):
        if not var.startswith(LLM_PARAM_PREFIX):
            continue
        name = var[len(LLM_PARAM_PREFIX):].lower()
        if name not in known:
            raise ValueError(f"{var}: {name!r} is not a parameter of the llm model (known: {sorted(known)})")
        out[name] = value
    return out


def llm_parameters(model_config: Union[str, Mapping[str, Any]]) -> dict[str, str]:
    """The llm model's parameters: config.pbtxt's, then the LLM_PARAM_<name> overrides."""
    return {**parameters_of(model_config), **parameter_overrides()}


def load_tokenizer(model_config: Union[str, Mapping[str, Any]], model_dir: Optional[str] = None):
    """The tokenizer of the checkpoint folder (parameter `tokenizer_path`, else `model_path`).
    No remote code, no downloads."""
    from transformers import AutoTokenizer

    params = parameters_of(model_config)
    raw = params.get("tokenizer_path") or params.get("model_path") or "models/tiny-llama"
    path = check_tokenizer_folder(resolve_tokenizer_path(raw, model_dir))
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' text does not say which folder
        raise ValueError(f"tokenizer {path}: cannot load ({type(e).__name__}: "
                         f"{' '.join(str(e).split())})") from None


# Files one of which a local tokenizer folder holds (fast tokenizers, SentencePiece, BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_tokenizer_folder(path: str) -> str:
    """`path` when it is a folder with tokenizer files; else a one-line error that names it and
    where it came from (instead of transformers' hub messages: "Repo id must be in the form...",
    "You need to have sentencepiece or tiktoken installed")."""
    source = (TOKENIZER_PATH_ENV if os.environ.get(TOKENIZER_PATH_ENV, "").strip()
              else MODEL_PATH_ENV if os.environ.get(MODEL_PATH_ENV, "").strip()
              else "the tokenizer_path/model_path parameter")
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"tokenizer folder {path} does not exist (from {source})")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"tokenizer folder {path} has no tokenizer files (none of "
                         f"{', '.join(TOKENIZER_FILES)}; from {source}): point {TOKENIZER_PATH_ENV} "
                         "at the folder that has them")
    return path
