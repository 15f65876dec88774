"""tests/engine: the engine core on CPU, checked against HF transformers on the same weights.

The tiny models' ops are far too small to gain from intra-op threads, and on a busy 2-core
machine OpenMP spin-waiting makes them 10-40x slower; these tests run torch single-threaded.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_helpers import make_engine  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _single_thread_torch():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def single_thread_core():
    """OMP_NUM_THREADS=1 for the engine core processes a module starts (the fixture above
    reaches this process only)."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if old is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = old


@pytest.fixture(scope="module")
def path(tiny_llama_path):
    return str(tiny_llama_path)


@pytest.fixture(scope="module")
def eng(path):
    """An engine on the tiny llama with a 64-token budget (a module may define its own)."""
    return make_engine(path, max_num_batched_tokens=64)
