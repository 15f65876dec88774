"""Shared pytest setup: markers, GPU auto-skip, tiny-model fixtures.

Markers (registered in pytest.ini): ``gpu`` tests are skipped when torch.cuda is not
available; ``server`` tests start a real tritonserver.  ``make test`` runs ``-m "not gpu"``.

Model fixtures return the folders built by ``scripts/make_model.py`` under ``models/``,
building them first if missing or stale (the script's stamp makes this a no-op otherwise).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO_ROOT / "models"

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from backend_lib.envs import TUNING_CACHE_ENV  # noqa: E402
from scripts import load_make_model  # noqa: E402

# Start-up tuning keeps its picks (backend_lib/layers/tuning_cache.py) in a folder of this run,
# not the user's cache (engines and servers the tests start inherit it): a run neither reads
# nor leaves picks of another.
if TUNING_CACHE_ENV not in os.environ:
    _PICKS = tempfile.mkdtemp(prefix="tuning-picks-")
    os.environ[TUNING_CACHE_ENV] = _PICKS
    atexit.register(shutil.rmtree, _PICKS, True)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for it in gpu_items:
            it.add_marker(skip)


def _tiny(name: str) -> Path:
    mm = load_make_model()
    arch, shard = mm.TINY_MODELS[name]
    return mm.make_tiny(MODELS_DIR / name, arch, shard_size=shard)


@pytest.fixture(scope="session")
def make_model_module():
    return load_make_model()


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    return _tiny("tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen3_path() -> Path:
    return _tiny("tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_llama_sharded_path() -> Path:
    return _tiny("tiny-llama-sharded")
