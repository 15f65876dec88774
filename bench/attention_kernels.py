"""Timing of the Triton paged-attention kernels (backend_lib/layers/triton_attention.py).

    python3 bench/attention_kernels.py            # decode table + config sweep + prefill
    python3 bench/attention_kernels.py --no-sweep

Decode: Llama-3-8B head config (32 q heads, 8 kv heads, head_dim 128), bf16, block 16,
shuffled block tables.  Effective bandwidth = bytes of K+V read / kernel time.  Times are
medians of triton.testing.do_bench over a CUDA graph of back-to-back calls that rotate over
>= 200 MB of distinct KV (cold L2, no host launch overhead, as in a graph-captured engine);
the 'eager' column is one plain call including host overhead.  Baseline: gather the paged
KV with torch indexing, then F.scaled_dot_product_attention (enable_gqa), also graphed.
Also: a split/tile-config sweep for decode and a BLOCK_M sweep for the varlen prefill kernel,
and that kernel's flat grid (the mixed-step CUDA graphs' mode) on each case padded to its bucket.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from backend_lib.layers.triton_support import num_sms  # noqa: E402
from backend_lib.layers.triton_attention import (  # noqa: E402
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    reference_paged_attention,
)

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEV = "cuda"


def graph_us(calls, rep=100):
    """Median GPU time per call (us) of `calls` captured back-to-back in one CUDA graph.

    do_bench flushes L2 before every replay; the calls rotate over distinct KV sets, so
    each call reads cold KV.  No host launch overhead is included (as in a graph engine).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    t = do_bench(g.replay, warmup=10, rep=rep, return_mode="median")
    del g
    return t * 1e3 / len(calls)


