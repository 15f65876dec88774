"""The request bodies of /v1/completions and /v1/chat/completions (OpenAI's fields, plus the
vLLM extras vLLM users send through `extra_body`), parsed strictly: a wrong type, a value out
of range or an unknown field is a 400 that names the field.

Fields the engine cannot honour yet are accepted at their neutral value only (see
`sampling.unsupported`), so a client never silently gets something other than it asked for.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import OpenAIError, bad_request

MAX_N = 128
MAX_STOP = 16


def _takes_none(annotation: Any) -> bool:
    return annotation is Any or annotation is type(None) or type(None) in get_args(annotation)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """null for a field that has no null value of its own (`n`, `stream`, `echo`, ...) means
        its default, as in OpenAI's API and vLLM: the OpenAI SDK sends null for a parameter
        passed as None. Fields whose null means something (completions' `max_tokens`: the rest
        of the context) keep it."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not _takes_none(fields[k].annotation))}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extra sampling parameters
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    min_tokens: Optional[int] = Field(None, ge=0)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_Common):
    # str | list[str] | list[int] | list[list[int]]: checked in `prompts()` for one clear message
    prompt: Any
    max_tokens: Optional[int] = Field(16, ge=1)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    suffix: Optional[str] = None

    def prompts(self) -> list[str]:
        p = self.prompt
        if isinstance(p, str):
            items = [p]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            items = p
        elif isinstance(p, list) and p and all(isinstance(x, (int, list)) and not isinstance(x, bool)
                                               for x in p):
            raise bad_request("prompt", "token-id prompts are not supported: the vllm_model route "
                                        "takes text (send the prompt as a string)")
        else:
            raise bad_request("prompt", "must be a string or a non-empty list of strings")
        for i, s in enumerate(items):
            if s == "":
                raise bad_request("prompt" if len(items) == 1 else f"prompt[{i}]", "must not be empty")
        return items


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    refusal: Optional[str] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_of(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; pydantic's union-member tags
    ('str', 'list[str]', 'function-after[...]') are not fields and end the path."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _UNION_TAGS:
            out += ("." if out else "") + part
        else:
            break
    return out


def parse(model: type[BaseModel], raw: bytes):
    if not raw.strip():
        raise OpenAIError(400, "the request body is empty (expected a JSON object)")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        param = _param_of(tuple(first["loc"]))
        if first["type"] == "json_invalid":
            raise OpenAIError(400, f"the request body is not valid JSON ({first['msg']})") from None
        if not param:
            raise OpenAIError(400, f"the request body must be a JSON object ({first['msg']})") from None
        if first["type"] == "extra_forbidden":
            raise bad_request(param, "unknown field (not an OpenAI or supported vLLM parameter)") from None
        if first["type"] == "missing":
            raise bad_request(param, "is required") from None
        # a union field reports one error per member: say what each allows
        same = [x for x in errs if _param_of(tuple(x["loc"])) == param]
        msg = "; or ".join(dict.fromkeys(x["msg"] for x in same))
        got = first.get("input")
        raise bad_request(param, f"{msg} (got {got!r})" if not isinstance(got, (dict, list)) else msg) from None
