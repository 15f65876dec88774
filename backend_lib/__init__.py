"""backend_lib: a paged-KV, continuous-batching LLM engine with asynchronous token handoff.

Importable and testable without Triton; the Triton models in model_repository/ wrap it.

The names below load their module on first use: a process that only talks to an engine
process (EngineProcessClient, the Triton stub of an engine-process `llm`) never imports torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "AsyncEngine": "async_engine", "RequestStream": "output_sinks",
    "EngineConfig": "config", "AsyncDecision": "config", "resolve_async_handoff": "config",
    "EngineStats": "engine_stats", "LLMEngine": "engine",
    "EngineProcessClient": "engine_client",
    "CompletionOutput": "request", "FinishReason": "request", "RequestOutput": "request",
    "SamplingParams": "request",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'backend_lib' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:
    from .async_engine import AsyncEngine
    from .config import AsyncDecision, EngineConfig, resolve_async_handoff
    from .engine import LLMEngine
    from .engine_client import EngineProcessClient
    from .engine_stats import EngineStats
    from .output_sinks import RequestStream
    from .request import CompletionOutput, FinishReason, RequestOutput, SamplingParams
