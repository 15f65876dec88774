"""EngineConfig: every engine knob, one place that validates and resolves "auto".

Field names are the config.pbtxt `parameters` keys of the Triton `llm` model, so the
Triton glue maps parameters onto this dataclass one-to-one (see `EngineConfig.from_parameters`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from . import envs

logger = logging.getLogger(__name__)

_DEVICES = ("cpu", "cuda")
_DTYPES = ("float32", "float16", "bfloat16")
_TRISTATE = ("auto", "on", "off")
_SUBMISSION = ("inline", "thread")


# A larger scheduler_delay_factor would hold prompts back for hundreds of steps: a mistake, not a setting.
MAX_DELAY_FACTOR = 100.0


def is_number(v: object) -> bool:
    """An int or float, not a bool. NaN passes here and fails every range comparison after."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class EngineConfig:
    model_path: str = "models/tiny-llama"
    device: str = "cpu"                     # cpu | cuda
    dtype: str = "float32"                  # float32 | float16 | bfloat16
    max_num_seqs: int = 64                  # concurrent requests in the running batch
    max_num_batched_tokens: int = 2048      # token budget of one step (prefill chunks + decodes)
    max_model_len: int = 0                  # 0: the checkpoint's max_position_embeddings
    block_size: int = 16                    # tokens per KV block
    num_kv_blocks: int = 0                  # 0: derived (gpu_memory_utilization on CUDA, a fixed size on CPU)
    gpu_memory_utilization: float = 0.85    # fraction of device memory the engine may take (CUDA only)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True      # reuse the KV of cached prompt prefixes (full blocks)
    async_token_handoff: str = "auto"       # auto | on | off
    step_submission: str = "inline"         # inline | thread: who launches planned steps (submission.py)
    step_lookahead: int = 1                 # 1 | 2: steps launched ahead of the one whose tokens the host reads (async only)
    enable_cuda_graph: bool = True
    cuda_graph_max_batch: int = 256         # largest captured decode bucket
    cuda_graph_mixed: bool = True           # steps with prefill chunks replay CUDA graphs too (mixed_graphs.py; with enable_cuda_graph)
    cuda_graph_mixed_tokens: str = ""       # their token buckets, e.g. "64,256,1024"; "": graph_buckets.default_token_buckets
    scheduler_delay_factor: float = 0.0     # vLLM's: new prompts wait until the oldest has waited this x an admitting step's latency (admission_delay.py; 0: at once)
    stream_interval: int = 1                # SGLang's: a request's tokens go out with its first token, then every this many, and at its end (1: each token)
    pipeline_parallel_size: int = 1
    max_stop_token_ids: int = 16            # per-request device-side stop-id table width
    seed: int = 0                           # engine seed for requests that give none
    load_format: str = "safetensors"        # safetensors | dummy (random weights of the config's shape: benchmarks)

    # ---- validation -------------------------------------------------------------------
    def __post_init__(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"EngineConfig.{name}: {msg} (got {getattr(self, name)!r})")

        if isinstance(self.model_path, os.PathLike):
            self.model_path = os.fspath(self.model_path)
        if not isinstance(self.model_path, str) or not self.model_path:
            fail("model_path", "must be a non-empty path to a local checkpoint folder")
        if self.device not in _DEVICES:
            fail("device", f"must be one of {_DEVICES}")
        if self.dtype not in _DTYPES:
            fail("dtype", f"must be one of {_DTYPES}")
        if self.load_format not in ("safetensors", "dummy"):
            fail("load_format", "must be 'safetensors' or 'dummy'")
        if self.async_token_handoff not in _TRISTATE:
            fail("async_token_handoff", f"must be one of {_TRISTATE}")
        if self.step_submission not in _SUBMISSION:
            fail("step_submission", f"must be one of {_SUBMISSION}")
        for name, lo in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("block_size", 1),
                         ("pipeline_parallel_size", 1), ("max_model_len", 0), ("num_kv_blocks", 0),
                         ("cuda_graph_max_batch", 1), ("max_stop_token_ids", 1), ("stream_interval", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                fail(name, f"must be an integer >= {lo}")
        if self.step_lookahead not in (1, 2) or isinstance(self.step_lookahead, bool):
            fail("step_lookahead", "must be 1 or 2")
        if self.step_submission == "thread" and self.pipeline_parallel_size > 1:
            fail("step_submission", "'thread' is for the single-GPU engine (pipeline stages launch their own steps)")
        if not is_number(self.scheduler_delay_factor) or not 0.0 <= self.scheduler_delay_factor <= MAX_DELAY_FACTOR:
            fail("scheduler_delay_factor", f"must be a number in [0, {MAX_DELAY_FACTOR:g}]")
        if not (0.0 < float(self.gpu_memory_utilization) <= 1.0):
            fail("gpu_memory_utilization", "must be in (0, 1]")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enable_cuda_graph", "cuda_graph_mixed"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        if self.num_kv_blocks and self.num_kv_blocks < 2:
            fail("num_kv_blocks", "must be 0 (auto) or >= 2")
        if not isinstance(self.cuda_graph_mixed_tokens, str):
            fail("cuda_graph_mixed_tokens", "must be a comma list of token counts (a string)")
        from .graph_buckets import parse_token_buckets
        parse_token_buckets(self.cuda_graph_mixed_tokens, self.max_num_batched_tokens)  # raises, naming the field

    def context_window(self, checkpoint_config: Any = None) -> int:
        """max_model_len, 0 resolved to the checkpoint's max_position_embeddings: the engine's
        limit on prompt + output tokens (the OpenAI frontend checks requests against it too).
        checkpoint_config: the model_path's config when the caller has loaded it already."""
        if self.max_model_len:
            return self.max_model_len
        if checkpoint_config is None:
            from .models.hf_config import load_hf_config

            checkpoint_config = load_hf_config(self.model_path)
        return checkpoint_config.max_position_embeddings

    # ---- Triton parameters ------------------------------------------------------------
    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> "EngineConfig":
        """Build from config.pbtxt `parameters` (string values). Unknown keys are errors
        (a typo must not silently leave a knob at its default)."""
        names = set(engine_parameter_names())
        kwargs: dict[str, Any] = {}
        for key, raw in params.items():
            if isinstance(raw, Mapping):  # Triton's model_config gives {"string_value": ...}
                raw = raw.get("string_value", "")
            if key not in names:
                continue  # parameters that belong to the Triton glue, not the engine
            kwargs[key] = parameter_value(key, raw)
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def engine_parameter_names() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig)]


