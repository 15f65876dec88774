"""Timing of the Triton skinny GEMM (backend_lib/layers/skinny_gemm.py) against cuBLAS.

    python3 bench/skinny_gemm.py                 # kernel table + whole-model decode step
    python3 bench/skinny_gemm.py --no-model      # kernel table only
    python3 bench/skinny_gemm.py --llama-model   # also a Llama-3-8B-shaped decode step
    python3 bench/skinny_gemm.py --no-sweep      # skip the per-shape config sweep

Kernel table: Qwen2.5-0.5B and Llama-3-8B projection shapes, bf16, M = 1, 8, 16 rows.
Times are medians of triton.testing.do_bench_cudagraph (a CUDA graph of back-to-back calls,
no host launch overhead); consecutive calls rotate over >= 256 MB of distinct weight copies,
so every call reads its weight from HBM (cold L2), as in a real decode step. TB/s = weight
bytes / time.

Whole model: DecoderModel built on meta and materialized with random weights
(loader.build_model(load_format="dummy")) from a Qwen2Config saved to a temp dir; one batch-1
decode step (embed + 24 layers + final norm + lm_head + argmax) captured in a CUDA graph,
with the skinny path on and off (module flag skinny_gemm.ENABLED), ctx 512.
"""
import argparse
import os
import sys
import tempfile
import time
import types
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

try:
    from backend_lib.layers import attention, skinny_gemm as sg  # noqa: E402
    from backend_lib.models import llama  # noqa: E402
except Exception:  # engine extras missing (or mid-edit): load the layers under a bare package stub
    for _n in [m for m in sys.modules if m == "backend_lib" or m.startswith("backend_lib.")]:
        del sys.modules[_n]
    _pkg = types.ModuleType("backend_lib")
    _pkg.__path__ = [str(_ROOT / "backend_lib")]
    sys.modules["backend_lib"] = _pkg
    from backend_lib.layers import attention, skinny_gemm as sg  # noqa: E402
    from backend_lib.models import llama  # noqa: E402

DEV = "cuda"
DTYPE = torch.bfloat16
# (name, K, N, bias)
SHAPES = [
    ("qwen qkv", 896, 1152, True),
    ("qwen o", 896, 896, False),
    ("qwen gate_up", 896, 9728, False),
    ("qwen down", 4864, 896, False),
    ("llama qkv", 4096, 6144, False),
    ("llama o", 4096, 4096, False),
    ("llama gate_up", 4096, 28672, False),
    ("llama down", 14336, 4096, False),
]


def p(*a):
    print(*a, flush=True)


def kernel_table(ms=(1, 8, 16), rep=20):
    old = sg.ENABLED
    sg.ENABLED = True  # the flag is OFF by default
    try:
        return _kernel_table(ms, rep)
    finally:
        sg.ENABLED = old


