"""Load a local HF Llama/Qwen2/Qwen3 checkpoint (single or sharded safetensors) into
DecoderModel. No hub, no trust_remote_code."""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch
from safetensors import safe_open

from .hf_config import load_hf_config  # noqa: F401 - the loader's API
from .llama import DecoderModel
from ..layers.rotary import RotaryEmbedding

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _open_safetensors(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors' own errors do not say which file
        raise ValueError(f"{file}: unreadable safetensors file, truncated or corrupt "
                         f"({type(e).__name__}: {e})") from None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise ValueError(f"model_path {path!r} holds no .safetensors weights")
    return found


def build_model(hf_config, path: str, device: torch.device, dtype: torch.dtype,
                layer_start: int = 0, layer_end: Optional[int] = None,
                load_format: str = "safetensors") -> DecoderModel:
    # Build on the meta device (no random init of billions of weights), then materialize.
    with torch.device("meta"):
        model = DecoderModel(hf_config, layer_start, layer_end)
    model = model.to_empty(device=device).to(dtype)
    model.rotary = RotaryEmbedding(hf_config, model.shape.head_dim).to(device)
    if load_format == "dummy":  # benchmarks of real shapes without checkpoints on disk
        gen = torch.Generator(device=device).manual_seed(0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, 0.02, generator=gen)
        return model.eval().requires_grad_(False)
    loaded = _load_weights(model, path, device, dtype)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights: {sorted(missing)[:8]}")
    model.requires_grad_(False)
    return model.eval()


def _load_weights(model: DecoderModel, path: str, device, dtype) -> set[str]:
    s = model.shape
    q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    parts: dict[str, int] = {}

    def put(name: str, tensor: torch.Tensor, rows: Optional[tuple[int, int]] = None) -> None:
        p = params[name]
        dst = p.data if rows is None else p.data[rows[0]:rows[1]]
        if dst.shape != tensor.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
        dst.copy_(tensor.to(device=device, dtype=dtype))
        loaded.add(name)
        parts[name] = parts.get(name, 0) + 1

    fused = {  # HF name suffix -> (our suffix, row range or None)
        "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", (0, q)),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", (q, q + kv)),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", (q + kv, q + 2 * kv)),
        "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", (0, q)),
        "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", (q, q + kv)),
        "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", (q + kv, q + 2 * kv)),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", (0, inter)),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", (inter, 2 * inter)),
        "mlp.gate_proj.bias": ("mlp.gate_up_proj.bias", (0, inter)),
        "mlp.up_proj.bias": ("mlp.gate_up_proj.bias", (inter, 2 * inter)),
    }
    unused: list[str] = []
    for file in safetensors_files(path):
        with _open_safetensors(file) as f:
            for key in f.keys():
                m = _LAYER.match(key)
                if m:
                    idx, rest = int(m.group(1)), m.group(2)
                    if not (model.layer_start <= idx < model.layer_end):
                        continue
                    prefix = f"layers.{idx - model.layer_start}."
                    target, rows = fused.get(rest, (rest, None))
                    if prefix + target in params:
                        put(prefix + target, f.get_tensor(key), rows)
                    elif not rest.endswith("rotary_emb.inv_freq"):
                        unused.append(key)
                elif key == "model.embed_tokens.weight":
                    if model.is_first:
                        put("embed_tokens.weight", f.get_tensor(key))
                    if model.is_last and s.tie_word_embeddings:
                        put("lm_head.weight", f.get_tensor(key))
                elif key == "model.norm.weight" and model.is_last:
                    put("norm.weight", f.get_tensor(key))
                elif key == "lm_head.weight":
                    if model.is_last and not s.tie_word_embeddings:
                        put("lm_head.weight", f.get_tensor(key))
                elif not (key == "model.norm.weight" or key.endswith("rotary_emb.inv_freq")):
                    unused.append(key)
    if unused:  # a weight we would silently ignore means the model computes something else
        raise ValueError(f"checkpoint {path!r} has weights this model does not use: {unused[:8]}")
    # A fused tensor counts as loaded only when every part of it was found.
    for name, count in parts.items():
        need = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 1
        if count != need:
            loaded.discard(name)
    return loaded
