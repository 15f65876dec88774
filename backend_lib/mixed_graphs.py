"""CUDA-graph mixed steps: steps that carry prefill chunks (with or without decode rows),
replayed as one captured program per (token bucket, sequence bucket, sampling variant).

A mixed step of T tokens in S rows runs in the smallest captured bucket (T_b >= T,
S_b >= S). The captured program is the runner's mixed program (input ids gathered from the
relay -> forward with the flat-grid varlen attention -> sample the rows' last tokens ->
relay write); it reads one persistent metadata buffer (`MixedMeta`) that the host fills
through the pinned staging ring before each replay. Padding tokens write their KV into the
reserved block 0 (through the scratch slot's all-zero block-table row) and belong to no
sequence; padding rows are sequences of q_len 0 that sample into the scratch slot.

Capture policy: the greedy, temperature and full-filter programs of every bucket are
captured when the runner starts (what serving workloads use); the logprobs program of a
bucket is captured on first use (a one-off device synchronization). A step that fits no bucket,
or whose capture failed, runs the eager mixed step; each reason is logged once and counted.

On CPU an `EagerGraph` stands in for torch.cuda.CUDAGraph (decode_graphs.py), so bucket
choice, padding, lazy capture and fallback run in the CPU tests exactly as on the GPU.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from .decode_graphs import GRAPH_VARIANTS, CapturedGraph, capture_graph, graph_variant
from .mixed_pack import MixedRows, pack_rows

logger = logging.getLogger(__name__)

# Captured when the runner starts (argmax, temperature, the full filters: what serving
# workloads use); the logprobs program on first use.
STARTUP_VARIANTS = GRAPH_VARIANTS[:3]


class MixedMeta:
    """One bucket's persistent metadata: a flat int64 buffer of 4*T + 4*S + (S+1) entries
    (one upload a step), read through named views. Token views are [T], row views [S]."""

    def __init__(self, packed: torch.Tensor, tokens: int, seqs: int):
        self.packed, self.tokens, self.seqs = packed, tokens, seqs
        t, s = tokens, seqs
        tok = packed[:4 * t].view(4, t)
        row = packed[4 * t:4 * t + 4 * s].view(4, s)
        self.ids = tok[0]          # host-known input id (ignored where relay_src >= 0)
        self.relay_src = tok[1]    # slot whose relay entry is the input id; -1: use ids
        self.pos = tok[2]          # the token's position
        self.tok_slot = tok[3]     # the slot whose block table places the token's KV
        self.row_slot = row[0]     # the row's slot (scratch for padding rows)
        self.seq_len = row[1]      # KV length after this step (0: padding row)
        self.last_idx = row[2]     # index of the row's last token (its sampled hidden state)
        self.samples = row[3]      # 1: the row's sampled token is a real output
        self.cu = packed[4 * t + 4 * s:]  # [S+1] cu_seqlens_q; padding rows add no tokens

    @staticmethod
    def size(tokens: int, seqs: int) -> int:
        return 4 * tokens + 5 * seqs + 1

    @classmethod
    def empty(cls, tokens: int, seqs: int, scratch_slot: int, device: torch.device) -> "MixedMeta":
        """All padding (what warm-up and capture run on: every write goes to scratch)."""
        none = pack_rows([], [])
        return cls(torch.from_numpy(cls.host_flat(none, tokens, seqs, scratch_slot)).to(device), tokens, seqs)

    @staticmethod
    def host_flat(rows: MixedRows, tokens: int, seqs: int, scratch_slot: int) -> np.ndarray:
        """The flat host buffer of one step (mixed_pack.MixedRows) padded to the bucket:
        padding tokens write their KV through the scratch slot, padding rows are empty
        sequences that sample into it."""
        t, s = rows.tok.shape[1], rows.row.shape[1]
        flat = np.empty(MixedMeta.size(tokens, seqs), dtype=np.int64)
        tok = flat[:4 * tokens].reshape(4, tokens)
        row = flat[4 * tokens:4 * tokens + 4 * seqs].reshape(4, seqs)
        cu = flat[4 * tokens + 4 * seqs:]
        tok[:, :t] = rows.tok
        tok[:, t:] = np.array([0, -1, 0, scratch_slot], dtype=np.int64)[:, None]
        row[:, :s] = rows.row
        row[:, s:] = np.array([scratch_slot, 0, 0, 0], dtype=np.int64)[:, None]
        cu[:s + 1] = rows.cu
        cu[s + 1:] = rows.cu[-1]
        return flat


# program(meta, all_greedy, use_masks, logprobs) -> [S] ids (or [S, C] with logprobs).
MixedProgram = Callable[[MixedMeta, bool, bool, bool], torch.Tensor]


class MixedGraphPlan(NamedTuple):
    """A planned mixed graph step: the graph's (tokens, rows, variant) and its flat host
    metadata (MixedMeta.host_flat, padded to the bucket)."""
    key: tuple
    meta: torch.Tensor


class MixedGraphs:
    """Captured mixed-step graphs of one runner."""

    def __init__(self, program: MixedProgram, device: torch.device, buckets: Sequence[tuple[int, int]],
                 scratch_slot: int, stand_in: bool = False,
                 out_shape: Callable[[int, tuple], tuple[int, ...]] = lambda s, variant: (s,),
                 startup_variants: Sequence[tuple] = STARTUP_VARIANTS):
        self._program = program
        self._out_shape = out_shape
        self.device = device
        self.scratch_slot = scratch_slot
        self.stand_in = stand_in
        self.buckets = tuple(sorted(set(buckets)))
        self.token_buckets = tuple(sorted({t for t, _ in self.buckets}))
        self.graphs: dict[tuple[int, int, tuple], CapturedGraph] = {}
        self.failed: dict[tuple, str] = {}   # key -> why its capture failed (eager from then on)
        self.steps_graphed = 0
        self.steps_eager = 0
        self.capture_s = 0.0
        self._logged: set[str] = set()
        self._pool = None if stand_in else torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        # Largest first: the smaller graphs then reuse the shared pool's blocks.
        for key in ((t, s, v) for t, s in reversed(self.buckets) for v in startup_variants):
            self._capture(key)
        logger.info("captured %d %smixed-step graphs in %.1f s: token buckets %s, (tokens, rows) buckets %d",
                    len(self.graphs), "stand-in " if stand_in else "CUDA ", time.perf_counter() - t0,
                    self.token_buckets, len(self.buckets))

    def close(self) -> None:
        """Drop the graphs (their pool goes with the last one) and the program: each graph's
        program refers back to this object."""
        self.graphs.clear()
        self._program = None
        self._pool = None

    def bucket(self, num_tokens: int, num_seqs: int) -> Optional[tuple[int, int]]:
        """The smallest (T_b, S_b) with T_b >= num_tokens and S_b >= num_seqs."""
        for t, s in self.buckets:   # sorted by tokens, then rows
            if t >= num_tokens and s >= num_seqs:
                return t, s
        return None

    def plan(self, rows: MixedRows, greedy: bool, masks: bool, logprobs: bool) -> Optional[MixedGraphPlan]:
        """Host side of a mixed step (mixed_pack.MixedRows): its graph key and padded
        metadata, or None when no bucket holds it (it runs eagerly)."""
        num_tokens, num_rows = rows.tok.shape[1], rows.row.shape[1]
        b = self.bucket(num_tokens, num_rows)
        if b is None:
            self._eager(f"no bucket holds {num_rows} rows of {num_tokens} tokens (buckets "
                        f"up to {self.buckets[-1]})", "no-bucket")
            return None
        meta = torch.from_numpy(MixedMeta.host_flat(rows, b[0], b[1], self.scratch_slot))
        return MixedGraphPlan((b[0], b[1], graph_variant(greedy, masks, logprobs)), meta)

    def replay(self, plan: MixedGraphPlan, upload: Callable[[torch.Tensor], torch.Tensor]
               ) -> Optional[tuple[torch.Tensor, tuple]]:
        """Device side: replay the planned graph (capturing it on first use); (static output,
        tensors to keep alive), or None when its capture failed (the step runs eagerly)."""
        key = plan.key
        g = self.graphs.get(key) or self._capture(key)
        if g is None:
            self._eager(f"the capture of {key} failed: {self.failed[key]}", f"failed-{key}")
            return None
        staged = upload(plan.meta)
        g.meta.packed.copy_(staged)
        g.graph.replay()
        self.steps_graphed += 1
        return g.out, (staged,)

    def _eager(self, why: str, tag: str) -> None:
        self.steps_eager += 1
        if tag not in self._logged:
            self._logged.add(tag)
            logger.warning("mixed step runs eagerly: %s (logged once; MixedGraphs.steps_eager counts them)", why)

    @torch.inference_mode()
    def _capture(self, key: tuple) -> Optional[CapturedGraph]:
        if key in self.failed:
            return None
        tokens, seqs, variant = key
        t0 = time.perf_counter()
        try:
            with _sync_allowed():  # the static metadata's upload synchronizes too
                meta = MixedMeta.empty(tokens, seqs, self.scratch_slot, self.device)
                if self.stand_in:
                    g = self._capture_stand_in(meta, variant)
                else:
                    g = self._capture_cuda(meta, variant)
        except Exception as e:  # out of memory, an op that cannot be captured: eager instead
            self.failed[key] = f"{type(e).__name__}: {e}"
            logger.error("mixed-step graph %s: capture failed, its steps run eagerly: %s", key, self.failed[key],
                         exc_info=True)
            return None
        self.graphs[key] = g
        self.capture_s += time.perf_counter() - t0
        return g

    def _program_of(self, meta: MixedMeta, variant: tuple) -> Callable[[], torch.Tensor]:
        return lambda: self._program(meta, *variant)

    def _capture_stand_in(self, meta: MixedMeta, variant: tuple) -> CapturedGraph:
        return capture_graph(self._program_of(meta, variant), meta, self._out_shape(meta.seqs, variant),
                             self.device, stand_in=True)

    def _capture_cuda(self, meta: MixedMeta, variant: tuple) -> CapturedGraph:
        # thread_local: a first-use capture runs while the engine serves; CUDA calls of other
        # threads (a sender, a pipeline stage) must neither break nor be broken by it.
        g = capture_graph(self._program_of(meta, variant), meta, self._out_shape(meta.seqs, variant),
                          self.device, stand_in=False, pool=self._pool, capture_error_mode="thread_local")
        torch.cuda.synchronize()
        return g


class _sync_allowed:
    """A capture synchronizes the device by design (once per key); the no-sync rule
    (tests/gpu/test_no_host_sync.py) is about launching steps, so torch's sync debug mode is
    paused for it."""

    def __enter__(self):
        self._mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
        if self._mode:
            torch.cuda.set_sync_debug_mode(0)

    def __exit__(self, *exc):
        if self._mode:
            torch.cuda.set_sync_debug_mode(self._mode)
        return False
