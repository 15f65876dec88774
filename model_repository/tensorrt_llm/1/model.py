"""`tensorrt_llm`: TensorRT-LLM's non-decoupled deployment of `llm` (triton_glue/sync_proxy.py)."""
import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.config import parameters_of  # noqa: E402
from triton_glue.sync_proxy import SyncProxy  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = parameters_of(json.loads(args["model_config"]))
        self.proxy = SyncProxy(pb_utils, params.get("target_model", "llm"),
                               int(params.get("max_concurrent_requests", "256")))

    def execute(self, requests):
        return self.proxy.execute(requests)

    def finalize(self):
        self.proxy.close()
