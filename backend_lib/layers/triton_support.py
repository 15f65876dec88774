"""Triton, where it is installed: CUDA builds of torch ship it, the CPU build does not, so the
kernel modules import it from here and fall back to their torch definitions without it."""
from __future__ import annotations

import functools
import logging
from typing import Callable, Iterable

import torch

from .. import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

if HAS_TRITON:
    @triton.jit
    def pdl_release_dependents():
        """griddepcontrol.launch_dependents: the next kernel (launched with PDL) may start now.
        Declared with side effects, so the compiler keeps it where the kernel puts it whatever
        the Triton release (tl.extra.cuda.gdc_launch_dependents has been declared pure in
        some releases, which lets the compiler move or drop an instruction whose result is
        unused)."""
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def l2_prefetch(ptrs, nbytes):
        """cp.async.bulk.prefetch.L2.global (Hopper): ask L2 for nbytes at each of ptrs (16-byte
        aligned, nbytes a multiple of 16; <= 0: nothing). Fire and forget: no register waits
        on it. One element a thread: a tensor smaller than the CTA repeats the prefetch in
        every thread holding a copy."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)
else:  # pragma: no cover - depends on the environment
    pdl_release_dependents = None
    l2_prefetch = None

# kernels also run on CPU tensors, in Triton's interpreter (TRITON_INTERPRET=1)
INTERPRET = envs.triton_interpret()

logger = logging.getLogger(__name__)


def compile_in_parallel(warmups: Iterable[Callable[[], object]]) -> int:
    """Run `warmups` (each a JITFunction.warmup call with a launch's arguments) under Triton's
    AsyncCompileMode, so their kernels compile in a pool of BACKEND_LIB_COMPILE_THREADS threads
    (Triton's compiler releases the GIL for most of its work) and later launches find them
    compiled. Start-up tuning compiles a dozen candidates a projection shape, most of the
    kernels an engine compiles at start. A warmup that fails is skipped: its launch compiles it then,
    or reports the error, as without this. Returns how many warmups were submitted (0 where
    there is nothing to gain: the interpreter, one thread, a Triton without AsyncCompileMode)."""
    mode = getattr(triton, "AsyncCompileMode", None)
    threads = envs.compile_threads()
    if mode is None or INTERPRET or threads <= 1:
        return 0
    from concurrent.futures import ThreadPoolExecutor
    submitted = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool, mode(pool, ignore_errors=True):
        for warmup in warmups:
            try:
                warmup()
                submitted += 1
            except Exception as e:  # noqa: BLE001 - the launch itself will compile or report it
                logger.debug("compile_in_parallel: a warmup failed (%s: %s)", type(e).__name__, e)
    return submitted


@functools.lru_cache(maxsize=None)
def _num_sms_cuda(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (an H200's count for CPU tensors, which run in
    Triton's interpreter: grids sized from it stay the same)."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms_cuda(idx)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel starts while the one before it runs, and waits
    in-kernel with griddepcontrol.wait) needs compute capability 9.0 (Hopper) or newer."""
    return HAS_TRITON and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(pdl: bool) -> dict:
    """A Triton launch's extra keyword arguments: launched with PDL, or plainly."""
    return {"launch_pdl": True} if pdl else {}
