"""GPU tests for backend_lib/layers/decode_mlp.py: the one-token MLP kernel (add + RMSNorm,
gate/up, silu * mul, down with fp32 atomics) against the unfused torch ops on random inputs,
the accumulator ring's zeroing, the fp32 accumulator read by the next projection's add + norm,
and the rejections.

Run: python3 -m pytest -q tests/gpu/test_decode_mlp.py
Also runs on CPU under Triton's interpreter (slow, small shapes):
     TRITON_INTERPRET=1 DECODE_MLP_ON_CPU=1 python -m pytest -q tests/gpu/test_decode_mlp.py
Seed: DECODE_MLP_TEST_SEED reproduces one run. Speed is in bench/decode.py, not asserted here.
"""

import pytest

from gpu_helpers import kernel_test_target, seed_from_env, torch

_ON_CPU, pytestmark, DEVICE = kernel_test_target("DECODE_MLP_ON_CPU")
if _ON_CPU:
    # (H, I, bias): neither a multiple of any block
    SHAPES = [(40, 56, True), (72, 200, False)]
    DTYPES = [torch.float32]
    CONFIGS = [None]
else:
    # Qwen2.5-0.5B, Llama-3-8B, odd sizes
    SHAPES = [(896, 4864, False), (4096, 14336, False), (300, 1000, True), (130, 17, True)]
    DTYPES = [torch.bfloat16, torch.float16, torch.float32]
    CONFIGS = [None, "all"]
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5}
POISON = 12345.0


def _dm():
    from backend_lib.layers import decode_mlp
    return decode_mlp


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _case(h, inter, bias, dtype):
    x = torch.randn(1, h, device=DEVICE).to(dtype)
    res = torch.randn(1, h, device=DEVICE).to(dtype)
    ln = (1 + 0.1 * torch.randn(h, device=DEVICE)).to(dtype)
    w_gu = (torch.randn(2 * inter, h, device=DEVICE) * 0.05).to(dtype)
    w_d = (torch.randn(h, inter, device=DEVICE) * 0.05).to(dtype)
    b_gu = (torch.randn(2 * inter, device=DEVICE) * 0.1).to(dtype) if bias else None
    b_d = (torch.randn(h, device=DEVICE) * 0.1).to(dtype) if bias else None
    return x, res, ln, w_gu, w_d, b_gu, b_d


def _configs(dm, which):
    if which is None:
        return [dm.MlpConfig(16, 32, 32, 4) if _ON_CPU else dm.DEFAULT_CONFIG]
    return list(dm.CANDIDATES)


