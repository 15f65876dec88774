"""The engine process on CUDA: the same greedy tokens as the in-process engine (CUDA graphs, async
handoff), and the parent process never initializes CUDA (only the core owns the device)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_helpers import GPU_MARKS

pytestmark = GPU_MARKS

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import torch
from backend_lib import AsyncEngine, EngineConfig, EngineProcessClient, SamplingParams
cfg = EngineConfig(model_path=sys.argv[1], device="cuda", dtype="float32", max_num_seqs=16, max_model_len=512,
                   num_kv_blocks=256)
prompts = [[5 + i, 6, 7, 8 + i] * (1 + i) for i in range(6)]
sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
proc = EngineProcessClient(cfg)
streams = [proc.add_request(f"p{i}", p, sp) for i, p in enumerate(prompts)]
got = [s.result()[0] for s in streams]
healthy = proc.is_healthy()
proc.shutdown()
parent_cuda = torch.cuda.is_initialized()   # before the in-process reference below
ref_eng = AsyncEngine(cfg)
ref = [ref_eng.add_request(f"r{i}", p, sp).result()[0] for i, p in enumerate(prompts)]
ref_eng.shutdown()
print(json.dumps({"got": got, "ref": ref, "parent_cuda": parent_cuda, "healthy": healthy}))
"""


def test_engine_process_matches_in_process_and_parent_stays_off_cuda(tiny_llama_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["healthy"]
    assert out["parent_cuda"] is False
    assert out["got"] == out["ref"]
    assert all(len(t) == 24 for t in out["got"])
