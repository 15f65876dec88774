"""GPU tests for backend_lib/layers/triton_attention.py (paged decode / prefill kernels).

Run: python3 -m pytest -q tests/gpu/test_triton_attention.py
Skipped cleanly when CUDA or Triton is absent.  Seeds are fresh per test (printed on
failure); set TRITON_ATTN_TEST_SEED to reproduce one.
"""

import itertools

import pytest

from gpu_helpers import GPU_MARKS, seed_from_env, torch  # skips the module without torch (CUDA: triton)

pytestmark = GPU_MARKS

from backend_lib.layers.triton_attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
    reference_paged_attention,
)

DEV = "cuda"


def _seed() -> int:
    return seed_from_env("TRITON_ATTN_TEST_SEED")


def _rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _tol(dtype):
    return {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}[dtype]


def _make_cache(num_seqs, seq_lens, hkv, d, page, dtype, extra_blocks=7, extra_cols=2):
    """Random K/V cache and a block table with shuffled, non-contiguous block ids."""
    pages_per_seq = [-(-int(L) // page) for L in seq_lens]
    num_blocks = sum(pages_per_seq) + extra_blocks
    k_cache = torch.randn(num_blocks, page, hkv, d, device=DEV, dtype=torch.float32).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, device=DEV, dtype=torch.float32).to(dtype)
    max_blocks = max(pages_per_seq + [1]) + extra_cols
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    # Unused entries hold valid-but-wrong block ids, so reading past seq_len would show.
    block_tables = perm[torch.randint(0, num_blocks, (num_seqs, max_blocks), device=DEV)]
    block_tables = block_tables.to(torch.int32).contiguous()
    i = 0
    for s, n in enumerate(pages_per_seq):
        block_tables[s, :n] = perm[i:i + n]
        i += n
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return k_cache, v_cache, block_tables, seq_lens_t


def _check(out, ref, dtype, seed, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output (seed={seed})"
    err = _rel_err(out, ref)
    assert err < _tol(dtype), f"{what}: rel err {err:.3e} (seed={seed})"


# --------------------------------------------------------------------------- decode
HEADS = [(8, 8), (32, 8), (14, 2)]          # GQA ratio 1, 4 (Llama-3-8B), 7 (Qwen2.5-0.5B)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("d", [64, 128])
def test_decode_matches_reference(dtype, hq, hkv, d):
    seed = _seed()
    lens = [1, 15, 16, 17, 300, 1000, int(torch.randint(2, 700, (1,)))]
    bsz = len(lens)
    k_cache, v_cache, bt, sl = _make_cache(bsz, lens, hkv, d, 16, dtype)
    q = torch.randn(bsz, hq, d, device=DEV, dtype=dtype)
    scale = d ** -0.5
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, scale)
    for splits in (None, 1, 5):     # auto (split-K here), no split, odd split count
        out = torch.full_like(q, float("nan"))
        res = paged_decode_attention(q, k_cache, v_cache, bt, sl, scale, out=out, num_splits=splits)
        assert res is out and out.dtype == dtype
        _check(out, ref, dtype, seed, f"decode splits={splits}")


@pytest.mark.parametrize("page", [8, 16, 32])
def test_decode_block_sizes_head32_and_padding_rows(page):
    seed = _seed()
    dtype = torch.bfloat16
    hq, hkv, d = 12, 3, 32
    lens = [0, 1, page - 1, page, page + 1, 5 * page + 3, 0, 257]
    bsz = len(lens)
    k_cache, v_cache, bt, sl = _make_cache(bsz, lens, hkv, d, page, dtype)
    q = torch.randn(bsz, hq, d, device=DEV, dtype=dtype)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 0.2)
    for splits in (None, 1, 3):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, bt, sl, 0.2, out=out, num_splits=splits)
        _check(out, ref, dtype, seed, f"page={page} splits={splits}")
        assert (out[0] == 0).all() and (out[6] == 0).all(), "seq_len 0 rows must be zeros"


def test_decode_non_pow2_head_dim():
    seed = _seed()
    dtype = torch.float16
    lens = [3, 100, 64]
    k_cache, v_cache, bt, sl = _make_cache(3, lens, 2, 80, 16, dtype)
    q = torch.randn(3, 8, 80, device=DEV, dtype=dtype)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 80 ** -0.5)
    out = paged_decode_attention(q, k_cache, v_cache, bt, sl, 80 ** -0.5)
    _check(out, ref, dtype, seed, "d=80")


