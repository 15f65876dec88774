"""Paged attention: the KV write, a reference path that runs anywhere (CPU tests), and the
dispatch to the Triton kernels on CUDA.

KV cache layout per layer: k_cache, v_cache = [num_blocks, block_size, num_kv_heads, head_dim].
The current step's K/V are written first (slot_mapping), so attention reads only the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .triton_support import INTERPRET  # the kernels also run on CPU tensors in Triton's interpreter


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] int64: flat KV slot of each new token
    block_tables: torch.Tensor        # [S, max_blocks] int32
    seq_lens: torch.Tensor            # [S] int32: KV length of each sequence incl. new tokens
    cu_seqlens_q: torch.Tensor        # [S+1] int32: offsets of each sequence's new tokens
    max_q_len: Optional[int]          # host int (grid size of the varlen kernel); None: the
                                      # flat grid from the shapes alone (CUDA-graph capturable)
    is_decode: bool                   # every sequence has exactly one new token
    # Host copies for the reference path (CPU only; None on the CUDA fast path).
    seq_lens_host: Optional[list[int]] = None
    q_lens_host: Optional[list[int]] = None


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Scatter this step's K/V into their paged slots. Padding rows of a CUDA-graph bucket
    write into block 0, which the block pool reserves and never hands out."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, pdl: bool = False,
                    partials: bool = False, newest_kv: Optional[tuple] = None):
    """pdl: the decode kernels launch with programmatic dependent launch (one-token forwards).
    partials: one decode row on the Triton path returns its splits' unmerged states
    (triton_attention.DecodePartials, for the consumer to merge); anything else the output.
    newest_kv: decode rows' (k, v) of this step, also in the cache: the decode kernels read
    them from here and load the cache before their PDL wait (triton_attention)."""
    if q.is_cuda or (partials and INTERPRET):
        from . import triton_attention as ta
        if newest_kv is not None and not ta.newest_kv_wanted(k_cache):
            newest_kv = None  # the cache holds the newest K/V too
        if partials and meta.is_decode and q.shape[0] == 1 and q.shape[-1] & (q.shape[-1] - 1) == 0:
            return ta.paged_decode_partials(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, pdl=pdl,
                                            newest_kv=newest_kv)
        if meta.is_decode:
            return ta.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                             pdl=pdl, newest_kv=newest_kv)
        return ta.paged_prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                          meta.block_tables, scale, meta.max_q_len)
    if meta.is_decode and len(meta.seq_lens_host) > 1:
        return reference_decode_attention(q, k_cache, v_cache, meta, scale)
    return reference_paged_attention(q, k_cache, v_cache, meta, scale)


def reference_decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Decode rows (one query each) in one batched SDPA: every row's KV gathered through its
    block table up to the longest row, the tail masked. The CPU path's decode steps; the
    per-sequence loop below is the reference it must match."""
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    hq = q.shape[1]
    seq_lens = torch.tensor(meta.seq_lens_host)
    max_len = max(int(seq_lens.max()), 1)
    nblk = (max_len + bs - 1) // bs
    blocks = meta.block_tables[:, :nblk].long()                      # [S, nblk]
    k = k_cache[blocks].reshape(len(seq_lens), -1, hkv, d)[:, :max_len]  # [S, L, Hkv, D]
    v = v_cache[blocks].reshape(len(seq_lens), -1, hkv, d)[:, :max_len]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=2)
        v = v.repeat_interleave(hq // hkv, dim=2)
    mask = (torch.arange(max_len).unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]  # [S,1,1,L]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale)   # [S, Hq, 1, D]
    return o.squeeze(2)


def reference_paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """One sequence at a time: gather its KV through the block table, causal SDPA with the
    queries placed at the end of the sequence. Exact, simple, slow: the CPU path."""
    bs = k_cache.shape[1]
    hq, hkv = q.shape[1], k_cache.shape[2]
    # Zeros where a graph bucket's padding tokens (past the last sequence) sit.
    out = torch.empty_like(q) if sum(meta.q_lens_host) == q.shape[0] else torch.zeros_like(q)
    start = 0
    for i, (kv_len, q_len) in enumerate(zip(meta.seq_lens_host, meta.q_lens_host)):
        if q_len == 0:  # a padding row of a graph bucket
            continue
        nblk = (kv_len + bs - 1) // bs
        blocks = meta.block_tables[i, :nblk].long()
        k = k_cache[blocks].reshape(-1, hkv, k_cache.shape[3])[:kv_len]
        v = v_cache[blocks].reshape(-1, hkv, v_cache.shape[3])[:kv_len]
        if hq != hkv:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        qi = q[start:start + q_len]
        # Query j sits at absolute position kv_len - q_len + j and sees keys <= it.
        qpos = torch.arange(kv_len - q_len, kv_len).unsqueeze(1)
        mask = torch.arange(kv_len).unsqueeze(0) <= qpos
        o = F.scaled_dot_product_attention(qi.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                           v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale)
        out[start:start + q_len] = o.squeeze(0).transpose(0, 1)
        start += q_len
    return out
