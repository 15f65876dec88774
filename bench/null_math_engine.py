"""The real engine (scheduler, runner packing, handoff, update) with no model math behind an
emulated device: the CPU stand-ins of bench/host_loop.py and bench/trickle.py, and an engine
class with them, so that an engine process (engine_core) or an AsyncEngine can run it.

    BACKEND_LIB_ENGINE_CLASS=bench.null_math_engine:NullMathEngine
    BENCH_NULL_MATH_DEVICE_US=1800     # every step takes this long on the emulated device

CPU only; the config's async_token_handoff should be "on" (the GPU's path). Not a product
path: bench only (bench/engine_process.py `--null-math-us`).
"""
from __future__ import annotations

import os
import time

from backend_lib.engine import LLMEngine

DEVICE_US_ENV = "BENCH_NULL_MATH_DEVICE_US"


def _null_decode_program(runner):
    """A decode program with the real one's contract and none of its math: fixed token ids
    out, real rows' positions advanced by one (decode_graphs.DecodeProgram)."""
    import torch
    from backend_lib.layers.logprobs import packed_width
    cache: dict = {}

    def program(meta, greedy, masks, logprobs=False):
        b = meta.pos.shape[0]
        out = cache.get((b, logprobs))
        if out is None:
            ids = torch.arange(b, dtype=torch.int64) % 500 + 10  # never a special id
            out = ids if not logprobs else torch.zeros(b, packed_width(), dtype=torch.int64)
            cache[(b, logprobs)] = out
        meta.pos.add_(meta.slot >= 0)
        return out

    return program


def _null_mixed_program(runner):
    """The mixed-step program (mixed_graphs.MixedProgram) without its math: fixed token ids
    for every row, so that on CPU a step carrying prefill chunks costs its host work alone."""
    import torch
    from backend_lib.layers.logprobs import packed_width
    cache: dict = {}

    def program(meta, greedy, masks, logprobs=False):
        key = (meta.seqs, logprobs)
        if key not in cache:
            ids = torch.arange(meta.seqs, dtype=torch.int64) % 500 + 10
            cache[key] = ids if not logprobs else torch.zeros(meta.seqs, packed_width(), dtype=torch.int64)
        return cache[key]

    return program


class _EmulatedEvent:
    """The token event of one emulated step: complete at the step's end (perf_counter)."""

    def __init__(self, end: float):
        self.end = end

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return time.perf_counter() >= self.end

    def synchronize(self) -> None:
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)  # releases the GIL, as torch's event wait does


class _EmulatedDevice:
    """--device-us: a device that runs one step at a time, step_s each, in wall time."""

    def __init__(self, device_us: float):
        self.step_s = device_us / 1e6
        self.busy_until: float | None = None
        self.idle_s = 0.0
        self.counted_from = 0.0  # idle time before this (untimed steps) is not counted

    def start_window(self) -> None:
        self.idle_s, self.counted_from = 0.0, time.perf_counter()

    def event(self, timing: bool = False) -> _EmulatedEvent:
        """Called when a step is launched (TokenHandoff.publish): queue it, return its event."""
        now = time.perf_counter()
        if self.busy_until is None or now >= self.busy_until:
            if self.busy_until is not None:
                self.idle_s += max(0.0, now - max(self.busy_until, self.counted_from))
            start = now
        else:
            start = self.busy_until
        self.busy_until = start + self.step_s
        return _EmulatedEvent(self.busy_until)


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
