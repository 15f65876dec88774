"""Rotary position embedding with HF's rope-scaling variants (llama3, linear, yarn, ...).

inv_freq comes from transformers' own ROPE_INIT_FUNCTIONS so scaled variants match HF
exactly; cos/sin are precomputed for every position up to max_position_embeddings.
"""
from __future__ import annotations

import torch
from torch import nn


def _rope_params(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return dict(params)


def compute_inv_freq(cfg, head_dim: int) -> tuple[torch.Tensor, float]:
    params = _rope_params(cfg)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return inv.float(), float(scaling)


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
