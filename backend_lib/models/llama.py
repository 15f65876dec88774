"""Llama / Qwen2 / Qwen3 decoder over a paged KV cache.

One module serves the three families; they differ only in flags read from the HF config:
attention bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings, rope scaling.
A model may hold a contiguous range of layers (pipeline stages): the first stage owns the
embedding, the last the final norm and lm_head. The last stage's forward ends with the final
norm (as HF's last_hidden_state does); compute_logits is the LM head of the rows that sample.

On CUDA (with Triton) the layers run a residual stream with fused kernels (layers/fused_ops.py):
one kernel each for add+RMSNorm (the last one with the final norm), rotary+KV write (+ Qwen3
q/k norm) and silu*mul. Elsewhere (CPU), or with ``DecoderModel.use_fused_ops = False``, the
plain torch code below runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import decode_gemv, fused_ops
from ..layers.attention import AttentionMetadata, paged_attention, write_kv
from ..layers.triton_attention import DecodePartials
from ..layers.rotary import RotaryEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool          # q/k/v projections carry a bias
    o_proj_bias: bool             # Llama's attention_bias also covers o_proj (Qwen2's does not)
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelShape":
        mt = cfg.model_type
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            model_type=mt, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_norm_eps=cfg.rms_norm_eps,
            attention_bias=bool(getattr(cfg, "attention_bias", False)) or mt == "qwen2",
            o_proj_bias=bool(getattr(cfg, "attention_bias", False)) and mt != "qwen2",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=(mt == "qwen3"),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as HF (normalize in fp32, cast back, then scale) so logits match.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Projection(nn.Linear):
    """nn.Linear whose matmul may go through a per-shape GEMM table (layers/skinny_gemm.py,
    set by `DecoderModel.set_gemm_table`); without one it is exactly nn.Linear."""

    gemm = None  # SkinnyGemmTable or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is None:
            return F.linear(x, self.weight, self.bias)
        return self.gemm.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, s: ModelShape, layer_idx: int):
        super().__init__()
        self.s, self.layer_idx = s, layer_idx
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        # q, k and v fused into one matmul (weights concatenated at load time).
        self.qkv_proj = Projection(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.attention_bias)
        self.o_proj = Projection(self.q_size, s.hidden_size, bias=s.o_proj_bias)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.scale = s.head_dim ** -0.5

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache, meta: AttentionMetadata,
                fused: bool = False):
        out = self.attend(self.qkv_proj(x), positions, rotary, kv_cache, meta, fused)
        return self.o_proj(out)

    def attend(self, qkv, positions, rotary: RotaryEmbedding, kv_cache, meta: AttentionMetadata,
               fused: bool = False, pdl: bool = False, rotated: bool = False, partials: bool = False):
        """qkv projection's output -> attention output [T, q_size], before o_proj. pdl: the
        fused kernels launch with programmatic dependent launch (layers/decode_gemv.py).
        rotated: q is already rotated and k/v already in the cache (the projection's epilogue
        did it), so only attention runs. partials (one decode row on CUDA): its splits'
        unmerged states (triton_attention.DecodePartials) for o_proj to merge."""
        s = self.s
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        k_cache, v_cache = kv_cache
        if rotated:
            pass  # the q/k/v projection's epilogue rotated q in place and wrote k/v to the cache
        elif fused:  # one kernel: [q/k norm,] rotary (q in place), K/V into the paged cache
            qn, kn = (self.q_norm.weight, self.k_norm.weight) if s.qk_norm else (None, None)
            q = fused_ops.rope_and_write_kv(q, k, v, rotary.cos_cache, rotary.sin_cache, positions,
                                            k_cache, v_cache, meta.slot_mapping, qn, kn, s.rms_norm_eps,
                                            pdl=pdl)
        else:
            if s.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(positions, q, k)
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # rotated: the epilogue left this step's rotated k and v in qkv as well as in the cache
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, pdl=pdl, partials=partials,
                              newest_kv=(k, v) if rotated else None)
        return out if not isinstance(out, torch.Tensor) else out.reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.gate_up_proj = Projection(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)
        self.down_proj = Projection(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)

    def forward(self, x, fused: bool = False):
        if fused:
            return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, layer_idx)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x, positions, rotary, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, h, residual, positions, rotary, kv_cache, meta):
        """Residual-stream form (CUDA): the layer's output is h + residual, the sum being
        deferred into the next layer's fused add+norm. residual None: h is the full stream."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = h, fused_ops.rms_norm(h, ln1.weight, ln1.eps)
        else:
            h, residual = fused_ops.fused_add_rms_norm(h, residual, ln1.weight, ln1.eps)
        h = self.self_attn(h, positions, rotary, kv_cache, meta, fused=True)
        h, residual = fused_ops.fused_add_rms_norm(h, residual, ln2.weight, ln2.eps)
        return self.mlp(h, fused=True), residual

    def forward_one_token(self, h, residual, positions, rotary, kv_cache, meta, gemv,
                          mlp_kernel=None, oproj_kernel=None, index: Optional[int] = None):
        """forward_fused for a single token: each projection is one kernel that also runs the
        op feeding it (add + norm, silu * mul), launched with PDL (layers/decode_gemv.py).
        mlp_kernel (layers/decode_mlp.LayerMlp): the whole MLP as one kernel, whose output h is an fp32
        accumulator that the next projection's add + norm rounds. oproj_kernel
        (layers/decode_oproj.LayerOproj): attention's splits merged and projected in one
        kernel, its output likewise an fp32 accumulator. index: this layer's place in the
        forward (the accumulator rings of gemv's split-K projections; None: none split)."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        attn, mlp, s = self.self_attn, self.mlp, self.self_attn.s
        # Qwen3's per-head q/k norm needs whole heads: its rope stays a kernel of its own.
        rope = None
        if gemv.rope and not s.qk_norm:
            rope = decode_gemv.RopeKV(rotary.cos_cache, rotary.sin_cache, positions, *kv_cache,
                                      meta.slot_mapping, s.num_heads, s.num_kv_heads, s.head_dim)
        if residual is None:
            qkv, _ = gemv.run(h, attn.qkv_proj, decode_gemv.RMSNORM, None, ln1.weight, ln1.eps, rope)
            residual = h
        else:
            qkv, residual = gemv.run(h, attn.qkv_proj, decode_gemv.ADD_RMSNORM, residual,
                                     ln1.weight, ln1.eps, rope)
        o = attn.attend(qkv, positions, rotary, kv_cache, meta, fused=True, pdl=gemv.pdl,
                        rotated=rope is not None, partials=gemv.merge_attention or oproj_kernel is not None)
        if oproj_kernel is not None and isinstance(o, DecodePartials):
            h = oproj_kernel(o, attn.o_proj)
        else:
            h = gemv.project_attention(o, attn.o_proj, layer=index)
        if mlp_kernel is not None:
            return mlp_kernel(h, residual, ln2, mlp)
        gate_up, residual = gemv.run(h, mlp.gate_up_proj, decode_gemv.ADD_RMSNORM, residual,
                                     ln2.weight, ln2.eps)
        h, _ = gemv.run(gate_up, mlp.down_proj, decode_gemv.SILU_MUL, layer=index)
        return h, residual


class DecoderModel(nn.Module):
    """Layers [layer_start, layer_end) of a Llama-family decoder."""

    use_fused_ops = True  # set False (class or instance) to run the torch path on CUDA too
    one_token_gemv = None  # layers/decode_gemv.DecodeGemv: one-token forwards go through it
    one_token_mlp = None  # layers/decode_mlp.DecodeMlp: their MLPs as one kernel each
    one_token_oproj = None  # layers/decode_oproj.DecodeOproj: attention merge + o_proj as one

    def __init__(self, hf_config, layer_start: int = 0, layer_end: Optional[int] = None):
        super().__init__()
        s = self.shape = ModelShape.from_hf_config(hf_config)
        self.layer_start = layer_start
        self.layer_end = s.num_layers if layer_end is None else layer_end
        self.is_first = layer_start == 0
        self.is_last = self.layer_end == s.num_layers
        if self.is_first:
            self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, i) for i in range(self.layer_start, self.layer_end))
        if self.is_last:
            self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
            self.lm_head = Projection(s.hidden_size, s.vocab_size, bias=False)
        self.rotary: Optional[RotaryEmbedding] = None  # set by the loader (not built on meta)

    def forward(self, input_ids_or_hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids_or_hidden) if self.is_first else input_ids_or_hidden
        if self._fused(x):
            residual = None
            one_token = self.one_token_gemv is not None and x.shape[0] == 1
            if one_token and not self.is_first:
                # A plain launch between the step's metadata writers and the PDL chain, as the
                # embedding gather is on the first stage (layers/decode_gemv.py, the chain).
                x = x.clone()
            mlp_kernels = oproj_kernels = None
            if one_token and self.one_token_mlp is not None:
                mlp_kernels = self.one_token_mlp.for_layers(x, self.layers)
            if one_token and self.one_token_oproj is not None:
                oproj_kernels = self.one_token_oproj.for_layers(self.layers, x.dtype)
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                if one_token:
                    x, residual = layer.forward_one_token(
                        x, residual, positions, self.rotary, kv, meta, self.one_token_gemv,
                        mlp_kernels[i] if mlp_kernels else None,
                        oproj_kernels[i] if oproj_kernels else None, index=i)
                else:
                    x, residual = layer.forward_fused(x, residual, positions, self.rotary, kv, meta)
            if not self.is_last:
                # x may be an fp32 accumulator (one-token split-K projections, the fused MLP)
                return x if residual is None else x.to(residual.dtype) + residual
            # The stream's last add fused with the final norm: one kernel, which also rounds an
            # fp32 accumulator x to the stream's dtype.
            if residual is None:
                return fused_ops.rms_norm(x, self.norm.weight, self.norm.eps)
            return fused_ops.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rotary, kv, meta)
        return self.norm(x) if self.is_last else x

    def projections(self) -> list[Projection]:
        return [m for m in self.modules() if isinstance(m, Projection)]

    def set_gemm_table(self, table) -> None:
        """Route every projection's matmul through `table.linear` (None: plain F.linear)."""
        for p in self.projections():
            p.gemm = table

    def _fused(self, x: torch.Tensor) -> bool:
        return self.use_fused_ops and fused_ops.available(x)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden: rows of the last stage's output (already through the final norm). float32
        logits, or with upcast=False the LM head's own dtype (the sampler's kernels upcast
        in registers: layers/sampler.native_logits_ok)."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits
