"""Typed request parsing shared by the routes (TensorRT-LLM tensors: triton_glue/trtllm.py; vllm_backend:
triton_glue/vllm_compat.py). Input: a mapping from input name to numpy array
(model.py builds it from the pb_utils request). Output: typed dataclasses. Every error is an
`InputError` whose message starts with the offending field's name.

The engine validates the sampling values against its limits (SamplingParams.validate names
the field); here we check presence, shape, dtype-level coercion and cross-field rules.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import numpy as np


class InputError(ValueError):
    """A client error in one request. `field` is the input (or parameter) at fault."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


Arrays = Mapping[str, np.ndarray]


# ---- scalar helpers -------------------------------------------------------------------
def _one(arrays: Arrays, name: str) -> Optional[Any]:
    """The single element of an optional [1] / [batch=1, 1] input, or None when absent."""
    arr = arrays.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise InputError(name, f"expected exactly one value, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def get_bool(arrays: Arrays, name: str, default: bool) -> bool:
    v = _one(arrays, name)
    if v is None:
        return default
    if isinstance(v, (bytes, str)):
        return parse_bool(name, v.decode() if isinstance(v, bytes) else v)
    return bool(v)


def decode_utf8(name: str, raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, (bytes, bytearray, np.bytes_)):
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(name, f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    raise InputError(name, f"must be a string (got {type(raw).__name__})")


def get_text(arrays: Arrays, name: str, required: bool = True) -> Optional[str]:
    arr = arrays.get(name)
    if arr is None:
        if required:
            raise InputError(name, "is required")
        return None
    arr = np.asarray(arr)
    if arr.size != 1:
        raise InputError(name, f"expected exactly one string, got shape {list(arr.shape)}")
    return decode_utf8(name, arr.reshape(-1)[0])


def parse_bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise InputError(name, f"must be a boolean (got {text!r})")


def batch_size(arrays: Arrays, name: str) -> int:
    arr = arrays.get(name)
    return 1 if arr is None or np.asarray(arr).ndim < 2 else int(np.asarray(arr).shape[0])


# ---- typed requests -----------------------------------------------------------------
@dataclass
class SamplingFields:
    """The request knobs that become backend_lib.SamplingParams (values unvalidated: the
    engine checks ranges and names the field)."""
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop_token_ids: list[int] = field(default_factory=list)
    bad_token_ids: list[int] = field(default_factory=list)
    stop_sequences: list[list[int]] = field(default_factory=list)
    ignore_eos: bool = False
    # Penalties, min_p, logprobs, n: SamplingParams' names and neutral defaults.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logprobs: Optional[int] = None   # None: no logprobs; N: the sampled token's + the top-N
    n: int = 1

    def check_ranges(self, prefix: str = "") -> None:
        """The engine's own range checks (SamplingParams.validate, its wording) on the values a
        text route forwards, before any reaches `llm`: InputError naming prefix + the field.
        The limits that depend on the engine (max_model_len, vocabulary) stay the engine's: a
        message here names them, the engine's own gives their values."""
        # a number per limit that no request reaches, replaced by the limit's name in a message
        unknown = {"max_model_len": 2**62, "vocab_size": 2**62 + 1, "max_stop_ids": 2**62 + 2}
        try:
            self.to_params().validate(**unknown)
        except ValueError as e:
            message = str(e)
            for name, value in unknown.items():
                message = message.replace(f"{value}] ({name})", f"{name}]").replace(str(value), name)
            raise InputError(prefix + message.split(" ", 1)[0], message) from None

    def to_params(self, default_max_tokens: int = 16, default_temperature: float = 1.0):
        from backend_lib import SamplingParams
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature if self.temperature is not None else default_temperature,
            top_k=self.top_k if self.top_k is not None else -1,
            top_p=self.top_p if self.top_p is not None else 1.0,
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids),
            bad_token_ids=list(self.bad_token_ids),
            stop_sequences=[list(q) for q in self.stop_sequences],
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_p=self.min_p,
            logprobs=self.logprobs,
            n=self.n,
        )


@dataclass
class TokenRequest:
    """What the `llm` model needs for one request."""
    prompt_ids: list[int]
    sampling: SamplingFields
    stream: bool = True
    exclude_input: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    top_logprobs: Optional[int] = None  # N: the top-N logprobs per token as well (num_top_logprobs)


@dataclass
class TextRequest:
    """A text route request (llm_bls, vllm_model)."""
    text: str
    sampling: SamplingFields
    stop_strings: list[str] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    stream: bool = False
    exclude_input: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    # vllm_backend's outputs `logprobs` (needs sampling.logprobs) and `cumulative_logprob`
    return_logprobs: bool = False
    return_cumulative_logprob: bool = False
    # n > 1: the route runs n single-sequence requests (triton_glue/sequences.py); this is one
    sequence_index: int = 0
    num_sequences: int = 1

    @property
    def wants_logprobs(self) -> bool:
        """Whether `llm` must compute logprobs for this request."""
        return self.sampling.logprobs is not None or self.return_cumulative_logprob


# ---- request parameters -------------------------------------------------------------
# HTTP generate turns every top-level JSON key that is not an input of the model into a
# request parameter (and an ensemble passes its request's parameters on to its steps), so a
# misspelt knob ("temprature") would silently do nothing. Parameters that Triton's clients and
# frontends set or read themselves are not ours to reject.
TRITON_REQUEST_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                       "binary_data_output", "headers"})


def request_parameters(raw: Any) -> dict[str, Any]:
    """The request's parameters (pb_utils `request.parameters()` is a JSON object string)."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        params = json.loads(raw)
    except (TypeError, ValueError):
        return {}
    return params if isinstance(params, dict) else {}


def client_parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a client set for the model: Triton's own ones left out."""
    return {k: v for k, v in params.items()
            if k not in TRITON_REQUEST_PARAMETERS and not k.startswith("triton_")}


def reject_unknown_parameters(raw: Any, accepted: frozenset = frozenset()) -> None:
    """InputError naming the first request parameter the model does not read."""
    unknown = sorted(k for k in client_parameters(request_parameters(raw)) if k not in accepted)
    if unknown:
        raise InputError(unknown[0], "unknown input or parameter (misspelt? GET /v2/models/<model>/config "
                                     f"lists the inputs; unknown keys: {unknown})")
