"""Incremental, UTF-8 safe detokenization.

Two well-known bugs of per-chunk decoding (TensorRT-LLM's postprocessing decodes each
streamed chunk on its own):
  1. leading spaces vanish: SentencePiece/Llama decoders strip the space of the first token
     of a decode call ("▁world" -> "world"), so streamed words glue together;
  2. multi-byte UTF-8 characters split across tokens (byte-level BPE, byte fallback) decode
     to U+FFFD in both halves.

Primary method ("bytes"): every token id maps to the exact bytes it contributes (byte-level
BPE: the GPT-2 byte alphabet; SentencePiece: "▁" -> " " and <0xHH> byte-fallback pieces;
special tokens: nothing when skipped), and text is the UTF-8 *incremental* decode of that
byte stream. That is exact, and independent of how tokens are chunked: streamed pieces always
concatenate to the non-streamed text, even for invalid byte sequences a random model emits.
Only the first token of a whole sequence gets the decoder's leading-space strip, as
tokenizer.decode does. The method is enabled per tokenizer after a self-check against
tokenizer.decode; otherwise the fallback ("window") is vLLM's detokenize_incrementally:
decode a window that starts a few tokens before the new ones and subtract its prefix, holding
back text that ends in U+FFFD.

`IncrementalDetokenizer`: per-request state (BLS / vllm routes).
`decode_delta`: the stateless form for the ensemble's postprocessing model; the llm model
sends with each chunk up to PREFIX_WINDOW tokens that precede it (`prefix_ids`, empty at the
start of a sequence), from which the pending bytes of an incomplete character are recovered.
"""
from __future__ import annotations

import codecs
import json
import threading
from typing import Any, Optional, Sequence

REPLACEMENT = "\ufffd"
PREFIX_WINDOW = 8     # tokens of context sent with each chunk (>= 4 bytes of any text)
INITIAL_PREFIX = PREFIX_WINDOW

_SELF_CHECK_TEXTS = [
    "Hello world, this is a test.", "  two  spaces\tand a tab\nand a newline",
    "naïve café résumé — 東京 中文 ß ☃ 😀😀 end", "a", " leading space",
]


