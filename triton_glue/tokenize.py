"""Tokenizer helpers shared by preprocessing and the BLS routes."""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from .config import load_tokenizer, parameters_of
from .inputs import InputError


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
    """Stop/bad words for the token-level engine: each must be a single token (as a word
    continuing text, i.e. with and without a leading space we accept whichever is one token).
    Multi-token stop strings are matched on text by the llm_bls / vllm_model routes."""
    out: list[int] = []
    for w in words:
        if not w:
            continue
        cands = [tokenizer.encode(w, add_special_tokens=False)]
        if not w.startswith(" "):
            cands.append(tokenizer.encode(" " + w, add_special_tokens=False))
        single = [c[0] for c in cands if len(c) == 1]
        if not single:
            raise InputError(field, f"{w!r} is {len(cands[0])} tokens; the ensemble route supports "
                                    "single-token words only (use llm_bls for stop strings)")
        out.extend(dict.fromkeys(single))
    return out
