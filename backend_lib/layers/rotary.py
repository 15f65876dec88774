"""Rotary position embedding with HF's rope-scaling variants (llama3, linear, yarn, ...).

inv_freq: default and llama3 computed here as transformers computes them (tests compare), the
other scaled variants from transformers' own ROPE_INIT_FUNCTIONS so that they match HF exactly;
cos/sin are precomputed for every position up to max_position_embeddings.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def _rope_params(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return dict(params)


def compute_inv_freq(cfg, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_params(cfg)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", "llama3"):
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return (inv if rope_type == "default" else _llama3_inv_freq(inv, params)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv.float(), float(scaling)


def _llama3_inv_freq(inv: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's scaling, as transformers' `_compute_llama3_parameters` computes it (here so
    that the engine needs no transformers import for Llama 3 checkpoints): long wavelengths
    divided by `factor`, short ones kept, the band between interpolated."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg, head_dim: int):
        super().__init__()
        inv_freq, scaling = compute_inv_freq(cfg, head_dim)
        max_pos = cfg.max_position_embeddings
        t = torch.arange(max_pos, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # Kept in fp32; cast to the activation dtype at use, as HF does.
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply(x, cos, sin):
    return x * cos + _rotate_half(x) * sin
