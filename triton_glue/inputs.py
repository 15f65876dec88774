"""Typed request parsing for every route. Input: a mapping from input name to numpy array
(model.py builds it from the pb_utils request). Output: typed dataclasses. Every error is an
`InputError` whose message starts with the offending field's name.

The engine validates the sampling values against its limits (SamplingParams.validate names
the field); here we check presence, shape, dtype-level coercion and cross-field rules.
"""
from __future__ import annotations

import json
import math
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


def get_int(arrays: Arrays, name: str, default: Optional[int]) -> Optional[int]:
    v = _one(arrays, name)
    if v is None:
        return default
    if isinstance(v, (float, np.floating)) and not float(v).is_integer():
        raise InputError(name, f"must be an integer (got {v!r})")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise InputError(name, f"must be an integer (got {v!r})") from None


def get_float(arrays: Arrays, name: str, default: Optional[float]) -> Optional[float]:
    v = _one(arrays, name)
    if v is None:
        return default
    f = float(v)
    if math.isnan(f) or math.isinf(f):
        raise InputError(name, f"must be a finite number (got {f!r})")
    return f


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


def get_strings(arrays: Arrays, name: str) -> list[str]:
    """A [-1] / [1, -1] string list; empty strings dropped."""
    arr = arrays.get(name)
    if arr is None:
        return []
    out = [decode_utf8(name, x) for x in np.asarray(arr).reshape(-1)]
    return [s for s in out if s != ""]


def get_ids(arrays: Arrays, name: str) -> Optional[list[int]]:
    arr = arrays.get(name)
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.ndim == 2 and arr.shape[0] != 1:
        raise InputError(name, f"batch size must be 1 (got shape {list(arr.shape)}); "
                               "send one request per sequence")
    if arr.ndim > 2:
        raise InputError(name, f"must be 1-D (got shape {list(arr.shape)})")
    if arr.dtype.kind not in "iu":
        raise InputError(name, f"must hold integer token ids (got dtype {arr.dtype})")
    return [int(x) for x in arr.reshape(-1)]


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
    ignore_eos: bool = False

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
            ignore_eos=self.ignore_eos,
        )


def _check_neutral(arrays: Arrays, name: str, neutral: float) -> None:
    v = get_float(arrays, name, None)
    if v is not None and v != neutral:
        raise InputError(name, f"is not supported by this engine (only {neutral} is accepted)")


def _check_false(arrays: Arrays, name: str) -> None:
    if get_bool(arrays, name, False):
        raise InputError(name, "is not supported by this engine (only false is accepted)")


def _check_one(arrays: Arrays, name: str) -> None:
    v = get_int(arrays, name, None)
    if v is not None and v != 1:
        raise InputError(name, f"must be 1: this engine returns one sequence (got {v})")


def check_unsupported_trtllm(arrays: Arrays) -> None:
    """TensorRT-LLM inputs we accept for interface compatibility only at their neutral value."""
    for n in ("repetition_penalty", "length_penalty"):
        _check_neutral(arrays, n, 1.0)
    for n in ("presence_penalty", "frequency_penalty"):
        _check_neutral(arrays, n, 0.0)
    for n in ("return_log_probs", "return_context_logits", "return_generation_logits"):
        _check_false(arrays, n)
    for n in ("beam_width", "num_return_sequences"):
        _check_one(arrays, n)


def parse_sampling_tensors(arrays: Arrays) -> SamplingFields:
    """TensorRT-LLM style sampling inputs (ensemble, llm_bls, llm)."""
    check_unsupported_trtllm(arrays)
    f = SamplingFields()
    f.max_tokens = get_int(arrays, "max_tokens", None)
    mt = get_int(arrays, "min_tokens", None)
    ml = get_int(arrays, "min_length", None)  # TensorRT-LLM's older name
    if mt is not None and ml is not None and mt != ml:
        raise InputError("min_tokens", f"and its alias min_length disagree ({mt} vs {ml})")
    f.min_tokens = mt if mt is not None else (ml if ml is not None else 0)
    f.temperature = get_float(arrays, "temperature", None)
    f.top_k = get_int(arrays, "top_k", None)
    f.top_p = get_float(arrays, "top_p", None)
    f.seed = get_int(arrays, "seed", None)
    if f.seed is None:
        f.seed = get_int(arrays, "random_seed", None)
    f.ignore_eos = get_bool(arrays, "ignore_eos", False)
    # -1 pads ragged lists (TensorRT-LLM convention)
    f.stop_token_ids = [t for t in (get_ids(arrays, "stop_token_ids") or []) if t >= 0]
    f.bad_token_ids = [t for t in (get_ids(arrays, "bad_token_ids") or []) if t >= 0]
    end_id = get_int(arrays, "end_id", None)
    if end_id is not None and end_id >= 0:
        # TensorRT-LLM's end_id replaces the model's EOS.
        f.ignore_eos = True
        f.stop_token_ids = list(f.stop_token_ids) + [end_id]
    return f


@dataclass
class TokenRequest:
    """What the `llm` model needs for one request."""
    prompt_ids: list[int]
    sampling: SamplingFields
    stream: bool = True
    exclude_input: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def parse_token_request(arrays: Arrays) -> TokenRequest:
    if batch_size(arrays, "input_ids") != 1:
        raise InputError("input_ids", f"batch size must be 1 (got {batch_size(arrays, 'input_ids')}); "
                                      "send one request per prompt")
    ids = get_ids(arrays, "input_ids")
    if ids is None:
        raise InputError("input_ids", "is required")
    if len(ids) == 0:
        raise InputError("input_ids", "prompt must not be empty")
    samp = parse_sampling_tensors(arrays)
    if samp.max_tokens is None:
        raise InputError("max_tokens", "is required")
    return TokenRequest(
        prompt_ids=ids,
        sampling=samp,
        stream=get_bool(arrays, "stream", False),
        exclude_input=get_bool(arrays, "exclude_input_in_output", False),
        return_num_input_tokens=get_bool(arrays, "return_num_input_tokens", False),
        return_num_output_tokens=get_bool(arrays, "return_num_output_tokens", False),
    )


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


def parse_trtllm_text_request(arrays: Arrays) -> TextRequest:
    """TensorRT-LLM ensemble/BLS interface."""
    if batch_size(arrays, "text_input") != 1:
        raise InputError("text_input", f"batch size must be 1 (got {batch_size(arrays, 'text_input')})")
    text = get_text(arrays, "text_input")
    if text == "":
        raise InputError("text_input", "prompt must not be empty")
    samp = parse_sampling_tensors(arrays)
    if samp.max_tokens is None:
        raise InputError("max_tokens", "is required")
    return TextRequest(
        text=text,
        sampling=samp,
        stop_strings=get_strings(arrays, "stop_words"),
        bad_words=get_strings(arrays, "bad_words"),
        stream=get_bool(arrays, "stream", False),
        exclude_input=get_bool(arrays, "exclude_input_in_output", False),
        return_finish_reason=True,
        return_num_input_tokens=get_bool(arrays, "return_num_input_tokens", False),
        return_num_output_tokens=get_bool(arrays, "return_num_output_tokens", False),
    )
