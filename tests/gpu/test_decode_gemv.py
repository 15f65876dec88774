"""GPU tests for backend_lib/layers/decode_gemv.py: the one-token projection kernel with each
prologue (plain, RMSNorm, add + RMSNorm, silu * mul) against the unfused torch ops on random
inputs (poisoned outputs, relative error bounds per dtype), with and without PDL, inside a
CUDA graph, and after start-up tuning.

Run: python3 -m pytest -q tests/gpu/test_decode_gemv.py
Also runs on CPU under Triton's interpreter (slow, small shapes):
     TRITON_INTERPRET=1 DECODE_GEMV_ON_CPU=1 python -m pytest -q tests/gpu/test_decode_gemv.py
Seed: DECODE_GEMV_TEST_SEED reproduces one run. Speed is in bench/kernels.py, not asserted here.
"""

import pytest

from gpu_helpers import kernel_test_target, seed_from_env, torch

_ON_CPU, pytestmark, DEVICE = kernel_test_target("DECODE_GEMV_ON_CPU")
if _ON_CPU:
    # (N, K, bias): N not a multiple of any BLOCK_N, K not a multiple of any BLOCK_K
    SHAPES = [(40, 96, True), (17, 1030, False)]
    DTYPES = [torch.float32]
else:
    # the Qwen2.5-0.5B and Llama-3-8B projections, plus odd sizes
    SHAPES = [(1152, 896, True), (896, 896, False), (9728, 896, False), (896, 4864, False),
              (6144, 4096, False), (4096, 14336, False), (1000, 300, True), (17, 1030, True)]
    DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5}
POISON = 12345.0


