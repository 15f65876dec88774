"""The HTTP app: /v1/models, /v1/completions, /v1/chat/completions, /health.

Response objects follow OpenAI's schema field by field (ids `cmpl-`/`chatcmpl-`, `object`,
`created`, `model`, `choices[].index/finish_reason/logprobs`, `usage`); streams are SSE
`data: {chunk}` lines closed by `data: [DONE]`, with a last `choices: []` chunk carrying
`usage` when `stream_options.include_usage` is set (every other chunk then has `usage: null`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional, Union

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import chat as chat_mod
from .choices import Choice, ChoiceResult, Usage, merged
from .config import FrontendConfig
from .context_window import ContextWindow
from .errors import OpenAIError, model_not_found
from .protocol import ChatCompletionRequest, CompletionRequest, parse
from .logprobs import chat_logprobs, completion_logprobs
from .sampling import (check_supported, finish_reason, logprobs_count, sampling_parameters,
                       wants_usage_in_stream)
from .triton_stream import Piece, TritonRoute

log = logging.getLogger("openai_frontend")
DISCONNECT_POLL_S = 0.1


def _error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Frontend:
    def __init__(self, config: FrontendConfig, tokenizer: Any, route: Optional[TritonRoute] = None):
        self.config = config
        self.tokenizer = tokenizer
        self.route = route or TritonRoute(config.grpc_url, config.triton_model)
        self.window = ContextWindow(self.route, tokenizer, config.max_model_len)
        self.created = int(time.time())

    # ---- shared -----------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model not in self.config.served_model_names:
            raise model_not_found(model, self.config.served_model_names)

    def choices_of(self, req: Union[CompletionRequest, ChatCompletionRequest], prompts: list[str],
                   max_tokens: Optional[list[Optional[int]]] = None) -> list[Choice]:
        """n choices per prompt; `max_tokens[p]`, where given, is prompt p's budget."""
        out = []
        for p, prompt in enumerate(prompts):
            for j in range(req.n):
                sp = sampling_parameters(req, self.config.default_max_tokens, j)
                if max_tokens and max_tokens[p] is not None:
                    sp["max_tokens"] = max_tokens[p]
                out.append(Choice(len(out), p, prompt, sp))
        return out

    async def _collect(self, http: Request, choices: list[Choice], prompt_param: str
                       ) -> tuple[list[ChoiceResult], Usage]:
        """Every choice to its end; a client that disconnects meanwhile cancels them all."""
        results = [ChoiceResult() for _ in choices]
        usage = Usage()

        async def run() -> None:
            async with contextlib.aclosing(merged(self.route, choices, prompt_param)) as it:
                async for choice, piece in it:
                    results[choice.index].add(piece)
                    usage.add(choice, piece)

        task = asyncio.create_task(run())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not done and await http.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    # nobody is left to read it: nginx's "client closed request"
                    raise OpenAIError(499, "the client closed the connection")
            await task
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return results, usage

    async def _stream(self, http: Request, choices: list[Choice], prompt_param: str, chunks
                      ) -> Union[StreamingResponse, JSONResponse]:
        """SSE reply. The first piece is awaited before the response starts, so an error the
        server reports at once (a bad value) is an HTTP 400, not an error event."""
        it = merged(self.route, choices, prompt_param)
        try:
            first = await it.__anext__()
        except OpenAIError as e:
            await it.aclose()
            return _error_response(e)

        async def body() -> AsyncIterator[str]:
            try:
                async for line in chunks(first, it):
                    yield line
            except OpenAIError as e:
                yield _sse(e.body())
            finally:
                # a disconnect cancels this body: closing the choices (which cancels their
                # upstream requests) must still run to the end
                with anyio.CancelScope(shield=True):
                    await it.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ---- /v1/completions --------------------------------------------------------------------
    async def completions(self, http: Request) -> Any:
        req = parse(CompletionRequest, await http.body())
        self.check_model(req.model)
        check_supported(req)
        prompts = req.prompts()
        await self.window.check(prompts, req.max_tokens, "max_tokens")
        # null max_tokens: the rest of the window, as in vLLM
        choices = self.choices_of(req, prompts, await self.window.rest(prompts) if req.max_tokens is None else None)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def envelope(chs: list, usage: Optional[dict] = None, with_usage: bool = True) -> dict:
            obj = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                   "choices": chs, "system_fingerprint": None}
            if with_usage:
                obj["usage"] = usage
            return obj

        k = logprobs_count(req)

        def lp(tokens, offset: int = 0):
            return None if k is None else completion_logprobs(tokens or [], k, offset)

        if not req.stream:
            results, usage = await self._collect(http, choices, "prompt")
            return envelope([{"index": c.index,
                              "text": (c.prompt if req.echo else "") + "".join(r.text),
                              "logprobs": lp(r.logprobs), "finish_reason": finish_reason(r.finish_reason)}
                             for c, r in zip(choices, results)], usage.as_dict())

        include_usage = wants_usage_in_stream(req)

        async def chunks(first, it) -> AsyncIterator[str]:
            usage = Usage()
            echoed: set[int] = set()
            sent_chars: dict[int, int] = {}   # text offset of each choice's next token

            def lines(choice: Choice, piece: Piece):
                usage.add(choice, piece)
                text = piece.text
                if req.echo and choice.index not in echoed:
                    echoed.add(choice.index)
                    text = choice.prompt + text
                if text or piece.finish_reason is not None or piece.logprobs:
                    fr = None if piece.finish_reason is None else finish_reason(piece.finish_reason)
                    offset = sent_chars.get(choice.index, 0)
                    sent_chars[choice.index] = offset + sum(len(t.sampled.text) for t in piece.logprobs or [])
                    yield _sse(envelope([{"index": choice.index, "text": text,
                                          "logprobs": lp(piece.logprobs, offset), "finish_reason": fr}],
                                        None, include_usage))

            async for line in _piece_lines(first, it, lines):
                yield line
            if include_usage:
                yield _sse(envelope([], usage.as_dict()))

        return await self._stream(http, choices, "prompt", chunks)

    # ---- /v1/chat/completions ---------------------------------------------------------------
    async def chat_completions(self, http: Request) -> Any:
        req = parse(ChatCompletionRequest, await http.body())
        self.check_model(req.model)
        check_supported(req)
        prompt = chat_mod.render(self.tokenizer, req)
        if req.max_completion_tokens is not None:
            await self.window.check([prompt], req.max_completion_tokens, "max_completion_tokens")
        else:
            await self.window.check([prompt], req.max_tokens, "max_tokens")
        choices = self.choices_of(req, [prompt])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def envelope(obj_type: str, chs: list, usage: Optional[dict] = None, with_usage: bool = True) -> dict:
            obj = {"id": rid, "object": obj_type, "created": created, "model": req.model,
                   "choices": chs, "system_fingerprint": None}
            if with_usage:
                obj["usage"] = usage
            return obj

        k = logprobs_count(req)

        def lp(tokens):
            return None if k is None else chat_logprobs(tokens or [], k)

        if not req.stream:
            results, usage = await self._collect(http, choices, "messages")
            return envelope("chat.completion", [
                {"index": c.index,
                 "message": {"role": "assistant", "content": "".join(r.text), "refusal": None},
                 "logprobs": lp(r.logprobs), "finish_reason": finish_reason(r.finish_reason)}
                for c, r in zip(choices, results)], usage.as_dict())

        include_usage = wants_usage_in_stream(req)

        async def chunks(first, it) -> AsyncIterator[str]:
            usage = Usage()

            def chunk(index: int, delta: dict, fr: Optional[str] = None, logprobs=None) -> str:
                return _sse(envelope("chat.completion.chunk",
                                     [{"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": fr}], None, include_usage))

            # OpenAI opens every choice with the role and empty content
            for c in choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})

            def lines(choice: Choice, piece: Piece):
                usage.add(choice, piece)
                if piece.text or piece.logprobs:
                    yield chunk(choice.index, {"content": piece.text}, logprobs=lp(piece.logprobs))
                if piece.finish_reason is not None:
                    yield chunk(choice.index, {}, finish_reason(piece.finish_reason))

            async for line in _piece_lines(first, it, lines):
                yield line
            if include_usage:
                yield _sse(envelope("chat.completion.chunk", [], usage.as_dict()))

        return await self._stream(http, choices, "messages", chunks)

    # ---- /v1/models ------------------------------------------------------------------------
    async def model_card(self, name: str) -> dict:
        # vLLM's card carries the context window too
        return {"id": name, "object": "model", "created": self.created, "owned_by": "triton",
                "max_model_len": await self.window.size()}

    async def models(self) -> dict:
        return {"object": "list", "data": [await self.model_card(n) for n in self.config.served_model_names]}


