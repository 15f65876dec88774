"""StepPlan: one step as the device will run it. Built on the engine thread from the
scheduler's output (ModelRunner.plan), launched by whichever thread owns the stream
(ModelRunner.launch: inline on the engine thread, or the submission thread, submission.py).

A plan holds host tensors, lists it owns and decisions only, never a Request: once it is
built, the engine thread goes on mutating requests (the previous step's update, aborts, the
next schedule) while the plan may still wait in the submission queue. So everything the
device side needs is copied into the plan's named fields when it is built.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from .decode_graphs import DecodeGraphPlan
from .int64_pack import int64_array
from .mixed_graphs import MixedGraphPlan
from .mixed_pack import MixedRows


class StepProgram(enum.Enum):
    DECODE_GRAPH = "decode_graph"   # a decode-only step replayed through a captured decode graph
    DECODE_EAGER = "decode_eager"   # a decode-only step larger than every graph bucket (or no graphs)
    MIXED = "mixed"                 # a step with prefill chunks: a mixed graph, or eager


class TableSections(NamedTuple):
    """A step's persistent-table updates, views of one packed tensor (None where none)."""
    admissions: Optional[torch.Tensor]        # [A, admission_width] int64: slot, top_k, seed, prompt_len, ...
    admission_floats: Optional[torch.Tensor]  # [A, F] float32 (model_runner.ADMISSION_FLOATS)
    history: Optional[torch.Tensor]           # [3, H] int64: penalty rows' slot, known token, is_output
    growth: Optional[torch.Tensor]            # [3, G] int64: slot, block index, block id
    penalty_resets: Optional[torch.Tensor]    # [R] int64: the slots of the first R admissions (with penalties)


@dataclass(slots=True)
class TablePlan:
    """A step's persistent-table updates packed in one int64 host tensor, so the device side
    is one upload (each upload costs the host a staging copy, an allocation, a copy and an
    event) and `sections` views of it. Layout: admissions [A, W], their floats [A, F] as
    float32 (two to an int64, F even), history [3, H], growth [3, G]."""
    packed: torch.Tensor
    num_admissions: int
    admission_width: int
    num_admission_floats: int
    num_history: int
    num_growth: int
    num_penalized: int = 0

    @classmethod
    def pack(cls, ints: list[list[int]], floats: list[list[float]], history: list[list[int]],
             growth: list[list[int]], width: int, num_floats: int, num_penalized: int = 0) -> "TablePlan":
        """ints / floats: one row per admission, those with penalties first (num_penalized of
        them); history / growth: three rows each."""
        if num_floats % 2:
            raise ValueError(f"admission floats pack two to an int64: {num_floats} is odd")
        a, h, g = len(ints), len(history[0]), len(growth[0])
        buf = np.empty(a * width + a * num_floats // 2 + 3 * h + 3 * g, dtype=np.int64)
        o = a * width
        if a:
            buf[:o].reshape(a, width)[:] = ints
            buf[o:o + a * num_floats // 2] = np.array(floats, dtype=np.float32).view(np.int64).ravel()
            o += a * num_floats // 2
        if h:
            buf[o:o + 3 * h] = int64_array(history[0] + history[1] + history[2])
            o += 3 * h
        if g:
            buf[o:] = int64_array(growth[0] + growth[1] + growth[2])
        return cls(torch.from_numpy(buf), a, width, num_floats, h, g, num_penalized)

    def sections(self, packed: torch.Tensor) -> TableSections:
        """Views of `packed` (this plan's tensor, or its device copy) by section."""
        a, w, f, h, g = (self.num_admissions, self.admission_width, self.num_admission_floats,
                         self.num_history, self.num_growth)
        o = a * w + a * f // 2
        adm = packed[:a * w].view(a, w) if a else None
        adm_f = packed[a * w:o].view(torch.float32).view(a, f) if a else None
        hist = packed[o:o + 3 * h].view(3, h) if h else None
        growth = packed[o + 3 * h:].view(3, g) if g else None
        resets = adm[:self.num_penalized, 0] if self.num_penalized else None
        return TableSections(adm, adm_f, hist, growth, resets)


@dataclass(slots=True)
class MixedPlan:
    """A step with prefill chunks: its packed rows (mixed_pack.MixedRows) and `graph` when a
    mixed-graph bucket holds the step, else the eager step's inputs as host tensors (built
    with the plan, on the engine thread)."""
    rows: MixedRows
    graph: Optional[MixedGraphPlan]
    eager: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    @classmethod
    def build(cls, rows: MixedRows, graph: Optional[MixedGraphPlan]) -> "MixedPlan":
        plan = cls(rows, graph)
        if graph is None:
            plan.eager_inputs()
        return plan

    def eager_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tok [4, T], row [4, S], cu [S + 1]) int64 host tensors of the eager step (built
        on first use: a graphed step needs them only when its graph's capture failed)."""
        if self.eager is None:
            self.eager = tuple(torch.from_numpy(a) for a in self.rows)
        return self.eager


@dataclass(slots=True)
class StepPlan:
    num_rows: int                   # rows whose sampled tokens go to the host
    greedy: bool                    # the sampling program: every row greedy
    masks: bool                     # some row needs bans / min_tokens / filters / penalties
    logprobs: bool                  # some row wants logprobs
    tables: Optional[TablePlan]     # None: no admission, no penalty history, no KV growth
    program: StepProgram
    decode_graph: Optional[DecodeGraphPlan] = None   # DECODE_GRAPH
    decode_meta: Optional[torch.Tensor] = None       # DECODE_EAGER: [5, rows] int64 (DecodeMeta)
    mixed: Optional[MixedPlan] = None                # MIXED
