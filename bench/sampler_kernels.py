"""The split sampler alone (backend_lib/layers/sampling_split.py) on synthetic logits: µs per
call of one captured sample_rows_split, per variant of its launch settings, side by side in
one process; and how many rows take the threshold search (their unfiltered Gumbel winner is
outside the top-k/top-p set), the rows the later passes work on.

    python3 -m bench.sampler_kernels --rows 256 --variant base --variant "pw8:PIVOT_WARPS=8"

A variant is NAME or NAME:KEY=VALUE[,KEY=VALUE...] over sampling_split's module settings
(PIVOT_WARPS, RESOLVE_WARPS, PIVOT_BLOCK, WORKERS_PER_SM, PIVOT_CHUNK_DIVISOR, ...).
Logits: N(0, scale^2) over the vocabulary plus 8 strong tokens (as tests/gpu does), bf16.
CUDA only; speed is not asserted anywhere.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from backend_lib.layers import sampling_split  # noqa: E402
from backend_lib.layers.sampler import SamplingTensors, gumbel_noise, kept_mask, row_keys  # noqa: E402


def _tensors(rows, temperature, top_p, top_k, dev):
    full = lambda v, dt=torch.float32: torch.full((rows,), v, dtype=dt, device=dev)
    return SamplingTensors(
        temperature=full(temperature), top_k=full(top_k, torch.int64), top_p=full(top_p),
        seed=torch.arange(rows, dtype=torch.int64, device=dev) * 7919 + 1,
        position=torch.full((rows,), 300, dtype=torch.int64, device=dev),
        banned_ids=torch.full((rows, 1), -1, dtype=torch.int64, device=dev),
        min_stop_ids=torch.full((rows, 1), -1, dtype=torch.int64, device=dev),
        min_tokens_left=torch.zeros(rows, dtype=torch.int64, device=dev), min_p=full(0.0))


def _searching_rows(logits, st) -> int:
    z = logits.float() / st.temperature.unsqueeze(1)
    win = (z + gumbel_noise(row_keys(st.seed, st.position), logits.shape[1])).argmax(-1)
    kept = kept_mask(z, st.top_k, st.top_p, st.min_p)
    return int((~kept.gather(1, win.unsqueeze(1))).sum())


def settings(spec: str) -> dict:
    """KEY=VALUE[,KEY=VALUE...] over sampling_split's module settings, typed as they are."""
    sets = {}
    for kv in filter(None, spec.split(",")):
        k, v = kv.split("=")
        sets[k] = type(getattr(sampling_split, k))(v)
    return sets


def _parse(spec: str):
    name, _, rest = spec.partition(":")
    return name, settings(rest)


def _time(logits, st, reps: int) -> float:
    fn = lambda: sampling_split.sample_rows_split(logits, st, use_filters=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000.0 / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--scales", default="1,3")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--best-out", default="",
                    help="write the settings of the fastest variant (summed over scales, largest rows) here")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    specs = a.variant or ["base"]
    variants = [_parse(v) for v in specs]
    total = [0.0] * len(variants)
    row_list = [int(r) for r in a.rows.split(",")]
    print("| rows | logit scale | rows searching | variant | µs per call |")
    print("|---|---|---|---|---|")
    for rows in row_list:
        for scale in [float(x) for x in a.scales.split(",")]:
            gen = torch.Generator(device=dev).manual_seed(0)
            logits = torch.randn(rows, a.vocab, device=dev, generator=gen) * scale
            logits[:, :8] += torch.rand(rows, 8, device=dev, generator=gen) * 4 * scale
            logits = logits.to(torch.bfloat16)
            st = _tensors(rows, a.temperature, a.top_p, a.top_k, dev)
            searching = _searching_rows(logits, st)
            for i, (name, sets) in enumerate(variants):
                saved = {k: getattr(sampling_split, k) for k in sets}
                for k, v in sets.items():
                    setattr(sampling_split, k, v)
                try:
                    us = _time(logits, st, a.reps)
                finally:
                    for k, v in saved.items():
                        setattr(sampling_split, k, v)
                print(f"| {rows} | {scale:g} | {searching} | {name} | {us:.1f} |", flush=True)
                if rows == max(row_list):
                    total[i] += us
    best = min(range(len(variants)), key=total.__getitem__)
    print(f"fastest at {max(row_list)} rows: {variants[best][0]} ({total[best]:.1f} us over the scales)")
    if a.best_out:
        Path(a.best_out).write_text(specs[best].partition(":")[2])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
