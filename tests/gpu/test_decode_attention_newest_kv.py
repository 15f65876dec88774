"""GPU tests for the decode attention's newest_kv (backend_lib/layers/triton_attention.py): each
row's newest K/V come from the q/k/v projection's output, never from the cache, whose tiles the
kernel loads before its PDL wait. The cache's newest slots hold NaN here, so a kernel that reads
them fails; the result must equal the float32 reference over the true cache, for the reduce
kernel, the fused reduce, the unsplit kernel and the partials merged by the consumer.

Run: python3 -m pytest -q tests/gpu/test_decode_attention_newest_kv.py
Also runs on CPU under Triton's interpreter:
     TRITON_INTERPRET=1 DECODE_ATTN_ON_CPU=1 python -m pytest -q tests/gpu/test_decode_attention_newest_kv.py
Seed: TRITON_ATTN_TEST_SEED reproduces one run.
"""

import pytest

from gpu_helpers import kernel_test_target, seed_from_env, torch

_ON_CPU, pytestmark, DEV = kernel_test_target("DECODE_ATTN_ON_CPU")
if _ON_CPU:
    DTYPES = [torch.float32]
    HEADS = [(14, 2, 64), (4, 4, 32)]
else:
    DTYPES = [torch.bfloat16, torch.float32]
    HEADS = [(14, 2, 64), (32, 8, 128)]
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}
PAGE = 16


def _attn():
    from backend_lib.layers import triton_attention
    return triton_attention


