"""CUDA-graph decode steps: one captured decode program per (bucket, sampling variant), the
static metadata each graph reads, and the one decision that lets a step skip uploading it.

The captured program is the runner's decode program (input ids gathered from the relay ->
forward -> sample -> relay write). On CPU an `EagerGraph` can stand in for
torch.cuda.CUDAGraph: it replays the same program eagerly on the same static buffers, so
everything here (bucketing, variant choice, metadata reuse, relay sources) runs in the CPU
tests exactly as it runs on the GPU.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from .handoff import host_tensor

logger = logging.getLogger(__name__)

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

# Sampling programs captured per bucket, as (all_greedy, use_masks, logprobs): argmax only;
# temperature sampling; the full program (bans, min_tokens, penalties, min_p/top-k/top-p, each
# row paying only for its own filters; greedy rows still take argmax); the full program plus
# logprobs.
GRAPH_VARIANTS = ((True, False, False), (False, False, False), (False, True, False), (False, True, True))


def graph_variant(greedy: bool, masks: bool, logprobs: bool = False) -> tuple[bool, bool, bool]:
    if logprobs:
        return (False, True, True)
    return (False, True, False) if masks else (greedy, False, False)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Captured batch sizes up to max_batch, plus the bucket that covers max_batch itself."""
    buckets = tuple(b for b in GRAPH_BUCKETS if b <= max_batch)
    if max_batch not in buckets and max_batch < GRAPH_BUCKETS[-1]:
        buckets += (min(b for b in GRAPH_BUCKETS if b >= max_batch),)
    return buckets


_START_POS = operator.attrgetter("start_pos")  # of a ScheduledRow


class DecodeMeta:
    """The packed per-step decode metadata ([5, B] int64: one upload), read through named
    row views. Padding rows (slot -1) come last."""
    NUM_ROWS = 5
    PAD = (0, -1, 0, -1, 0)  # fill of each row for padding

    def __init__(self, packed: torch.Tensor):
        self.packed = packed
        self.ids = packed[0]        # host-known input id (ignored where relay_src >= 0)
        self.relay_src = packed[1]  # slot whose relay entry is the input id; -1: use ids
        self.pos = packed[2]        # position of the row's token
        self.slot = packed[3]       # the request's slot; -1: padding
        self.samples = packed[4]    # 1: the sampled token is a real output

    @classmethod
    def empty(cls, bucket: int, device: torch.device) -> "DecodeMeta":
        packed = torch.zeros(cls.NUM_ROWS, bucket, dtype=torch.int64, device=device)
        packed[3].fill_(-1)
        return cls(packed)

    @classmethod
    def host_rows(cls, rows: Sequence, pad: int) -> list[list[int]]:
        """Host side of one step's metadata for `rows` (ScheduledRow), `pad` padding rows."""
        meta = [[r.host_token_ids[0] for r in rows],
                [r.request.slot if r.first_from_relay else -1 for r in rows],
                [r.start_pos for r in rows],
                [r.request.slot for r in rows],
                [1] * len(rows)]
        return [row + [fill] * pad for row, fill in zip(meta, cls.PAD)]

    @classmethod
    def host_relay(cls, rows: Sequence, slots: Sequence[int], bucket: int) -> torch.Tensor:
        """host_rows(rows, bucket - len(rows)) as a tensor, for rows that all take their input
        id from the relay (every id 0, relay_src = slot: steady decode), built a row of the
        table at a time in numpy. The batch changes at nearly every step of a served engine
        (a request ends, one joins), so this runs about as often as the step itself."""
        n = len(rows)
        m = np.empty((cls.NUM_ROWS, bucket), dtype=np.int64)
        m[:, n:] = np.array(cls.PAD, dtype=np.int64)[:, None]
        s = np.array(slots, dtype=np.int64)
        m[0, :n] = 0
        m[1, :n] = s
        m[2, :n] = np.fromiter(map(_START_POS, rows), dtype=np.int64, count=n)
        m[3, :n] = s
        m[4, :n] = 1
        return torch.from_numpy(m)


class EagerGraph:
    """CPU stand-in for torch.cuda.CUDAGraph, with its contract: the program and its static
    input/output buffers are fixed at capture; replay() recomputes the static output in
    place from whatever the static input holds now."""

    def __init__(self, program: Callable[[], torch.Tensor], out: torch.Tensor):
        self._program = program
        self.out = out

    def replay(self) -> None:
        self.out.copy_(self._program())


class DecodeGraphPlan(NamedTuple):
    """A planned decode graph step: the graph's (bucket, variant), and its host metadata
    ([5, bucket] int64), or None to replay on the saved metadata (positions advanced)."""
    key: tuple
    meta: Optional[torch.Tensor]


@dataclass
class CapturedGraph:
    graph: Any            # torch.cuda.CUDAGraph or EagerGraph
    meta: Any             # static input (DecodeMeta, mixed_graphs.MixedMeta)
    out: torch.Tensor     # static output: [rows] sampled ids, or [rows, C] ids + logprobs


