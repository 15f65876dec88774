"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

A client error names the request field at fault in `param` (and at the head of `message`),
so the official `openai` package exposes it as `BadRequestError.param`."""
from __future__ import annotations

import re
from typing import Optional


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type_: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "server_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "server_error"}


def bad_request(param: str, message: str) -> OpenAIError:
    """400 for one field: 'param: message'."""
    return OpenAIError(400, f"{param}: {message}", param=param)


def model_not_found(model: str, served: list[str]) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist (served: {served})", param="model",
                       code="model_not_found")


# vllm_model / llm field names -> the OpenAI request field they come from.
_UPSTREAM_FIELDS = {
    "text_input": "prompt", "input_ids": "prompt", "prompt": "prompt",
    "max_tokens": "max_tokens", "min_tokens": "min_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop_token_ids": "stop_token_ids",
    "bad_token_ids": "bad_words", "return_logprobs": "logprobs", "logprobs": "logprobs",
}
# "field: message" (triton_glue.inputs.InputError) or "field must ..." (the engine's checks).
_FIELD_COLON = re.compile(r"^(?:\[[^\]]*\]\s*)?([A-Za-z_][\w.]*): (.+)$", re.S)
_FIELD_WORD = re.compile(r"^(?:\[[^\]]*\]\s*)?([a-z_][a-z_]*) (?:must|has|may) ", re.S)


def from_upstream(message: str, prompt_param: str = "prompt") -> OpenAIError:
    """An error the server returned for a request: 400 naming the OpenAI field when it is a
    client error in a known field, else 500 with the server's text."""
    # vllm_model words its request errors as vllm_backend does: "Error generating stream: <field>: ..."
    msg = message.strip().removeprefix("Error generating stream: ")
    m = _FIELD_COLON.match(msg)
    field = m.group(1) if m else None
    if field is None:
        w = _FIELD_WORD.match(msg)
        field = w.group(1) if w else None
    if field is not None and not msg.startswith("internal error"):
        base = field.split(".", 1)[1] if field.startswith("sampling_parameters.") else field
        param = _UPSTREAM_FIELDS.get(base, base if field.startswith("sampling_parameters.") else None)
        if param is not None:
            if param == "prompt":
                param = prompt_param
            if base != param:  # e.g. the route's text_input is the request's prompt/messages
                return OpenAIError(400, f"{param}: {msg}", param=param)
            text = m.group(2) if m else msg[len(field):].lstrip()
            return OpenAIError(400, f"{param}: {text}" if m else f"{param} {text}", param=param)
    return OpenAIError(500, f"the inference server failed the request: {msg}")
