"""A checkpoint's config.json read without transformers, for the model types and rope types the
engine runs; anything else through transformers' AutoConfig.

Why: importing transformers and resolving AutoConfig costs every engine start ~2.3 s on the
CPU box (its import chain pulls in torch.distributed.tensor, the hub integrations, ...), and
the engine core process (`engine_process: "on"`), each pipeline stage and each server start pay
it again, while the engine reads a dozen fields of the file.

`CheckpointConfig` carries every field of config.json plus, for the fields the engine reads
(models/llama.py ModelShape, layers/rotary.py, engine.py), the values transformers' config class
of that model type gives when config.json leaves them out: the defaults below are those of
LlamaConfig, Qwen2Config, Qwen3Config and MistralConfig (tests/engine/test_hf_config.py checks
each field against AutoConfig on the repository's models and on configs missing each field).
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any, Optional

# Defaults of transformers' config classes (5.x) for the fields the engine reads.
_COMMON = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, rms_norm_eps=1e-6,
               tie_word_embeddings=False, rope_theta=10000.0)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, vocab_size=32000, intermediate_size=11008, max_position_embeddings=2048,
                  attention_bias=False, mlp_bias=False, head_dim=None, num_key_value_heads=None,
                  bos_token_id=1, eos_token_id=2),
    "qwen2": dict(_COMMON, vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
                  num_key_value_heads=32, bos_token_id=None, eos_token_id=None),
    "qwen3": dict(_COMMON, vocab_size=151936, intermediate_size=22016, max_position_embeddings=32768,
                  attention_bias=False, head_dim=128, num_key_value_heads=32, bos_token_id=None,
                  eos_token_id=None),
    "mistral": dict(_COMMON, vocab_size=32000, intermediate_size=14336, max_position_embeddings=131072,
                    head_dim=None, num_key_value_heads=8, bos_token_id=1, eos_token_id=2),
}
# The rope types computed here (layers/rotary.py); others need transformers' ROPE_INIT_FUNCTIONS,
# which read transformers' own config object.
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class CheckpointConfig(SimpleNamespace):
    """config.json's fields as attributes, with the model type's defaults filled in."""


def load_hf_config(path: str):
    """The checkpoint's config: a CheckpointConfig where read_config can, else transformers'
    AutoConfig (trust_remote_code off)."""
    if not os.path.isdir(path):
        raise ValueError(f"model_path {path!r} is not a local checkpoint folder")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"model_path {path!r} has no config.json (not a Hugging Face checkpoint folder)")
    try:
        with open(file) as f:
            raw = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"model_path {path!r}: config.json is not valid JSON ({e})") from None
    try:
        light = read_config(raw)
    except ValueError as e:
        raise ValueError(f"model_path {path!r}: {e}") from None
    if light is not None:
        return light
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path, trust_remote_code=False)


def read_config(raw: dict) -> Optional[CheckpointConfig]:
    """config.json's dict as a CheckpointConfig; None when transformers must read it (another
    model type, a rope type other than default and llama3, a llama3 rope missing a key).
    ValueError names a size field that is not a positive integer."""
    if not isinstance(raw, dict):
        return None
    defaults = _DEFAULTS.get(raw.get("model_type"))
    if defaults is None:
        return None
    rope = _rope_parameters(raw, defaults)
    if rope is None:
        return None
    fields = dict(defaults)
    fields.update(raw)
    for name in _INTS:
        _check_size(name, fields[name])
    # absent: the class default; null: derived from the heads, as the config classes do
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    _check_size("num_key_value_heads", fields["num_key_value_heads"])
    if "head_dim" in defaults and fields["head_dim"] is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if not isinstance(fields["rms_norm_eps"], (int, float)) or isinstance(fields["rms_norm_eps"], bool):
        raise ValueError(f"config.json: rms_norm_eps must be a number (got {fields['rms_norm_eps']!r})")
    fields["rope_parameters"] = rope
    fields.pop("rope_theta", None)  # in rope_parameters, as transformers 5 keeps it
    return CheckpointConfig(**fields)


_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "max_position_embeddings")


def _check_size(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"config.json: {name} must be a positive integer (got {v!r})")


def _rope_parameters(raw: dict, defaults: dict) -> Optional[dict]:
    """transformers 5's rope_parameters: the file's rope_parameters, else its rope_scaling
    (legacy key "type" -> "rope_type"), with rope_theta in it."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return None
    params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    theta = raw.get("rope_theta")
    params.setdefault("rope_theta", defaults["rope_theta"] if theta is None else theta)
    kind = params["rope_type"]
    if kind == "default" or (kind == "llama3" and all(k in params for k in LLAMA3_KEYS)):
        return params
    return None