def capture_graph(program: Callable[[], torch.Tensor], meta: Any, out_shape: tuple, device: torch.device,
                  stand_in: bool, pool: Any = None, capture_error_mode: str = "global") -> CapturedGraph:
    """`program()` on the static buffers of `meta` as a CUDA graph (after two eager runs:
    they compile the Triton kernels and settle allocations), or as its EagerGraph stand-in."""
    if stand_in:
        out = torch.zeros(out_shape, dtype=torch.int64, device=device)
        return CapturedGraph(EagerGraph(program, out), meta, out)
    for _ in range(2):
        program()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
        out = program()
    return CapturedGraph(graph, meta, out)


# program(meta, all_greedy, use_masks, logprobs) -> sampled ids [B] (or [B, C] with logprobs).
# Contract: the program ends by advancing meta.pos of its real rows by one, so that the
# metadata then describes the same rows' next decode step (what the reuse in
# DecodeGraphs.plan relies on).
DecodeProgram = Callable[[DecodeMeta, bool, bool, bool], torch.Tensor]


class DecodeGraphs:
    """Captured decode graphs of one runner and the metadata they last read."""

    def __init__(self, program: DecodeProgram, device: torch.device, buckets: tuple[int, ...],
                 stand_in: bool = False,
                 out_shape: Callable[[int, tuple], tuple[int, ...]] = lambda b, variant: (b,)):
        self._program = program
        self._out_shape = out_shape  # of a stand-in graph's static output
        self.device = device
        self.buckets = buckets
        self.stand_in = stand_in
        self.graphs: dict[tuple[int, tuple[bool, bool, bool]], CapturedGraph] = {}
        # Key (bucket, variant, slots) of the graph whose saved metadata the next step may
        # reuse by advancing positions; None when the last step was anything else.
        self._reusable: Optional[tuple] = None
        self.steps_reused = 0    # graph steps that only advanced the saved positions
        self.steps_uploaded = 0  # graph steps that uploaded their metadata
        self._capture()

    def bucket(self, n: int) -> Optional[int]:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def invalidate(self) -> None:
        """A step ran outside the graphs: no saved metadata describes the previous step."""
        self._reusable = None

    def close(self) -> None:
        """Drop the graphs (their pool goes with the last one) and the program: a stand-in
        graph holds a program that refers back to this object."""
        self.graphs.clear()
        self._program = None
        self._reusable = None

    def plan(self, rows: Sequence, greedy: bool, masks: bool, logprobs: bool = False,
             slots: Optional[Sequence[int]] = None, all_relay: Optional[bool] = None) -> DecodeGraphPlan:
        """Host side of a decode-only graph step of `rows` (len(rows) <= the largest bucket):
        which graph, and its metadata or the decision to reuse the saved one. Plans must be
        replayed in the order they were made (the decision assumes the previous plan ran).
        slots / all_relay: the rows' slots and whether every first input id comes from the
        relay, when the caller already has them (SchedulerOutput keeps both)."""
        bucket = self.bucket(len(rows))
        variant = graph_variant(greedy, masks, logprobs)
        key = (bucket, variant, tuple(r.request.slot for r in rows) if slots is None else tuple(slots))
        if all_relay is None:
            all_relay = all(r.first_from_relay for r in rows)
        meta = None
        if key == self._reusable and all_relay:
            # Only positions changed since the last replay, and the program advanced them.
            self.steps_reused += 1
        else:
            meta = (DecodeMeta.host_relay(rows, key[2], bucket) if all_relay
                    else host_tensor(DecodeMeta.host_rows(rows, bucket - len(rows))))
            self.steps_uploaded += 1
        # Reuse is sound only while every row's input id comes from the relay: a host-known
        # id saved here (a recomputed request's 1-token final prefill chunk) would be fed
        # again on the next step instead of relay[slot].
        self._reusable = key if all_relay else None
        return DecodeGraphPlan((bucket, variant), meta)

    def replay(self, plan: DecodeGraphPlan, upload: Callable[[torch.Tensor], torch.Tensor]
               ) -> tuple[torch.Tensor, tuple]:
        """Device side: upload the planned metadata (if any), replay; returns (static output,
        tensors the step reads that must stay alive)."""
        g = self.graphs[plan.key]
        keep: tuple = ()
        if plan.meta is not None:
            staged = upload(plan.meta)
            g.meta.packed.copy_(staged)
            keep = (staged,)
        g.graph.replay()
        return g.out, keep

    def launch(self, rows: Sequence, greedy: bool, masks: bool,
               upload: Callable[[torch.Tensor], torch.Tensor],
               logprobs: bool = False, slots: Optional[Sequence[int]] = None,
               all_relay: Optional[bool] = None) -> tuple[torch.Tensor, tuple]:
        """plan + replay in one call (a step planned and launched on the same thread)."""
        return self.replay(self.plan(rows, greedy, masks, logprobs, slots, all_relay), upload)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for b in sorted(self.buckets, reverse=True):
            for variant in GRAPH_VARIANTS:
                meta = DecodeMeta.empty(b, self.device)
                g = capture_graph(lambda m=meta, v=variant: self._program(m, *v), meta, self._out_shape(b, variant),
                                  self.device, self.stand_in, pool)
                if not self.stand_in:
                    pool = g.graph.pool()
                self.graphs[(b, variant)] = g
        if not self.stand_in:
            torch.cuda.synchronize()
        logger.info("captured %d %sdecode graphs for buckets %s", len(self.graphs),
                    "stand-in " if self.stand_in else "CUDA ", self.buckets)