def _utf8_decoder():
    return codecs.getincrementaldecoder("utf-8")("replace")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-unicode alphabet (byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {v: k for k, v in _bytes_to_unicode().items()}


def _decoder_types(node: Any) -> list[dict]:
    out: list[dict] = []
    if isinstance(node, dict):
        if "type" in node:
            out.append(node)
        for v in node.values():
            out += _decoder_types(v)
    elif isinstance(node, list):
        for v in node:
            out += _decoder_types(v)
    return out


class TokenBytes:
    """id -> bytes for one tokenizer (and one skip_special_tokens setting)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.kind: Optional[str] = None
        self.strip_first_space = False
        self._cache: dict[int, bytes] = {}
        self._special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._added = {int(i): t for i, t in added.items()}
        try:
            spec = json.loads(tokenizer.backend_tokenizer.to_str())
            nodes = _decoder_types(spec.get("decoder"))
        except Exception:  # noqa: BLE001 - not a fast tokenizer: use the window fallback
            nodes = []
        types = {n.get("type") for n in nodes}
        if "ByteLevel" in types:
            self.kind = "bytelevel"
        elif types & {"ByteFallback", "Metaspace", "Replace"}:
            self.kind = "sentencepiece"
        for n in nodes:
            if n.get("type") == "Strip" and n.get("content") == " " and int(n.get("start", 0)) >= 1:
                self.strip_first_space = True
            if n.get("type") == "Metaspace" and n.get("prepend_scheme", "always") in ("always", "first"):
                self.strip_first_space = True
        self.ok = self.kind is not None and self._self_check()

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._compute(token_id)
        return b

    def join(self, ids: Sequence[int]) -> bytes:
        return b"".join(self(int(i)) for i in ids)

    def _compute(self, i: int) -> bytes:
        if i in self._special:
            return b"" if self.skip else str(self.tok.convert_ids_to_tokens(i)).encode("utf-8")
        if i in self._added:
            content = getattr(self._added[i], "content", str(self._added[i]))
            return content.encode("utf-8")
        piece = self.tok.convert_ids_to_tokens(i)
        if piece is None:
            return b""
        if self.kind == "bytelevel":
            try:
                return bytes(_BYTE_DECODER[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("▁", " ").encode("utf-8")

    def decode_from_start(self, ids: Sequence[int]) -> str:
        text = self.join(ids).decode("utf-8", "replace")
        return self._strip_start(text)

    def _strip_start(self, text: str) -> str:
        return text[1:] if self.strip_first_space and text.startswith(" ") else text

    def _self_check(self) -> bool:
        try:
            for t in _SELF_CHECK_TEXTS:
                ids = self.tok.encode(t, add_special_tokens=True)
                ref = self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)
                if self.decode_from_start(ids) != ref:
                    return False
            return True
        except Exception:  # noqa: BLE001
            return False


_TB_CACHE: dict[tuple[int, bool], TokenBytes] = {}
_TB_LOCK = threading.Lock()


def token_bytes(tokenizer: Any, skip_special_tokens: bool = True) -> TokenBytes:
    key = (id(tokenizer), skip_special_tokens)
    with _TB_LOCK:
        tb = _TB_CACHE.get(key)
        if tb is None:
            tb = _TB_CACHE[key] = TokenBytes(tokenizer, skip_special_tokens)
        return tb


def _decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    if not ids:
        return ""
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Stateful detokenizer for one sequence.

    add(new_ids) returns the text those tokens complete; add(..., final=True) (or finish())
    flushes what was held back. The concatenation of all returned pieces equals
    full_text(...), however the tokens were chunked. An empty `prompt_ids` means the output
    starts the sequence (the decoder's leading-space strip applies to its first token).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, method: str = "auto"):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.num_output_tokens = 0
        tb = token_bytes(tokenizer, skip_special_tokens) if method in ("auto", "bytes") else None
        self.tb = tb if tb is not None and tb.ok else None
        if self.tb is not None:
            self._dec = _utf8_decoder()
            self._at_start = len(prompt_ids) == 0
            return
        ctx = list(prompt_ids)[-INITIAL_PREFIX:]
        self.ids: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)

    @property
    def method(self) -> str:
        return "bytes" if self.tb is not None else "window"

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        self.num_output_tokens += len(new_ids)
        if self.tb is not None:
            text = self._dec.decode(self.tb.join(new_ids), final)
            if self._at_start and text:
                text = self.tb._strip_start(text)
                self._at_start = False
            return text
        return self._add_window(new_ids, final)

    def _add_window(self, new_ids: Sequence[int], final: bool) -> str:
        self.ids.extend(int(t) for t in new_ids)
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = _decode(self.tokenizer, self.ids[self.prefix_offset:self.read_offset], self.skip)
        new_text = _decode(self.tokenizer, self.ids[self.prefix_offset:], self.skip)
        if not final and new_text.endswith(REPLACEMENT):
            return ""  # incomplete character: wait for the next token(s)
        if new_text.startswith(prefix_text):
            delta = new_text[len(prefix_text):]
        else:  # decode not prefix-stable here: fall back to the new tokens alone
            delta = _decode(self.tokenizer, self.ids[self.read_offset:], self.skip)
        self.prefix_offset = max(self.read_offset, len(self.ids) - PREFIX_WINDOW)
        self.read_offset = len(self.ids)
        if self.prefix_offset > 4 * PREFIX_WINDOW:  # bound memory
            cut = self.prefix_offset
            self.ids = self.ids[cut:]
            self.prefix_offset -= cut
            self.read_offset -= cut
        return delta

    def finish(self) -> str:
        return self.add([], final=True)


def full_text(tokenizer: Any, prompt_ids: Sequence[int], output_ids: Sequence[int],
              skip_special_tokens: bool = True) -> str:
    """The non-streaming text of `output_ids`: what the streamed pieces concatenate to."""
    d = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    return d.add(output_ids, final=True)


def _clean_prefix(tokenizer: Any, ids: Sequence[int], lo: int, skip: bool) -> Optional[str]:
    for j in range(len(ids), lo - 1, -1):
        text = _decode(tokenizer, ids[:j], skip)
        if not text.endswith(REPLACEMENT):
            return text
    return None


def decode_delta(tokenizer: Any, prefix_ids: Sequence[int], new_ids: Sequence[int],
                 final: bool, skip_special_tokens: bool = True, method: str = "auto") -> str:
    """Stateless chunk text (ensemble postprocessing). `prefix_ids`: up to PREFIX_WINDOW tokens
    that precede `new_ids` in the sequence; empty when `new_ids` starts the sequence.

    bytes method: the pending bytes of an incomplete character are recovered from the prefix's
    bytes (an incremental UTF-8 decoder's buffer after feeding them), so the result is exactly
    what IncrementalDetokenizer returns for the same chunk.
    window method: T(prefix + new) - T(prefix), T = decode up to the last token boundary that
    ends on a complete character (everything on the final chunk).
    """
    tb = token_bytes(tokenizer, skip_special_tokens)
    if tb.ok and method in ("auto", "bytes"):
        dec = _utf8_decoder()
        if prefix_ids:
            dec.decode(tb.join(prefix_ids), False)
            pending = dec.getstate()[0]
            dec = _utf8_decoder()
            dec.setstate((pending, 0))
        text = dec.decode(tb.join(new_ids), final)
        return tb._strip_start(text) if not prefix_ids else text
    prefix = list(prefix_ids)
    seq = prefix + list(new_ids)
    a = _clean_prefix(tokenizer, prefix, 0, skip_special_tokens) or ""
    b = _decode(tokenizer, seq, skip_special_tokens) if final else \
        _clean_prefix(tokenizer, seq, len(prefix) + 1, skip_special_tokens)
    if b is None:
        return ""
    if b.startswith(a):
        return b[len(a):]
    return _decode(tokenizer, list(new_ids), skip_special_tokens) if new_ids else ""
