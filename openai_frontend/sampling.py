"""OpenAI request fields -> the `sampling_parameters` JSON of the vllm_model route.

The route checks every value against the engine (an unsupported penalty comes back as
`sampling_parameters.<key>: ...`, which errors.from_upstream turns into a 400 naming the
OpenAI field), so the penalties and log probabilities are forwarded as given and start
working as soon as the route has them. Features the route has no output for are refused here, naming the field.

`n` > 1 runs n requests on the route, like vLLM's own frontend does (vllm.v1 ParentRequest):
with a seed, choice i uses seed + i, so each choice is reproducible and they differ.
"""
from __future__ import annotations

from typing import Optional, Union

from .errors import bad_request
from .protocol import MAX_STOP, ChatCompletionRequest, CompletionRequest

Request = Union[CompletionRequest, ChatCompletionRequest]

# vllm_model sampling keys forwarded as given when the client sets them
_FORWARDED = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "stop_token_ids")


def stop_strings(req: Request) -> list[str]:
    stop = req.stop
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP:
        raise bad_request("stop", f"at most {MAX_STOP} stop strings (got {len(items)})")
    if any(s == "" for s in items):
        raise bad_request("stop", "stop strings must not be empty")
    return items


def check_supported(req: Request) -> None:
    """400 for a feature this server cannot give, at a non-neutral value."""
    if req.logit_bias:
        raise bad_request("logit_bias", "is not supported by this server (only {} or null)")
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None and req.echo:
            raise bad_request("echo", "with logprobs needs prompt log probabilities, which this "
                                      "server does not return")
        if req.suffix:
            raise bad_request("suffix", "is not supported (no fill-in-the-middle)")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of", f"only best_of == n is supported (got best_of={req.best_of}, "
                                         f"n={req.n})")
    else:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs", "needs logprobs: true")
        if req.tools:
            raise bad_request("tools", "tool calling is not supported by this server")
        if req.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice", "tool calling is not supported by this server")
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request("response_format.type", "only 'text' is supported (no guided decoding)")
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise bad_request("max_completion_tokens", "differs from max_tokens: send one of them")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options", "is only allowed when stream is true")


def max_tokens_of(req: Request, default: int) -> int:
    if isinstance(req, ChatCompletionRequest):
        v = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        v = req.max_tokens
    return default if v is None else v


def sampling_parameters(req: Request, default_max_tokens: int, choice: int = 0) -> dict:
    """The route's sampling_parameters for choice `choice` of the request."""
    sp: dict = {"max_tokens": max_tokens_of(req, default_max_tokens)}
    for key in _FORWARDED:
        v = getattr(req, key)
        if v is not None:
            sp[key] = v
    k = logprobs_count(req)
    if k is not None:
        sp["logprobs"] = k
    if req.seed is not None:
        sp["seed"] = _child_seed(req.seed, choice)
    stops = stop_strings(req)
    if stops:
        sp["stop"] = stops
    if req.ignore_eos:
        sp["ignore_eos"] = True
    if req.include_stop_str_in_output:
        sp["include_stop_str_in_output"] = True
    if not req.skip_special_tokens:
        sp["skip_special_tokens"] = False
    return sp


def logprobs_count(req: Request) -> Optional[int]:
    """How many alternatives per token the request wants (0: the sampled token's only), or
    None for no log probabilities (vLLM's SamplingParams.logprobs)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def _child_seed(seed: int, choice: int) -> int:
    return (seed + choice) % (2**63)


def wants_usage_in_stream(req: Request) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def finish_reason(engine_reason: Optional[str]) -> str:
    """The engine's stop | length -> OpenAI's (the same words)."""
    return engine_reason or "stop"
