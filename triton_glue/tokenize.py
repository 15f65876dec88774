"""Tokenizer helpers shared by preprocessing and the BLS routes."""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping, Sequence

from .config import load_tokenizer, parameters_of
from .inputs import InputError


def keep_torch_out() -> None:
    """For a process that only tokenizes (the preprocessing, postprocessing and BLS stubs):
    keep torch out of it. transformers imports torch whenever it is installed, though a
    tokenizer needs none of it; that costs each such stub seconds of start-up and ~250 MB
    (tests/server/test_shared_core.py checks the stubs' maps). A `None` in sys.modules makes
    `import torch` fail and find_spec report it absent, so transformers runs its tokenizer-only
    mode. A no-op where torch is already loaded (the in-process engine, test processes)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
        # its "PyTorch was not found" advice is expected here, not a problem to report
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def model_tokenizer(args: Mapping[str, str]) -> tuple[dict, dict[str, str], Any]:
    """(model config, its parameters, the checkpoint's tokenizer) from the `args` Triton passes
    to a model's initialize(): what preprocessing, postprocessing and the BLS routes start from."""
    model_config = json.loads(args["model_config"])
    params = parameters_of(model_config)
    return model_config, params, load_tokenizer(model_config, args["model_repository"])


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    if text == "":
        raise InputError("text_input", "prompt must not be empty")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise InputError("text_input", "prompt encodes to no tokens")
    return [int(i) for i in ids]


def words_to_single_token_ids(tokenizer: Any, field: str, words: Sequence[str]) -> list[int]:
    """Bad words for the token-level engine: each must be a single token (as a word continuing
    text, i.e. with and without a leading space we accept whichever is one token). Stop strings
    need no such function: the text routes match them on text."""
    out: list[int] = []
    for w in words:
        if not w:
            continue
        cands = [tokenizer.encode(w, add_special_tokens=False)]
        if not w.startswith(" "):
            cands.append(tokenizer.encode(" " + w, add_special_tokens=False))
        single = [c[0] for c in cands if len(c) == 1]
        if not single:
            raise InputError(field, f"{w!r} is {len(cands[0])} tokens; multi-token words are not "
                                    "supported (single-token words only)")
        out.extend(dict.fromkeys(single))
    return out


def words_to_sequences(tokenizer: Any, field: str, words: Sequence[str]) -> list[list[int]]:
    """Stop/bad words as token sequences, each word encoded on its own without special tokens
    (TensorRT-LLM's preprocessing); words that encode to nothing are dropped."""
    out = []
    for w in words:
        ids = tokenizer.encode(w, add_special_tokens=False) if w else []
        if ids:
            out.append([int(i) for i in ids])
    return out


class TrtllmTokenizer:
    """TensorRT-LLM's `preprocessing` model on one request: input arrays by name -> output
    arrays by name (INPUT_ID, REQUEST_INPUT_LEN, DECODER_INPUT_ID, REQUEST_DECODER_INPUT_LEN,
    REQUEST_OUTPUT_LEN, STOP_WORDS_IDS, BAD_WORDS_IDS, EMBEDDING_BIAS, OUT_END_ID, OUT_PAD_ID).
    Errors name the ensemble's input (text_input, stop_words, ...)."""

    def __init__(self, tokenizer: Any, add_special_tokens: bool = True):
        self.tok = tokenizer
        self.add_special = add_special_tokens
        self.end_id = _first_id(tokenizer, tokenizer.eos_token)
        self.pad_id = _first_id(tokenizer, tokenizer.pad_token or tokenizer.eos_token)

    def preprocess(self, arrays: Mapping[str, Any]):
        import numpy as np
        from .inputs import decode_utf8
        from .trtllm import word_list_batch

        query = np.asarray(arrays["QUERY"])
        batch = query.shape[0] if query.ndim >= 1 else 1
        query = query.reshape(batch, -1)

        def per_row(name, fill, dtype):
            a = arrays.get(name)
            if a is None:
                return np.full((batch, 1), fill, dtype)
            a = np.asarray(a).reshape(np.asarray(a).shape[0], -1)[:, :1].astype(dtype)
            return a if a.shape[0] == batch else np.repeat(a[:1], batch, axis=0)

        def strings(name, b):
            a = arrays.get(name)
            if a is None:
                return []
            a = np.asarray(a)
            r = a.reshape(a.shape[0], -1)[b if a.shape[0] == batch else 0]
            return [s for s in (decode_utf8(field_of[name], x) for x in r) if s != ""]

        field_of = {"STOP_WORDS_DICT": "stop_words", "BAD_WORDS_DICT": "bad_words",
                    "EMBEDDING_BIAS_WORDS": "embedding_bias_words", "DECODER_QUERY": "decoder_text_input"}
        for name in ("DECODER_QUERY", "EMBEDDING_BIAS_WORDS"):
            if any(strings(name, b) for b in range(batch)):
                raise InputError(field_of[name], "encoder-decoder models are not supported"
                                 if name == "DECODER_QUERY" else "embedding bias is not supported")
        extra = arrays.get("PROMPT_TABLE_EXTRA_ID")
        if extra is not None and np.any(np.asarray(extra)):
            raise InputError("prompt_table_extra_id", "prompt tuning is not supported (only 0)")
        ids_rows, stop_rows, bad_rows = [], [], []
        for b in range(batch):
            ids_rows.append(encode_prompt(self.tok, decode_utf8("text_input", query[b, 0]), self.add_special))
            stop_rows.append(words_to_sequences(self.tok, "stop_words", strings("STOP_WORDS_DICT", b)))
            bad = words_to_sequences(self.tok, "bad_words", strings("BAD_WORDS_DICT", b))
            for w, seq in zip(strings("BAD_WORDS_DICT", b), bad):
                if len(seq) != 1:
                    raise InputError("bad_words", f"{w!r} is {len(seq)} tokens {seq}; multi-token bad words "
                                                  "are not supported (single-token words only)")
            bad_rows.append(bad)
        pad_id = per_row("PAD_ID", self.pad_id, np.int32)
        width = max(len(r) for r in ids_rows)
        input_ids = np.array([r + [int(pad_id[b, 0])] * (width - len(r)) for b, r in enumerate(ids_rows)],
                             dtype=np.int32)
        out_len = arrays.get("REQUEST_OUTPUT_LEN")
        out_len = per_row("REQUEST_OUTPUT_LEN", 16, np.int32) if out_len is not None else np.full((batch, 1), 16, np.int32)
        return {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": np.array([[len(r)] for r in ids_rows], dtype=np.int32),
            # decoder-only models: one pad token, as TensorRT-LLM's preprocessing sends
            "DECODER_INPUT_ID": pad_id.copy(),
            "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), np.int32),
            "REQUEST_OUTPUT_LEN": out_len,
            "STOP_WORDS_IDS": word_list_batch(stop_rows),
            "BAD_WORDS_IDS": word_list_batch(bad_rows),
            "EMBEDDING_BIAS": np.zeros((batch, 0), np.float32),
            "OUT_END_ID": per_row("END_ID", self.end_id, np.int32),
            "OUT_PAD_ID": pad_id,
        }


def _first_id(tokenizer: Any, token: Any) -> int:
    if not token:
        return -1
    ids = tokenizer.encode(token, add_special_tokens=False)
    return int(ids[0]) if ids else -1
