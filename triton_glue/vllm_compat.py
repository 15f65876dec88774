"""vllm_backend's request interface: `text_input`, `stream`, `sampling_parameters` (a JSON
object whose values may be strings: genai-perf sends numbers as strings), and the
`exclude_input_in_output` / `return_*` flags.

Coercion follows vllm_backend (`TritonSamplingParams.from_dict`: None values dropped, each
known key cast to its declared type), with two deliberate differences: booleans are parsed
("false" is False; vllm_backend's bool("false") is True), and an unknown key is an error
naming the key instead of a silently ignored typo.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np

from .inputs import (Arrays, InputError, SamplingFields, TextRequest, batch_size, get_bool,
                     get_text, parse_bool)

# vLLM SamplingParams keys we implement, with their types.
_SUPPORTED: dict[str, type] = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_k": int, "top_p": float,
    "seed": int, "ignore_eos": bool, "include_stop_str_in_output": bool,
    "skip_special_tokens": bool, "stop": list, "stop_token_ids": list, "bad_words": list,
    "n": int, "logprobs": int, "presence_penalty": float, "frequency_penalty": float,
    "repetition_penalty": float, "min_p": float,
}
# vLLM keys accepted only at their neutral value (the engine has no such feature).
_NEUTRAL: dict[str, Any] = {
    "best_of": 1, "prompt_logprobs": None,
    "detokenize": True, "spaces_between_special_tokens": True, "lora_name": None,
}
# every key sampling_parameters may hold
SAMPLING_KEYS = frozenset(_SUPPORTED) | frozenset(_NEUTRAL)
MAX_N = 16         # backend_lib.request.MAX_N
MAX_LOGPROBS = 20  # backend_lib.layers.logprobs.MAX_LOGPROBS


def _cast(key: str, typ: type, value: Any) -> Any:
    try:
        if typ is bool:
            return value if isinstance(value, bool) else parse_bool(key, str(value))
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
    except InputError:
        raise
    except (TypeError, ValueError):
        raise InputError(f"sampling_parameters.{key}",
                         f"must be {typ.__name__} (got {value!r})") from None
    return value


def _str_list(key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise InputError(f"sampling_parameters.{key}", f"must be a string or a list of strings (got {value!r})")


def _int_list(key: str, value: Any) -> list[int]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InputError(f"sampling_parameters.{key}", f"must be a list of integers (got {value!r})") from None
    if not isinstance(value, list):
        raise InputError(f"sampling_parameters.{key}", f"must be a list of integers (got {value!r})")
    return [_cast(key, int, v) for v in value]


def parse_sampling_parameters(text: Optional[str]) -> tuple[SamplingFields, dict[str, Any]]:
    """Returns the engine knobs and the text-level options (stop strings, etc.)."""
    try:
        return _parse_sampling_parameters(text)
    except RecursionError:  # JSON nested deeper than the parser (or a repr in a message) goes
        raise InputError("sampling_parameters", "is nested too deeply") from None


def _parse_sampling_parameters(text: Optional[str]) -> tuple[SamplingFields, dict[str, Any]]:
    samp = SamplingFields()
    extra: dict[str, Any] = {"stop": [], "bad_words": [], "include_stop_str_in_output": False,
                             "skip_special_tokens": True}
    if text is None or text.strip() == "":
        return samp, extra
    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError("sampling_parameters", f"is not valid JSON ({e.msg})") from None
    if not isinstance(params, dict):
        raise InputError("sampling_parameters", "must be a JSON object")
    params = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(k for k in params if k not in _SUPPORTED and k not in _NEUTRAL)
    if unknown:
        raise InputError(f"sampling_parameters.{unknown[0]}",
                         f"unknown sampling parameter (unknown keys: {unknown}; supported: "
                         f"{sorted(_SUPPORTED)})")
    for key, neutral in _NEUTRAL.items():
        if key in params:
            v = params[key]
            if neutral is None or isinstance(neutral, bool):
                ok = v == neutral or (isinstance(v, str) and neutral is True and parse_bool(key, v))
            else:
                try:
                    ok = float(v) == float(neutral)
                except (TypeError, ValueError):
                    ok = False
            if not ok:
                raise InputError(f"sampling_parameters.{key}",
                                 f"is not supported by this engine (only {neutral!r} is accepted, got {v!r})")
    for key in ("max_tokens", "min_tokens", "top_k", "seed", "n", "logprobs"):
        if key in params:
            setattr(samp, key, _cast(key, int, params[key]))
    # the engine checks the other ranges and names the key; these two shape the route's work
    if not 1 <= samp.n <= MAX_N:
        raise InputError("sampling_parameters.n", f"must be in [1, {MAX_N}] (got {samp.n})")
    if samp.logprobs is not None and not 0 <= samp.logprobs <= MAX_LOGPROBS:
        raise InputError("sampling_parameters.logprobs", f"must be in [0, {MAX_LOGPROBS}] (got {samp.logprobs})")
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if key in params:
            setattr(samp, key, _cast(key, float, params[key]))
    if "ignore_eos" in params:
        samp.ignore_eos = _cast("ignore_eos", bool, params["ignore_eos"])
    if "stop_token_ids" in params:
        samp.stop_token_ids = _int_list("stop_token_ids", params["stop_token_ids"])
    if "stop" in params:
        extra["stop"] = _str_list("stop", params["stop"])
    if "bad_words" in params:
        extra["bad_words"] = _str_list("bad_words", params["bad_words"])
    for key in ("include_stop_str_in_output", "skip_special_tokens"):
        if key in params:
            extra[key] = _cast(key, bool, params[key])
    samp.check_ranges("sampling_parameters.")
    return samp, extra


VLLM_ERROR_PREFIX = "Error generating stream: "  # vllm_backend's wording of every request error
# vllm_backend's message, word for word (its ci/L0_backend_vllm/enabled_stream test checks it)
STREAM_PROMPT_ERROR = "When streaming, `exclude_input_in_output` = False is not allowed."


class VllmRequestError(InputError):
    """An InputError worded as vllm_backend words it: "Error generating stream: <field>: ..."."""

    def __init__(self, field_name: str, message: str):
        super().__init__(field_name, message)
        self.args = (f"{VLLM_ERROR_PREFIX}{message}",)


def parse_vllm_request(arrays: Arrays, request_parameters: Optional[str] = None) -> TextRequest:
    """`request_parameters`: the request's own parameters JSON (vllm_backend reads those when the
    `sampling_parameters` input is absent). Errors: VllmRequestError."""
    try:
        return _parse_vllm_request(arrays, request_parameters)
    except VllmRequestError:
        raise
    except InputError as e:
        raise VllmRequestError(e.field, str(e)) from None


def _parse_vllm_request(arrays: Arrays, request_parameters: Optional[str]) -> TextRequest:
    if batch_size(arrays, "text_input") != 1:
        raise InputError("text_input", "expected exactly one prompt")
    text = get_text(arrays, "text_input")
    if text == "":
        raise InputError("text_input", "prompt must not be empty")
    sp = get_text(arrays, "sampling_parameters", required=False)
    if sp is None and request_parameters:
        sp = request_parameters
    samp, extra = parse_sampling_parameters(sp)
    stream = get_bool(arrays, "stream", False)
    if "exclude_input_in_output" in arrays:
        exclude = get_bool(arrays, "exclude_input_in_output", True)
    else:
        exclude = bool(stream)  # vllm_backend: prepend the prompt unless streaming
    if stream and not exclude:
        raise VllmRequestError("exclude_input_in_output", STREAM_PROMPT_ERROR)
    for name, why in (("image", "multimodal inputs are not supported"),
                      ("embedding_request", "embedding requests are not supported")):
        if name in arrays and np.asarray(arrays[name]).size:
            raise InputError(name, why)
    return TextRequest(
        text=text, sampling=samp, stop_strings=extra["stop"], bad_words=extra["bad_words"],
        stream=stream, exclude_input=exclude,
        include_stop_str_in_output=extra["include_stop_str_in_output"],
        skip_special_tokens=extra["skip_special_tokens"],
        return_finish_reason=get_bool(arrays, "return_finish_reason", False),
        return_num_input_tokens=get_bool(arrays, "return_num_input_tokens", False),
        return_num_output_tokens=get_bool(arrays, "return_num_output_tokens", False),
        return_logprobs=get_bool(arrays, "return_logprobs", False),
        return_cumulative_logprob=get_bool(arrays, "return_cumulative_logprob", False),
    )
