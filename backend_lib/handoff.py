"""The token handoff: step n's sampled tokens go device -> pinned host memory asynchronously,
with one event per step; the host waits on that event only (GIL released) when it needs the
tokens. Everything here that touches CUDA has a CPU stand-in behind the same interface, so
the overlapped scheduling runs (and is tested) on CPU.

The relay buffer that feeds step n+1's input ids on the device is owned by the model runner
(it is part of the step's device program); this module owns what crosses to the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from .layers.logprobs import TokenLogprobs, unpack_logprobs


class _DoneEvent:
    """CPU stand-in for torch.cuda.Event: CPU work is complete when it is enqueued."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass
class StepHandle:
    """AsyncStepOutput of one launched step. `get()` is the only host wait.

    host_buf holds [num_rows] token ids, or [num_rows, packed_width] rows of ids + logprobs
    (layers/logprobs.py) for a step that computed them."""
    host_buf: torch.Tensor
    num_rows: int
    done: Any                          # torch.cuda.Event or _DoneEvent
    start: Any = None                  # timing events (CUDA only) for the idle-gap metric
    end: Any = None
    keepalive: tuple = field(default_factory=tuple)  # tensors the step reads stay alive
    _tokens: Optional[list[int]] = None

    def get(self) -> list[int]:
        if self._tokens is None:
            self.done.synchronize()  # torch releases the GIL while it waits
            buf = self.host_buf
            self._tokens = (buf[:, 0] if buf.dim() == 2 else buf).tolist()
            self.keepalive = ()
        return self._tokens

    def logprobs(self, vocab: int) -> Optional[list[TokenLogprobs]]:
        """Per row, after get(): the token's logprobs, or None when the step computed none."""
        if self.host_buf.dim() != 2:
            return None
        self.get()
        return unpack_logprobs(self.host_buf, vocab)


class TokenHandoff:
    """A ring of host buffers (pinned on CUDA), one per step in flight. A buffer is reused
    only after the handle that last used it has been consumed (its event completed)."""

    def __init__(self, device: torch.device, width: int, depth: int = 4, time_steps: bool = True,
                 max_cols: int = 1):
        self.device = device
        self.is_cuda = device.type == "cuda"
        pin = self.is_cuda
        # Flat buffers: a step's [rows] ids or [rows, cols] packed rows fill a contiguous prefix.
        self._bufs = [torch.zeros(width * max_cols, dtype=torch.int64, pin_memory=pin) for _ in range(depth)]
        self._owners: list[Optional[StepHandle]] = [None] * depth
        # Per ring buffer, its last (shape, view): steady decode publishes the same shape
        # every step, and slicing + viewing a buffer costs the host two tensor ops.
        self._views: list[tuple] = [((), None)] * depth
        self._next = 0
        self._time = time_steps and self.is_cuda
        self._last_end: Any = None
        self._gaps_us: list[float] = []

    def _event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing) if self.is_cuda else _DoneEvent()

    def begin_step(self) -> Any:
        """Record the step's start on the stream (idle-gap metric)."""
        if not self._time:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def publish(self, sampled: torch.Tensor, num_rows: int, start: Any = None,
                keepalive: tuple = ()) -> StepHandle:
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        prev = self._owners[i]
        if prev is not None and prev._tokens is None:
            # Ring deeper than the steps in flight makes this unreachable; wait, never clobber.
            prev.get()
        rows = sampled if sampled.shape[0] == num_rows else sampled[:num_rows]
        shape, buf = self._views[i]
        if shape != rows.shape:
            buf = self._bufs[i][:rows.numel()].view(rows.shape)
            self._views[i] = (rows.shape, buf)
        buf.copy_(rows, non_blocking=self.is_cuda)
        done = self._event(timing=self._time)
        done.record()
        handle = StepHandle(buf, num_rows, done, start, done if self._time else None, keepalive)
        self._owners[i] = handle
        return handle

    def collect_gap(self, handle: StepHandle) -> None:
        """After `handle.get()`: the GPU idle time between the previous step's end and this
        step's start, from CUDA events (both have completed by now)."""
        if not self._time or handle.start is None:
            return
        if self._last_end is not None:
            self._gaps_us.append(max(0.0, self._last_end.elapsed_time(handle.start) * 1000.0))
        self._last_end = handle.end

    def reset_gap_chain(self) -> None:
        """The GPU went idle on purpose (no work queued): don't count that as a gap."""
        self._last_end = None

    def take_gaps_us(self) -> list[float]:
        gaps, self._gaps_us = self._gaps_us, []
        return gaps


class HostStaging:
    """Pinned staging for the per-step host->device uploads (step metadata, table updates).

    A ring of preallocated pinned buffers, each reused only after the event of its last copy
    has completed. Allocating pinned memory per step instead (torch.tensor(pin_memory=True))
    calls cudaHostAlloc whenever the caching host allocator has no free block, and that call
    synchronizes the device: measured on the H200, the host then blocked for a whole step.
    On CPU the rows are returned as a plain tensor (no copy).
    """

    def __init__(self, device: torch.device, capacity_bytes: int, depth: int = 32):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.capacity = capacity_bytes
        self._bufs = [torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True)
                      for _ in range(depth)] if self.is_cuda else []
        self._events: list[Any] = [None] * depth
        self._next = 0

    def upload(self, rows: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return self.upload_tensor(host_tensor(rows, dtype))

    def upload_tensor(self, host: torch.Tensor) -> torch.Tensor:
        """A host (pageable) tensor -> device, through the ring; on CPU `host` itself."""
        dtype = host.dtype
        if not self.is_cuda:
            return host
        nbytes = host.numel() * host.element_size()
        if nbytes > self.capacity:  # unusually large step: a one-off pinned tensor
            return host.pin_memory().to(self.device, non_blocking=True)
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        if self._events[i] is not None:
            self._events[i].synchronize()  # normally long complete: the ring is deep
        staged = self._bufs[i][:nbytes].view(dtype).view(host.shape)
        staged.copy_(host)
        dev = torch.empty(host.shape, dtype=dtype, device=self.device)
        dev.copy_(staged, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return dev


_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def host_tensor(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) for (nested, rectangular) lists of Python numbers,
    through numpy: torch.tensor walks a list element by element, ~4x slower (5.6k ints: 400
    against 90 µs on the CPU box), and the step metadata is built this way every time the
    batch changes."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))