def _kernel_table(ms, rep):
    sms = sg._sms(torch.device(DEV))
    p(f"\n== skinny GEMM vs cuBLAS, bf16, cold weights, do_bench_cudagraph median ({sms} SMs) ==")
    p(f"{'shape':14s} {'K':>6s} {'N':>6s} {'M':>3s} {'cuBLAS us':>10s} {'triton us':>10s} "
      f"{'speedup':>8s} {'cuBLAS TB/s':>11s} {'triton TB/s':>11s}  config (BN,BK,SPLIT,warps,stages)")
    rows = []
    for name, K, N, has_bias in SHAPES:
        wbytes = N * K * 2
        copies = max(2, -(-256 * 2**20 // wbytes))
        ws = [torch.randn(N, K, device=DEV, dtype=DTYPE) for _ in range(copies)]
        b = torch.randn(N, device=DEV, dtype=DTYPE) if has_bias else None
        cfg = sg.pick_config(N, K, sms)
        for M in ms:
            x = torch.randn(M, K, device=DEV, dtype=DTYPE)
            it = [0]

            def cublas():
                it[0] = (it[0] + 1) % copies
                return F.linear(x, ws[it[0]], b)

            def triton_fn():
                it[0] = (it[0] + 1) % copies
                return sg.linear(x, ws[it[0]], b)

            # correctness at a glance
            ref = F.linear(x.float(), ws[0].float(), None if b is None else b.float())
            err = ((sg.linear(x, ws[0], b).float() - ref).norm() / ref.norm()).item()
            t_cu = do_bench_cudagraph(cublas, rep=rep, return_mode="median") * 1e3
            t_tr = do_bench_cudagraph(triton_fn, rep=rep, return_mode="median") * 1e3
            rows.append((name, M, t_cu, t_tr))
            p(f"{name:14s} {K:6d} {N:6d} {M:3d} {t_cu:10.2f} {t_tr:10.2f} {t_cu / t_tr:7.2f}x "
              f"{wbytes / t_cu / 1e6:11.2f} {wbytes / t_tr / 1e6:11.2f}  {cfg}"
              f"{'  REL ERR %.1e' % err if err > 1e-2 else ''}")
        del ws
        torch.cuda.empty_cache()
    return rows


SWEEP = {  # (K, N): alternative (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) to the heuristic
    (896, 896): [(16, 128, 2, 4, 4), (16, 64, 1, 4, 8)],
    (896, 9728): [(32, 128, 1, 4, 7), (16, 128, 1, 4, 7)],
    (4864, 896): [(16, 128, 4, 4, 8), (16, 256, 8, 4, 3), (16, 256, 2, 4, 4)],
    (4096, 4096): [(32, 256, 1, 4, 3), (16, 128, 1, 4, 8), (32, 128, 2, 4, 4)],
    (4096, 28672): [(64, 128, 1, 4, 3), (16, 256, 1, 4, 4), (32, 128, 1, 4, 6)],
}


def config_sweep(M=1, rep=20, deadline=None):
    """Heuristic config vs a few alternatives (M=1, cold weights): data for retuning."""
    sms = sg._sms(torch.device(DEV))
    p(f"\n== config sweep, M={M}: us per call (heuristic config first) ==")
    for (K, N), alts in SWEEP.items():
        if deadline is not None and time.time() > deadline:
            p("(sweep stopped: time budget)")
            return
        copies = max(2, -(-256 * 2**20 // (N * K * 2)))
        ws = [torch.randn(N, K, device=DEV, dtype=DTYPE) for _ in range(copies)]
        x = torch.randn(M, K, device=DEV, dtype=DTYPE)
        locks = torch.zeros(1024, dtype=torch.int32, device=DEV)
        line = []
        for cfg in [sg.pick_config(N, K, sms)] + alts:
            it = [0]
            out = torch.empty(M, N, device=DEV, dtype=DTYPE)

            def fn():
                it[0] = (it[0] + 1) % copies
                return sg._launch(x, ws[it[0]], None, out, cfg, locks)

            fn()
            ref = F.linear(x.float(), ws[it[0]].float())
            err = ((out.float() - ref).norm() / ref.norm()).item()
            t = do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
            line.append(f"{cfg}: {t:.2f}{' ERR' if err > 1e-2 else ''}")
        p(f"K={K:5d} N={N:5d}  " + "  ".join(line))
        del ws
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ whole model
def _hf_config(kind):
    args = dict(
        qwen=dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1000000.0),
        llama=dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                   rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=8192,
                   rope_theta=500000.0),
    )[kind]
    try:
        from transformers import LlamaConfig, Qwen2Config
        from backend_lib.models.loader import build_model, load_hf_config
    except ImportError:
        return types.SimpleNamespace(**args), None
    cls = Qwen2Config if kind == "qwen" else LlamaConfig
    kw = {k: v for k, v in args.items() if k != "model_type"}
    d = tempfile.mkdtemp(prefix=f"skinny_{kind}_")
    cls(**kw).save_pretrained(d)
    return load_hf_config(d), (build_model, d)


def _build(kind):
    cfg, how = _hf_config(kind)
    if how is not None:
        build_model, d = how
        return build_model(cfg, d, torch.device(DEV), DTYPE, load_format="dummy")
    from backend_lib.layers.rotary import RotaryEmbedding  # same steps as build_model(dummy)
    with torch.device("meta"):
        model = llama.DecoderModel(cfg)
    model = model.to_empty(device=DEV).to(DTYPE)
    model.rotary = RotaryEmbedding(cfg, model.shape.head_dim).to(DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name, prm in model.named_parameters():
        if name.endswith("norm.weight"):
            prm.data.fill_(1.0)
        else:
            prm.data.normal_(0.0, 0.02, generator=gen)
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def model_step(kind="qwen", ctx=512, iters=200, rounds=5):
    model = _build(kind)
    s = model.shape
    bs = 16
    nblk = (ctx + 1 + bs - 1) // bs
    num_blocks = nblk + 1
    caches = [(torch.randn(num_blocks, bs, s.num_kv_heads, s.head_dim, device=DEV, dtype=DTYPE),
               torch.randn(num_blocks, bs, s.num_kv_heads, s.head_dim, device=DEV, dtype=DTYPE))
              for _ in model.layers]
    tables = (torch.arange(nblk, dtype=torch.int32, device=DEV) + 1).view(1, nblk)
    slot = int(tables[0, ctx // bs]) * bs + ctx % bs
    meta = attention.AttentionMetadata(
        torch.tensor([slot], device=DEV), tables,
        torch.tensor([ctx + 1], dtype=torch.int32, device=DEV),
        torch.tensor([0, 1], dtype=torch.int32, device=DEV), 1, True)
    ids = torch.randint(0, s.vocab_size, (1,), device=DEV)
    pos = torch.tensor([ctx], device=DEV)

    def step():
        h = model(ids, pos, caches, meta)
        logits = model.compute_logits(h)
        return logits, logits.argmax(-1)

    def graph_ms(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(iters):
                g.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / iters * 1e3)
        times.sort()
        return times[len(times) // 2], out, g

    old = sg.ENABLED
    res = {}
    try:
        for on in (False, True):
            sg.ENABLED = on
            ms, out, g = graph_ms(step)
            logits = out[0].clone()
            ms_dec, _, g2 = graph_ms(lambda: model(ids, pos, caches, meta))
            res[on] = (ms, ms_dec, logits)
            del g, g2
    finally:
        sg.ENABLED = old
    off, on = res[False], res[True]
    rel = ((on[2] - off[2]).norm() / off[2].norm()).item()
    p(f"\n== whole-model decode step, {kind} ({s.num_layers} layers, hidden {s.hidden_size}), "
      f"bs=1 ctx={ctx}, one CUDA graph, median of {rounds}x{iters} replays ==")
    p(f"{'':18s} {'step ms':>9s} {'decoder-only ms':>16s}")
    p(f"{'cuBLAS (flag off)':18s} {off[0]:9.4f} {off[1]:16.4f}")
    p(f"{'skinny (flag on)':18s} {on[0]:9.4f} {on[1]:16.4f}")
    p(f"speedup: step {off[0] / on[0]:.3f}x, decoder-only {off[1] / on[1]:.3f}x; "
      f"logits rel diff on/off {rel:.2e}; argmax equal: {bool(torch.equal(on[2].argmax(-1), off[2].argmax(-1)))}")
    del model, caches
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument("--llama-model", action="store_true")
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-until", type=float, default=1e9,
                    help="skip the config sweep once this many seconds have passed")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("CUDA not available")
    p(torch.cuda.get_device_name(), "torch", torch.__version__)
    t0 = time.time()
    if not a.no_model:
        model_step("qwen")
        p(f"[{time.time() - t0:.0f}s]")
    if not a.no_table:
        kernel_table(rep=a.rep)
        p(f"[{time.time() - t0:.0f}s]")
    if not a.no_sweep and time.time() - t0 < a.sweep_until:
        config_sweep(rep=a.rep, deadline=t0 + a.sweep_until + 20)
        p(f"[{time.time() - t0:.0f}s]")
    if a.llama_model:
        model_step("llama")
        p(f"[{time.time() - t0:.0f}s]")


if __name__ == "__main__":
    main()
