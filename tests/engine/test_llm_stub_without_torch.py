"""The `llm` model with engine_process=on only talks to the engine core: its process (the
Triton stub) must never import torch or transformers. Each costs every stub seconds of
start-up and hundreds of MB, and every full garbage collection in the stub walks their
objects while the stub's reader thread has tokens to deliver. Checked in a fresh interpreter,
through the model's own initialize / execute / finalize, with in-process as the control."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.util, json, sys
sys.path.insert(0, {tests!r})
from llm_model_fakes import Request, Sender, fake_pb_utils
sys.modules["triton_python_backend_utils"] = fake_pb_utils()
spec = importlib.util.spec_from_file_location("llm_model", {model!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
imported_by_module = sorted(m for m in ("torch", "transformers") if m in sys.modules)
params = dict(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=120, max_num_batched_tokens=48,
              max_num_seqs=16, model_path={path!r}, engine_process={mode!r})
cfg = {{"name": "llm", "parameters": {{k: {{"string_value": str(v)}} for k, v in params.items()}}}}
m = mod.TritonPythonModel()
m.initialize({{"model_config": json.dumps(cfg), "model_name": "llm", "model_version": "1",
               "model_instance_name": "llm_0", "model_repository": {repo!r}}})
s = Sender()
m.execute([Request({{"input_ids": [[5, 6, 7]], "request_output_len": [[6]], "streaming": [[True]],
                     "ignore_eos": [[True]]}}, s)])
done = s.done.wait(120)
m.finalize()
print("RESULT " + json.dumps({{"done": done, "finals": s.finals, "tokens": s.tokens(),
                               "imported_by_module": imported_by_module,
                               "imported": sorted(m for m in ("torch", "transformers") if m in sys.modules)}}))
"""


def _run(path: str, mode: str) -> dict:
    code = SCRIPT.format(tests=str(Path(__file__).parent), model=str(ROOT / "model_repository/llm/1/model.py"),
                         path=path, mode=mode, repo=str(ROOT / "model_repository/llm"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TRITON_HTTP_PORT", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.parametrize("mode", ["on", "off"])
def test_engine_process_stub_never_imports_torch(path, mode):
    got = _run(path, mode)
    assert got["done"] and got["finals"] == 1 and got["tokens"] == 6, got
    assert got["imported_by_module"] == [], got  # the model module alone, either way
    if mode == "on":
        assert got["imported"] == [], got
    else:  # the control: the in-process engine runs torch in this process
        assert "torch" in got["imported"], got
