"""The served model's context window, and the 400 vLLM's OpenAI server gives a request whose
prompt plus max_tokens does not fit it.

vLLM's engine (so vllm_backend, and our vllm_model route) ends such a generation at the window
with finish_reason "length"; vLLM's OpenAI server refuses it up front, in the words below. The
window is the `llm` model's: its max_model_len parameter (an LLM_PARAM_MAX_MODEL_LEN variable
overrides it, for the server and this frontend alike) or, at 0, the checkpoint's
max_position_embeddings. It is read from tritonserver's model config on first use, unless the
frontend is given one (OPENAI_MAX_MODEL_LEN); LLM_PARAM_* overrides and a relative model_path
resolve in this process's environment, so the two must share it (scripts/serve.sh starts both
from one).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import anyio

from .errors import OpenAIError

log = logging.getLogger("openai_frontend")

# A tokenizer gives at most one token per UTF-8 byte (byte-level BPE, SentencePiece's byte
# fallback) plus the special tokens it adds; a prompt within this bound needs no counting.
SPECIAL_TOKENS_ALLOWANCE = 8
RETRY_S = 5.0   # between look-ups of a window that could not be read (server not up yet)
LOOKUP_TIMEOUT_S = 5.0


async def served_window(route: Any) -> Optional[int]:
    """The window of the `llm` model behind `route` (its `llm_model` parameter), or None for a
    route that names none."""
    from triton_glue.config import engine_config, parameters_of

    route_cfg = (await route.client.get_model_config(route.model, as_json=True,
                                                     client_timeout=LOOKUP_TIMEOUT_S))["config"]
    llm = parameters_of(route_cfg).get("llm_model")
    if not llm:
        return None
    llm_cfg = (await route.client.get_model_config(llm, as_json=True, client_timeout=LOOKUP_TIMEOUT_S))["config"]
    return engine_config(llm_cfg).context_window()


class ContextWindow:
    def __init__(self, route: Any, tokenizer: Any, fixed: int = 0):
        self.route, self.tokenizer = route, tokenizer
        self.tokens: Optional[int] = fixed or None
        self._looked_up = bool(fixed)
        self._next_try = 0.0
        self._lookup = asyncio.Lock()  # one look-up at a time; the others wait for its answer

    async def size(self) -> Optional[int]:
        """The window, looked up once the route answers; None while it cannot be known."""
        if self._looked_up or time.monotonic() < self._next_try:
            return self.tokens
        async with self._lookup:
            if self._looked_up or time.monotonic() < self._next_try:
                return self.tokens
            try:
                self.tokens = await served_window(self.route)
                self._looked_up = True
            except ValueError as e:  # the llm model's settings do not resolve here: for good
                self._looked_up = True
                log.warning("context window unknown (requests go unchecked; set OPENAI_MAX_MODEL_LEN): %s", e)
            except Exception as e:  # noqa: BLE001 - server not up yet: the route ends at the window itself
                self._next_try = time.monotonic() + RETRY_S
                log.warning("context window not known yet (requests go unchecked): %s", e)
        return self.tokens

    async def check(self, prompts: list[str], max_tokens: Optional[int], param: str) -> None:
        """400 naming `param` when a prompt plus `max_tokens` passes the window. A prompt that
        alone fills it is left to the route, whose error names the prompt."""
        if max_tokens is None:
            return
        window = await self.size()
        if window is None:
            return
        for prompt in prompts:
            if len(prompt.encode("utf-8")) + SPECIAL_TOKENS_ALLOWANCE + max_tokens <= window:
                continue
            n = len(await anyio.to_thread.run_sync(self.tokenizer.encode, prompt))
            if n < window < n + max_tokens:
                raise OpenAIError(
                    400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                         f"model's maximum context length is {window} tokens and your request has {n} "
                         f"input tokens ({max_tokens} > {window} - {n}).", param=param)

    async def rest(self, prompts: list[str]) -> list[Optional[int]]:
        """For each prompt, the tokens the window leaves after it (vLLM's max_tokens for a
        completions request that sends null); None where unknown or nothing is left."""
        window = await self.size()
        if window is None:
            return [None] * len(prompts)
        out: list[Optional[int]] = []
        for prompt in prompts:
            n = len(await anyio.to_thread.run_sync(self.tokenizer.encode, prompt))
            out.append(window - n if n < window else None)
        return out
