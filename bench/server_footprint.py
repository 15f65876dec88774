"""Start-up time and memory of the served repository: the full model repository (tiny model,
CPU) started as the server tests start it, timed to ready, and each Python stub's and engine
core's resident memory (VmRSS) and whether torch is mapped in it; beside it, an engine core
alone (EngineProcessClient, as the llm stub starts it) timed to ready. Prints a markdown table.

    .venv/bin/python -m bench.server_footprint --repeat 3

To compare commits, run it from a worktree of each (alternating: this box is noisy).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tests.server import procs
from tests.server.conftest import MODEL_DIR, start_server


def _rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def one_start() -> dict:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        srv = start_server(Path(d))
        try:
            start_s = time.monotonic() - t0
            members = procs.group(srv.proc.pid)
            stubs = {p.stub_model: p.pid for p in members if p.is_stub}
            cores = [p.pid for p in members if "backend_lib.engine_core" in p.argv]
            return {"start_s": start_s,
                    "stub_rss": {m: _rss_mb(pid) for m, pid in sorted(stubs.items())},
                    "stubs_with_torch": sorted(m for m, pid in stubs.items() if procs.maps_library(pid, "libtorch")),
                    "core_rss": sum(_rss_mb(pid) for pid in cores)}
        finally:
            srv.stop()


def one_core_start() -> float:
    """Seconds from EngineProcessClient() to its core's READY (the core's imports and engine)."""
    from backend_lib import EngineConfig, EngineProcessClient
    t0 = time.monotonic()
    client = EngineProcessClient(EngineConfig(model_path=str(MODEL_DIR), device="cpu", dtype="float32",
                                              max_num_seqs=8, max_model_len=256))
    ready_s = time.monotonic() - t0
    client.shutdown()
    return ready_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = [dict(one_start(), core_start_s=one_core_start()) for _ in range(args.repeat)]
    models = list(rows[0]["stub_rss"])
    print("| run | start s | engine core alone: start s | stubs' RSS MB | " + " | ".join(f"{m} MB" for m in models)
          + " | engine core MB | stubs with torch |")
    print("|---" * (len(models) + 6) + "|")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['start_s']:.1f} | {r['core_start_s']:.2f} | {sum(r['stub_rss'].values())} | "
              + " | ".join(str(r["stub_rss"].get(m, "")) for m in models)
              + f" | {r['core_rss']} | {', '.join(r['stubs_with_torch']) or 'none'} |")


if __name__ == "__main__":
    main()
