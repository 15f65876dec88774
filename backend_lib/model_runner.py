"""Model runner: persistent device tables, per-step input preparation, the decode program
(replayed through decode_graphs.py's CUDA graphs) and the mixed-step program (prefill chunks
with decodes; replayed through mixed_graphs.py's, or run eagerly), forward + on-device
sampling, and the relay buffer that feeds step n+1's input ids.

Persistent per-slot device state (rows indexed by the request's slot, updated only when a
request is admitted or its KV grows): block table, relay token, sampling parameters. Each
step uploads one small packed int64 tensor (row slots, positions, host-known ids) from
pinned memory; nothing is ever read back except through the TokenHandoff.

A step is planned, then launched: `plan` (host, the engine thread) copies what the step
needs out of the scheduler's requests into a StepPlan (step_plan.py); `launch` (device)
runs it from the plan alone, on the engine thread or on the submission thread
(submission.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from . import envs
from .config import AsyncDecision, EngineConfig
from .decode_graphs import DecodeGraphs, DecodeMeta, graph_buckets
from .handoff import HostStaging, StepHandle, TokenHandoff, host_tensor
from .graph_buckets import mixed_buckets, parse_token_buckets
from .mixed_graphs import MixedGraphs, MixedMeta
from .mixed_pack import MixedRows, pack_rows
from .layers.attention import AttentionMetadata
from .layers import decode_gemv, decode_mlp, decode_oproj, skinny_gemm
from .layers.decode_prep import decode_inputs
from .layers.logprobs import MAX_LOGPROBS, pack_tokens_and_logprobs, packed_width
from .layers.penalties import PenaltyState
from .layers.sampler import SamplingTensors, native_logits_ok, sample
from .models.loader import build_model
from .scheduler import SchedulerOutput
from .step_plan import MixedPlan, StepPlan, StepProgram, TablePlan

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class TableUpdates:
    """Host side of one step's persistent-table updates."""
    ints: list[list[int]]       # admissions: [slot, top_k, seed, prompt_len, min_tokens, banned[k], stops[w]]
    floats: list[list[float]]   # admissions: ADMISSION_FLOATS
    growth: list[list[int]]     # KV growth: [slots], [block indices], [block ids]
    history: list[list[int]]    # penalty rows' known tokens: [slots], [tokens], [is_output]
    num_penalized: int = 0      # the first admissions, those with penalties (their state is reset)


# Floats per admission row.
ADMISSION_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty")


def _has_penalties(sp) -> bool:
    return sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0


