"""The frontend's settings. Every environment variable it reads is read here:

    OPENAI_HOST                 bind address (default: TRITON_BIND_ADDRESS, tritonserver's, else
                                127.0.0.1)
    OPENAI_PORT                 HTTP port (default 9000)
    TRITON_GRPC_URL             tritonserver's gRPC endpoint (default 127.0.0.1:$GRPC_PORT, 8001)
    OPENAI_TRITON_MODEL         the route requests go to (default vllm_model)
    OPENAI_MODEL_NAME           the model id clients send and /v1/models lists (default: the route)
    OPENAI_DEFAULT_MAX_TOKENS   max_tokens of a chat request that gives none (default 16, OpenAI's
                                for completions, as Triton's frontend does; a completions request
                                without one has OpenAI's 16, with null the rest of the window)
    OPENAI_MAX_MODEL_LEN        the context window requests are checked against (default 0: the
                                `llm` model's, read from tritonserver; context_window.py)
    OPENAI_PARENT_PID           with --exit-with-parent: the process it must outlive no longer than
                                (scripts/serve.sh sets it)
    TOKENIZER_PATH, MODEL_PATH  the tokenizer whose chat template renders chat prompts (the
                                server's: TOKENIZER_PATH, else MODEL_PATH, else models/tiny-llama)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from triton_glue.config import tokenizer_path_from_env


@dataclass
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 9000
    grpc_url: str = "127.0.0.1:8001"
    triton_model: str = "vllm_model"
    served_model_names: list[str] = field(default_factory=lambda: ["vllm_model"])
    default_max_tokens: int = 16
    max_model_len: int = 0
    tokenizer_path: str = ""
    parent_pid: Optional[int] = None

    @classmethod
    def from_env(cls) -> "FrontendConfig":
        env = os.environ
        triton_model = env.get("OPENAI_TRITON_MODEL", "").strip() or "vllm_model"
        names = [n.strip() for n in env.get("OPENAI_MODEL_NAME", "").split(",") if n.strip()]
        return cls(
            host=env.get("OPENAI_HOST", "").strip() or env.get("TRITON_BIND_ADDRESS", "").strip()
            or "127.0.0.1",
            port=int(env.get("OPENAI_PORT", "").strip() or 9000),
            grpc_url=env.get("TRITON_GRPC_URL", "").strip()
            or f"127.0.0.1:{env.get('GRPC_PORT', '').strip() or 8001}",
            triton_model=triton_model,
            served_model_names=names or [triton_model],
            default_max_tokens=int(env.get("OPENAI_DEFAULT_MAX_TOKENS", "").strip() or 16),
            max_model_len=int(env.get("OPENAI_MAX_MODEL_LEN", "").strip() or 0),
            tokenizer_path=tokenizer_path_from_env("models/tiny-llama"),
            parent_pid=int(env["OPENAI_PARENT_PID"]) if env.get("OPENAI_PARENT_PID", "").strip() else None,
        )