def _case(lens, hq, hkv, d, dtype):
    """q, the true caches, block tables, seq_lens, and the rows' newest (k, v) as the q/k/v
    projection's output holds them: one [B, Hq + 2 Hkv, D] buffer, k and v views of it."""
    pages = [-(-n // PAGE) for n in lens]
    num_blocks = sum(pages) + 3
    k = torch.randn(num_blocks, PAGE, hkv, d, device=DEV).to(dtype)
    v = torch.randn(num_blocks, PAGE, hkv, d, device=DEV).to(dtype)
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    bt = perm[torch.randint(0, num_blocks, (len(lens), max(pages + [1]) + 1), device=DEV)].contiguous()
    i = 0
    for s, n in enumerate(pages):
        bt[s, :n] = perm[i:i + n]
        i += n
    qkv = torch.randn(len(lens), hq + 2 * hkv, d, device=DEV).to(dtype)
    for s, n in enumerate(lens):
        if n:
            page, slot = int(bt[s, (n - 1) // PAGE]), (n - 1) % PAGE
            qkv[s, hq:hq + hkv] = k[page, slot]
            qkv[s, hq + hkv:] = v[page, slot]
    return qkv, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=DEV)


def _poisoned(cache, bt, lens):
    """The cache with every row's newest slot NaN."""
    bad = cache.clone()
    for s, n in enumerate(lens):
        if n:
            bad[int(bt[s, (n - 1) // PAGE]), (n - 1) % PAGE] = float("nan")
    return bad


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_newest_kv_replaces_the_cache_slot(dtype, hq, hkv, d):
    ta = _attn()
    seed = seed_from_env("TRITON_ATTN_TEST_SEED")
    block_n = 32 if dtype == torch.float32 else 64
    # newest token in the first tile, on a tile edge, past the first round of splits, padding rows
    lens = [1, 0, block_n, block_n + 1, 7 * block_n + 5, 17, 0, 300]
    qkv, k, v, bt, sl = _case(lens, hq, hkv, d, dtype)
    q, kn, vn = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    ref = ta.reference_paged_attention(q, k, v, bt, sl, d ** -0.5)
    kb, vb = _poisoned(k, bt, lens), _poisoned(v, bt, lens)
    assert torch.isnan(ta.paged_decode_attention(q, kb, vb, bt, sl, d ** -0.5, num_splits=2)).any(), \
        "the poison must reach a kernel that reads the cache's newest slot"
    for splits in (1, 2, 3, 8):
        for fused in (False, True):
            out = ta.paged_decode_attention(q, kb, vb, bt, sl, d ** -0.5, num_splits=splits, fused_reduce=fused,
                                            newest_kv=(kn, vn))
            assert not torch.isnan(out).any(), (splits, fused, seed)
            assert _rel(out, ref) < TOL[dtype], (splits, fused, seed)
            assert (out[1] == 0).all() and (out[6] == 0).all(), "seq_len 0 rows must be zeros"


@pytest.mark.parametrize("n", [1, 40, 333])
def test_newest_kv_through_the_partials(n):
    ta = _attn()
    seed = seed_from_env("TRITON_ATTN_TEST_SEED")
    hq, hkv, d, dtype = 14, 2, 64, DTYPES[0]
    qkv, k, v, bt, sl = _case([n], hq, hkv, d, dtype)
    q, kn, vn = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    ref = ta.reference_paged_attention(q, k, v, bt, sl, d ** -0.5)
    for splits in (1, 4):
        parts = ta.paged_decode_partials(q, _poisoned(k, bt, [n]), _poisoned(v, bt, [n]), bt, sl, d ** -0.5,
                                         num_splits=splits, newest_kv=(kn, vn))
        out = ta.merge_decode_partials(parts)
        assert _rel(out, ref) < TOL[dtype], (n, splits, seed)


def test_newest_kv_shape_errors_name_the_field():
    ta = _attn()
    qkv, k, v, bt, sl = _case([20, 5], 4, 2, 32, torch.float32)
    q = qkv[:, :4]
    with pytest.raises(ValueError, match=r"newest_kv k: must be \[batch 2, num_kv_heads 2, head_dim 32\]"):
        ta.paged_decode_attention(q, k, v, bt, sl, 0.2, newest_kv=(qkv[:1, 4:6], qkv[:, 6:]))
    with pytest.raises(ValueError, match=r"newest_kv v: must be .* contiguous last dim"):
        ta.paged_decode_attention(q, k, v, bt, sl, 0.2, newest_kv=(qkv[:, 4:6], qkv[:, 6:].transpose(1, 2)))


def test_one_token_steps_take_newest_kv_only_for_small_tiles():
    """The gate paged_attention applies: newest_kv where the first tile held across the wait
    is at most 16 KB: head_dim 64 in bf16 (64-token tiles) or fp32 (32), head_dim 128 in bf16
    (32-token tiles); not head_dim 128 in fp32 nor head_dim 256 in bf16 (32 KB)."""
    ta = _attn()

    def cache(d, dtype=torch.float32):
        return torch.zeros(2, PAGE, 2, d, device=DEV, dtype=dtype)

    assert ta.newest_kv_pays(cache(64, torch.bfloat16)) and ta.newest_kv_pays(cache(64))
    assert ta.newest_kv_pays(cache(128, torch.bfloat16))
    assert not ta.newest_kv_pays(cache(128)) and not ta.newest_kv_pays(cache(256, torch.bfloat16))


def test_auto_tile_halves_for_wide_16_bit_heads_while_the_context_splits(monkeypatch):
    """The automatic tile (block_n, num_stages, num_warps): 64 KV tokens for 16-bit caches with
    head_dim below 128; from 128 up, 32 while batch x kv heads is below 3 programs an SM (the
    context splits: the 64-token tile spills and measured slower) and 64 from there (unsplit,
    it measured faster); 32 for fp32 caches. BACKEND_LIB_DECODE_ATTN_TILE still overrides it."""
    from backend_lib import envs
    from backend_lib.layers.triton_support import num_sms
    ta = _attn()
    monkeypatch.delenv(envs.DECODE_ATTN_TILE_ENV, raising=False)

    def tiling(d, dtype, batch, kv_heads=8):
        return ta._decode_tiling(torch.zeros(1, PAGE, kv_heads, d, device=DEV, dtype=dtype), batch)

    first_unsplit = -(-3 * num_sms(torch.device(DEV)) // 8)   # the smallest batch (8 kv heads) left unsplit
    for dtype in (torch.bfloat16, torch.float16):
        assert [tiling(64, dtype, b) for b in (1, first_unsplit, 512)] == [(64, 3, 4)] * 3
        for d in (128, 256):
            assert [tiling(d, dtype, b) for b in (1, 8, first_unsplit - 1)] == [(32, 3, 4)] * 3, (d, dtype)
            assert [tiling(d, dtype, b) for b in (first_unsplit, 64, 256)] == [(64, 3, 4)] * 3, (d, dtype)
        assert tiling(128, dtype, 64, kv_heads=1) == (32, 3, 4)    # 64 programs: still split
    for d in (64, 128, 256):
        assert [tiling(d, torch.float32, b) for b in (1, 256)] == [(32, 2, 4)] * 2
    monkeypatch.setenv(envs.DECODE_ATTN_TILE_ENV, "64x8")
    assert tiling(128, torch.bfloat16, 1) == (64, 3, 8)
