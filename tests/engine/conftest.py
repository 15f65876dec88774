"""tests/engine: the engine core on CPU, checked against HF transformers on the same weights.

The tiny models' ops are far too small to gain from intra-op threads, and on a busy 2-core
machine OpenMP spin-waiting makes them 10-40x slower; these tests run torch single-threaded.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True, scope="module")
def _single_thread_torch():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
