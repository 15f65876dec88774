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
from typing import Optional

import torch

from .decode_graphs import DecodeGraphPlan
from .mixed_graphs import MixedGraphPlan
from .mixed_pack import MixedRows


class StepProgram(enum.Enum):
    DECODE_GRAPH = "decode_graph"   # a decode-only step replayed through a captured decode graph
    DECODE_EAGER = "decode_eager"   # a decode-only step larger than every graph bucket (or no graphs)
    MIXED = "mixed"                 # a step with prefill chunks: a mixed graph, or eager


@dataclass(slots=True)
class TablePlan:
    """A step's persistent-table updates (host tensors; None where the step has none)."""
    admissions: Optional[torch.Tensor]        # [A, admission_width] int64: slot, top_k, seed, prompt_len, ...
    admission_floats: Optional[torch.Tensor]  # [A, len(ADMISSION_FLOATS)] float32
    history: Optional[torch.Tensor]           # [3, H] int64: penalty rows' slot, known token, is_output
    growth: Optional[torch.Tensor]            # [3, G] int64: slot, block index, block id


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