def _dg():
    from backend_lib.layers import decode_gemv
    return decode_gemv


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _case(n, k, bias, dtype, prologue):
    dg = _dg()
    width = 2 * k if prologue == dg.SILU_MUL else k
    x = torch.randn(1, width, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    b = (torch.randn(n, device=DEVICE) * 0.1).to(dtype) if bias else None
    res = torch.randn(1, k, device=DEVICE).to(dtype)
    ln = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    return x, w, b, res, ln


PROLOGUES = ["PLAIN", "RMSNORM", "ADD_RMSNORM", "SILU_MUL"]


@pytest.mark.parametrize("prologue_name", PROLOGUES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,bias", SHAPES)
def test_matches_unfused_ops(n, k, bias, dtype, prologue_name):
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    prologue = getattr(dg, prologue_name)
    x, w, b, res, ln = _case(n, k, bias, dtype, prologue)
    ref, ref_res = dg.gemv_ref(x, w, b, prologue=prologue, residual=res, ln_weight=ln, eps=1e-6)
    pdl_ok = dg.pdl_supported(torch.device(DEVICE))
    if DEVICE == "cpu":  # ahead 2: K of 1030 leaves a ragged last tile, 96 a second tile past K
        runs = [(dg.GemvConfig(4, 32, 1), False), (dg.GemvConfig(16, 64, 2), False),
                (dg.GemvConfig(8, 64, 1, ahead=2), False), (dg.GemvConfig(8, 64, 1, ahead=2, norm_block=32), False)]
    elif dtype == torch.bfloat16:  # the models' dtype: every candidate, launched as the model does
        runs = ([(c, pdl_ok) for c in dg.CANDIDATES + dg.NORM_AHEAD_CANDIDATES]
                + [(dg.DEFAULT_CONFIG, False)])
    else:
        runs = [(dg.DEFAULT_CONFIG, pdl_ok)]
    for cfg, pdl in runs:
        out = torch.full((1, n), POISON, dtype=dtype, device=DEVICE)
        res_out = torch.full((1, k), POISON, dtype=dtype, device=DEVICE)
        y, new_res = dg.gemv(x, w, b, prologue=prologue, residual=res, ln_weight=ln, eps=1e-6,
                             cfg=cfg, pdl=pdl, out=out, residual_out=res_out)
        assert y.data_ptr() == out.data_ptr()
        assert _rel(y, ref) < TOL[dtype], (seed, cfg, pdl, _rel(y, ref))
        if prologue == dg.ADD_RMSNORM:
            # the new stream is exactly x + residual in the stream dtype
            assert torch.equal(new_res, ref_res), (seed, cfg, pdl)
        else:
            assert new_res is None
            assert torch.all(res_out == POISON)


SPLIT_SHAPES = ([(40, 300, True), (17, 1030, False)] if _ON_CPU
                else [(896, 4864, False), (896, 896, True), (4096, 14336, False), (1000, 300, True)])


@pytest.mark.parametrize("prologue_name", ["PLAIN", "SILU_MUL"])
@pytest.mark.parametrize("n,k,bias", SPLIT_SHAPES)
def test_split_k_adds_into_the_accumulator_and_zeroes_the_other(n, k, bias, prologue_name):
    """split_k > 1: the slices' partial sums land in the fp32 accumulator (zero before), the
    bias once, and the ring's other buffer (poisoned here) is zeroed; splits that leave a
    slice empty or ragged included."""
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    prologue = getattr(dg, prologue_name)
    dtype = torch.float32 if _ON_CPU else torch.bfloat16
    x, w, b, _, _ = _case(n, k, bias, dtype, prologue)
    ref, _ = dg.gemv_ref(x, w, b, prologue=prologue)
    if _ON_CPU:
        cfgs = [dg.GemvConfig(8, 64, 1, 2), dg.GemvConfig(16, 32, 1, 3), dg.GemvConfig(4, 256, 1, 8)]
    else:
        cfgs = list(dg.SPLIT_K_CANDIDATES) + [dg.GemvConfig(8, 1024, 4, 16)]
    pdl = dg.pdl_supported(torch.device(DEVICE))
    for cfg in cfgs:
        acc = torch.zeros(1, n, device=DEVICE)
        zero = torch.full((1, n), POISON, device=DEVICE)
        y, new_res = dg.gemv(x, w, b, prologue=prologue, cfg=cfg, pdl=pdl, out=acc, zero=zero)
        assert y.data_ptr() == acc.data_ptr() and y.dtype == torch.float32 and new_res is None
        assert _rel(y, ref) < TOL[dtype], (seed, cfg, _rel(y, ref))
        assert torch.all(zero == 0), (seed, cfg)


def test_split_k_rejects_what_it_cannot_split_with_the_field_named():
    dg = _dg()
    w = torch.zeros(8, 16, device=DEVICE)
    x = torch.zeros(1, 16, device=DEVICE)
    cfg = dg.GemvConfig(8, 16, 1, 2)
    acc, zero = torch.zeros(1, 8, device=DEVICE), torch.zeros(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="PLAIN, SILU_MUL or MERGE_SPLITS prologue"):
        dg.gemv(x, w, prologue=dg.ADD_RMSNORM, residual=x.clone(), ln_weight=torch.ones(16, device=DEVICE),
                cfg=cfg, out=acc, zero=zero)
    with pytest.raises(ValueError, match="needs `zero`"):
        dg.gemv(x, w, cfg=cfg, out=acc)
    with pytest.raises(ValueError, match="needs `out`, a contiguous fp32 buffer of 8"):
        dg.gemv(x, w, cfg=cfg, out=torch.zeros(1, 8, device=DEVICE, dtype=torch.float16), zero=zero)
    with pytest.raises(ValueError, match="different buffers"):
        dg.gemv(x, w, cfg=cfg, out=acc, zero=acc)


def test_norm_input_is_rounded_like_hf():
    """The normalized row is rounded to the activation dtype before the products, as the
    unfused add + norm kernel's output is: with W = identity rows, y equals it exactly (one
    chunk of K, so both kernels sum the squares in the same order)."""
    dg = _dg()
    seed_from_env("DECODE_GEMV_TEST_SEED")
    k = 64
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    res = torch.randn(1, k, device=DEVICE).to(dtype)
    ln = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    eye = torch.eye(k, device=DEVICE).to(dtype)
    y, new_res = dg.gemv(x, eye, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln, eps=1e-6,
                         cfg=dg.GemvConfig(8, 64, 1))
    from backend_lib.layers.fused_ops import fused_add_rms_norm
    normed, stream = fused_add_rms_norm(x, res, ln, 1e-6)
    assert torch.equal(new_res, stream)
    assert torch.equal(y, normed)


def test_silu_input_is_rounded_like_the_unfused_kernel():
    """silu(gate) is rounded to the activation dtype before the product with up, as
    fused_ops.silu_and_mul rounds it: with W = identity rows, y equals its output exactly."""
    dg = _dg()
    seed_from_env("DECODE_GEMV_TEST_SEED")
    k = 64
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    gate_up = (torch.randn(1, 2 * k, device=DEVICE) * 3).to(dtype)
    eye = torch.eye(k, device=DEVICE).to(dtype)
    y, _ = dg.gemv(gate_up, eye, prologue=dg.SILU_MUL, cfg=dg.GemvConfig(8, 32, 1))
    from backend_lib.layers.fused_ops import silu_and_mul
    assert torch.equal(y, silu_and_mul(gate_up))


def test_rejects_bad_shapes_with_the_field_named():
    dg = _dg()
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="needs 32"):
        dg.gemv(torch.zeros(1, 16, device=DEVICE), w, prologue=dg.SILU_MUL)
    with pytest.raises(ValueError, match="not supported"):
        dg.gemv(torch.zeros(2, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="ln_weight"):
        dg.gemv(torch.zeros(1, 16, device=DEVICE), w, prologue=dg.RMSNORM)
    with pytest.raises(ValueError, match="residual"):
        dg.gemv(torch.zeros(1, 16, device=DEVICE), w, prologue=dg.ADD_RMSNORM,
                ln_weight=torch.ones(16, device=DEVICE))
    x = torch.zeros(1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="ln_weight is torch.float16"):
        dg.gemv(x, w, prologue=dg.RMSNORM, ln_weight=torch.ones(16, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="must not alias"):
        dg.gemv(x, w, prologue=dg.ADD_RMSNORM, residual=torch.zeros_like(x),
                ln_weight=torch.ones(16, device=DEVICE), residual_out=x)


@pytest.mark.skipif(_ON_CPU, reason="CUDA graphs")
def test_pdl_chain_in_a_cuda_graph():
    """A layer's chain (add+norm -> qkv, plain o, add+norm -> gate_up, silu*mul -> down) of
    PDL launches captured in one graph and replayed gives the eager unfused result: every
    kernel reads its inputs only after the previous one's writes are visible."""
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    dtype, hidden, inter = torch.bfloat16, 896, 4864
    mk = lambda n, k: (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    w_qkv, w_o, w_gu, w_down = mk(1152, hidden), mk(hidden, 1152), mk(2 * inter, hidden), mk(hidden, inter)
    ln1 = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    ln2 = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    h = torch.randn(1, hidden, device=DEVICE).to(dtype)
    r = torch.randn(1, hidden, device=DEVICE).to(dtype)
    pdl = dg.pdl_supported(h.device)

    def layer(h, r, fused):
        for _ in range(4):  # four layers deep, each reading the last one's stream
            if fused:
                qkv, r = dg.gemv(h, w_qkv, prologue=dg.ADD_RMSNORM, residual=r, ln_weight=ln1, pdl=pdl)
                o, _ = dg.gemv(qkv[:, :hidden].contiguous(), w_o[:, :hidden].contiguous(), pdl=pdl)
                gu, r = dg.gemv(o, w_gu, prologue=dg.ADD_RMSNORM, residual=r, ln_weight=ln2, pdl=pdl)
                h, _ = dg.gemv(gu, w_down, prologue=dg.SILU_MUL, pdl=pdl)
            else:
                qkv, r = dg.gemv_ref(h, w_qkv, prologue=dg.ADD_RMSNORM, residual=r, ln_weight=ln1)
                o, _ = dg.gemv_ref(qkv[:, :hidden], w_o[:, :hidden])
                gu, r = dg.gemv_ref(o, w_gu, prologue=dg.ADD_RMSNORM, residual=r, ln_weight=ln2)
                h, _ = dg.gemv_ref(gu, w_down, prologue=dg.SILU_MUL)
        return h, r

    ref_h, ref_r = layer(h, r, fused=False)
    layer(h, r, fused=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_h, out_r = layer(h, r, fused=True)
    for _ in range(3):
        out_h.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out_h, ref_h) < 5e-2, (seed, _rel(out_h, ref_h))
        assert _rel(out_r, ref_r) < 5e-2, (seed, _rel(out_r, ref_r))


@pytest.mark.skipif(_ON_CPU, reason="timing needs CUDA graphs")
def test_tune_picks_a_candidate_per_shape():
    dg = _dg()
    table = dg.DecodeGemv(pdl=dg.pdl_supported(torch.device(DEVICE)))
    w = (torch.randn(1152, 896, device=DEVICE) * 0.05).to(torch.bfloat16)
    table.tune([(dg.ADD_RMSNORM, w, None, (14, 2, 64)), (dg.ADD_RMSNORM, w, None, None),
                (dg.PLAIN, w, None, None)])
    assert set(table.configs) == {(dg.ADD_RMSNORM, 1152, 896, False, True),
                                  (dg.ADD_RMSNORM, 1152, 896, False, False),
                                  (dg.PLAIN, 1152, 896, False, False)}
    for key, cfg in table.configs.items():
        # None: the unfused ops measured faster
        assert cfg is None or cfg in dg.CANDIDATES + dg.NORM_AHEAD_CANDIDATES + dg.SPLIT_K_CANDIDATES
        assert None in table.timings[key]
        assert table.timings[key][cfg] == min(table.timings[key].values())


@pytest.mark.skipif(_ON_CPU, reason="compiles for the GPU")
def test_candidates_compiled_in_parallel_launch_without_compiling_again(monkeypatch):
    """Start-up tuning's warmups (compile_in_parallel, Triton's AsyncCompileMode) leave every
    candidate compiled under the key its launch looks up: the launches that follow add nothing
    to the kernel cache, and their outputs equal the reference."""
    import triton
    from backend_lib import envs
    dg = _dg()
    monkeypatch.setenv(envs.COMPILE_THREADS_ENV, "4")
    x, w, b, res, ln = _case(1000, 1000, True, torch.bfloat16, dg.ADD_RMSNORM)   # shapes no other test uses
    cands = dg.CANDIDATES + dg.NORM_AHEAD_CANDIDATES
    pdl = dg.pdl_supported(torch.device(DEVICE))

    def run(c, warmup=False):
        return dg.gemv(x, w, b, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln, cfg=c, pdl=pdl, warmup=warmup)

    submitted = dg.compile_in_parallel(lambda c=c: run(c, warmup=True) for c in cands)
    if getattr(triton, "AsyncCompileMode", None) is None:
        assert submitted == 0
        pytest.skip("this Triton has no AsyncCompileMode: tuning compiles one kernel at a time")
    assert submitted == len(cands)
    cache = dg._gemv_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(cache)
    ref, ref_res = dg.gemv_ref(x, w, b, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln, eps=1e-6)
    for c in cands:
        y, new_res = run(c)
        assert _rel(y, ref) < TOL[torch.bfloat16] and torch.equal(new_res, ref_res), c
    assert len(cache) == compiled, "a launch compiled its kernel again"


@pytest.mark.skipif(_ON_CPU, reason="compiled PTX")
def test_pdl_kernel_waits_and_releases_its_dependents():
    """With PDL the compiled kernel holds both grid-dependency instructions: the wait before
    activations are read, and the early release of the next kernel (a pure inline asm the
    compiler could drop as dead code)."""
    dg = _dg()
    if not dg.pdl_supported(torch.device(DEVICE)):
        pytest.skip("PDL needs compute capability 9.0")
    x = torch.randn(1, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16)
    y = torch.empty(1, 64, device=DEVICE, dtype=torch.bfloat16)
    def ptx(early_release):
        return dg._gemv_kernel[(8,)](x, x, x, w, w, y, y, 64, 256, 1e-6, w.stride(0), *(x,) * 6, 0,
                                     PART_M=x, PART_L=x, ATTN_SL=x, num_splits=0, ZERO=x, k_per_split=256,
                                     PROLOGUE=dg.PLAIN, HAS_BIAS=False, USE_PDL=True,
                                     EARLY_RELEASE=early_release, BLOCK_N=8, BLOCK_K=256,
                                     num_warps=4, launch_pdl=True).asm["ptx"]
    early, implicit = ptx(True), ptx(False)
    assert "griddepcontrol.wait" in early and "griddepcontrol.wait" in implicit
    assert "griddepcontrol.launch_dependents" in early
    assert "griddepcontrol.launch_dependents" not in implicit
    assert torch.allclose(y.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("split_k", [1, 2])
def test_l2_prefetch_is_issued_before_the_wait_and_changes_nothing(split_k):
    """l2_prefetch: the compiled kernel asks L2 for the weight (cp.async.bulk.prefetch) before
    griddepcontrol.wait, and the projection's output is the same bits as without it."""
    dg = _dg()
    if not dg.pdl_supported(torch.device(DEVICE)):
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0")
    n, k = 320, 1024
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
    cfg = dg.GemvConfig(8, 256, 4, split_k)
    meta = dg._prefetch_meta(True, w, cfg)
    assert meta == {"L2_PREFETCH": True, "pf_bytes": n * k * 2, "pf_programs": dg.num_sms(w.device),
                    "PF_THREADS": 128}
    outs = []
    for prefetch in (False, True):
        acc = zero = None
        if split_k > 1:
            acc, zero = torch.zeros(1, n, device=DEVICE), torch.full((1, n), 7.0, device=DEVICE)
        y, _ = dg.gemv(x, w, cfg=cfg, pdl=True, out=acc, zero=zero, l2_prefetch=prefetch)
        outs.append(y.clone())
    torch.cuda.synchronize()
    if split_k == 1:
        assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1].float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-1)
    kernel = dg._gemv_kernel[(n // 8, split_k)](
        x, x, x, w, w, outs[1], outs[1], n, k, 1e-6, w.stride(0), *(x,) * 6, 0, PART_M=x, PART_L=x,
        ATTN_SL=x, num_splits=0, ZERO=zero if split_k > 1 else x, k_per_split=k // split_k,
        PROLOGUE=dg.PLAIN, HAS_BIAS=False, USE_PDL=True, BLOCK_N=8, BLOCK_K=256, SPLIT_K=split_k > 1,
        num_warps=4, launch_pdl=True, **meta)
    ptx = kernel.asm["ptx"]
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1
    assert ptx.index("cp.async.bulk.prefetch.L2.global") < ptx.index("griddepcontrol.wait")


def test_l2_prefetch_needs_a_contiguous_weight():
    """A weight view with gaps between its rows launches without the prefetch."""
    dg = _dg()
    w = torch.randn(16, 256, device=DEVICE, dtype=torch.bfloat16)[:, :128]
    assert dg._prefetch_meta(True, w, dg.GemvConfig(8, 256, 4)) == {}
    assert dg._prefetch_meta(False, torch.randn(16, 128, device=DEVICE, dtype=torch.bfloat16),
                             dg.GemvConfig(8, 256, 4)) == {}


ROPE_SHAPES = ([(3, 1, 16, True), (4, 2, 32, False)] if _ON_CPU
               else [(14, 2, 64, True), (32, 8, 128, False), (3, 1, 16, True)])


def _rope_case(hq, hkv, d, bias, dtype, slot):
    dg = _dg()
    k = 96 if _ON_CPU else 896
    n = (hq + 2 * hkv) * d
    x, w, b, res, ln = _case(n, k, bias, dtype, dg.ADD_RMSNORM)
    max_pos, blocks, bs = 64, 4, 16
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    ang = torch.arange(max_pos, device=DEVICE).float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    caches = [torch.full((blocks, bs, hkv, d), POISON, dtype=dtype, device=DEVICE) for _ in range(2)]
    rope = dg.RopeKV(cos=emb.cos(), sin=emb.sin(), positions=torch.tensor([37], device=DEVICE),
                     k_cache=caches[0], v_cache=caches[1],
                     slot_mapping=torch.tensor([slot], device=DEVICE), num_heads=hq,
                     num_kv_heads=hkv, head_dim=d)
    return x, w, b, res, ln, rope


@pytest.mark.parametrize("dtype", DTYPES[:1], ids=str)
@pytest.mark.parametrize("hq,hkv,d,bias", ROPE_SHAPES)
def test_rope_epilogue_matches_unfused_rope_and_cache_write(hq, hkv, d, bias, dtype):
    """The q/k/v projection with the rope + KV-write epilogue: q rotated and v in y, rotated k
    and v in the cache slot, every other cache entry untouched."""
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    x, w, b, res, ln, rope = _rope_case(hq, hkv, d, bias, dtype, slot=21)
    q_ref, v_ref, kc_ref, vc_ref, res_ref = dg.gemv_rope_ref(
        x, w, b, rope, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln)
    configs = (dg.CANDIDATES + dg.NORM_AHEAD_CANDIDATES if DEVICE == "cuda"
               else (dg.GemvConfig(4, 32, 1), dg.GemvConfig(16, 64, 2), dg.GemvConfig(8, 32, 1, ahead=2),
                     dg.GemvConfig(8, 32, 1, norm_block=16)))
    for cfg in configs:
        rope.k_cache.fill_(POISON)
        rope.v_cache.fill_(POISON)
        y, new_res = dg.gemv(x, w, b, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln,
                             rope=rope, cfg=cfg, pdl=dg.pdl_supported(torch.device(DEVICE)))
        assert torch.equal(new_res, res_ref)
        assert _rel(y[:, :hq * d], q_ref) < TOL[dtype], (seed, cfg)
        assert _rel(y[:, (hq + hkv) * d:], v_ref) < TOL[dtype], (seed, cfg)
        written = torch.zeros(rope.k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
        written.view(-1)[21] = True
        for got, ref in ((rope.k_cache, kc_ref), (rope.v_cache, vc_ref)):
            assert torch.all(got[~written] == POISON)
            assert _rel(got[written], ref[written]) < TOL[dtype], (seed, cfg)


def test_rope_epilogue_skips_the_cache_for_a_negative_slot():
    dg = _dg()
    x, w, b, res, ln, rope = _rope_case(*ROPE_SHAPES[0], DTYPES[0], slot=-1)
    y, _ = dg.gemv(x, w, b, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln, rope=rope)
    assert torch.all(rope.k_cache == POISON) and torch.all(rope.v_cache == POISON)
    assert torch.isfinite(y.float()).all()


def test_rope_epilogue_rejects_a_projection_of_the_wrong_width():
    dg = _dg()
    x, w, b, res, ln, rope = _rope_case(*ROPE_SHAPES[0], DTYPES[0], slot=3)
    with pytest.raises(ValueError, match="rope needs N"):
        dg.gemv(x, w[:-2], None, prologue=dg.ADD_RMSNORM, residual=res, ln_weight=ln, rope=rope)


@pytest.mark.parametrize("mode", ["fused", "rope", "merge", "unfused"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_one_token_forward_matches_the_batched_path(arch, mode, tiny_llama_path, tiny_qwen3_path):
    """DecoderModel's one-token forward through DecodeGemv (each projection fused; with the
    rope epilogue; every shape on the unfused fallback) gives the batched fused path's hidden
    state and KV cache. Qwen3 (q/k norm) keeps its rope kernel even with rope on."""
    from transformers import AutoConfig
    from backend_lib.layers.attention import AttentionMetadata
    from backend_lib.layers.rotary import RotaryEmbedding
    from backend_lib.models.llama import DecoderModel
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    cfg = AutoConfig.from_pretrained(tiny_llama_path if arch == "llama" else tiny_qwen3_path)
    model = DecoderModel(cfg).to(DEVICE, torch.float32)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    s = model.shape
    model.rotary = RotaryEmbedding(cfg, s.head_dim).to(DEVICE)
    if DEVICE == "cpu":
        model._fused = lambda x: True  # the fused kernels run in the interpreter
    blocks, bs = 4, 16
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([2 * bs + 4], device=DEVICE),  # token 20: block table entry 1, offset 4
        block_tables=torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([21], dtype=torch.int32, device=DEVICE),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), max_q_len=1,
        is_decode=True, seq_lens_host=[21], q_lens_host=[1])
    ids, pos = torch.tensor([5], device=DEVICE), torch.tensor([20], device=DEVICE)

    def caches():
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        shape = (blocks, bs, s.num_kv_heads, s.head_dim)
        return [(torch.randn(shape, generator=g, device=DEVICE), torch.randn(shape, generator=g, device=DEVICE))
                for _ in model.layers]

    ref_cache = caches()
    ref = model(ids, pos, ref_cache, meta)
    configs = {}
    if mode == "unfused":
        configs = {dg.shape_key(p, proj.weight, proj.bias, rope): None
                   for p in range(4) for proj in model.projections() for rope in (False, True)}
    model.one_token_gemv = dg.DecodeGemv(configs=configs, rope=(mode != "fused"), merge_attention=(mode == "merge"),
                                         pdl=dg.pdl_supported(torch.device(DEVICE)))
    got_cache = caches()
    got = model(ids, pos, got_cache, meta)
    assert _rel(got, ref) < 1e-5, (seed, _rel(got, ref))
    for (k1, v1), (k2, v2) in zip(ref_cache, got_cache):
        assert _rel(k2, k1) < 1e-5 and _rel(v2, v1) < 1e-5, seed


def _small_config(kind):
    """Configs the tiny checkpoints lack: Qwen2 (q/k/v bias), Llama with every bias on."""
    import transformers
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, rms_norm_eps=1e-6)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common, attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("merge,fused_mlp,splitk_oproj,split_gemv",
                         [(False, False, False, False), (True, False, False, False),
                          (False, True, False, False), (False, False, True, False),
                          (False, True, True, False), (False, False, False, True),
                          (True, False, False, True)],
                         ids=["reduce-kernel", "merge-in-o_proj", "one-kernel-mlp", "split-k-o_proj",
                              "split-k-o_proj-and-mlp", "split-k-gemv", "split-k-gemv-merge-in-o_proj"])
@pytest.mark.parametrize("kind", ["qwen2", "llama-bias"])
def test_one_token_graph_with_pdl_matches_the_batched_path(kind, merge, fused_mlp, splitk_oproj, split_gemv):
    """The one-token forward as the decode graph runs it: captured in a CUDA graph (on CUDA),
    every kernel launched with PDL where the GPU has it, the rope epilogue on, a context long
    enough that the decode attention splits (and its reduce kernel runs). Each replay gets
    fresh inputs and caches, and must equal the batched fused path run eagerly on the same
    inputs: hidden state and both caches. one-kernel-mlp: each MLP is decode_mlp's kernel,
    whose accumulators each forward zeroes for the next one (replays 2 and 3 fail if not);
    split-k-o_proj: attention's splits merged and projected by decode_oproj's kernel (its own
    accumulator ring), alone and feeding the one-kernel MLP; split-k-gemv: o_proj and down
    through decode_gemv's split-K tiles, each layer adding into its ring accumulator, which
    the next layer's projection zeroes (replays 2 and 3 fail if not)."""
    from backend_lib.layers import decode_mlp, decode_oproj
    from backend_lib.layers.attention import AttentionMetadata
    from backend_lib.layers.rotary import RotaryEmbedding
    from backend_lib.layers.triton_attention import decode_num_splits
    from backend_lib.models.llama import DecoderModel
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    cuda = DEVICE == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter truncates to bf16
    cfg = _small_config(kind)
    model = DecoderModel(cfg).to(DEVICE, dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    s = model.shape
    model.rotary = RotaryEmbedding(cfg, s.head_dim).to(DEVICE)
    if not cuda:
        model._fused = lambda x: True
    blocks, bs, max_blocks = 16, 16, 8
    assert decode_num_splits(1, s.num_kv_heads, max_blocks, bs) > 1  # the split + reduce path
    ids = torch.zeros(1, dtype=torch.long, device=DEVICE)
    pos = torch.zeros(1, dtype=torch.long, device=DEVICE)
    slot = torch.zeros(1, dtype=torch.long, device=DEVICE)
    seq_lens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    tables = torch.arange(1, max_blocks + 1, dtype=torch.int32, device=DEVICE)[None]
    meta = AttentionMetadata(slot, tables, seq_lens, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                             1, True, [1], [1])
    shape = (blocks, bs, s.num_kv_heads, s.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE))
              for _ in model.layers]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def fresh_inputs():
        p = int(torch.randint(60, 120, (1,), generator=gen, device=DEVICE))
        ids.fill_(int(torch.randint(0, cfg.vocab_size, (1,), generator=gen, device=DEVICE)))
        pos.fill_(p)
        slot.fill_(int(tables[0, p // bs]) * bs + p % bs)
        seq_lens.fill_(p + 1)
        meta.seq_lens_host = [p + 1]
        for kc, vc in caches:
            kc.copy_(torch.randn(shape, generator=gen, device=DEVICE).to(dtype))
            vc.copy_(torch.randn(shape, generator=gen, device=DEVICE).to(dtype))

    mlp_table = None
    if fused_mlp:
        mlp_table = decode_mlp.DecodeMlp(pdl=dg.pdl_supported(torch.device(DEVICE)),
                                         accumulators=decode_mlp.AccumulatorRing.create(
                                             len(model.layers), s.hidden_size, DEVICE))
        if not cuda:
            mlp_table.configs = {decode_mlp._key(model.layers[0].mlp.gate_up_proj.weight,
                                                 model.layers[0].mlp.gate_up_proj.bias):
                                 decode_mlp.MlpConfig(16, 64, 64, 4)}

    oproj_table = None
    if splitk_oproj:
        oproj_table = decode_oproj.DecodeOproj(
            pdl=dg.pdl_supported(torch.device(DEVICE)),
            ring=decode_mlp.AccumulatorRing.create(len(model.layers), s.hidden_size, DEVICE),
            cfg=decode_oproj.DEFAULT_CONFIG if cuda else decode_oproj.OprojConfig(1, 32, 4))

    def reference():
        model.one_token_gemv = model.one_token_mlp = model.one_token_oproj = None
        ref_caches = [(k.clone(), v.clone()) for k, v in caches]
        out = model(ids, pos, ref_caches, meta)
        return out, ref_caches

    gemv = dg.DecodeGemv(pdl=dg.pdl_supported(torch.device(DEVICE)), rope=True, merge_attention=merge,
                         num_layers=len(model.layers))
    if split_gemv:
        split = dg.GemvConfig(16, 1024, 4, 3) if cuda else dg.GemvConfig(16, 32, 1, 3)
        layer0 = model.layers[0]
        for p, proj in ((dg.PLAIN, layer0.self_attn.o_proj), (dg.SILU_MUL, layer0.mlp.down_proj)):
            gemv.configs[dg.shape_key(p, proj.weight, proj.bias, False)] = split
        gemv.make_rings(DEVICE)
        assert len(gemv.rings) == 2
    runs = []
    if cuda:
        fresh_inputs()
        model.one_token_gemv, model.one_token_mlp, model.one_token_oproj = gemv, mlp_table, oproj_table
        model(ids, pos, caches, meta)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = model(ids, pos, caches, meta)
    for _ in range(3 if cuda else 1 + (fused_mlp or splitk_oproj or split_gemv)):
        fresh_inputs()
        ref, ref_caches = reference()
        model.one_token_gemv, model.one_token_mlp, model.one_token_oproj = gemv, mlp_table, oproj_table
        if cuda:
            graph.replay()
            torch.cuda.synchronize()
            got = static_out
        else:
            got = model(ids, pos, caches, meta)
        tol = 2e-2 if cuda else 1e-5
        runs.append(_rel(got, ref))
        assert _rel(got, ref) < tol, (seed, kind, runs)
        for (k1, v1), (k2, v2) in zip(ref_caches, caches):
            assert _rel(k2, k1) < tol and _rel(v2, v1) < tol, (seed, kind)


# ---- o_proj merging split decode attention (MERGE_SPLITS) ------------------------------------
MERGE_HEADS = [(4, 2, 32), (3, 1, 16)] if _ON_CPU else [(14, 2, 64), (32, 8, 128), (8, 8, 64)]


def _merge_case(hq, hkv, d, seq_len, dtype, bias, page=16):
    """q, caches with a shuffled block table for one row of seq_len tokens, o_proj weight/bias."""
    blocks = max(1, -(-seq_len // page))
    nb = blocks + 3
    perm = torch.randperm(nb, device=DEVICE).to(torch.int32)
    bt = perm[:blocks + 2][None].contiguous()  # two spare entries past the row's blocks
    k = torch.randn(nb, page, hkv, d, device=DEVICE).to(dtype)
    v = torch.randn(nb, page, hkv, d, device=DEVICE).to(dtype)
    q = torch.randn(1, hq, d, device=DEVICE).to(dtype)
    sl = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    w = (torch.randn(40, hq * d, device=DEVICE) * 0.05).to(dtype)
    b = (torch.randn(40, device=DEVICE) * 0.1).to(dtype) if bias else None
    return q, k, v, bt, sl, w, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", MERGE_HEADS)
def test_o_proj_merging_the_splits_equals_the_reduce_kernel_then_the_projection(hq, hkv, d, dtype):
    """Padding row (seq_len 0: zeros in, bias out), one token, one tile, several, more splits
    than the merge takes at once (SPLIT_CHUNK 8); one split to many; block_k 2 heads to all
    heads and past K. Against the float32 reference and the two-kernel path (reduce kernel,
    then the plain gemv with the same config), output poisoned."""
    from backend_lib.layers import triton_attention as ta
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    block_n = 32 if dtype == torch.float32 else 64
    for seq_len, bias in ((0, True), (1, False), (block_n, True), (5 * block_n + 3, False), (20 * block_n + 7, True)):
        q, k, v, bt, sl, w, b = _merge_case(hq, hkv, d, seq_len, dtype, bias)
        ref_o = ta.reference_paged_attention(q, k, v, bt, sl, d ** -0.5) if seq_len else torch.zeros(1, hq, d)
        ref = dg.gemv_ref(ref_o.to(DEVICE).float().reshape(1, -1), w.float(), None if b is None else b.float())[0]
        for splits in (1, 3, 8, 13):
            parts = ta.paged_decode_partials(q, k, v, bt, sl, d ** -0.5, num_splits=splits)
            two = ta.merge_decode_partials(parts)
            assert torch.equal(two, ta.paged_decode_attention(q, k, v, bt, sl, d ** -0.5, num_splits=splits,
                                                              fused_reduce=False)) or splits == 1, (seed, splits)
            for cfg in (dg.GemvConfig(4, 2 * d, 4), dg.GemvConfig(8, 1024, 4)):
                out = torch.full((1, w.shape[0]), POISON, dtype=dtype, device=DEVICE)
                got = dg.gemv_merged(parts, w, b, cfg=cfg, out=out)
                assert got.data_ptr() == out.data_ptr()
                plain = dg.gemv(two.reshape(1, -1), w, b, cfg=cfg)[0]
                where = (seed, seq_len, splits, cfg)
                assert _rel(got, ref) < TOL[dtype] + (1e-2 if dtype != torch.float32 else 1e-4), where
                # the same merge and the same projection: equal up to the merge's summation order
                assert torch.allclose(got.float(), plain.float(), rtol=2e-2 if dtype != torch.float32 else 1e-5,
                                      atol=2e-2 if dtype != torch.float32 else 1e-5), where
                if seq_len == 0:
                    assert torch.equal(got, (b if b is not None else torch.zeros_like(got)).reshape(1, -1)), where


@pytest.mark.parametrize("hq,hkv,d", MERGE_HEADS)
def test_o_proj_merge_split_over_k_adds_whole_heads_into_the_accumulator(hq, hkv, d):
    """The merged o_proj with split_k > 1: each K slice holds whole heads (slices ragged and
    empty included); the fp32 accumulator gets the merged projection, the ring's other buffer
    (poisoned) is zeroed; equal to the unsplit merged gemv up to summation order."""
    from backend_lib.layers import triton_attention as ta
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    dtype = DTYPES[0]
    pdl = dg.pdl_supported(torch.device(DEVICE))
    for seq_len, bias in ((0, True), (1, False), (300, True)):
        q, k, v, bt, sl, w, b = _merge_case(hq, hkv, d, seq_len, dtype, bias)
        parts = ta.paged_decode_partials(q, k, v, bt, sl, d ** -0.5, num_splits=3)
        whole = dg.gemv_merged(parts, w, b, cfg=dg.GemvConfig(8, 2 * d, 4))
        for cfg in (dg.GemvConfig(8, d, 4, 2), dg.GemvConfig(4, 2 * d, 4, 3), dg.GemvConfig(16, d, 4, 2 * hq)):
            acc = torch.zeros(1, w.shape[0], device=DEVICE)
            zero = torch.full((1, w.shape[0]), POISON, device=DEVICE)
            got = dg.gemv_merged(parts, w, b, cfg=cfg, pdl=pdl, out=acc, zero=zero)
            where = (seed, seq_len, cfg)
            assert got.data_ptr() == acc.data_ptr() and got.dtype == torch.float32, where
            assert torch.all(zero == 0), where
            assert torch.allclose(got, whole.float(), rtol=2e-2 if dtype != torch.float32 else 1e-5,
                                  atol=2e-2 if dtype != torch.float32 else 1e-5), where
    assert dg._k_per_split(hq * d, 3, d) % d == 0 and dg._k_per_split(896, 8, 128) == 128


def test_o_proj_merge_rejects_what_it_cannot_merge():
    from backend_lib.layers import triton_attention as ta
    dg = _dg()
    hq, hkv, d = MERGE_HEADS[0]
    q, k, v, bt, sl, w, b = _merge_case(hq, hkv, d, 40, DTYPES[0], True)
    parts = ta.paged_decode_partials(q, k, v, bt, sl, d ** -0.5, num_splits=2)
    with pytest.raises(ValueError, match="block_k 48"):
        dg.gemv_merged(parts, w, b, cfg=dg.GemvConfig(4, 48, 4))
    with pytest.raises(ValueError, match=r"into w \(40, 16\)"):
        dg.gemv_merged(parts, w[:, :16].contiguous(), b)
    with pytest.raises(ValueError, match="one row"):
        ta.paged_decode_partials(torch.cat([q, q]), k, v, torch.cat([bt, bt]), torch.cat([sl, sl]), d ** -0.5)


def test_project_attention_merges_with_the_reduce_kernel_where_o_proj_runs_unfused():
    """A shape whose tuning chose the unfused ops (config None), or a config whose block_k
    splits a head: the reduce kernel merges, then the projection; equal to the merged gemv."""
    from backend_lib.layers import triton_attention as ta
    dg = _dg()
    seed = seed_from_env("DECODE_GEMV_TEST_SEED")
    hq, hkv, d = MERGE_HEADS[0]
    dtype = DTYPES[-1]
    q, k, v, bt, sl, w, b = _merge_case(hq, hkv, d, 3 * 64 + 5, dtype, True)
    proj = torch.nn.Linear(hq * d, w.shape[0], device=DEVICE, dtype=dtype)
    with torch.no_grad():
        proj.weight.copy_(w)
        proj.bias.copy_(b)
    parts = ta.paged_decode_partials(q, k, v, bt, sl, d ** -0.5, num_splits=4)
    fused = dg.DecodeGemv(merge_attention=True).project_attention(parts, proj)
    key = dg.shape_key(dg.PLAIN, w, b, False)
    for configs in ({key: None}, {key: dg.GemvConfig(4, d // 2, 4)}):
        got = dg.DecodeGemv(merge_attention=True, configs=configs).project_attention(parts, proj)
        assert torch.allclose(got.float(), fused.float(), rtol=1e-4, atol=1e-4), (seed, configs)
    # a plain attention output (batched rows, or no Triton) goes through run()
    o = ta.merge_decode_partials(parts).reshape(1, -1)
    assert torch.allclose(dg.DecodeGemv().project_attention(o, proj).float(), fused.float(), rtol=1e-4, atol=1e-4)
