"""bench/gemv_tma.py's TMA GEMV against torch (odd row counts: the descriptor's out-of-range
rows must load as zeros and not be stored), with and without PDL.

Run: python3 -m pytest -q tests/gpu/test_gemv_tma.py
Also on CPU: TRITON_INTERPRET=1 DECODE_GEMV_ON_CPU=1 python -m pytest -q tests/gpu/test_gemv_tma.py
"""
import pytest

from gpu_helpers import kernel_test_target, torch

_ON_CPU, pytestmark, DEV = kernel_test_target("DECODE_GEMV_ON_CPU")
DTYPES = [torch.float32] if _ON_CPU else [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,cfg", [(100, 296, (16, 128, 3, 4)), (37, 512, (8, 256, 4, 4)), (64, 136, (32, 128, 3, 4))])
@pytest.mark.parametrize("pdl", [False, True])
def test_tma_gemv_matches_torch(dtype, n, k, cfg, pdl):
    from bench import gemv_tma
    if pdl and (_ON_CPU or torch.cuda.get_device_capability()[0] < 9):
        pytest.skip("PDL: sm_90")
    if DEV == "cuda":
        gemv_tma._set_allocator()
    torch.manual_seed(n * k)
    w = torch.randn(n, k, device=DEV).to(dtype)
    x = torch.randn(1, k, device=DEV).to(dtype)
    out = torch.full((1, n + 5), float("nan"), device=DEV, dtype=dtype)   # past N must stay NaN
    y = gemv_tma.tma_gemv(x, w, gemv_tma.TmaConfig(*cfg), pdl=pdl, out=out[:, :n])
    ref = x.float() @ w.float().t()
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < TOL[dtype]
    assert torch.isnan(out[:, n:]).all()
