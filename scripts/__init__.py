"""scripts/ holds command-line tools; this package only lets tests and benchmarks load them."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_make_model():
    """scripts/make_model.py as the module `make_model` (imported once, then shared)."""
    name = "make_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
