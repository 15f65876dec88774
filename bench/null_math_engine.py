"""The real engine (scheduler, runner packing, handoff, update) with no model math behind an
emulated device: bench/host_loop.py's CPU stand-ins as an engine class, so that an engine
process (engine_core) or an AsyncEngine can run it.

    BACKEND_LIB_ENGINE_CLASS=bench.null_math_engine:NullMathEngine
    BENCH_NULL_MATH_DEVICE_US=1800     # every step takes this long on the emulated device

CPU only; the config's async_token_handoff should be "on" (the GPU's path). Not a product
path: bench only (bench/engine_process.py `--null-math-us`).
"""
from __future__ import annotations

import os

from backend_lib.engine import LLMEngine
from bench.host_loop import _EmulatedDevice, _null_decode_program, _null_mixed_program

DEVICE_US_ENV = "BENCH_NULL_MATH_DEVICE_US"


def strip_math(eng: LLMEngine, device_us: float) -> None:
    """Replace eng's decode and mixed programs with ones that do no math, its graphs with CPU
    stand-ins, and (device_us > 0) its step events with an emulated device's."""
    eng.runner._decode_program = _null_decode_program(eng.runner)
    eng.runner._mixed_program = _null_mixed_program(eng.runner)
    eng.runner.use_stand_in_graphs()
    if device_us:
        eng._emulated_device = _EmulatedDevice(device_us)
        eng.runner.handoff._event = eng._emulated_device.event


class NullMathEngine(LLMEngine):
    def __init__(self, config, *args, **kwargs):
        if config.device != "cpu":
            raise ValueError("NullMathEngine emulates the device on CPU (device='cpu')")
        super().__init__(config, *args, **kwargs)
        strip_math(self, float(os.environ.get(DEVICE_US_ENV, "0")))