def test_decode_large_batch_llama():
    """B*Hkv large -> single-pass path (no split)."""
    seed = _seed()
    dtype = torch.bfloat16
    bsz = 256
    lens = torch.randint(1, 200, (bsz,)).tolist()
    lens[3] = 0
    k_cache, v_cache, bt, sl = _make_cache(bsz, lens, 8, 128, 16, dtype)
    q = torch.randn(bsz, 32, 128, device=DEV, dtype=dtype)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 128 ** -0.5)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, bt, sl, 128 ** -0.5, out=out)
    _check(out, ref, dtype, seed, "B=256")
    assert (out[3] == 0).all()


def test_decode_fp32_cache():
    seed = _seed()
    dtype = torch.float32
    lens = [1, 77, 400]
    k_cache, v_cache, bt, sl = _make_cache(3, lens, 2, 64, 16, dtype)
    q = torch.randn(3, 8, 64, device=DEV, dtype=dtype)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 0.125)
    out = paged_decode_attention(q, k_cache, v_cache, bt, sl, 0.125)
    _check(out, ref, dtype, seed, "fp32")


def test_decode_strided_q_out():
    """q as a view into a fused qkv buffer; out as a view too."""
    seed = _seed()
    dtype = torch.bfloat16
    hq, hkv, d = 14, 2, 64
    lens = [5, 33, 129]
    k_cache, v_cache, bt, sl = _make_cache(3, lens, hkv, d, 16, dtype)
    qkv = torch.randn(3, (hq + 2 * hkv) * d, device=DEV, dtype=dtype)
    q = qkv[:, : hq * d].view(3, hq, d)
    assert not q.is_contiguous()
    big_out = torch.full((3, hq + 1, d), float("nan"), device=DEV, dtype=dtype)
    out = big_out[:, 1:]
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, d ** -0.5)
    paged_decode_attention(q, k_cache, v_cache, bt, sl, d ** -0.5, out=out)
    _check(out, ref, dtype, seed, "strided")
    assert torch.isnan(big_out[:, 0]).all(), "wrote outside out"


@pytest.mark.parametrize("bsz", [2, 128])
def test_decode_cuda_graph_replay(bsz):
    seed = _seed()
    dtype = torch.bfloat16
    hq, hkv, d, page = 32, 8, 128, 16
    max_len = 600
    lens = torch.randint(1, max_len, (bsz,)).tolist()
    k_cache, v_cache, bt, sl = _make_cache(bsz, [max_len] * bsz, hkv, d, page, dtype)
    sl.copy_(torch.tensor(lens, dtype=torch.int32, device=DEV))
    q = torch.randn(bsz, hq, d, device=DEV, dtype=dtype)
    out = torch.empty_like(q)
    scale = d ** -0.5

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):      # warm-up / compile outside capture
            paged_decode_attention(q, k_cache, v_cache, bt, sl, scale, out=out)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, bt, sl, scale, out=out)

    for it in range(3):
        # change every input in place
        q.copy_(torch.randn_like(q))
        k_cache.copy_(torch.randn_like(k_cache))
        v_cache.copy_(torch.randn_like(v_cache))
        new_lens = torch.randint(1, max_len, (bsz,), device=DEV, dtype=torch.int32)
        if it == 1:
            new_lens[0] = 0
        sl.copy_(new_lens)
        bt.copy_(bt[torch.randperm(bsz, device=DEV)])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, scale)
        _check(out, ref, dtype, seed, f"graph replay {it}")
        eager = paged_decode_attention(q, k_cache, v_cache, bt, sl, scale)
        assert torch.equal(eager, out), "graph replay differs from eager"


