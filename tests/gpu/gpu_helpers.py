"""Shared pieces of the kernel tests in tests/gpu: the module-level GPU marks and skips, and
the per-test seed (fresh, or fixed by an environment variable to reproduce a failure)."""
import os

import pytest

torch = pytest.importorskip("torch")

# A test module's pytestmark: marked gpu, skipped when CUDA is absent.
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]

if torch.cuda.is_available():
    pytest.importorskip("triton")


def seed_from_env(var: str) -> int:
    """Seed torch from $var, else from os.urandom; the seed (for failure messages)."""
    env = os.environ.get(var)
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed
