"""Triton, where it is installed: CUDA builds of torch ship it, the CPU build does not, so the
kernel modules import it from here and fall back to their torch definitions without it."""
from __future__ import annotations

from .. import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

# kernels also run on CPU tensors, in Triton's interpreter (TRITON_INTERPRET=1)
INTERPRET = envs.triton_interpret()