@pytest.mark.parametrize("which", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h,inter,bias", SHAPES)
def test_matches_the_unfused_ops(h, inter, bias, dtype, which):
    """Output (the fp32 accumulator, compared after rounding to the dtype as its reader
    rounds), the new residual, and the other accumulator zeroed, for every configuration."""
    dm = _dm()
    seed = seed_from_env("DECODE_MLP_TEST_SEED")
    x, res, ln, w_gu, w_d, b_gu, b_d = _case(h, inter, bias, dtype)
    ref, ref_res = dm.mlp_ref(x, res, ln, w_gu, w_d, b_gu, b_d)
    for cfg in _configs(dm, which):
        ring = dm.AccumulatorRing.create(2, h, DEVICE)
        acc, zero = ring.for_layer(1)
        zero.fill_(POISON)
        res_out = torch.full_like(x, POISON)
        out, new_res = dm.mlp(x, res, ln, w_gu, w_d, b_gu, b_d, acc=acc, zero=zero, cfg=cfg,
                              pdl=dm.pdl_supported(x.device), residual_out=res_out)
        assert out.dtype == torch.float32 and out.shape == (1, h)
        assert _rel(out.to(dtype), ref) < TOL[dtype], (seed, cfg, _rel(out.to(dtype), ref))
        assert torch.equal(new_res, ref_res), (seed, cfg)
        assert new_res.data_ptr() == res_out.data_ptr()
        assert torch.count_nonzero(zero).item() == 0, (seed, cfg)


def test_accumulates_onto_what_the_buffer_holds():
    """The kernel adds into acc (it never clears it itself): a second call into the same
    buffer holds twice the output. This is why the ring must zero every accumulator once a
    forward."""
    dm = _dm()
    seed = seed_from_env("DECODE_MLP_TEST_SEED")
    h, inter, _ = SHAPES[0]
    x, res, ln, w_gu, w_d, _, _ = _case(h, inter, False, DTYPES[0])
    ring = dm.AccumulatorRing.create(2, h, DEVICE)
    acc, zero = ring.for_layer(0)
    cfg = _configs(dm, None)[0]
    once = dm.mlp(x, res, ln, w_gu, w_d, acc=acc, zero=zero, cfg=cfg)[0].clone()
    twice = dm.mlp(x, res, ln, w_gu, w_d, acc=acc, zero=zero, cfg=cfg)[0]
    assert _rel(twice, 2 * once) < 1e-5, seed


def test_ring_zeroes_the_previous_layer_and_layer_0_the_last():
    dm = _dm()
    ring = dm.AccumulatorRing.create(3, 8, DEVICE)
    for i, zeroed in [(0, 2), (1, 0), (2, 1)]:
        acc, zero = ring.for_layer(i)
        assert acc.data_ptr() == ring.buffers[i].data_ptr()
        assert zero.data_ptr() == ring.buffers[zeroed].data_ptr()
    with pytest.raises(ValueError, match="needs 2 layers or more"):
        dm.AccumulatorRing.create(1, 8, DEVICE)


def test_next_projection_rounds_the_fp32_accumulator_like_a_bf16_store():
    """decode_gemv's add + norm prologue given the fp32 accumulator equals the same call
    given the accumulator rounded to the model dtype (what the unfused down projection
    stores): same output, same new residual."""
    from backend_lib.layers import decode_gemv as dg
    seed = seed_from_env("DECODE_MLP_TEST_SEED")
    dtype = torch.float32 if _ON_CPU else torch.bfloat16
    h, n = (40, 24) if _ON_CPU else (896, 1152)
    acc = torch.randn(1, h, device=DEVICE) * 3
    if not _ON_CPU:
        acc += 1e-3 * torch.rand(1, h, device=DEVICE)  # bits that the rounding drops
    res = torch.randn(1, h, device=DEVICE).to(dtype)
    ln = (1 + 0.1 * torch.randn(h, device=DEVICE)).to(dtype)
    w = (torch.randn(n, h, device=DEVICE) * 0.05).to(dtype)
    cfg = dg.GemvConfig(8, 64, 4) if _ON_CPU else dg.DEFAULT_CONFIG
    y1, r1 = dg.gemv(acc, w, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln, cfg=cfg)
    y2, r2 = dg.gemv(acc.to(dtype), w, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln, cfg=cfg)
    assert y1.dtype == dtype and r1.dtype == dtype
    assert torch.equal(r1, r2), seed
    assert torch.equal(y1, y2), seed
    if dtype != torch.float32:  # an fp32 row into a plain projection of another dtype
        with pytest.raises(ValueError, match="fp32 x only before add"):
            dg.gemv(acc, w, cfg=cfg)


def test_rejects_bad_inputs_with_the_field_named():
    dm = _dm()
    dtype = DTYPES[0]
    h, inter = 40, 56
    x, res, ln, w_gu, w_d, b_gu, b_d = _case(h, inter, True, dtype)
    ring = dm.AccumulatorRing.create(2, h, DEVICE)
    acc, zero = ring.for_layer(0)
    with pytest.raises(ValueError, match=r"w_down \[H=40, I\]"):
        dm.mlp(x, res, ln, w_gu, w_d[:, :-1].contiguous(), acc=acc, zero=zero)
    with pytest.raises(ValueError, match="give both biases"):
        dm.mlp(x, res, ln, w_gu, w_d, b_gu, None, acc=acc, zero=zero)
    with pytest.raises(ValueError, match="acc must be a contiguous fp32 buffer of 40"):
        dm.mlp(x, res, ln, w_gu, w_d, acc=acc.to(torch.float16), zero=zero)
    with pytest.raises(ValueError, match="zero must be a contiguous fp32 buffer"):
        dm.mlp(x, res, ln, w_gu, w_d, acc=acc, zero=zero[:, :8])
    with pytest.raises(ValueError, match="different buffers"):
        dm.mlp(x, res, ln, w_gu, w_d, acc=acc, zero=acc)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        dm.mlp(x, res[:, :8], ln, w_gu, w_d, acc=acc, zero=zero)
    with pytest.raises(ValueError, match="b_down is torch.float16"):
        dm.mlp(x, res, ln, w_gu, w_d, b_gu, b_d.to(torch.float16), acc=acc, zero=zero)


@pytest.mark.skipif(_ON_CPU, reason="timing needs CUDA graphs")
def test_tune_picks_the_fastest_of_the_candidates_and_the_two_kernels():
    from backend_lib.layers import decode_gemv as dg
    dm = _dm()
    mlp_module = torch.nn.Module()
    mlp_module.gate_up_proj = torch.nn.Linear(896, 2 * 4864, bias=False).to(DEVICE, torch.bfloat16)
    mlp_module.down_proj = torch.nn.Linear(4864, 896, bias=False).to(DEVICE, torch.bfloat16)
    gemv = dg.DecodeGemv(pdl=dg.pdl_supported(torch.device(DEVICE)))
    table = dm.DecodeMlp(pdl=gemv.pdl)
    table.tune(mlp_module, gemv)
    key = (896, 4864, False)
    assert set(table.timings[key]) == {None, *dm.CANDIDATES}
    assert table.timings[key][table.configs[key]] == min(table.timings[key].values())


# ---- decode_oproj: attention's splits merged and projected, split over the heads -------------
OPROJ_HEADS = [(4, 2, 32), (3, 1, 16)] if _ON_CPU else [(14, 2, 64), (32, 8, 128), (8, 8, 64), (7, 1, 64)]


def _oproj_case(hq, hkv, d, seq_len, dtype, bias, n=40, page=16):
    blocks = max(1, -(-seq_len // page))
    nb = blocks + 3
    bt = torch.randperm(nb, device=DEVICE).to(torch.int32)[:blocks + 2][None].contiguous()
    k = torch.randn(nb, page, hkv, d, device=DEVICE).to(dtype)
    v = torch.randn(nb, page, hkv, d, device=DEVICE).to(dtype)
    q = torch.randn(1, hq, d, device=DEVICE).to(dtype)
    sl = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    w = (torch.randn(n, hq * d, device=DEVICE) * 0.05).to(dtype)
    b = (torch.randn(n, device=DEVICE) * 0.1).to(dtype) if bias else None
    return q, k, v, bt, sl, w, b


def _oproj_configs():
    from backend_lib.layers import decode_oproj as do
    return [do.OprojConfig(1, 16, 4), do.OprojConfig(2, 32, 4)] if _ON_CPU else list(do.CANDIDATES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", OPROJ_HEADS)
def test_merge_oproj_equals_the_reduce_kernel_then_the_projection(hq, hkv, d, dtype):
    """Padding row (seq_len 0: bias only), one token, one tile, several, more splits than the
    merge takes at once; every configuration (heads per program 1 and 2, an odd head count);
    against the reduce kernel then the projection, rounded where the unfused path rounds, and
    the other accumulator zeroed."""
    from backend_lib.layers import decode_gemv as dg
    from backend_lib.layers import decode_oproj as do
    from backend_lib.layers import triton_attention as ta
    dm = _dm()
    seed = seed_from_env("DECODE_MLP_TEST_SEED")
    block_n = 32 if dtype == torch.float32 else 64
    for seq_len, bias in ((0, True), (1, False), (block_n, True), (5 * block_n + 3, False), (20 * block_n + 7, True)):
        q, k, v, bt, sl, w, b = _oproj_case(hq, hkv, d, seq_len, dtype, bias)
        for splits in (1, 3, 13):
            parts = ta.paged_decode_partials(q, k, v, bt, sl, d ** -0.5, num_splits=splits)
            two = ta.merge_decode_partials(parts).reshape(1, -1)
            ref = torch.nn.functional.linear(two, w, b)
            for cfg in _oproj_configs():
                ring = dm.AccumulatorRing.create(2, w.shape[0], DEVICE)
                acc, zero = ring.for_layer(1)
                zero.fill_(POISON)
                got = do.merge_oproj(parts, w, b, acc=acc, zero=zero, cfg=cfg, pdl=dg.pdl_supported(q.device))
                where = (seed, seq_len, splits, cfg)
                assert got.dtype == torch.float32 and got.data_ptr() == acc.data_ptr(), where
                assert torch.allclose(got.to(dtype).float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype]), where
                assert torch.count_nonzero(zero).item() == 0, where
                if seq_len == 0:
                    want = b.float() if b is not None else torch.zeros(w.shape[0], device=DEVICE)
                    assert torch.allclose(got.reshape(-1), want, atol=1e-6), where


def test_merge_oproj_rejects_what_it_cannot_merge():
    from backend_lib.layers import decode_oproj as do
    from backend_lib.layers import triton_attention as ta
    dm = _dm()
    hq, hkv, d = OPROJ_HEADS[0]
    q, k, v, bt, sl, w, b = _oproj_case(hq, hkv, d, 40, DTYPES[0], True)
    parts = ta.paged_decode_partials(q, k, v, bt, sl, d ** -0.5, num_splits=2)
    ring = dm.AccumulatorRing.create(2, w.shape[0], DEVICE)
    acc, zero = ring.for_layer(0)
    with pytest.raises(ValueError, match=r"into w \(40, 16\)"):
        do.merge_oproj(parts, w[:, :16].contiguous(), b, acc=acc, zero=zero)
    with pytest.raises(ValueError, match="bias must be 40 values"):
        do.merge_oproj(parts, w, b[:5], acc=acc, zero=zero)
    with pytest.raises(ValueError, match="acc must be a contiguous fp32 buffer of 40"):
        do.merge_oproj(parts, w, b, acc=acc[:, :20], zero=zero)
    with pytest.raises(ValueError, match="different buffers"):
        do.merge_oproj(parts, w, b, acc=acc, zero=acc)