def eager_us(fn, rep=100):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def make_decode(bsz, ctx, n_sets=1, max_blocks=None):
    """One big cache; n_sets block tables over disjoint shuffled blocks (+ q/out each)."""
    n_pages = -(-ctx // PAGE)
    max_blocks = max_blocks or n_pages
    num_blocks = n_sets * bsz * n_pages + 1
    k = torch.randn(num_blocks, PAGE, HKV, D, device=DEV, dtype=DTYPE)
    v = torch.randn(num_blocks, PAGE, HKV, D, device=DEV, dtype=DTYPE)
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    sets = []
    for i in range(n_sets):
        bt = torch.zeros(bsz, max_blocks, device=DEV, dtype=torch.int32)
        bt[:, :n_pages] = perm[i * bsz * n_pages:(i + 1) * bsz * n_pages].view(bsz, n_pages)
        q = torch.randn(bsz, HQ, D, device=DEV, dtype=DTYPE)
        sets.append((q, bt, torch.empty_like(q)))
    sl = torch.full((bsz,), ctx, device=DEV, dtype=torch.int32)
    return k, v, sl, sets


def decode_table(sweep: bool):
    scale = D ** -0.5
    sms = num_sms(torch.device(DEV))
    print(f"\n== paged decode, Llama-3-8B heads (Hq={HQ}, Hkv={HKV}, D={D}), {DTYPE}, "
          f"block {PAGE}, {torch.cuda.get_device_name()} ({sms} SMs) ==")
    print("graph = per call inside a CUDA graph, cold L2 (KV rotated over >=200 MB); eager = one "
          "plain call incl. host launch overhead; sdpa = torch gather + SDPA(enable_gqa), graph")
    hdr = (f"{'B':>4} {'ctx':>5} {'splits':>6} {'KV MB':>7} | {'graph us':>8} {'GB/s':>6} | "
           f"{'eager us':>8} | {'sdpa us':>8} {'GB/s':>6} | {'speedup':>7} {'relerr':>7}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for ctx in (384, 2048):
        for bsz in (1, 8, 64, 256):
            kv_bytes = 2 * bsz * ctx * HKV * D * 2
            n_sets = max(1, min(128, -(-200_000_000 // kv_bytes)))
            k, v, sl, sets = make_decode(bsz, ctx, n_sets)
            ns = decode_num_splits(bsz, HKV, sets[0][1].shape[1], PAGE, 64, sms)

            def calls_for(k=k, v=v, sl=sl, sets=sets, **kw):   # bind this row's tensors
                return [(lambda q=q, bt=bt, out=out: paged_decode_attention(
                    q, k, v, bt, sl, scale, out=out, **kw)) for q, bt, out in sets]

            t = graph_us(calls_for())
            q0, bt0, out0 = sets[0]
            te = eager_us(lambda: paged_decode_attention(q0, k, v, bt0, sl, scale, out=out0))

            def naive(q, bt):
                btl = bt.long()
                kg = k[btl].flatten(1, 2)[:, :ctx].transpose(1, 2)   # [B, Hkv, L, D]
                vg = v[btl].flatten(1, 2)[:, :ctx].transpose(1, 2)
                return F.scaled_dot_product_attention(q.unsqueeze(2), kg, vg, scale=scale,
                                                      enable_gqa=True)

            try:
                tb = graph_us([(lambda q=q, bt=bt: naive(q, bt)) for q, bt, _ in sets])
            except Exception as e:  # noqa: BLE001
                print(f"  (sdpa graph capture failed: {type(e).__name__}; eager)")
                tb = eager_us(lambda: naive(q0, bt0))
            ref = naive(q0, bt0).squeeze(2).float()
            paged_decode_attention(q0, k, v, bt0, sl, scale, out=out0)
            err = ((out0.float() - ref).norm() / ref.norm()).item()
            print(f"{bsz:>4} {ctx:>5} {ns:>6} {kv_bytes / 1e6:>7.1f} | {t:>8.1f} "
                  f"{kv_bytes / t / 1e3:>6.0f} | {te:>8.1f} | {tb:>8.1f} {kv_bytes / tb / 1e3:>6.0f} | "
                  f"{tb / t:>6.1f}x {err:>7.1e}", flush=True)
            rows.append((bsz, ctx, calls_for, ns, t, sets[0][1].shape[1]))

    # Robustness: block table sized for a 32k context, actual context 2048.
    k, v, sl, sets = make_decode(8, 2048, 12, max_blocks=32768 // PAGE)
    t = graph_us([(lambda q=q, bt=bt, out=out: paged_decode_attention(q, k, v, bt, sl, scale, out=out))
                  for q, bt, out in sets])
    kv_bytes = 2 * 8 * 2048 * HKV * D * 2
    ns = decode_num_splits(8, HKV, 32768 // PAGE, PAGE, 64, sms)
    print(f"B=8 ctx=2048, max_blocks for 32k (splits {ns}): {t:.1f} us, {kv_bytes / t / 1e3:.0f} GB/s")
    del k, v, sets

    if not sweep:
        return
    print("\n== decode sweep (graph us): (block_n/warps/stages) with auto splits; nsX = default "
          "tile config with X splits ==")
    configs = [(64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 4, 2), (64, 8, 3)]
    for (bsz, ctx, calls_for, auto_ns, t_auto, mb) in rows:
        res = [(t_auto, f"auto(ns{auto_ns})")]
        for bn, nw, st in configs:
            try:
                res.append((graph_us(calls_for(block_n=bn, num_warps=nw, num_stages=st), rep=50),
                            f"bn{bn}/w{nw}/s{st}"))
            except Exception as e:  # noqa: BLE001
                res.append((float("inf"), f"bn{bn}/w{nw}/s{st}:{type(e).__name__}"))
        for ns in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
            if ns == auto_ns or ns > -(-ctx // 64):
                continue
            res.append((graph_us(calls_for(num_splits=ns), rep=50), f"ns{ns}"))
        res.sort()
        print(f"B={bsz:>3} ctx={ctx:>4}: " + ", ".join(f"{name}={t:.1f}" for t, name in res),
              flush=True)


def prefill_table():
    print(f"\n== paged prefill (varlen, causal), Hq={HQ} Hkv={HKV} D={D} {DTYPE}; graph us "
          "(cold L2); columns bmX = forced BLOCK_M ==")
    scale = D ** -0.5
    cases = [
        ("1 x 2048 new, ctx 0", [2048], [0]),
        ("4 x 512 new, ctx 1536", [512] * 4, [1536] * 4),
        ("1x1024 new + 63 decode @2048", [1024] + [1] * 63, [0] + [2047] * 63),
        ("1x256 new + 127 decode @1024", [256] + [1] * 127, [768] + [1023] * 127),
        ("16 x 128 new, ctx 0", [128] * 16, [0] * 16),
    ]
    for name, q_lens, ctx_lens in cases:
        seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
        n_pages = [-(-L // PAGE) for L in seq_lens]
        num_blocks = sum(n_pages) + 1
        k = torch.randn(num_blocks, PAGE, HKV, D, device=DEV, dtype=DTYPE)
        v = torch.randn(num_blocks, PAGE, HKV, D, device=DEV, dtype=DTYPE)
        perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
        bt = torch.zeros(len(q_lens), max(n_pages), device=DEV, dtype=torch.int32)
        i = 0
        for s, n in enumerate(n_pages):
            bt[s, :n] = perm[i:i + n]
            i += n
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), device=DEV,
                          dtype=torch.int32)
        sl = torch.tensor(seq_lens, device=DEV, dtype=torch.int32)
        q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=DTYPE)
        out = torch.empty_like(q)
        mq = max(q_lens)
        t = graph_us([lambda: paged_prefill_attention(q, k, v, cu, sl, bt, scale, mq, out=out)])
        flops = sum(4 * HQ * D * ql * (c + (ql + 1) / 2) for ql, c in zip(q_lens, ctx_lens))
        kv_bytes = sum(seq_lens) * HKV * D * 4
        ref = reference_paged_attention(q, k, v, bt, sl, scale, cu_seqlens_q=cu)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        forced = []
        for bm, nw in ((16, 4), (32, 4), (64, 4), (128, 8)):
            tt = graph_us([lambda bm=bm, nw=nw: paged_prefill_attention(
                q, k, v, cu, sl, bt, scale, mq, out=out, block_m=bm, num_warps=nw)], rep=50)
            forced.append(f"bm{bm}={tt:.1f}")
        # The flat grid of a mixed-step CUDA graph (max_q_len None), on the case padded to
        # its bucket as mixed_graphs.py pads it: tokens to a power of two, rows to a power of 4.
        tb, sb = 1 << (sum(q_lens) - 1).bit_length(), 4
        while sb < len(q_lens):
            sb *= 4
        q_b = torch.zeros(tb, HQ, D, device=DEV, dtype=DTYPE)
        q_b[:sum(q_lens)] = q
        cu_b = torch.cat([cu, cu[-1:].expand(sb - len(q_lens))]).contiguous()
        sl_b = torch.cat([sl, sl.new_zeros(sb - len(q_lens))]).contiguous()
        bt_b = torch.cat([bt, bt.new_zeros(sb - len(q_lens), bt.shape[1])]).contiguous()
        out_b = torch.empty_like(q_b)
        tfl = graph_us([lambda: paged_prefill_attention(q_b, k, v, cu_b, sl_b, bt_b, scale, None, out=out_b)])
        err_b = ((out_b[:sum(q_lens)].float() - ref).norm() / ref.norm()).item()
        forced.append(f"flat[{tb},{sb}]={tfl:.1f} (err {err_b:.1e})")
        extra = ""
        if all(c == 0 for c in ctx_lens) and len(set(q_lens)) == 1:
            qq = q.view(len(q_lens), q_lens[0], HQ, D).transpose(1, 2)
            kk = torch.randn(len(q_lens), HKV, q_lens[0], D, device=DEV, dtype=DTYPE)
            tf = graph_us([lambda: F.scaled_dot_product_attention(qq, kk, kk, is_causal=True,
                                                                  scale=scale, enable_gqa=True)])
            extra = f" | sdpa contiguous causal {tf:.1f} us"
        print(f"{name:<29} {t:>7.1f} us {flops / t / 1e6:>6.1f} TFLOP/s {kv_bytes / t / 1e3:>5.0f} "
              f"GB/s(KV) err {err:.1e} | {' '.join(forced)}{extra}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    decode_table(sweep=not args.no_sweep)
    if not args.no_prefill:
        prefill_table()


if __name__ == "__main__":
    main()