def parameter_value(name: str, raw: str) -> Any:
    """One EngineConfig field's value from its config.pbtxt string, unchecked against the
    others (ValueError names the field)."""
    field = {f.name: f for f in dataclasses.fields(EngineConfig)}.get(name)
    if field is None:
        raise ValueError(f"parameter {name!r}: not an EngineConfig field")
    return _coerce(name, field.type, raw)


def _coerce(name: str, type_name: Any, raw: Any) -> Any:
    text = str(raw).strip()
    t = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", str(type_name))
    try:
        if t == "bool":
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if t == "int":
            return int(text)
        if t == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"parameter {name!r}: cannot parse {text!r} as {t}") from None
    return text


@dataclass(frozen=True)
class AsyncDecision:
    """The capability gate's answer: whether the overlapped path runs, and why not."""
    enabled: bool
    emulated: bool            # CPU stand-ins for streams/events/pinned buffers
    reasons: tuple[str, ...]  # unmet requirements (empty when enabled on CUDA)


# Features that need host tokens between steps. None of them exists in this engine yet;
# each entry is (requirement text, predicate on the config) so adding one is one line.
_HOST_TOKEN_FEATURES: list[tuple[str, Any]] = [
    ("no speculative draft model (not implemented in this engine)", lambda c: False),
    ("no KV-transfer connector (not implemented in this engine)", lambda c: False),
    ("no multimodal inputs (not implemented in this engine)", lambda c: False),
]


def resolve_async_handoff(cfg: EngineConfig) -> AsyncDecision:
    """The one place that resolves async_token_handoff=auto|on|off.

    auto: on only when every requirement holds (CUDA, CUDA graphs, paged KV, no feature that
          needs host tokens between steps); otherwise off, with the reasons logged.
    on:   CUDA must meet every requirement or the engine refuses to load, listing them all.
          On CPU, "on" runs the same overlapped scheduling with CPU stand-ins (emulated).
    off:  synchronous. The kill switch env var forces off everywhere.
    """
    if envs.force_sync():
        return AsyncDecision(False, False, (f"{envs.FORCE_SYNC_ENV}=1 (kill switch)",))
    mode = cfg.async_token_handoff
    if mode == "off":
        return AsyncDecision(False, False, ("async_token_handoff=off",))
    reasons: list[str] = []
    if cfg.device != "cuda":
        reasons.append("CUDA device (device=cpu)")
    if cfg.device == "cuda" and not cfg.enable_cuda_graph:
        reasons.append("CUDA graphs on (enable_cuda_graph=false)")
    for text, needs_host in _HOST_TOKEN_FEATURES:
        if needs_host(cfg):
            reasons.append(text)
    if mode == "on":
        if cfg.device == "cpu":
            other = [r for r in reasons if not r.startswith("CUDA device")]
            if other:
                raise ValueError("EngineConfig.async_token_handoff=on: unmet requirements: " + "; ".join(other))
            return AsyncDecision(True, True, ())
        if reasons:
            raise ValueError("EngineConfig.async_token_handoff=on: unmet requirements: " + "; ".join(reasons))
        return AsyncDecision(True, False, ())
    # auto
    if reasons:
        logger.info("async token handoff off; unmet requirements: %s", "; ".join(reasons))
        return AsyncDecision(False, False, tuple(reasons))
    return AsyncDecision(True, False, ())


__all__ = ["EngineConfig", "AsyncDecision", "resolve_async_handoff", "engine_parameter_names"]
