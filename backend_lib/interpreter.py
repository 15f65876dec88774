"""The Python interpreter that child processes of the engine run on.

Inside Triton's Python-backend stub `sys.executable` is the stub binary, not python; its
embedded interpreter takes its prefix (the venv) from the `python3` first on PATH, so the venv's
python is found under sys.prefix, else on PATH.
"""
from __future__ import annotations

import os
import shutil
import sys


def python_executable() -> str:
    if os.path.basename(sys.executable or "").startswith("python"):
        return sys.executable
    v = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for d in (sys.prefix, sys.exec_prefix, sys.base_prefix):
        for name in (v, "python3", "python"):
            cand = os.path.join(d, "bin", name)
            if os.access(cand, os.X_OK):
                return cand
    return shutil.which(v) or shutil.which("python3") or sys.executable
