"""Chat messages -> one prompt string, with the checkpoint's own chat template
(tokenizer.apply_chat_template), as vLLM's and Triton's OpenAI frontends do."""
from __future__ import annotations

from typing import Any

from .errors import OpenAIError, bad_request
from .protocol import ChatCompletionRequest


def _content_text(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise bad_request(f"messages[{i}].content[{j}].type",
                              f"only 'text' parts are supported (got {kind!r})")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"messages[{i}].content[{j}].text", "must be a string")
        parts.append(text)
    return "".join(parts)


def conversation(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        msg = {"role": m.role, "content": _content_text(i, m.content)}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def render(tokenizer: Any, req: ChatCompletionRequest) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "the served model's tokenizer has no chat_template: use "
                               "/v1/completions, or serve a checkpoint whose tokenizer_config.json "
                               "has one", param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(conversation(req), tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt, **kwargs)
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template that raises (e.g. role order) is the client's
        raise bad_request("messages", f"the chat template rejected the conversation: {e}") from None
    if not text:
        raise bad_request("messages", "the chat template rendered an empty prompt")
    return text
