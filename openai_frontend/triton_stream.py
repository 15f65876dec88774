"""One generation on the `vllm_model` route over a gRPC bidirectional stream (tritonclient's
asyncio client): a prompt and vllm_backend sampling parameters in, text pieces out.

Each generation has its own stream, so cancelling it (the client went away, or the caller
stopped iterating) cancels exactly that request in tritonserver, and the route cancels its
upstream `llm` request, which frees the KV blocks.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc

from .errors import OpenAIError, from_upstream
from .logprobs import TokenLogprob, parse_route_logprobs


@dataclass
class Piece:
    """What one response of the route carries."""
    text: str
    num_output_tokens: int         # tokens behind this piece
    num_input_tokens: int          # the prompt's length, as the server tokenized it
    finish_reason: Optional[str]   # set on the last piece: "stop" | "length" | "abort"
    logprobs: Optional[list[TokenLogprob]] = None   # one per token, when requested


def _input(name: str, arr: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def route_inputs(prompt: str, sampling: dict, logprobs: bool = False) -> list:
    """vllm_model's inputs: streaming always (the frontend aggregates non-streamed replies),
    the prompt never echoed, finish reason and token counts returned (and log probabilities
    when `logprobs`: sampling["logprobs"] says how many alternatives)."""
    def flag(name: str) -> grpcclient.InferInput:
        return _input(name, np.array([True]), "BOOL")

    inputs = [
        _input("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
        _input("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
        flag("stream"), flag("exclude_input_in_output"), flag("return_finish_reason"),
        flag("return_num_input_tokens"), flag("return_num_output_tokens"),
    ]
    return inputs + [flag("return_logprobs")] if logprobs else inputs


OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")


class TritonRoute:
    def __init__(self, url: str, model: str = "vllm_model"):
        self.url = url
        self.model = model
        self._client: Optional[aiogrpc.InferenceServerClient] = None

    @property
    def client(self) -> aiogrpc.InferenceServerClient:
        # created lazily: the asyncio channel binds to the running event loop
        if self._client is None:
            self._client = aiogrpc.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model))
        except Exception:  # noqa: BLE001 - not reachable is not ready
            return False

    async def generate(self, prompt: str, sampling: dict, prompt_param: str = "prompt") -> AsyncIterator[Piece]:
        """Yields the route's pieces until the last one (finish_reason set). Raises OpenAIError
        for an error response. Closing the iterator early cancels the request."""
        logprobs = sampling.get("logprobs") is not None
        outputs = OUTPUTS + (("logprobs",) if logprobs else ())
        request = {"model_name": self.model, "inputs": route_inputs(prompt, sampling, logprobs),
                   "outputs": [grpcclient.InferRequestedOutput(o) for o in outputs],
                   "request_id": f"openai-{uuid.uuid4().hex}"}

        async def one_request():
            yield request

        stream = self.client.stream_infer(one_request())
        finished = False
        try:
            async for result, error in _unavailable_as_503(stream, self.url):
                if error is not None:
                    finished = True
                    raise from_upstream(str(error.message() if hasattr(error, "message") else error),
                                        prompt_param)
                piece = _piece(result)
                final = result.get_response().parameters.get("triton_final_response")
                if piece.finish_reason is not None or (final is not None and final.bool_param):
                    finished = True
                    if piece.finish_reason is None:
                        piece.finish_reason = "abort"
                    yield piece
                    return
                yield piece
            finished = True
            raise OpenAIError(500, "the inference server closed the stream before the last response")
        finally:
            if not finished:
                stream.cancel()


async def _unavailable_as_503(stream, url: str):
    """The stream's (result, error) pairs; a transport failure (server down, connection lost)
    is a 503 naming the server instead of an internal error."""
    it = stream.__aiter__()
    while True:
        try:
            item = await it.__anext__()
        except StopAsyncIteration:
            return
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code == grpc.StatusCode.CANCELLED:
                raise
            detail = e.details() if hasattr(e, "details") else str(e)
            raise OpenAIError(503, f"tritonserver at {url} is unavailable ({code.name if code else 'error'}: "
                                   f"{detail})") from None
        yield item


def _scalar(result, name: str):
    arr = result.as_numpy(name)
    return None if arr is None or arr.size == 0 else arr.reshape(-1)[0]


def _piece(result) -> Piece:
    text = result.as_numpy("text_output")
    text = "".join(x.decode("utf-8") if isinstance(x, bytes) else str(x)
                   for x in (text.reshape(-1) if text is not None else []))
    fr = _scalar(result, "finish_reason")
    fr = fr.decode() if isinstance(fr, bytes) else (None if fr is None else str(fr))
    if fr in ("None", ""):
        fr = None
    n_out = _scalar(result, "num_output_tokens")
    n_in = _scalar(result, "num_input_tokens")
    lp = _scalar(result, "logprobs")
    return Piece(text, int(n_out or 0), int(n_in or 0), fr,
                 parse_route_logprobs(lp) if lp is not None else None)
