"""GPU tests for backend_lib/layers/fused_ops.py (Triton add+RMSNorm, silu*mul, rotary+KV
write) and for the fused residual-stream path of DecoderModel against its torch path.

Run: python3 -m pytest -q tests/gpu/test_fused_ops.py
Timing (batch-1 decode under a CUDA graph, fused vs torch, Qwen2.5-0.5B shape):
     python3 tests/gpu/test_fused_ops.py
Skipped cleanly when CUDA or Triton is absent. Seed: FUSED_OPS_TEST_SEED reproduces one.
"""
import os
import sys
import time
from types import SimpleNamespace

import pytest

from gpu_helpers import GPU_MARKS, seed_from_env, torch  # skips the module without torch (CUDA: triton)

pytestmark = GPU_MARKS

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_layers():
    """fused_ops / llama / attention / rotary. The package __init__ pulls in the whole engine
    (transformers, safetensors, ...); these modules need only torch and triton, so when the
    engine's extras are missing they are loaded under a bare package stub."""
    try:
        from backend_lib.layers import attention, fused_ops, rotary
        from backend_lib.models import llama
        return fused_ops, llama, attention, rotary
    except ImportError:
        import types
        for name in [m for m in sys.modules if m == "backend_lib" or m.startswith("backend_lib.")]:
            del sys.modules[name]
        pkg = types.ModuleType("backend_lib")
        pkg.__path__ = [os.path.join(_ROOT, "backend_lib")]
        sys.modules["backend_lib"] = pkg
        from backend_lib.layers import attention, fused_ops, rotary
        from backend_lib.models import llama
        return fused_ops, llama, attention, rotary


if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
fo, llama, attention, rotary_mod = _import_layers()

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16]


def _seed() -> int:
    return seed_from_env("FUSED_OPS_TEST_SEED")


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _check(out, ref, seed, what, tol=1e-2):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in output (seed={seed})"
    err = _rel(out, ref)
    assert err < tol, f"{what}: rel err {err:.3e} (seed={seed})"


# ------------------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 896), (7, 4096), (33, 1000), (2, 64)])
def test_rms_norm(dtype, rows, n):
    seed = _seed()
    x = (3 * torch.randn(rows, n, device=DEV)).to(dtype)
    w = (1 + 0.5 * torch.randn(n, device=DEV)).to(dtype)
    ref = fo.rms_norm_ref(x, w, 1e-6)
    out = fo.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype
    _check(out, ref, seed, "rms_norm")
    # 3-D input and a strided (row-sliced) input
    x3 = torch.randn(2, 3, n, device=DEV).to(dtype)
    _check(fo.rms_norm(x3, w, 1e-5), fo.rms_norm_ref(x3, w, 1e-5), seed, "rms_norm 3d")
    xs = torch.randn(rows, 2 * n, device=DEV).to(dtype)[:, :n]
    _check(fo.rms_norm(xs, w, 1e-6), fo.rms_norm_ref(xs, w, 1e-6), seed, "rms_norm strided")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 896), (5, 4096), (9, 1000)])
def test_fused_add_rms_norm(dtype, rows, n):
    seed = _seed()
    x = torch.randn(rows, n, device=DEV).to(dtype)
    res = (4 * torch.randn(rows, n, device=DEV)).to(dtype)
    w = (1 + 0.5 * torch.randn(n, device=DEV)).to(dtype)
    x0, r0 = x.clone(), res.clone()
    ref_out, ref_res = fo.fused_add_rms_norm_ref(x, res, w, 1e-6)
    out, new_res = fo.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(x, x0) and torch.equal(res, r0), "inputs must not be modified"
    assert out.dtype == dtype and new_res.dtype == dtype
    _check(out, ref_out, seed, "fused_add_rms_norm out")
    # The residual sum is one rounding of an exact fp32 sum: bit-identical to torch's add.
    assert torch.equal(new_res, ref_res), f"residual differs (seed={seed})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_add_rms_norm_rounds_an_fp32_accumulator_first(dtype):
    """x an fp32 accumulator of a stream in residual's dtype (split-K projections): the same
    outputs, in the stream's dtype, as x.to(dtype) first."""
    seed = _seed()
    x = torch.randn(1, 896, device=DEV) / 3          # fp32, not representable in dtype
    res = (4 * torch.randn(1, 896, device=DEV)).to(dtype)
    w = (1 + 0.5 * torch.randn(896, device=DEV)).to(dtype)
    out, new_res = fo.fused_add_rms_norm(x, res, w, 1e-6)
    want_out, want_res = fo.fused_add_rms_norm(x.to(dtype), res, w, 1e-6)
    assert out.dtype == dtype and new_res.dtype == dtype, (out.dtype, new_res.dtype)
    assert torch.equal(new_res, want_res) and torch.equal(out, want_out), f"seed={seed}"


