"""`tensorrt_llm`: TensorRT-LLM's non-decoupled deployment of `llm` (triton_glue/sync_proxy.py)."""
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

_ROOT = Path(__file__).resolve().parents[3]
if (_ROOT / "triton_glue").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from triton_glue.sync_proxy import proxy_model  # noqa: E402

TritonPythonModel = proxy_model(pb_utils, default_target="llm")
