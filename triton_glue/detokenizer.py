"""Incremental, UTF-8 safe detokenization.

Two well-known bugs of per-chunk decoding (TensorRT-LLM's postprocessing decodes each
streamed chunk on its own):
  1. leading spaces vanish: SentencePiece/Llama decoders strip the space of the first token
     of a decode call ("▁world" -> "world"), so chunks glue words together;
  2. multi-byte UTF-8 characters split across tokens (byte-fallback / byte-level BPE) decode
     to U+FFFD in both halves.
Both are fixed the way vLLM's detokenize_incrementally does: always decode a *window* that
starts a few tokens before the new ones (so the first new token is never at the start of a
decode call) and subtract the window's prefix text; hold back text that ends in U+FFFD (an
incomplete character) until the next token completes it, flushing on the final chunk.

`IncrementalDetokenizer` keeps that state for one request (BLS / vllm routes).
`decode_delta` is the stateless form for the ensemble's postprocessing model: the llm model
sends with each chunk the tokens that precede it (`prefix_ids`), and the text of the chunk is
decode(prefix + new) - decode(prefix), both with the trailing incomplete character held back.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

REPLACEMENT = "\ufffd"
# Tokens of context in front of the new tokens: enough for a 4-byte character split into
# single-byte tokens plus the token that carries a leading space.
PREFIX_WINDOW = 8
INITIAL_PREFIX = PREFIX_WINDOW  # tokens of prompt context (vLLM uses 5)


def _decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    if not ids:
        return ""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


def _stable(text: str) -> str:
    """Text without a trailing incomplete character."""
    return text.rstrip(REPLACEMENT)


class IncrementalDetokenizer:
    """Stateful detokenizer for one sequence.

    add(new_ids) returns the text those tokens complete; add(..., final=True) flushes what was
    held back. The concatenation of all returned pieces equals `full_text(...)`.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        ctx = list(prompt_ids)[-INITIAL_PREFIX:]
        self.ids: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.num_output_tokens = 0

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(int(t) for t in new_ids)
        self.num_output_tokens += len(new_ids)
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = _decode(self.tokenizer, self.ids[self.prefix_offset:self.read_offset], self.skip)
        new_text = _decode(self.tokenizer, self.ids[self.prefix_offset:], self.skip)
        if not final and new_text.endswith(REPLACEMENT):
            return ""  # incomplete character: wait for the next token(s)
        if not new_text.startswith(prefix_text):
            # A tokenizer whose decode is not prefix-stable: fall back to the new tokens alone.
            delta = _decode(self.tokenizer, self.ids[self.read_offset:], self.skip)
        else:
            delta = new_text[len(prefix_text):]
        # Slide the window; keep PREFIX_WINDOW tokens of context at most.
        self.prefix_offset = max(self.read_offset, len(self.ids) - PREFIX_WINDOW)
        self.read_offset = len(self.ids)
        # bound memory: drop tokens before the window
        if self.prefix_offset > 4 * PREFIX_WINDOW:
            cut = self.prefix_offset
            self.ids = self.ids[cut:]
            self.prefix_offset -= cut
            self.read_offset -= cut
        return delta

    def finish(self) -> str:
        return self.add([], final=True) if self.read_offset < len(self.ids) else ""


def full_text(tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int],
              skip_special_tokens: bool = True) -> str:
    """The non-streaming text of `output_ids`: what the streamed pieces concatenate to."""
    d = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return d.add(output_ids, final=True)


def _clean_prefix(tokenizer: Any, ids: Sequence[int], lo: int, skip: bool) -> Optional[str]:
    """Text of the longest ids[:j] (j >= lo) whose decode does not end in an incomplete
    character. Token-granular, so the result does not depend on how tokens were chunked."""
    for j in range(len(ids), lo - 1, -1):
        text = _decode(tokenizer, ids[:j], skip)
        if not text.endswith(REPLACEMENT):
            return text
    return None


def decode_delta(tokenizer: Any, prefix_ids: Sequence[int], new_ids: Sequence[int],
                 final: bool, skip_special_tokens: bool = True) -> str:
    """Stateless chunk text (ensemble postprocessing). `prefix_ids`: up to PREFIX_WINDOW tokens
    that precede `new_ids` in the sequence (the prompt's tail for the first chunk).

    text(chunk) = T(prefix + new) - T(prefix), where T decodes up to the last token boundary
    that ends on a complete character (everything, on the final chunk). T depends only on the
    tokens, so the pieces telescope to the full text whatever the chunking, for any output
    that is valid UTF-8; for invalid byte runs only the placement of U+FFFD can differ.
    """
    prefix = list(prefix_ids)
    seq = prefix + list(new_ids)
    a = _clean_prefix(tokenizer, prefix, 0, skip_special_tokens) or ""
    b = _decode(tokenizer, seq, skip_special_tokens) if final else \
        _clean_prefix(tokenizer, seq, len(prefix) + 1, skip_special_tokens)
    if b is None:
        return ""  # no new complete character yet
    if b.startswith(a):
        return b[len(a):]
    return _decode(tokenizer, list(new_ids), skip_special_tokens) if new_ids else ""