# ------------------------------------------------------------------------------ silu*mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 4864), (6, 1000), (3, 64), (2, 2048)])
def test_silu_and_mul(dtype, rows, inter):
    seed = _seed()
    gu = (2 * torch.randn(rows, 2 * inter, device=DEV)).to(dtype)
    out = fo.silu_and_mul(gu)
    assert out.shape == (rows, inter) and out.dtype == dtype
    _check(out, fo.silu_and_mul_ref(gu), seed, "silu_and_mul")


# ------------------------------------------------------------------------------ rotary + KV
def _cos_sin(d, max_pos=4096, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(DEV), emb.sin().to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (32, 8, 128), (8, 8, 32), (12, 3, 80)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_write_kv(dtype, hq, hkv, d, qk_norm):
    seed = _seed()
    t, nb, bs = 11, 9, 16
    # q, k, v as strided views of one qkv projection output, like the model does.
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    cos, sin = _cos_sin(d)
    pos = torch.randint(0, 4096, (t,), device=DEV)
    pos[0] = 0
    slots = torch.randperm(nb * bs, device=DEV)[:t]
    qw = (1 + 0.3 * torch.randn(d, device=DEV)).to(dtype) if qk_norm else None
    kw = (1 + 0.3 * torch.randn(d, device=DEV)).to(dtype) if qk_norm else None

    kc_ref = torch.full((nb, bs, hkv, d), float("nan"), device=DEV, dtype=dtype)
    vc_ref = kc_ref.clone()
    q_ref = fo.rope_and_write_kv_ref(q.clone(), k.clone(), v.clone(), cos, sin, pos, kc_ref, vc_ref,
                                     slots, qw, kw, 1e-6)
    kc, vc = kc_ref.clone().fill_(float("nan")), vc_ref.clone().fill_(float("nan"))
    k0, v0 = k.clone(), v.clone()
    q_out = fo.rope_and_write_kv(q, k, v, cos, sin, pos, kc, vc, slots, qw, kw, 1e-6)
    assert q_out.data_ptr() == q.data_ptr(), "q is rotated in place"
    assert torch.equal(k, k0) and torch.equal(v, v0)
    _check(q_out, q_ref, seed, "q")
    flat = lambda c: c.view(nb * bs, hkv, d)  # noqa: E731
    _check(flat(kc)[slots], flat(kc_ref)[slots], seed, "k cache")
    assert torch.equal(flat(vc)[slots], flat(vc_ref)[slots]), f"v cache (seed={seed})"
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.isnan(flat(kc)[untouched]).all() and torch.isnan(flat(vc)[untouched]).all(), \
        "wrote outside slot_mapping"


def test_rope_and_write_kv_negative_slot_and_fp32_cache():
    seed = _seed()
    t, hq, hkv, d, nb, bs = 4, 4, 2, 64, 2, 8
    dtype = torch.bfloat16
    q = torch.randn(t, hq, d, device=DEV).to(dtype)
    k = torch.randn(t, hkv, d, device=DEV).to(dtype)
    v = torch.randn(t, hkv, d, device=DEV).to(dtype)
    cos, sin = _cos_sin(d, 64)
    pos = torch.tensor([3, 9, 0, 63], device=DEV)
    slots = torch.tensor([5, -1, 0, 15], device=DEV)
    kc = torch.full((nb, bs, hkv, d), float("nan"), device=DEV)
    vc = kc.clone()
    kc_ref, vc_ref = torch.zeros_like(kc), torch.zeros_like(vc)
    ok = slots >= 0
    q_ref = fo.rope_and_write_kv_ref(q[ok].clone(), k[ok], v[ok], cos, sin, pos[ok], kc_ref, vc_ref,
                                     slots[ok], None, None, 1e-6)
    q_out = fo.rope_and_write_kv(q.clone(), k, v, cos, sin, pos, kc, vc, slots)
    _check(q_out[ok], q_ref, seed, "q")
    fk, fr = kc.view(-1, hkv, d), kc_ref.view(-1, hkv, d)
    _check(fk[slots[ok]], fr[slots[ok]], seed, "fp32 k cache")
    assert torch.equal(vc.view(-1, hkv, d)[slots[ok]], vc_ref.view(-1, hkv, d)[slots[ok]])
    assert int(torch.isnan(fk).all(-1).all(-1).sum()) == nb * bs - 3, "slot -1 must write nothing"


# ------------------------------------------------------------------------------ whole model
def _config(kind: str, layers: int = 3, vocab: int = 1000):
    if kind == "qwen2":  # Qwen2.5-0.5B head layout, attention bias
        return SimpleNamespace(model_type="qwen2", vocab_size=vocab, hidden_size=896,
                               intermediate_size=1216, num_hidden_layers=layers,
                               num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, max_position_embeddings=2048,
                               rope_theta=1000000.0)
    if kind == "qwen3":  # explicit head_dim (q width != hidden), per-head q/k norm
        return SimpleNamespace(model_type="qwen3", vocab_size=vocab, hidden_size=256, head_dim=128,
                               intermediate_size=768, num_hidden_layers=layers,
                               num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, max_position_embeddings=2048,
                               rope_theta=1000000.0, attention_bias=False)
    if kind == "qwen2.5-0.5b":
        return SimpleNamespace(model_type="qwen2", vocab_size=151936, hidden_size=896,
                               intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
                               tie_word_embeddings=True, max_position_embeddings=32768,
                               rope_theta=1000000.0)
    raise ValueError(kind)


def _build(cfg, dtype=torch.bfloat16):
    with torch.device(DEV):
        model = llama.DecoderModel(cfg)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.data.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.data.normal_(0, 0.5)
    model = model.to(dtype)
    model.rotary = rotary_mod.RotaryEmbedding(cfg, model.shape.head_dim).to(DEV)
    model.requires_grad_(False)
    return model.eval()


def _caches(model, num_blocks, block_size, dtype=torch.bfloat16):
    s = model.shape
    return [(torch.zeros(num_blocks, block_size, s.num_kv_heads, s.head_dim, device=DEV, dtype=dtype),
             torch.zeros(num_blocks, block_size, s.num_kv_heads, s.head_dim, device=DEV, dtype=dtype))
            for _ in model.layers]


class _Seqs:
    """Sequences over a paged cache (block 0 reserved for padding rows, as in the engine)."""

    def __init__(self, lens, block_size=16, max_blocks=8):
        self.bs, self.lens = block_size, list(lens)
        n = len(lens)
        ids = torch.randperm(n * max_blocks) + 1
        self.tables = ids.view(n, max_blocks).to(torch.int32).to(DEV)
        self.num_blocks = n * max_blocks + 1

    def step(self, q_lens, pad_rows=0):
        """Metadata for appending q_lens[i] tokens to sequence i (+ decode padding rows)."""
        pos, slots, rows = [], [], []
        for i, ql in enumerate(q_lens):
            for p in range(self.lens[i], self.lens[i] + ql):
                pos.append(p)
                slots.append(int(self.tables[i, p // self.bs]) * self.bs + p % self.bs)
            rows.append(i)
        seq_lens = [self.lens[i] + ql for i, ql in enumerate(q_lens)]
        self.lens = seq_lens
        tables = self.tables
        if pad_rows:  # bucket padding: slot 0 (reserved block), seq_len 0
            pos += [0] * pad_rows
            slots += [0] * pad_rows
            seq_lens = seq_lens + [0] * pad_rows
            tables = torch.cat([tables, torch.zeros(pad_rows, tables.shape[1], dtype=torch.int32,
                                                    device=DEV)])
        cu = [0]
        for ql in list(q_lens) + [1] * pad_rows:
            cu.append(cu[-1] + ql)
        is_decode = all(ql == 1 for ql in q_lens)
        meta = attention.AttentionMetadata(
            torch.tensor(slots, device=DEV), tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
            torch.tensor(cu, dtype=torch.int32, device=DEV), max(q_lens), is_decode)
        return torch.tensor(pos, device=DEV), meta


def _run(model, fused, ids, pos, caches, meta):
    model.use_fused_ops = fused
    try:
        return model.compute_logits(model(ids, pos, caches, meta))
    finally:
        model.use_fused_ops = True


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_model_fused_matches_torch_path(kind):
    with torch.inference_mode():
        _model_fused_matches_torch_path(kind)


def _model_fused_matches_torch_path(kind):
    seed = _seed()
    cfg = _config(kind)
    model = _build(cfg)
    s = model.shape
    assert s.qk_norm == (kind == "qwen3") and s.attention_bias == (kind == "qwen2")
    seqs = _Seqs([0, 0, 0])
    caches_f = _caches(model, seqs.num_blocks, seqs.bs)
    caches_t = _caches(model, seqs.num_blocks, seqs.bs)

    def compare(ids, pos, meta, what):
        lf = _run(model, True, ids, pos, caches_f, meta)
        lt = _run(model, False, ids, pos, caches_t, meta)
        assert not torch.isnan(lf).any(), f"{what}: NaN logits (seed={seed})"
        err = _rel(lf, lt)
        mx = (lf - lt).abs().max().item() / lt.abs().max().item()
        assert err < 2e-2 and mx < 5e-2, f"{what}: rel {err:.3e} max {mx:.3e} (seed={seed})"
        for (kf, vf), (kt, vt) in zip(caches_f, caches_t):
            assert _rel(kf, kt) < 2e-2 and _rel(vf, vt) < 2e-2, f"{what}: KV caches differ"
        return lf

    # Prefill (varlen, 3 sequences), then two decode steps with a bucket padding row.
    q_lens = [5, 23, 1]
    ids = torch.randint(0, s.vocab_size, (sum(q_lens),), device=DEV)
    pos, meta = seqs.step(q_lens)
    compare(ids, pos, meta, "prefill")
    for step in range(2):
        ids = torch.randint(0, s.vocab_size, (4,), device=DEV)
        pos, meta = seqs.step([1, 1, 1], pad_rows=1)
        compare(ids, pos, meta, f"decode {step}")

    # CUDA graph: the fused decode step captures and replays to the eager result.
    ids = torch.randint(0, s.vocab_size, (4,), device=DEV)
    pos, meta = seqs.step([1, 1, 1], pad_rows=1)
    eager = _run(model, True, ids, pos, caches_f, meta)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(model, True, ids, pos, caches_f, meta)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _run(model, True, ids, pos, caches_f, meta)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any() and _rel(out, eager) < 1e-3, \
        f"graph replay differs from eager: {_rel(out, eager):.3e} (seed={seed})"


def test_cpu_path_untouched():
    """On CPU the model never reaches the fused ops (the torch code runs as before)."""
    cfg = _config("qwen3", layers=1, vocab=64)
    x = torch.randn(2, 256)
    assert not fo.available(x)
    with torch.device("cpu"):
        m = llama.DecoderModel(cfg)
    assert not m._fused(x)


# ------------------------------------------------------------------------------ timing
@torch.inference_mode()
def _time_decode(kind="qwen2.5-0.5b", ctx=512, iters=300):
    cfg = _config(kind)
    model = _build(cfg)
    s = model.shape
    seqs = _Seqs([ctx], block_size=16, max_blocks=(ctx + 64) // 16)
    caches = _caches(model, seqs.num_blocks, seqs.bs)
    ids = torch.randint(0, s.vocab_size, (1,), device=DEV)
    pos, meta = seqs.step([1])
    results = {}
    for fused in (False, True):
        def step():
            return _run(model, fused, ids, pos, caches, meta).argmax(-1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # kernel count of one eager step
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / iters * 1e3
        # decoder only (no lm_head): per-layer cost
        model.use_fused_ops = fused
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            model(ids, pos, caches, meta)
        model.use_fused_ops = True
        for _ in range(20):
            g2.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            g2.replay()
        torch.cuda.synchronize()
        ms_dec = (time.perf_counter() - t0) / iters * 1e3
        results[fused] = (ms, ms_dec, kernels)
        print(f"{kind} bs=1 ctx={ctx} fused={fused}: step {ms:.3f} ms (graph), decoder-only "
              f"{ms_dec:.3f} ms, {kernels} GPU ops/step eager (~{kernels / s.num_layers:.1f}/layer)")
    return results


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("CUDA not available")
    _time_decode()