def _decode_out_shape(bucket: int, variant: tuple) -> tuple[int, ...]:
    """A decode program's output: [B] ids, or [B, packed_width] ids + logprobs."""
    return (bucket, packed_width()) if variant[2] else (bucket,)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, hf_config, decision: AsyncDecision, num_kv_blocks: int,
                 max_model_len: int, layer_start: int = 0, layer_end: Optional[int] = None,
                 device: Optional[torch.device] = None):
        # A layer range makes this runner one pipeline stage (backend_lib/pipeline.py drives
        # it through the pack_* / apply_* / stage_* pieces below; no CUDA graphs then).
        self.cfg = cfg
        self.device = torch.device(cfg.device) if device is None else device
        self.dtype = _DTYPES[cfg.dtype]
        self.model = build_model(hf_config, cfg.model_path, self.device, self.dtype, layer_start, layer_end,
                                 load_format=cfg.load_format)
        self.is_pipeline_stage = not (self.model.is_first and self.model.is_last)
        s = self.shape = self.model.shape
        self.vocab_size = s.vocab_size
        self.block_size = cfg.block_size
        self.num_kv_blocks = num_kv_blocks
        self.max_blocks_per_seq = (max_model_len + cfg.block_size - 1) // cfg.block_size
        n, k = cfg.max_num_seqs, cfg.max_stop_token_ids
        dev = self.device

        kv = torch.zeros(len(self.model.layers), 2, num_kv_blocks, cfg.block_size, s.num_kv_heads,
                         s.head_dim, dtype=self.dtype, device=dev)
        self.kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
        # Persistent per-slot tables. Index n (one past the last slot) is a scratch row that
        # padding and non-sampling rows write into, so no real row is ever written twice.
        self.block_table = torch.zeros(n + 1, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.relay = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        # Sampling state: one int64 and one float32 table whose rows are laid out as an
        # admission's (pack_table_updates), so admitting is two scatters; the sampler reads
        # the named column views.
        self.slot_ints = torch.full((n + 1, 4 + k + k + 8), -1, dtype=torch.int64, device=dev)
        self.slot_ints[:, :4] = 0
        self.top_k, self.seed, self.prompt_len, self.min_tokens = self.slot_ints[:, :4].unbind(1)
        self.banned = self.slot_ints[:, 4:4 + k]           # ids never sampled
        self.min_stop = self.slot_ints[:, 4 + k:]          # stop ids masked until min_tokens
        # One row per ADMISSION_FLOATS name (each a contiguous per-slot vector), neutral values
        self.slot_floats = torch.tensor([[1.0], [1.0], [0.0], [1.0], [0.0], [0.0]], dtype=torch.float32,
                                        device=dev).repeat(1, n + 1)
        self.temperature, self.top_p, self.min_p = self.slot_floats[:3].unbind(0)
        # Penalty state lives where the sampler runs (the last pipeline stage); its
        # parameters are the last three rows.
        self.penalties = PenaltyState(self.slot_floats[3:], s.vocab_size) if self.model.is_last else None
        # Host mirrors of per-slot flags that pick the cheaper sampling program: the slots whose
        # request (the last one admitted there) samples, needs masks/filters/penalties, wants
        # logprobs. Sets, so that an all-greedy batch answers without a pass over its rows.
        self._sampling_slots: set[int] = set()
        self._mask_slots: set[int] = set()
        self._logprob_slots: set[int] = set()
        self._flags_slots: list[int] = []   # step_flags' last question and answer
        self._flags = (True, False, False)
        self.scratch_slot = n
        self.pin = self.device.type == "cuda"

        self.handoff = TokenHandoff(dev, width=max(n, 1), depth=4, max_cols=packed_width())
        # Largest upload: a mixed step's 4 x max_num_batched_tokens token rows (int64).
        self.staging = HostStaging(dev, 8 * (4 * cfg.max_num_batched_tokens + 8 * n + 4096))
        self.decision = decision
        # Off by default; before graph capture, so the graphs capture the chosen kernels.
        self.gemm_table = skinny_gemm.install(
            self.model, [b for b in self._graph_buckets() if b <= skinny_gemm.MAX_M],
            envs.skinny_gemm()) if self.device.type == "cuda" else None
        self.one_token_gemv = decode_gemv.install(self.model, envs.decode_gemv()) \
            if self.device.type == "cuda" and self.model.use_fused_ops else None
        self.one_token_mlp = decode_mlp.install(self.model, self.one_token_gemv, envs.decode_mlp())
        self.one_token_oproj = decode_oproj.install(self.model, self.one_token_gemv, envs.decode_attn_reduce())
        self.decode_graphs: Optional[DecodeGraphs] = None
        self.mixed_graphs: Optional[MixedGraphs] = None
        if self.device.type == "cuda" and cfg.enable_cuda_graph and not self.is_pipeline_stage:
            self.decode_graphs = DecodeGraphs(self._decode_program, self.device, self._graph_buckets(),
                                              out_shape=_decode_out_shape)
            if cfg.cuda_graph_mixed:
                self.mixed_graphs = self._make_mixed_graphs(stand_in=False)

    def _graph_buckets(self) -> tuple[int, ...]:
        return graph_buckets(min(self.cfg.max_num_seqs, self.cfg.cuda_graph_max_batch))

    def use_stand_in_graphs(self) -> None:
        """CPU tests: decode through EagerGraph stand-ins of the CUDA graphs, so the graph
        control logic (buckets, variants, metadata reuse, relay sources) runs without CUDA."""
        if self.is_pipeline_stage:
            raise ValueError("decode graphs need the whole model (not a pipeline stage)")
        self.decode_graphs = DecodeGraphs(self._decode_program, self.device, self._graph_buckets(),
                                          stand_in=True, out_shape=_decode_out_shape)
        if self.cfg.cuda_graph_mixed:
            self.mixed_graphs = self._make_mixed_graphs(stand_in=True)

    def _make_mixed_graphs(self, stand_in: bool) -> MixedGraphs:
        cfg = self.cfg
        tokens = parse_token_buckets(cfg.cuda_graph_mixed_tokens, cfg.max_num_batched_tokens)
        return MixedGraphs(self._mixed_program, self.device, mixed_buckets(tokens, cfg.max_num_seqs),
                           self.scratch_slot, stand_in=stand_in, out_shape=_decode_out_shape)

    def close(self) -> None:
        """Drop the captured graphs. They hold bound programs of this runner, reference
        cycles that the engine's gc.freeze() keeps from the collector: left in place, the
        model, KV cache and graph pools would stay allocated after the engine is gone.
        Later steps run eagerly."""
        for graphs in (self.decode_graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.close()
        self.decode_graphs = None
        self.mixed_graphs = None

    @property
    def graphs(self) -> dict:
        return self.decode_graphs.graphs if self.decode_graphs is not None else {}

    # ---- persistent table updates (admission, KV growth) --------------------------------
    def plan_tables(self, sched: SchedulerOutput, eos_ids: tuple[int, ...]) -> Optional[TablePlan]:
        """Host side of the table updates, packed in one tensor (None when the step has none):
        admissions write their slot's sampling state, KV growth writes block-table entries."""
        if not sched.new_slots and not sched.grown:
            return None  # most steady decode steps (KV growth comes every block_size steps)
        up = self.pack_table_updates(sched, eos_ids)
        if not (up.ints or up.history[0] or up.growth[0]):
            return None
        return TablePlan.pack(up.ints, up.floats, up.history, up.growth, self.admission_width,
                              len(ADMISSION_FLOATS), up.num_penalized)

    def apply_tables(self, t: TablePlan) -> None:
        """Device side: one async H2D copy (pinned staging), then a scatter per section."""
        sec = t.sections(self.staging.upload_tensor(t.packed))
        if sec.admissions is not None:
            self.apply_admissions(sec.admissions, sec.admission_floats, sec.penalty_resets)
        if sec.history is not None:
            self.apply_history(sec.history)
        if sec.growth is not None:
            self.apply_growth(sec.growth)

    @property
    def admission_width(self) -> int:
        """Ints per admission row: slot, top_k, seed, prompt_len, min_tokens, banned[k], stops[w]."""
        return 5 + self.banned.shape[1] + self.min_stop.shape[1]

    def pack_table_updates(self, sched: SchedulerOutput, eos_ids: tuple[int, ...]) -> TableUpdates:
        """Host side of the table updates. Also sets the host flags of admitted slots."""
        ints: list[list[int]] = []
        floats: list[list[float]] = []
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        history: list[list[int]] = [[], [], []]
        num_penalized = 0
        if sched.new_slots:
            k, w = self.banned.shape[1], self.min_stop.shape[1]
            # Admissions with penalties first: only their slots' penalty state is reset.
            for req in sorted(sched.new_slots, key=lambda r: not _has_penalties(r.sampling)):
                sp, slot = req.sampling, req.slot
                stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_ids))
                ints.append([slot, sp.top_k, req.effective_seed, req.num_prompt_tokens, sp.min_tokens]
                            + (list(sp.bad_token_ids) + [-1] * k)[:k] + (stops + [-1] * w)[:w])
                row = {name: float(getattr(sp, name)) for name in ADMISSION_FLOATS}
                if sp.greedy:
                    row["temperature"] = 0.0  # the sampler's greedy rows are those of temperature 0
                floats.append([row[name] for name in ADMISSION_FLOATS])
                penalized = _has_penalties(sp)
                masks = (bool(sp.bad_token_ids) or sp.min_tokens > 0 or sp.top_k > 0 or sp.top_p < 1.0
                         or sp.min_p > 0.0 or penalized)
                for flagged, on in ((self._sampling_slots, not sp.greedy), (self._mask_slots, masks),
                                    (self._logprob_slots, sp.logprobs is not None)):
                    if on:
                        flagged.add(slot)
                    else:
                        flagged.discard(slot)
                if penalized:
                    num_penalized += 1
                    # The tokens this request already has (prompt, and outputs from before a
                    # preemption) seed its penalty state; later tokens count on the device.
                    known = req.prompt_token_ids + req.output_token_ids
                    history[0].extend([slot] * len(known))
                    history[1].extend(known)
                    history[2].extend([0] * req.num_prompt_tokens + [1] * len(req.output_token_ids))
        for req, first in sched.grown:
            blocks = req.block_ids
            if len(blocks) == first + 1:  # one new block: a decode row's growth, the common entry
                rows.append(req.slot)
                cols.append(first)
                vals.append(blocks[first])
            else:
                rows.extend([req.slot] * (len(blocks) - first))
                cols.extend(range(first, len(blocks)))
                vals.extend(blocks[first:])
        return TableUpdates(ints, floats, [rows, cols, vals], history, num_penalized)

    def apply_admissions(self, it: torch.Tensor, ft: torch.Tensor, penalty_resets: Optional[torch.Tensor]) -> None:
        """Device side: scatter admission rows ([A, admission_width] int64, [A, ADMISSION_FLOATS]
        f32, the penalty parameters included); penalty_resets: the slots of the admissions
        with penalties, whose penalty state restarts (None: none)."""
        slots = it[:, 0]
        self.slot_ints[slots] = it[:, 1:]
        self.slot_floats[:, slots] = ft.T
        if self.penalties is not None and penalty_resets is not None:
            self.penalties.reset(penalty_resets)

    def apply_history(self, hist: torch.Tensor) -> None:
        """Device side: penalty state of admitted slots from their known tokens ([3, H] int64)."""
        if self.penalties is not None:
            self.penalties.load_history(hist)

    def apply_growth(self, t: torch.Tensor) -> None:
        """Device side: block-table entries ([3, G] int64: slot, block index, block id)."""
        self.block_table[t[0], t[1]] = t[2].to(torch.int32)

    def step_flags(self, sched: SchedulerOutput) -> tuple[bool, bool, bool]:
        """(all rows greedy, any row needs masks/filters/penalties, any row wants logprobs):
        host flags that pick the sampling program. A slot's flags change only when a request
        is admitted into it, so a step with the previous step's slots and no admission reuses
        the previous answer (steady decode: no per-row work)."""
        slots = sched.slots
        if not sched.new_slots and slots == self._flags_slots:
            return self._flags
        sampling, masks, logprobs = self._sampling_slots, self._mask_slots, self._logprob_slots
        self._flags = (not sampling or sampling.isdisjoint(slots), bool(masks) and not masks.isdisjoint(slots),
                       bool(logprobs) and not logprobs.isdisjoint(slots))
        self._flags_slots = list(slots)
        return self._flags

    # ---- one step: plan (host, engine thread), launch (device, the stream's owner) ----------
    def execute(self, sched: SchedulerOutput, eos_ids: tuple[int, ...]) -> StepHandle:
        """Plan and launch one step on this thread; returns at once (on CUDA) with the handle
        of its sampled tokens."""
        return self.launch(self.plan(sched, eos_ids))

    def plan(self, sched: SchedulerOutput, eos_ids: tuple[int, ...]) -> StepPlan:
        """Everything the device needs for `sched`, copied out of its requests (step_plan.py):
        table updates, the sampling program, and which program runs with which metadata."""
        tables = self.plan_tables(sched, eos_ids)
        rows = sched.rows
        greedy, masks, logprobs = self.step_flags(sched)
        graphs = self.decode_graphs
        if sched.is_decode_only and graphs is not None and graphs.bucket(len(rows)) is not None:
            g = graphs.plan(rows, greedy, masks, logprobs, slots=sched.slots, all_relay=sched.all_inputs_from_relay)
            return StepPlan(len(rows), greedy, masks, logprobs, tables, StepProgram.DECODE_GRAPH, decode_graph=g)
        if graphs is not None:
            graphs.invalidate()
        if sched.is_decode_only:
            # Decode larger than every graph bucket (or no graphs): the same program, eagerly.
            meta = (DecodeMeta.host_relay(rows, sched.slots, len(rows)) if sched.all_inputs_from_relay
                    else host_tensor(DecodeMeta.host_rows(rows, 0)))
            return StepPlan(len(rows), greedy, masks, logprobs, tables, StepProgram.DECODE_EAGER, decode_meta=meta)
        packed = self.pack_mixed(sched)
        mixed = self.mixed_graphs
        g = None if mixed is None else mixed.plan(packed, greedy, masks, logprobs)
        return StepPlan(len(rows), greedy, masks, logprobs, tables, StepProgram.MIXED,
                        mixed=MixedPlan.build(packed, g))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepHandle:
        """Device side of a planned step: table updates, the step program (graph replay or
        eager), the D2H copy of its tokens. Reads the plan and device state only, so it may
        run on another thread than the one that planned it (plans launch in plan order)."""
        if plan.tables is not None:
            self.apply_tables(plan.tables)
        start = self.handoff.begin_step()
        if plan.program is StepProgram.DECODE_GRAPH:
            out, keep = self.decode_graphs.replay(plan.decode_graph, self.staging.upload_tensor)
        elif plan.program is StepProgram.DECODE_EAGER:
            meta = DecodeMeta(self.staging.upload_tensor(plan.decode_meta))
            out, keep = self._decode_program(meta, plan.greedy, plan.masks, plan.logprobs), (meta.packed,)
        else:
            m = plan.mixed
            launched = None if m.graph is None else self.mixed_graphs.replay(m.graph, self.staging.upload_tensor)
            out, keep = launched or self._mixed_step(m, plan.greedy, plan.masks, plan.logprobs)
        return self.handoff.publish(out, plan.num_rows, start, keepalive=keep)

    # ---- decode: one token per row, fixed shapes (the CUDA-graph program) ------------------
    def _decode_program(self, meta: DecodeMeta, greedy: bool, masks: bool, logprobs: bool = False) -> torch.Tensor:
        # (also leaves meta.pos describing the same rows' next decode step, so that a graph
        # replayed for unchanged rows needs no upload and no kernel outside the graph:
        # decode_graphs.DecodeGraphs.launch)
        d = decode_inputs(meta, self.relay, self.block_table, self.block_size, self.scratch_slot)
        attn = AttentionMetadata(d.slot_mapping, d.tables, d.seq_lens, None, 1, True)
        if self.device.type == "cpu":
            attn.seq_lens_host = d.seq_lens.tolist()
            attn.q_lens_host = [1] * len(attn.seq_lens_host)
        hidden = self.model(d.ids, d.positions, self.kv_caches, attn)
        return self._sample_and_relay(hidden, d.slot, d.samples, d.next_pos, greedy, masks, logprobs,
                                      relay_dst=d.relay_dst)

    def _sample_and_relay(self, hidden, slot_c, samples, next_pos, greedy, masks, logprobs=False,
                          relay_dst: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.sample_rows(hidden, slot_c, next_pos, greedy, masks, logprobs, samples)
        tokens = out[:, 0] if logprobs else out
        # Relay: step n+1 gathers its input ids here, on the device, by slot.
        if relay_dst is None:
            relay_dst = torch.where(samples, slot_c, self.scratch_slot)
        self.relay[relay_dst] = tokens
        return out

    def sample_rows(self, hidden, slot_c, next_pos, greedy, masks, logprobs=False, samples=None) -> torch.Tensor:
        """Last stage: logits of each row's last hidden state -> what the step hands to the
        host: sampled ids [S], or [S, packed_width] ids + logprobs. Penalty rows' tokens are
        counted here, right after sampling (`samples`: rows whose token is a real output)."""
        logits = raw = self.model.compute_logits(hidden, upcast=False)
        native = native_logits_ok(logits)
        if not native:
            logits = raw = logits.float()
            if logprobs and masks:
                logits = logits.clone()  # logprobs are of the raw logits; masks/penalties write in place
        # Plain greedy reads none of the per-row sampling state: its ~11 gathers would be
        # kernels of every greedy step (CUDA graph included) for nothing.
        st = self.sampling_tensors(slot_c, next_pos) if masks or not greedy else None
        clean_rows = None
        if masks and native and greedy:
            logits = self.penalties.upcast_apply(logits, slot_c)  # the float32 copy masks write into
        elif masks and native:
            # Only the rows that penalties or id masks write into get a float32 copy; the
            # sampler reads the others (top-k/p, min_p rows) in the model's dtype.
            logits, written = self.penalties.upcast_apply_sparse(logits, slot_c, st)
            clean_rows = (raw, written)
        elif masks:
            self.penalties.apply_(logits, slot_c)
        tokens = sample(logits, st, greedy, masks, clean_rows)
        if masks:
            counted = slot_c if samples is None else torch.where(samples, slot_c, self.scratch_slot)
            self.penalties.count_sampled(counted, tokens)
        return pack_tokens_and_logprobs(raw, tokens, MAX_LOGPROBS) if logprobs else tokens

    def sampling_tensors(self, slot_c: torch.Tensor, next_pos: torch.Tensor) -> SamplingTensors:
        """The rows' sampling state, gathered from the per-slot tables."""
        return SamplingTensors(
            temperature=self.temperature[slot_c], top_k=self.top_k[slot_c], top_p=self.top_p[slot_c],
            seed=self.seed[slot_c], position=next_pos, banned_ids=self.banned[slot_c],
            min_stop_ids=self.min_stop[slot_c],
            min_tokens_left=self.min_tokens[slot_c] - (next_pos - self.prompt_len[slot_c]),
            min_p=self.min_p[slot_c])

    # ---- mixed / prefill steps (eager) ------------------------------------------------------
    def _mixed_step(self, m: MixedPlan, greedy: bool, masks: bool, logprobs: bool):
        tok, row, cu = (self.staging.upload_tensor(t) for t in m.eager_inputs())
        cu_t = cu.to(torch.int32)
        input_ids = self.gather_input_ids(tok[0], tok[1])
        p, attn = self.mixed_attention(tok[2], tok[3], row, cu_t, m.rows.seq_lens, m.rows.q_lens)
        hidden = self.model(input_ids, p, self.kv_caches, attn)
        sampled = self._sample_and_relay(hidden[row[2]], row[0], row[3] > 0, row[1], greedy, masks, logprobs)
        return sampled, (tok, row, cu_t)

    def _mixed_program(self, m: MixedMeta, greedy: bool, masks: bool, logprobs: bool = False) -> torch.Tensor:
        """A mixed step with fixed shapes (one bucket's CUDA-graph program): every per-step
        quantity comes from the metadata buffer, the attention grid from its shapes."""
        input_ids = self.gather_input_ids(m.ids, m.relay_src)
        seq_lens = m.seq_len.to(torch.int32)
        attn = AttentionMetadata(self._kv_slots(m.tok_slot, m.pos), self.block_table[m.row_slot], seq_lens,
                                 m.cu.to(torch.int32), None, False)
        if self.device.type == "cpu":  # the reference attention loops over host lengths
            attn.seq_lens_host = m.seq_len.tolist()
            attn.q_lens_host = (m.cu[1:] - m.cu[:-1]).tolist()
        hidden = self.model(input_ids, m.pos, self.kv_caches, attn)
        return self._sample_and_relay(hidden[m.last_idx], m.row_slot, m.samples > 0, m.seq_len, greedy, masks,
                                      logprobs)

    def _kv_slots(self, tok_slot: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Flat KV-cache slot of each token (its request's block table at its position): one
        element of the table per token, never a [T, max_blocks] copy of its rows."""
        flat = self.block_table.view(-1)
        blk = flat[tok_slot * self.block_table.shape[1] + p // self.block_size].long()
        return blk * self.block_size + p % self.block_size

    def pack_mixed(self, sched: SchedulerOutput) -> MixedRows:
        """Host side of a mixed step: its per-token and per-row arrays (mixed_pack.py)."""
        return pack_rows(sched.rows, sched.slots, sched.irregular_rows)

    def gather_input_ids(self, host_ids: torch.Tensor, relay_src: torch.Tensor) -> torch.Tensor:
        """First stage: input ids, placeholders gathered from the relay buffer by slot."""
        return torch.where(relay_src >= 0, self.relay[relay_src.clamp(min=0)], host_ids)

    def mixed_attention(self, p: torch.Tensor, tok_slot: torch.Tensor, row: torch.Tensor,
                        cu_t: torch.Tensor, seq_lens: Optional[list[int]], q_lens: list[int]):
        """(positions, AttentionMetadata) of a mixed step from its device tensors."""
        tables = self.block_table[row[0]]
        attn = AttentionMetadata(self._kv_slots(tok_slot, p), tables, row[1].to(torch.int32), cu_t, max(q_lens),
                                 all(n == 1 for n in q_lens), seq_lens, q_lens)
        return p, attn
