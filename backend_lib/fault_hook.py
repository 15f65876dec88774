"""Test hook shared by the in-process and the out-of-process engine: the step loop fails after
N steps (engine-death tests through the Triton model, parameter test_fault_after_steps)."""
from __future__ import annotations

import itertools


def fail_after_steps(engine, after_steps: int) -> None:
    """From step after_steps + 1 on, engine.step_rows() (the loops' step) raises RuntimeError."""
    real_step, count = engine.step_rows, itertools.count(1)

    def failing_step():
        if next(count) > after_steps:
            raise RuntimeError(f"injected engine fault after {after_steps} steps")
        return real_step()

    engine.step_rows = failing_step
