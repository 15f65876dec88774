"""A hint for the commonest first-hour mistake: running the project's modules with a Python
that is not the project's venv (`python -m client.generate` -> "No module named 'tritonclient'")."""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"


def venv_hint() -> str:
    """'' inside the project's venv; else what to run instead."""
    if Path(sys.prefix).resolve() == (REPO_ROOT / ".venv").resolve():
        return ""
    where = ".venv/bin/python" if VENV_PYTHON.exists() else "`make setup`, then .venv/bin/python"
    return f" (this is {sys.executable}, not the project's venv: use {where})"
