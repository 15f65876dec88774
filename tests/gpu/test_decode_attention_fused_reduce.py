"""GPU tests for the split decode attention with the fused reduce (the last split of each
sequence and kv head to finish merges the partial results; backend_lib/layers/triton_attention.py):
against the float32 reference and the two-kernel path, with padding rows (zeros), one-tile
rows, rows longer than the splits, launched again and again (the counters must come back to
0), and replayed in a CUDA graph with fresh lengths.

Run: python3 -m pytest -q tests/gpu/test_decode_attention_fused_reduce.py
Also runs on CPU under Triton's interpreter (programs run one after another there, so the
merge logic is checked but not the memory ordering between programs):
     TRITON_INTERPRET=1 DECODE_ATTN_ON_CPU=1 python -m pytest -q tests/gpu/test_decode_attention_fused_reduce.py
Seed: TRITON_ATTN_TEST_SEED reproduces one run.
"""

import pytest

from gpu_helpers import kernel_test_target, seed_from_env, torch

_ON_CPU, pytestmark, DEV = kernel_test_target("DECODE_ATTN_ON_CPU")
if _ON_CPU:
    DTYPES = [torch.float32]
    HEADS = [(14, 2, 64), (4, 4, 32)]
else:
    DTYPES = [torch.bfloat16, torch.float16, torch.float32]
    HEADS = [(14, 2, 64), (32, 8, 128), (12, 3, 32)]
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def _attn():
    from backend_lib.layers import triton_attention
    return triton_attention


