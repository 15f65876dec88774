"""The mixed-step CUDA-graph buckets (mixed_graphs.py captures one program per bucket): the
token buckets, from the `cuda_graph_mixed_tokens` setting or by default, and each one's
sequence buckets. Torch-free: EngineConfig checks the setting with it wherever it is built.
"""
from __future__ import annotations

from typing import Sequence

MIN_TOKEN_BUCKET = 16
# Above this many tokens a step's GEMMs are compute-bound (its cost grows with the padded
# tokens), so the default buckets step by 1.5x / 1.33x there instead of 2x.
FINE_BUCKETS_FROM = 256


def default_token_buckets(max_tokens: int) -> tuple[int, ...]:
    """16, 32, .., 256, 384, 512, 768, 1024, 1536, .. below max_tokens, plus max_tokens."""
    out, b = [], MIN_TOKEN_BUCKET
    while b < max_tokens:
        out.append(b)
        if b >= FINE_BUCKETS_FROM and b * 3 // 2 < max_tokens:
            out.append(b * 3 // 2)
        b *= 2
    return tuple(out) + (max_tokens,)


def parse_token_buckets(spec: str, max_tokens: int) -> tuple[int, ...]:
    """Token buckets: a comma list ("" = default_token_buckets). Buckets above max_tokens
    can never be used and are an error."""
    spec = (spec or "").strip()
    if not spec:
        return default_token_buckets(max_tokens)
    try:
        vals = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"EngineConfig.cuda_graph_mixed_tokens: not a comma list of integers (got {spec!r})") from None
    if not vals or vals[0] < 1 or vals[-1] > max_tokens:
        raise ValueError(f"EngineConfig.cuda_graph_mixed_tokens: buckets must be in 1..max_num_batched_tokens "
                         f"({max_tokens}) (got {spec!r})")
    return tuple(vals)


def seq_buckets(token_bucket: int, max_seqs: int) -> tuple[int, ...]:
    """Row buckets of one token bucket: powers of 4 below min(token_bucket, max_seqs), plus
    that cap. Coarse on purpose: the rows only size the LM head and the sampler (a small
    part of a mixed step), and every bucket is one more captured graph per variant."""
    cap = min(token_bucket, max_seqs)
    out, s = [], 4
    while s < cap:
        out.append(s)
        s *= 4
    return tuple(out) + (cap,)


def mixed_buckets(token_buckets: Sequence[int], max_seqs: int) -> tuple[tuple[int, int], ...]:
    return tuple((t, s) for t in token_buckets for s in seq_buckets(t, max_seqs))