# --------------------------------------------------------------------------- prefill
def _prefill_case(q_lens, ctx_lens, hq, hkv, d, page, dtype):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    s = len(q_lens)
    k_cache, v_cache, bt, sl = _make_cache(s, seq_lens, hkv, d, page, dtype)
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=DEV)
    q = torch.randn(int(cu[-1]), hq, d, device=DEV, dtype=dtype)
    return q, k_cache, v_cache, cu, sl, bt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_mixed_batch_matches_reference(dtype, hq, hkv, d):
    seed = _seed()
    # pure prefill, chunked prefill (ctx > 0), decode rows (q_len 1), odd lengths
    q_lens = [1, 37, 1, 128, 5, 200, 1, int(torch.randint(1, 90, (1,)))]
    ctx_lens = [0, 0, 300, 0, 17, 333, 16, int(torch.randint(0, 500, (1,)))]
    q, k_cache, v_cache, cu, sl, bt = _prefill_case(q_lens, ctx_lens, hq, hkv, d, 16, dtype)
    scale = d ** -0.5
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, scale, cu_seqlens_q=cu)
    out = torch.full_like(q, float("nan"))
    res = paged_prefill_attention(q, k_cache, v_cache, cu, sl, bt, scale, max(q_lens), out=out)
    assert res is out
    _check(out, ref, dtype, seed, "prefill")


@pytest.mark.parametrize("page", [8, 32])
def test_prefill_block_sizes_head32(page):
    seed = _seed()
    dtype = torch.bfloat16
    q_lens = [3, 1, 70, 1]
    ctx_lens = [page * 2 + 1, 0, page - 1, 5]
    q, k_cache, v_cache, cu, sl, bt = _prefill_case(q_lens, ctx_lens, 4, 1, 32, page, dtype)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 0.3, cu_seqlens_q=cu)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, cu, sl, bt, 0.3, max(q_lens), out=out)
    _check(out, ref, dtype, seed, f"prefill page={page}")


def test_prefill_long_sequence():
    """Long prefill + chunked prefill; also an empty (q_len 0) sequence in the batch."""
    seed = _seed()
    dtype = torch.bfloat16
    q_lens = [1500, 0, 700]
    ctx_lens = [0, 10, 900]
    q, k_cache, v_cache, cu, sl, bt = _prefill_case(q_lens, ctx_lens, 32, 8, 128, 16, dtype)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 128 ** -0.5, cu_seqlens_q=cu)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, cu, sl, bt, 128 ** -0.5, max(q_lens), out=out)
    _check(out, ref, dtype, seed, "prefill long")


def test_prefill_decode_rows_equal_decode_kernel():
    seed = _seed()
    dtype = torch.float16
    lens = [1, 16, 17, 500, 1234]
    k_cache, v_cache, bt, sl = _make_cache(len(lens), lens, 2, 128, 16, dtype)
    q = torch.randn(len(lens), 14, 128, device=DEV, dtype=dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV)
    a = paged_decode_attention(q, k_cache, v_cache, bt, sl, 0.09)
    b = paged_prefill_attention(q, k_cache, v_cache, cu, sl, bt, 0.09, 1)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 0.09)
    _check(a, ref, dtype, seed, "decode")
    _check(b, ref, dtype, seed, "prefill as decode")
    assert (a.float() - b.float()).abs().max().item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_m,num_warps", [(16, 4), (32, 4), (64, 4), (128, 8)])
def test_prefill_tile_configs(dtype, block_m, num_warps):
    """Every BLOCK_M the default heuristic may pick, on a mixed batch (GQA 4)."""
    seed = _seed()
    q_lens = [1, 150, 1, 33, 7]
    ctx_lens = [900, 0, 17, 400, 0]
    q, k_cache, v_cache, cu, sl, bt = _prefill_case(q_lens, ctx_lens, 32, 8, 128, 16, dtype)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 128 ** -0.5, cu_seqlens_q=cu)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, cu, sl, bt, 128 ** -0.5, max(q_lens), out=out,
                            block_m=block_m, num_warps=num_warps)
    _check(out, ref, dtype, seed, f"prefill block_m={block_m}")


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(32, 4, 3), (128, 4, 2), (64, 8, 3)])
def test_decode_tile_configs(block_n, num_warps, num_stages):
    seed = _seed()
    dtype = torch.bfloat16
    lens = [1, 63, 64, 65, 1000, 0]
    k_cache, v_cache, bt, sl = _make_cache(len(lens), lens, 8, 128, 16, dtype)
    q = torch.randn(len(lens), 32, 128, device=DEV, dtype=dtype)
    ref = reference_paged_attention(q, k_cache, v_cache, bt, sl, 128 ** -0.5)
    for splits in (1, 7):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, bt, sl, 128 ** -0.5, out=out, num_splits=splits,
                               block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        _check(out, ref, dtype, seed, f"decode cfg {block_n}/{num_warps}/{num_stages} ns={splits}")