def _case(lens, hq, hkv, d, page, dtype):
    """q, caches, shuffled block tables (unused entries point at real blocks), seq_lens."""
    pages = [-(-n // page) for n in lens]
    num_blocks = sum(pages) + 5
    k = torch.randn(num_blocks, page, hkv, d, device=DEV).to(dtype)
    v = torch.randn(num_blocks, page, hkv, d, device=DEV).to(dtype)
    width = max(pages + [1]) + 2
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    bt = perm[torch.randint(0, num_blocks, (len(lens), width), device=DEV)].contiguous()
    i = 0
    for s, n in enumerate(pages):
        bt[s, :n] = perm[i:i + n]
        i += n
    q = torch.randn(len(lens), hq, d, device=DEV).to(dtype)
    return q, k, v, bt, torch.tensor(lens, dtype=torch.int32, device=DEV)


def _rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_fused_reduce_equals_the_reference_and_the_reduce_kernel(dtype, hq, hkv, d):
    ta = _attn()
    seed = seed_from_env("TRITON_ATTN_TEST_SEED")
    block_n = 32 if dtype == torch.float32 else 64
    lens = [0, 1, 17, block_n, block_n + 1, 5 * block_n + 3, 0, 300]
    q, k, v, bt, sl = _case(lens, hq, hkv, d, 16, dtype)
    ref = ta.reference_paged_attention(q, k, v, bt, sl, d ** -0.5)
    for splits in (2, 3, 8):
        two = ta.paged_decode_attention(q, k, v, bt, sl, d ** -0.5, num_splits=splits, fused_reduce=False)
        for launch in range(3):  # the counters are back at 0 after each launch
            out = torch.full_like(q, float("nan"))
            ta.paged_decode_attention(q, k, v, bt, sl, d ** -0.5, out=out, num_splits=splits, fused_reduce=True)
            assert not torch.isnan(out).any(), (splits, launch, seed)
            assert _rel(out, ref) < TOL[dtype], (splits, launch, seed)
            assert (out[0] == 0).all() and (out[6] == 0).all(), "seq_len 0 rows must be zeros"
            # the same merge as the reduce kernel's, in the same order: equal up to rounding
            assert torch.allclose(out.float(), two.float(), rtol=1e-3, atol=1e-3), (splits, launch, seed)
        assert int(ta._COUNTERS[k.data_ptr()].abs().sum()) == 0, seed


def test_the_switch_picks_the_path(monkeypatch):
    ta = _attn()
    from backend_lib import envs
    q, k, v, bt, sl = _case([40, 90], 4, 2, 32, 16, torch.float32)
    ta._COUNTERS.pop(k.data_ptr(), None)
    monkeypatch.setenv(envs.DECODE_ATTN_REDUCE_ENV, "kernel")
    ta.paged_decode_attention(q, k, v, bt, sl, 0.2, num_splits=3)
    assert k.data_ptr() not in ta._COUNTERS
    monkeypatch.setenv(envs.DECODE_ATTN_REDUCE_ENV, "fused")
    ta.paged_decode_attention(q, k, v, bt, sl, 0.2, num_splits=3)
    assert k.data_ptr() in ta._COUNTERS
    # oproj: only one-token forwards leave the merge to o_proj; batched decode keeps the kernel
    ta._COUNTERS.pop(k.data_ptr(), None)
    monkeypatch.setenv(envs.DECODE_ATTN_REDUCE_ENV, "oproj")
    ta.paged_decode_attention(q, k, v, bt, sl, 0.2, num_splits=3)
    assert k.data_ptr() not in ta._COUNTERS
    monkeypatch.setenv(envs.DECODE_ATTN_REDUCE_ENV, "sideways")
    with pytest.raises(ValueError, match="BACKEND_LIB_DECODE_ATTN_REDUCE=.sideways.: must be one of kernel, fused, oproj, splitk, splitk-force"):
        ta.paged_decode_attention(q, k, v, bt, sl, 0.2, num_splits=3)


@pytest.mark.skipif(_ON_CPU, reason="CUDA graphs")
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_reduce_in_a_cuda_graph_with_fresh_lengths(pdl):
    ta = _attn()
    from backend_lib.layers.triton_support import pdl_supported
    if pdl and not pdl_supported(torch.device("cuda")):
        pytest.skip("no PDL on this GPU")
    seed = seed_from_env("TRITON_ATTN_TEST_SEED")
    hq, hkv, d = 14, 2, 64
    q, k, v, bt, sl = _case([700, 1, 300, 0], hq, hkv, d, 16, torch.bfloat16)
    out = torch.empty_like(q)
    ta.paged_decode_attention(q, k, v, bt, sl, 0.125, out=out, fused_reduce=True, pdl=pdl)  # compile, counters
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ta.paged_decode_attention(q, k, v, bt, sl, 0.125, out=out, fused_reduce=True, pdl=pdl)
    for lens in ([700, 5, 64, 0], [1, 1, 1, 1], [0, 650, 129, 320], [700, 700, 700, 700]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        for _ in range(4):
            g.replay()
        ref = ta.reference_paged_attention(q, k, v, bt, sl, 0.125)
        assert not torch.isnan(out).any() and _rel(out, ref) < TOL[torch.bfloat16], (lens, seed)
    torch.cuda.synchronize()
    assert int(ta._COUNTERS[k.data_ptr()].abs().sum()) == 0


@pytest.mark.skipif(_ON_CPU, reason="PDL")
@pytest.mark.parametrize("fused", [False, True])
def test_splits_without_a_tile_leave_before_the_wait(monkeypatch, fused):
    """With PDL, splits that have no KV tile exit before griddepcontrol.wait
    (BACKEND_LIB_DECODE_ATTN_EARLY_EXIT): the same output as when they wait, zeros for a
    padding row, and the fused reduce's counters back at 0."""
    ta = _attn()
    from backend_lib import envs
    from backend_lib.layers.triton_support import pdl_supported
    if not pdl_supported(torch.device("cuda")):
        pytest.skip("no PDL on this GPU")
    seed = seed_from_env("TRITON_ATTN_TEST_SEED")
    q, k, v, bt, sl = _case([1, 70, 0, 300, 64], 32, 8, 128, 16, torch.bfloat16)
    ref = ta.reference_paged_attention(q, k, v, bt, sl, 0.1)
    outs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(envs.DECODE_ATTN_EARLY_EXIT_ENV, mode)
        for launch in range(3):
            out = torch.full_like(q, float("nan"))
            ta.paged_decode_attention(q, k, v, bt, sl, 0.1, out=out, num_splits=16, fused_reduce=fused, pdl=True)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any() and (out[2] == 0).all(), (mode, launch, seed)
            assert _rel(out, ref) < TOL[torch.bfloat16], (mode, launch, seed)
        outs[mode] = out
        if fused:
            assert int(ta._COUNTERS[k.data_ptr()].abs().sum()) == 0, (mode, seed)
    assert torch.equal(outs["on"], outs["off"]), seed


@pytest.mark.parametrize("tile", ["16x2", "32x4", "64x8"])
def test_the_tile_switch_sets_the_decode_tile(monkeypatch, tile):
    """BACKEND_LIB_DECODE_ATTN_TILE=BLOCK_NxWARPS reaches both decode launches (the batched
    kernel, and the one-row partials that o_proj merges), whose outputs still equal the
    reference; a tile outside the lists is refused, naming them."""
    import inspect
    ta = _attn()
    from backend_lib import envs
    seed = seed_from_env("TRITON_ATTN_TEST_SEED")
    dtype = DTYPES[0]
    launched = []
    real = ta._launch_decode

    def recording(*a, **kw):
        args = inspect.signature(real).bind(*a, **kw).arguments
        launched.append((args["block_n"], args["num_warps"]))
        return real(*a, **kw)

    monkeypatch.setattr(ta, "_launch_decode", recording)
    monkeypatch.setenv(envs.DECODE_ATTN_TILE_ENV, tile)
    want = tuple(int(x) for x in tile.split("x"))
    q, k, v, bt, sl = _case([1, 70, 0, 130], 8, 2, 32, 16, dtype)
    ref = ta.reference_paged_attention(q, k, v, bt, sl, 0.2)
    out = ta.paged_decode_attention(q, k, v, bt, sl, 0.2, num_splits=3)
    assert _rel(out, ref) < TOL[dtype], (tile, seed)
    row = slice(3, 4)
    parts = ta.paged_decode_partials(q[row], k, v, bt[row], sl[row], 0.2, num_splits=2)
    assert parts.block_n == want[0]
    assert _rel(ta.merge_decode_partials(parts), ref[row]) < TOL[dtype], (tile, seed)
    assert launched == [want, want]
    monkeypatch.setenv(envs.DECODE_ATTN_TILE_ENV, "64x3")
    with pytest.raises(ValueError, match=r"BACKEND_LIB_DECODE_ATTN_TILE='64x3': must be auto or BLOCK_NxWARPS "
                                         r"with BLOCK_N one of \(16, 32, 64, 128\) and WARPS one of \(1, 2, 4, 8\)"):
        ta.paged_decode_attention(q, k, v, bt, sl, 0.2, num_splits=3)
