"""The flat-grid varlen paged attention (paged_prefill_attention with max_q_len=None: the grid
comes from the shapes (T, S) alone, so one CUDA graph per (T, S) bucket serves any q_lens)
against the float32 torch reference: ragged sequences, q_len 1 and long, seq_len > q_len
(prefix-cache hits, later chunks), a graph bucket's padding tokens and padding rows, GQA
ratios 1 / 4 / 7, and a captured graph replayed over changed lengths.

Run: python3 -m pytest -q tests/gpu/test_flat_prefill_attention.py
Also on CPU under Triton's interpreter (small shapes; needs the triton package):
     TRITON_INTERPRET=1 FLAT_ATTN_ON_CPU=1 python -m pytest -q tests/gpu/test_flat_prefill_attention.py
Seed: FLAT_ATTN_TEST_SEED reproduces one run.
"""
import itertools

import pytest

from gpu_helpers import kernel_test_target, seed_from_env, torch

_ON_CPU, pytestmark, DEV = kernel_test_target("FLAT_ATTN_ON_CPU")

from backend_lib.layers.triton_attention import paged_prefill_attention, reference_paged_attention  # noqa: E402

HEADS = [(4, 4), (8, 2), (14, 2)]   # GQA ratio 1, 4, 7 (Qwen2.5-0.5B)


def _bucketed_case(q_lens, ctx_lens, tokens, seqs, hq, hkv, d, page, dtype):
    """q_lens / ctx_lens of the real rows, padded to a (tokens, seqs) bucket the way
    MixedMeta pads: padding rows have q_len 0 and seq_len 0; padding tokens sit after the
    last row's tokens and belong to no row."""
    n = len(q_lens)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)] + [0] * (seqs - n)
    pages = [-(-L // page) for L in seq_lens]
    num_blocks = sum(pages) + 5
    k_cache = torch.randn(num_blocks, page, hkv, d, device=DEV).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, device=DEV).to(dtype)
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    bt = perm[torch.randint(0, num_blocks, (seqs, max(pages) + 2), device=DEV)].to(torch.int32).contiguous()
    i = 0
    for s, m in enumerate(pages):
        bt[s, :m] = perm[i:i + m]
        i += m
    cu = list(itertools.accumulate([0] + list(q_lens)))
    cu += [cu[-1]] * (seqs - n)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(tokens, hq, d, device=DEV).to(dtype)
    return q, k_cache, v_cache, cu_t, sl, bt, cu[-1]


def _check(q, k_cache, v_cache, cu, sl, bt, real, seed, what, dtype):
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, cu, sl, bt, scale, None, out=out)
    ref = reference_paged_attention(q[:real], k_cache, v_cache, bt, sl, scale, cu_seqlens_q=cu)
    got = out[:real].float()
    assert not torch.isnan(got).any(), f"{what}: NaN in a real token's output (seed={seed})"
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}[dtype]
    assert err < tol, f"{what}: rel err {err:.3e} (seed={seed})"
    # Padding tokens are left alone (the graph program never reads their attention output).
    assert torch.isnan(out[real:]).all(), f"{what}: a padding token's output was written"
    return out


_CASES = [  # (q_lens, ctx_lens, tokens bucket, seqs bucket)
    ([1, 1, 1], [0, 5, 40], 16, 4),                       # decode rows only, and a bucket's padding
    ([3, 1, 20, 1], [0, 33, 16, 7], 32, 4),               # a chunk among decodes, chunk with context
    ([9], [0], 16, 4),                                    # one prefill, padding rows and tokens
    ([17, 1, 30], [31, 64, 0], 64, 16),                   # prefix-cache hit (context mid-block)
    ([1] * 12 + [19], list(range(0, 36, 3)) + [5], 32, 16),  # many decodes + one chunk
    ([64], [0], 64, 1),                                   # exactly full bucket
]


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("case", range(len(_CASES)))
def test_flat_grid_matches_reference(hq, hkv, case):
    seed = seed_from_env("FLAT_ATTN_TEST_SEED")
    q_lens, ctx_lens, tokens, seqs = _CASES[case]
    dtype = torch.float32 if _ON_CPU else torch.bfloat16
    args = _bucketed_case(q_lens, ctx_lens, tokens, seqs, hq, hkv, 32 if _ON_CPU else 64, 16, dtype)
    _check(*args, seed, f"case {case} heads {hq}/{hkv}", dtype)


@pytest.mark.parametrize("page", [8, 32])
def test_flat_grid_long_rows_and_page_sizes(page):
    seed = seed_from_env("FLAT_ATTN_TEST_SEED")
    dtype = torch.float32 if _ON_CPU else torch.bfloat16
    q_lens, ctx_lens = ([40, 1, 2], [page + 3, 2 * page, 0]) if _ON_CPU else ([700, 1, 300, 1], [0, 900, 1200, 5])
    tokens = 64 if _ON_CPU else 1024
    args = _bucketed_case(q_lens, ctx_lens, tokens, 4, 14, 2, 32 if _ON_CPU else 64, page, dtype)
    _check(*args, seed, f"long rows page {page}", dtype)


@pytest.mark.skipif(_ON_CPU, reason="CUDA graphs")
def test_flat_grid_captured_then_replayed_over_new_lengths():
    """One capture, replays with other q_lens / contexts / row counts in the same bucket."""
    seed = seed_from_env("FLAT_ATTN_TEST_SEED")
    dtype = torch.bfloat16
    tokens, seqs, hq, hkv, d, page = 256, 16, 14, 2, 64, 16
    q, k_cache, v_cache, cu, sl, bt, _ = _bucketed_case([1], [0], tokens, seqs, hq, hkv, d, page, dtype)
    k_cache = torch.randn(400, page, hkv, d, device=DEV).to(dtype)
    v_cache = torch.randn(400, page, hkv, d, device=DEV).to(dtype)
    bt = torch.zeros(seqs, 64, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    scale = d ** -0.5
    paged_prefill_attention(q, k_cache, v_cache, cu, sl, bt, scale, None, out=out)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention(q, k_cache, v_cache, cu, sl, bt, scale, None, out=out)
    rng = torch.Generator().manual_seed(seed)
    for it in range(5):
        n = int(torch.randint(1, seqs + 1, (1,), generator=rng))
        q_lens = torch.randint(1, 3, (n,), generator=rng).tolist()
        q_lens[0] = int(torch.randint(1, tokens - sum(q_lens) + 2, (1,), generator=rng))
        ctx = torch.randint(0, 300, (n,), generator=rng).tolist()
        lens = [a + b for a, b in zip(q_lens, ctx)] + [0] * (seqs - n)
        c = list(itertools.accumulate([0] + q_lens))
        cu.copy_(torch.tensor(c + [c[-1]] * (seqs - n), dtype=torch.int32))
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        bt.copy_(torch.randint(0, 400, bt.shape, dtype=torch.int32))
        q.copy_(torch.randn(q.shape).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        real = c[-1]
        ref = reference_paged_attention(q[:real], k_cache, v_cache, bt, sl, scale, cu_seqlens_q=cu)
        err = ((out[:real].float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"replay {it}: rel err {err:.3e} (seed={seed})"
