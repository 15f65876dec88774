"""GPU tests for backend_lib/layers/skinny_gemm.py: the Triton skinny GEMM (M <= 16) against
torch on random inputs (poisoned outputs, relative error bounds per dtype), inside a CUDA
graph, the start-up selection (a configuration only where it measured faster than cuBLAS),
and the engine's greedy output with every projection forced through it.

Run: python3 -m pytest -q tests/gpu/test_skinny_gemm.py   (seed: SKINNY_GEMM_TEST_SEED)
Speed is in bench/kernels.py's GEMM table, not asserted here.
"""
import random

import pytest

from gpu_helpers import GPU_MARKS, seed_from_env, torch  # skips the module without torch (CUDA: triton)

pytestmark = GPU_MARKS

F = torch.nn.functional
DEV = "cuda"
# (N, K, bias): the projections of the Qwen2.5-0.5B and Llama-3-8B shapes, plus odd sizes
# (N not a multiple of any BLOCK_N, K not a multiple of any BLOCK_K).
SMALL_SHAPES = [(1152, 896, True), (896, 896, False), (9728, 896, False), (896, 4864, False),
                (1000, 300, True), (17, 1030, True)]
BIG_SHAPES = [(151936, 896, False), (6144, 4096, False), (4096, 4096, False), (28672, 4096, False),
              (4096, 14336, False)]
MS = (1, 2, 3, 5, 8, 13, 16)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _sg():
    from backend_lib.layers import skinny_gemm
    return skinny_gemm


def _rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _inputs(m, n, k, bias, dtype, gen):
    x = torch.randn(m, k, device=DEV, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(dtype)
    b = torch.randn(n, device=DEV, generator=gen).to(dtype) if bias else None
    return x, w, b


def _reference(x, w, b):
    """fp32 torch on the same (rounded) inputs, without TF32."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return F.linear(x.float(), w.float(), None if b is None else b.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


# Every configuration in bf16 (the dtype of the benchmarks); two (split 1 and split 4) in
# fp16 and fp32, to bound the compile time.
CASES = ([(torch.bfloat16, i) for i in range(11)]
         + [(dt, i) for dt in (torch.float16, torch.float32) for i in (0, 3)])


@pytest.mark.parametrize("dtype,cfg_index", CASES, ids=lambda v: str(v))
def test_skinny_linear_matches_torch(dtype, cfg_index):
    sg = _sg()
    cfg = sg.CANDIDATES[cfg_index]
    seed = seed_from_env("SKINNY_GEMM_TEST_SEED")
    gen = torch.Generator(device=DEV).manual_seed(seed)
    shapes = SMALL_SHAPES + (BIG_SHAPES if dtype == torch.bfloat16 else [])
    for n, k, bias in shapes:
        for m in MS:
            x, w, b = _inputs(m, n, k, bias, dtype, gen)
            if m > 1 and cfg.block_n < sg.MIN_DOT_BLOCK:  # a GEMV configuration: M == 1 only
                with pytest.raises(ValueError, match="M == 1 only"):
                    sg.skinny_linear(x, w, b, cfg)
                continue
            out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)  # poisoned
            y = sg.skinny_linear(x, w, b, cfg, out=out)
            assert y.data_ptr() == out.data_ptr() and y.shape == (m, n) and y.dtype == dtype
            assert not torch.isnan(y).any(), f"seed {seed}: {cfg} M={m} N={n} K={k}: unwritten outputs"
            err = _rel(y, _reference(x, w, b))
            assert err < TOL[dtype], f"seed {seed}: {cfg} {dtype} M={m} N={n} K={k} bias={bias}: rel err {err:.2e}"


def test_skinny_linear_rejects_what_it_cannot_do():
    sg = _sg()
    x = torch.randn(17, 64, device=DEV)
    with pytest.raises(ValueError, match="M in"):
        sg.skinny_linear(x, torch.randn(32, 64, device=DEV))
    with pytest.raises(ValueError, match="not supported"):
        sg.skinny_linear(x[:4], torch.randn(32, 64, device=DEV, dtype=torch.bfloat16))


def test_skinny_linear_in_a_cuda_graph():
    """Captured once (split-K: two kernels and a partials buffer from the graph's pool),
    replayed on new inputs: the output follows the inputs."""
    sg = _sg()
    cfg = next(c for c in sg.CANDIDATES if c.split_k > 1)
    gen = torch.Generator(device=DEV).manual_seed(seed_from_env("SKINNY_GEMM_TEST_SEED"))
    x, w, b = _inputs(4, 896, 4864, True, torch.bfloat16, gen)
    sg.skinny_linear(x, w, b, cfg)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = sg.skinny_linear(x, w, b, cfg)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device=DEV, generator=gen).to(x.dtype))
        g.replay()
        torch.cuda.synchronize()
        assert _rel(y, _reference(x, w, b)) < TOL[torch.bfloat16]


def test_tune_keeps_a_configuration_only_where_faster_than_cublas():
    sg = _sg()
    gen = torch.Generator(device=DEV).manual_seed(0)
    weights = [_inputs(1, n, k, bias, torch.bfloat16, gen)[1:] for n, k, bias in SMALL_SHAPES[:4]]
    table = sg.SkinnyGemmTable()
    table.tune(weights, [1, 8])
    assert len(table.choice) == 8
    for key, cfg in table.choice.items():
        t = table.timings[key]
        assert len(t) > 1, f"{key}: no configuration compiled"
        if cfg is not None:
            assert t[str(cfg)] < 0.97 * t["cublas"], (key, t)
        else:
            assert min(v for name, v in t.items() if name != "cublas") >= 0.97 * t["cublas"], (key, t)
    forced = sg.SkinnyGemmTable()
    forced.tune(weights, [1, 8], force=True)
    assert all(c is not None for c in forced.choice.values())
    for w, b in weights:  # the dispatch computes the same function as F.linear
        for m in (1, 8, 9):
            x = torch.randn(m, w.shape[1], device=DEV, generator=gen).to(w.dtype)
            assert _rel(forced.linear(x, w, b), _reference(x, w, b)) < TOL[torch.bfloat16]


def test_engine_greedy_with_every_projection_through_skinny(tiny_llama_path, monkeypatch):
    """BACKEND_LIB_SKINNY_GEMM=force: every decode projection (graph buckets 1-16) runs the
    Triton kernel; greedy outputs agree with the cuBLAS engine (fp32: ieee dots; a near-tie
    may flip a late token, as in the HF parity test)."""
    from backend_lib import EngineConfig, LLMEngine, SamplingParams
    from backend_lib import envs
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for mode in ("off", "force"):
        monkeypatch.setenv(envs.SKINNY_GEMM_ENV, mode)
        eng = LLMEngine(EngineConfig(model_path=str(tiny_llama_path), device="cuda", dtype="float32",
                                     max_num_seqs=8, max_model_len=256, num_kv_blocks=256))
        table = eng.runner.gemm_table
        if mode == "force":
            assert table is not None and table.choice and all(c is not None for c in table.choice.values())
            assert {m for (m, _, _, _) in table.choice} == {1, 2, 4, 8}
        else:
            assert table is None
        outs[mode] = [o.token_ids for o in eng.generate(prompts, sp)]
    agree = 0
    for a, b in zip(outs["off"], outs["force"]):
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert common >= 8, (a, b)
        agree += a == b
    assert agree >= len(prompts) - 1
