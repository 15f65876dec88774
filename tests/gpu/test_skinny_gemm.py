"""GPU tests for backend_lib/layers/skinny_gemm.py (Triton skinny GEMM for M <= 16 rows).

Run: python3 -m pytest -q tests/gpu/test_skinny_gemm.py
Timing: python3 bench/skinny_gemm.py
Random bf16/fp16 inputs (never zeros), the Qwen2.5-0.5B and Llama-3-8B projection shapes,
with and without bias, M in 1..16 (Triton) and 17 (F.linear fallback); outputs pre-filled
with NaN; CUDA-graph capture + replay equals eager bit for bit. Skipped cleanly without
CUDA or Triton. SKINNY_GEMM_TEST_SEED reproduces a seed.
"""
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]

if torch.cuda.is_available():
    pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def _import_sg():
    """The package __init__ pulls in the whole engine; skinny_gemm needs only torch and
    triton, so without the engine's extras it is loaded under a bare package stub."""
    try:
        from backend_lib.layers import skinny_gemm
        return skinny_gemm
    except Exception:
        for name in [m for m in sys.modules if m == "backend_lib" or m.startswith("backend_lib.")]:
            del sys.modules[name]
        pkg = types.ModuleType("backend_lib")
        pkg.__path__ = [os.path.join(_ROOT, "backend_lib")]
        sys.modules["backend_lib"] = pkg
        from backend_lib.layers import skinny_gemm
        return skinny_gemm


sg = _import_sg()
DEV = "cuda"


@pytest.fixture(autouse=True)
def _skinny_on():
    """The module flag is OFF by default (the model keeps cuBLAS); these tests exercise the
    Triton path, so they turn it on."""
    old = sg.ENABLED
    sg.ENABLED = True
    yield
    sg.ENABLED = old

# (name, K, N, has_bias_in_model)
SHAPES = [
    ("qwen-qkv", 896, 1152),
    ("qwen-o", 896, 896),
    ("qwen-gate_up", 896, 9728),
    ("qwen-down", 4864, 896),
    ("llama-qkv", 4096, 6144),
    ("llama-o", 4096, 4096),
    ("llama-gate_up", 4096, 28672),
    ("llama-down", 14336, 4096),
]
DTYPES = [torch.bfloat16, torch.float16]


def _seed() -> int:
    env = os.environ.get("SKINNY_GEMM_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


_weights: dict = {}


def _weight(K, N, dtype):
    """One random weight per (shape, dtype), scaled so outputs are O(1)."""
    key = (K, N, dtype)
    if key not in _weights:
        _weights.clear()  # keep at most one Llama-sized weight alive
        w = torch.randn(N, K, device=DEV, dtype=torch.float32).mul_(K ** -0.5).to(dtype)
        b = torch.randn(N, device=DEV, dtype=torch.float32).to(dtype)
        _weights[key] = (w, b)
    return _weights[key]


def _rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _check(M, K, N, dtype, bias, seed):
    w, b = _weight(K, N, dtype)
    b = b if bias else None
    x = torch.randn(M, K, device=DEV, dtype=dtype)
    assert x.abs().sum() > 0
    out = torch.full((M, N), float("nan"), device=DEV, dtype=dtype)
    res = sg.linear(x, w, b, out=out)
    assert res is out
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert not torch.isnan(out).any(), f"unwritten outputs M={M} K={K} N={N} (seed={seed})"
    err = _rel(out, ref)
    assert err < 1e-2, f"M={M} K={K} N={N} {dtype} bias={bias}: rel err {err:.3e} (seed={seed})"
    # allocating path agrees with the out= path bit for bit (same kernel, deterministic)
    assert torch.equal(sg.linear(x, w, b), out)
    return err


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,K,N", SHAPES, ids=[s[0] for s in SHAPES])
def test_shapes(name, K, N, dtype, bias):
    seed = _seed()
    for M in (1, 2, 7, 16, 17):
        assert sg.supported(torch.empty(M, K, device=DEV, dtype=dtype), *_weight(K, N, dtype)) \
            == (M <= 16)
        _check(M, K, N, dtype, bias, seed)


@pytest.mark.parametrize("name,K,N", [SHAPES[0], SHAPES[3]], ids=["qwen-qkv", "qwen-down"])
def test_every_m(name, K, N):
    seed = _seed()
    for M in range(1, 18):
        _check(M, K, N, torch.bfloat16, True, seed)


def test_odd_shapes_and_3d_input():
    """Masked N / K tails, split-K with empty splits, [B, T, K] input, non-contiguous x."""
    seed = _seed()
    for (K, N) in [(300, 100), (200, 40), (1000, 33), (8200, 72)]:
        for M in (1, 5, 16):
            _check(M, K, N, torch.float16, True, seed)
    w, b = _weight(512, 256, torch.bfloat16)
    x = torch.randn(2, 3, 512, device=DEV, dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float(), b.float())
    out = sg.linear(x, w, b)
    assert out.shape == (2, 3, 256) and _rel(out, ref) < 1e-2
    xs = torch.randn(4, 1024, device=DEV, dtype=torch.bfloat16)[:, ::2]  # stride(1) == 2
    assert _rel(sg.linear(xs, w, b), F.linear(xs.float(), w.float(), b.float())) < 1e-2


def test_split_k_counters_reset():
    """Split-K shapes leave their counters at zero (needed for the next launch / replay)."""
    _seed()
    K, N = 4864, 896
    cfg = sg.pick_config(N, K, sg._sms(torch.device(DEV)))
    w, b = _weight(K, N, torch.bfloat16)
    for _ in range(3):
        sg.linear(torch.randn(3, K, device=DEV, dtype=torch.bfloat16), w, b)
    torch.cuda.synchronize()
    if cfg[2] > 1:
        buf = sg._locks[torch.cuda.current_device()][0]
        assert int(buf.abs().sum()) == 0


@pytest.mark.parametrize("name,K,N", [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[4], SHAPES[7]],
                         ids=["qwen-qkv", "qwen-o", "qwen-down", "llama-qkv", "llama-down"])
@pytest.mark.parametrize("M", [1, 16])
def test_cuda_graph_replay_matches_eager(name, K, N, M):
    seed = _seed()
    dtype = torch.bfloat16
    w, b = _weight(K, N, dtype)
    b = b if name == "qwen-qkv" else None
    x = torch.randn(M, K, device=DEV, dtype=dtype)
    sg.linear(x, w, b)  # eager first: compiles, allocates the split-K counters
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sg.linear(x, w, b)
    for _ in range(3):
        x.copy_(torch.randn(M, K, device=DEV, dtype=dtype))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        eager = sg.linear(x, w, b)
        assert torch.equal(out, eager), f"graph replay != eager (seed={seed})"
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert _rel(out, ref) < 1e-2


def test_fallbacks():
    _seed()
    w = torch.randn(64, 32, dtype=torch.float32)
    x = torch.randn(3, 32)
    assert torch.equal(sg.linear(x, w), F.linear(x, w))  # CPU: exactly F.linear
    wc = w.to(DEV)
    xc = x.to(DEV)
    assert not sg.supported(xc, wc)  # fp32 CUDA -> F.linear
    assert torch.equal(sg.linear(xc, wc), F.linear(xc, wc))
    wb = wc.to(torch.bfloat16)
    xb = xc.to(torch.bfloat16)
    assert sg.supported(xb, wb)
    old = sg.ENABLED
    try:
        sg.ENABLED = False
        assert not sg.supported(xb, wb)
        assert torch.equal(sg.linear(xb, wb), F.linear(xb, wb))
    finally:
        sg.ENABLED = old
