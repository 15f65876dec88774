"""backend_lib: a paged-KV, continuous-batching LLM engine with asynchronous token handoff.

Importable and testable without Triton; the Triton models in model_repository/ wrap it.
"""
from .async_engine import AsyncEngine, RequestStream
from .config import AsyncDecision, EngineConfig, resolve_async_handoff
from .engine import EngineStats, LLMEngine
from .engine_client import EngineProcessClient
from .request import CompletionOutput, FinishReason, RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "EngineProcessClient", "RequestStream", "EngineConfig", "AsyncDecision", "resolve_async_handoff",
           "EngineStats", "LLMEngine", "CompletionOutput", "FinishReason", "RequestOutput", "SamplingParams"]
