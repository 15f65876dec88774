"""When new prompts may join the running batch: vLLM's `scheduler_delay_factor`.

Each step that admits a prompt carries prefill chunks, and such a step costs the host more
than a decode step (its rows are packed, its tables written, its blocks hashed). Requests
that trickle in one at a time make almost every step one of those; holding new prompts back
a little lets several join in one step. vLLM's rule: admit once the oldest waiting request
has waited longer than `factor` times the latency of an admitting step (the time from its
schedule to the next one), or at once when nothing is running; a factor of 0 admits at once.
One difference: vLLM takes the last admitting step's latency, this takes the median of the
last few, so that a one-off slow step (a CUDA graph captured on first use, a kernel compiled)
does not hold every new prompt back for factor x seconds.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Callable, Collection

# Admitting steps whose latencies the delay follows (their median).
LATENCY_WINDOW = 5


class AdmissionDelay:
    def __init__(self, factor: float, clock: Callable[[], float] = time.monotonic):
        self.factor = factor
        self.clock = clock
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._prev_time = 0.0
        self._prev_admitted = False

    @property
    def prompt_latency(self) -> float:
        """The median latency of the last admitting steps (0 before the first)."""
        return statistics.median(self._latencies) if self._latencies else 0.0

    def may_admit(self, waiting: Collection, anything_running: bool) -> bool:
        """Called at every schedule, before admitting: whether the prompts `waiting` (requests
        with an `arrival_time` of this clock) may join now."""
        if self.factor <= 0.0:
            return True
        now = self.clock()
        if self._prev_admitted:
            self._latencies.append(now - self._prev_time)
        self._prev_time, self._prev_admitted = now, False
        if not waiting or not anything_running:
            return True
        return now - min(r.arrival_time for r in waiting) > self.factor * self.prompt_latency

    def admitted(self) -> None:
        """This schedule admitted a prompt: its latency is measured at the next schedule."""
        self._prev_admitted = True