async def _piece_lines(first: tuple, it: AsyncIterator, lines: Callable) -> AsyncIterator[str]:
    """The SSE lines `lines(choice, piece)` makes of the first (choice, piece) and of the rest."""
    for line in lines(*first):
        yield line
    async for choice, piece in it:
        for line in lines(choice, piece):
            yield line


def create_app(config: FrontendConfig, tokenizer: Any, route: Optional[TritonRoute] = None) -> FastAPI:
    fe = Frontend(config, tokenizer, route)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await fe.route.close()

    app = FastAPI(title="OpenAI-compatible frontend for tritonserver", lifespan=lifespan)
    app.state.frontend = fe

    @app.exception_handler(OpenAIError)
    async def _openai_error(_req, e: OpenAIError):
        return _error_response(e)

    @app.exception_handler(404)
    async def _not_found(req, _e):
        return _error_response(OpenAIError(404, f"no route {req.method} {req.url.path}"))

    @app.exception_handler(405)
    async def _not_allowed(req, _e):
        return _error_response(OpenAIError(405, f"method {req.method} not allowed on {req.url.path}"))

    @app.exception_handler(Exception)
    async def _internal(_req, e: Exception):
        log.exception("request failed")
        return _error_response(OpenAIError(500, f"internal error: {e!r}"))

    @app.get("/v1/models")
    async def list_models():
        return await fe.models()

    @app.get("/v1/models/{model}")
    async def get_model(model: str):
        fe.check_model(model)
        return await fe.model_card(model)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await fe.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await fe.chat_completions(request)

    @app.get("/health")
    async def health():
        if await fe.route.ready():
            return JSONResponse({"status": "ok"})
        return _error_response(OpenAIError(503, f"model {config.triton_model!r} is not ready on "
                                                f"{config.grpc_url}"))

    return app
