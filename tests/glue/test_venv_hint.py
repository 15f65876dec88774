"""Run with a python that is not the project's venv, the documented commands say what to run
instead (the first-hour failure was a bare "No module named 'tritonclient'")."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"


def _has(module: str) -> bool:
    return subprocess.run([str(BASE_PYTHON), "-c", f"import {module}"], capture_output=True).returncode == 0


@pytest.mark.skipif(not BASE_PYTHON.exists() or _has("tritonclient"),
                    reason="needs a base python without tritonclient")
def test_client_outside_the_venv_names_the_venv_python():
    r = subprocess.run([str(BASE_PYTHON), "-m", "client.generate", "hi", "--url", "127.0.0.1:1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "No module named" in r.stderr and "not the project's venv: use .venv/bin/python" in r.stderr, r.stderr


@pytest.mark.skipif(not BASE_PYTHON.exists() or _has("pytriton"), reason="needs a base python without pytriton")
def test_launch_outside_the_venv_names_the_venv_python():
    r = subprocess.run([str(BASE_PYTHON), "-m", "triton_glue.launch", "argv"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "tritonserver not found" in r.stderr and "use .venv/bin/python" in r.stderr, r.stderr
