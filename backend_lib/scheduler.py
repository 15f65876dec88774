"""Continuous batching with a token budget, chunked prefill, preemption by recompute, and
honest accounting while steps are in flight.

Pure host logic: no torch.cuda here, so every case tests on CPU.

Accounting (vLLM v1 style, seed 001): `num_computed_tokens` counts tokens whose KV has been
*scheduled*; a row that samples adds one output placeholder at schedule time, resolved when
its step's tokens reach the host (`update`). A request with steps in flight is scheduled
again as soon as it has budget and KV room: its next input token is the placeholder, which
the runner gathers on the device from the relay buffer (never through the host).

Prefix caching: a block is *committed* (its KV final: registered in the prefix cache,
shareable with n > 1 forks) once every position in it is below both num_computed_tokens
(its KV is scheduled) and num_tokens (its token is confirmed). So no placeholder and no
overshoot position (a lookahead step past a stop computes KV for a token the host then
discards) is ever inside a committed block. A reader of a committed block is scheduled in
a later step, which the device and every pipeline stage run after the write, or in the
same step as the write, where every layer writes the KV of all the step's tokens before any
row attends (models/llama.py), as in vLLM. Commits happen before admissions (for the
running requests), after each admission's row (so a burst sharing a prefix computes it
once), and when a request is preempted or finished. An admitted request takes the longest
committed prefix of its known tokens (recomputation after preemption included) and
computes only the rest.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import numpy as np

from .admission_delay import AdmissionDelay
from .int64_pack import int64_bytes
from .kv_cache import ROOT_HASH, BlockPool, SlotPool, chain_hashes
from .request import FinishReason, OutputRow, Request, RequestStatus


class ScheduledRow(NamedTuple):
    """One request's part of a step (immutable; the hot path builds it with tuple.__new__)."""
    request: Request
    start_pos: int              # num_computed_tokens before this step
    num_new_tokens: int
    samples: bool               # this row's sampled token is a real output
    host_token_ids: Sequence[int]  # known input ids (a prompt chunk's: an int64 numpy view of
                                   # Request.prompt_bytes); a relay row's first id is a dummy 0
    first_from_relay: bool      # the first input token is a placeholder: gather it on device

    @property
    def is_relay_decode(self) -> bool:
        """One token whose id comes from the relay, sampled: a row all of whose packed
        columns but slot and position are constants (mixed_pack.pack_rows)."""
        return self.first_from_relay and self.num_new_tokens == 1 and self.samples


_RELAY_IDS = (0,)  # host ids of a row whose one input token comes from the relay (shared, immutable)
_new_row = tuple.__new__  # ScheduledRow without its Python-level __new__ (the steady decode hot path)


@dataclass
class SchedulerOutput:
    """One step's plan. Rows are added only through `add_row`, which also keeps the per-step
    summaries the runner reads (row slots, decode-only, all inputs from the relay), so no
    consumer walks the rows again to derive them."""
    step_id: int
    rows: list[ScheduledRow] = field(default_factory=list)
    new_slots: list[Request] = field(default_factory=list)     # admitted this step: upload sampling state
    grown: list[tuple[Request, int]] = field(default_factory=list)  # (req, first new block index)
    num_preempted: int = 0
    slots: list[int] = field(default_factory=list)   # rows[i].request.slot, in row order
    num_tokens: int = 0
    num_non_decode_rows: int = 0   # rows other than one sampled token past the prompt
    num_host_input_rows: int = 0   # rows whose first input id is host-known (not from the relay)
    # Indices of the rows other than one relay token that samples (prefill chunks, host-known
    # inputs): the mixed packing reads only these rows one by one (mixed_pack.pack_rows).
    irregular_rows: list[int] = field(default_factory=list)

    def add_row(self, row: ScheduledRow) -> None:
        if not row.is_relay_decode:
            self.irregular_rows.append(len(self.rows))
        self.rows.append(row)
        self.slots.append(row.request.slot)
        n = row.num_new_tokens
        self.num_tokens += n
        if n != 1 or not row.samples or row.start_pos < row.request.num_prompt_tokens:
            self.num_non_decode_rows += 1
        if not row.first_from_relay:
            self.num_host_input_rows += 1

    @property
    def is_decode_only(self) -> bool:
        return self.num_non_decode_rows == 0

    @property
    def all_inputs_from_relay(self) -> bool:
        return self.num_host_input_rows == 0

    @property
    def is_empty(self) -> bool:
        return not self.rows


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prompt_tokens_total: int = 0        # prompt tokens of admitted requests (first admission)
    generation_tokens_total: int = 0    # output tokens delivered to requests
    prefill_tokens_total: int = 0       # known tokens whose KV was computed (recomputation included)
    prefix_cache_queried_tokens_total: int = 0  # known tokens of admissions that looked up the cache
    prefix_cache_hit_tokens_total: int = 0      # of which found cached (not computed)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool, blocks: BlockPool, delay: Optional[AdmissionDelay] = None,
                 stream_interval: int = 1):
        """stream_interval: a running request's tokens are output with its first token, then
        once it has `stream_interval` more, and at its end (SGLang's; fewer outputs to build,
        encode and send when the host is the bottleneck)."""
        self.max_num_seqs = max_num_seqs
        self.stream_interval = stream_interval
        self.token_budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked = enable_chunked_prefill
        self.blocks = blocks
        self.slots = SlotPool(max_num_seqs)
        self.delay = delay or AdmissionDelay(0.0)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._step = 0
        self._pending_finished: list[OutputRow] = []  # finished outside update (abort, length at admission)
        self._fork_leader: dict[str, Request] = {}  # n > 1 fork not admitted yet -> the fork computing the prompt

    # ---- intake -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        # Both length limits as one bound on the outputs (max_tokens, and max_model_len).
        req.max_output_tokens = min(req.sampling.max_tokens, self.max_model_len - req.num_prompt_tokens)
        req.arrival_time = self.delay.clock()
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_forks(self, reqs: Sequence[Request]) -> None:
        """Requests of one prompt (n > 1): the first computes the prompt, the others wait
        until its full blocks are committed and then share them (each computes its own
        partial last block, so no block is ever written by two requests)."""
        leader = reqs[0]
        for r in reqs[1:]:
            if r.prompt_token_ids != leader.prompt_token_ids:
                raise ValueError(f"forks of {leader.request_id!r} must have its prompt ({r.request_id!r} differs)")
        for r in reqs:
            self.add(r)
        for r in reqs[1:]:
            self._fork_leader[r.request_id] = leader

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_pending_outputs(self) -> bool:
        """Final outputs of requests finished outside `update` (aborts) not yet taken."""
        return bool(self._pending_finished)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- schedule -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step += 1
        out = SchedulerOutput(step_id=self._step)
        budget = self.token_budget

        bs = self.blocks.block_size
        running = self.running
        rows, slots = out.rows, out.slots
        add_row, add_slot = rows.append, slots.append
        # Steady decode (the hot path, kept inline): the leading requests that decode a
        # placeholder with KV room each take one token; the row is what add_row would record
        # (one relay token, sampled, past the prompt). The general loop below goes on from
        # the first other request.
        for req in running if len(running) <= budget else running[:budget]:
            computed = req.num_computed_tokens
            ph = req.num_output_placeholders
            n_out = len(req.output_token_ids)
            if not (ph and computed == req.num_prompt_tokens + n_out + ph - 1 and n_out + ph < req.max_output_tokens
                    and (computed < len(req.block_ids) * bs or self._grow_one_block(out, req, computed))):
                break
            req.num_computed_tokens = computed + 1
            req.num_output_placeholders = ph + 1
            add_row(_new_row(ScheduledRow, (req, computed, 1, True, _RELAY_IDS, True)))
            add_slot(req.slot)
        num_fast = i = len(rows)
        budget -= num_fast
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            ph = req.num_output_placeholders
            n_out = len(req.output_token_ids)
            if ph and computed == req.num_prompt_tokens + n_out + ph - 1 and n_out + ph < req.max_output_tokens \
                    and (computed < len(req.block_ids) * bs or self._grow_one_block(out, req, computed)):
                # The same steady decode row, after a request that took the general path.
                req.num_computed_tokens = computed + 1
                req.num_output_placeholders = ph + 1
                add_row(_new_row(ScheduledRow, (req, computed, 1, True, _RELAY_IDS, True)))
                add_slot(req.slot)
                num_fast += 1
                budget -= 1
                i += 1
                continue
            n = self._tokens_to_schedule(req, budget)
            if n == 0:
                i += 1
                continue
            # Find KV room, preempting from the tail: everything after index i is not yet
            # scheduled this step, so a victim never has a row in this step.
            need = self.blocks.blocks_needed(len(req.block_ids), req.num_computed_tokens + n)
            while not self.blocks.can_allocate(need) and self.running[-1] is not req:
                self._preempt(self.running[-1])
                out.num_preempted += 1
            if not self.blocks.can_allocate(need):
                # Every later request is preempted and there is still no room: this one goes
                # too (a lone request always fits: the pool holds max_model_len at start-up).
                if len(self.running) > 1:
                    self._preempt(req)
                    out.num_preempted += 1
                    continue
                i += 1
                continue
            self._add_row(out, req, n, need)
            budget -= n
            i += 1

        out.num_tokens += num_fast
        if self.delay.may_admit(self.waiting, bool(self.running)) and out.num_preempted == 0:
            if self.waiting:  # only an admission can use what is committed now
                for req in self.running:
                    # inline: only rows that completed a block since their last commit
                    if req.num_computed_tokens // bs > req.num_committed_blocks:
                        self._commit_blocks(req)
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if req.num_output_placeholders > 0:
                    break  # preempted with steps in flight: re-admit once their tokens arrived
                hit = self._cached_prefix(req)
                if hit is None:
                    break  # a fork waiting for the prompt blocks its leader is computing
                hit_tokens = len(hit) * bs
                total = req.num_tokens - hit_tokens
                if total > budget and not self.chunked:
                    break
                n = min(total, budget)
                need = self.blocks.blocks_needed(len(hit), hit_tokens + n)
                # Sharing a cached block that nobody holds takes it out of the free count.
                if not self.blocks.can_allocate(need + self.blocks.num_evictable_in(hit)):
                    break
                self.waiting.popleft()
                self._fork_leader.pop(req.request_id, None)
                if req.num_preemptions == 0:
                    self.stats.prompt_tokens_total += req.num_prompt_tokens
                if self.blocks.enable_caching:
                    self.stats.prefix_cache_queried_tokens_total += req.num_tokens
                    self.stats.prefix_cache_hit_tokens_total += hit_tokens
                self.blocks.share(hit)
                req.block_ids = list(hit)
                req.num_computed_tokens = hit_tokens
                req.num_committed_blocks = len(hit)
                req.status = RequestStatus.RUNNING
                req.slot = self.slots.acquire()
                out.new_slots.append(req)
                self.running.append(req)
                self._add_row(out, req, n, need, table_from=0)
                self._commit_blocks(req)  # the next admission may share what this row computes
                budget -= n
            if out.new_slots:
                self.delay.admitted()
        if self._step % bs == 0 and out.rows:  # an empty step is never launched: its table updates would be lost
            self._grow_ahead(out)
        return out

    def _grow_ahead(self, out: SchedulerOutput) -> None:
        """A growth epoch (every block_size steps): each running request takes now the next
        KV block it would otherwise open before the next epoch (decoding one token a step),
        so steady decode rows open their blocks on epoch steps only, and the steps between
        carry no block-table update at all. An update costs the host the same fixed work
        (table pack, upload, scatter) for one row as for hundreds, and with rows spread
        over block phases nearly every step had one.

        At most one block per request is held early, and only a block the request will
        use (below its last possible position). Only free blocks holding no cached KV are
        taken, leaving one per running request, so this never evicts a cached prefix or
        takes the room the next steps' own growth needs; admissions went first."""
        bs = self.blocks.block_size
        spare = self.blocks.num_free_uncached - len(self.running)
        if spare <= 0:
            return
        grow = []
        for req in self.running:
            end = len(req.block_ids) * bs  # the first position without a block
            # end - computed < bs - 1: the request reaches `end` before the next epoch;
            # the last position it may compute KV for is prompt + max outputs - 2 (the
            # last output token is never an input)
            if end - req.num_computed_tokens < bs - 1 and end <= req.num_prompt_tokens + req.max_output_tokens - 2:
                grow.append(req)
                if len(grow) == spare:
                    break
        if not grow:
            return
        # A request already in `grown` this step (admitted, or grown by the general path)
        # keeps its entry: the runner reads block_ids[first:] when it plans the step.
        listed = {id(r) for r, _ in out.grown}
        for req, block in zip(grow, self.blocks.allocate(len(grow))):
            if id(req) not in listed:
                out.grown.append((req, len(req.block_ids)))
            req.block_ids.append(block)

    def _grow_one_block(self, out: SchedulerOutput, req: Request, computed: int) -> bool:
        """A steady decode token that opens the next KV block: take one block if one is free
        (as _add_row would); False leaves the row to the general path, which preempts."""
        blocks = req.block_ids
        if computed != len(blocks) * self.blocks.block_size or not self.blocks.can_allocate(1):
            return False
        out.grown.append((req, len(blocks)))
        blocks.extend(self.blocks.allocate(1))
        return True

    def _tokens_to_schedule(self, req: Request, budget: int) -> int:
        remaining = req.num_tokens_with_placeholders - req.num_computed_tokens
        if remaining <= 0:
            return 0
        if remaining <= budget:
            # This row would sample: skip it when the host already knows the request has all
            # the tokens it may get (no wasted overshoot step for length limits).
            if req.num_generated_with_placeholders >= req.sampling.max_tokens \
                    or req.num_tokens_with_placeholders >= self.max_model_len:
                return 0
            return remaining
        return budget if self.chunked else 0

    def _add_row(self, out: SchedulerOutput, req: Request, n: int, need: int,
                 table_from: Optional[int] = None) -> None:
        """table_from: the first block-table entry the runner must write (0 at admission,
        where shared prefix blocks come first); default: the newly allocated ones."""
        first = len(req.block_ids) if table_from is None else table_from
        if need:
            req.block_ids.extend(self.blocks.allocate(need))
        if len(req.block_ids) > first:
            out.grown.append((req, first))
        start = req.num_computed_tokens
        known = req.num_tokens
        # Prefill: prompt positions, and after a preemption the earlier outputs recomputed
        # (not the decode input at known - 1).
        prefill_end = max(req.num_prompt_tokens, known - 1)
        if start < prefill_end:
            self.stats.prefill_tokens_total += min(start + n, prefill_end) - start
        if start >= known:  # decode of a placeholder: its id is gathered on the device
            ids = _RELAY_IDS
        elif start + n <= req.num_prompt_tokens:
            ids = np.frombuffer(req.prompt_bytes, dtype=np.int64, count=n, offset=8 * start)
        else:
            ids = [req.token_at(p) if p < known else 0 for p in range(start, start + n)]
        first_from_relay = start >= known
        samples = start + n == known + req.num_output_placeholders
        req.num_computed_tokens += n
        if samples:
            req.num_output_placeholders += 1
        out.add_row(ScheduledRow(req, start, n, samples, ids, first_from_relay))

    # ---- prefix cache ---------------------------------------------------------------------
    def _cached_prefix(self, req: Request) -> Optional[list[int]]:
        """Blocks of the longest committed prefix of req's known tokens, leaving at least
        one token to compute (its logits give the next token); None: a fork whose leader is
        still computing the prompt blocks it would share."""
        shareable = (req.num_tokens - 1) // self.blocks.block_size
        hit = self.blocks.longest_hit(self._hashes(req, shareable)) if self.blocks.enable_caching else []
        leader = self._fork_leader.get(req.request_id)
        if leader is not None and leader.status == RequestStatus.RUNNING and len(hit) < shareable:
            if leader.num_committed_blocks < shareable:
                return None
            hit = leader.block_ids[:shareable]
        return hit

    def _hashes(self, req: Request, n: int) -> list[bytes]:
        """The chained hashes of req's first n full blocks (computed once, kept)."""
        hs = req.block_hashes
        have = len(hs)
        if have < n:
            bs = self.blocks.block_size
            a, b, p = have * bs, n * bs, req.num_prompt_tokens
            if b <= p:
                data = req.prompt_bytes[8 * a:8 * b]
            elif a >= p:
                data = int64_bytes(req.output_token_ids[a - p:b - p])
            else:  # the block that straddles the prompt's end
                data = req.prompt_bytes[8 * a:] + int64_bytes(req.output_token_ids[:b - p])
            hs.extend(chain_hashes(hs[-1] if hs else ROOT_HASH, data, bs))
        return hs

    def _commit_blocks(self, req: Request) -> None:
        """Commit req's blocks whose KV is final (see the module docstring)."""
        n = min(req.num_computed_tokens, req.num_tokens) // self.blocks.block_size
        if n <= req.num_committed_blocks:
            return
        if self.blocks.enable_caching:
            hs = self._hashes(req, n)
            for i in range(req.num_committed_blocks, n):
                self.blocks.cache(req.block_ids[i], hs[i])
        req.num_committed_blocks = n

    def _release_blocks(self, req: Request) -> None:
        self._commit_blocks(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.num_committed_blocks = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req)
        self.slots.release(req.slot)
        req.slot = -1
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- results ------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, sampled: Optional[Sequence[int]],
               logprobs: Optional[Sequence] = None) -> list[OutputRow]:
        """Apply one step's sampled tokens (Python ints, one per row, in row order; None when
        the step produced none) and, when the step computed them, their logprobs
        (TokenLogprobs per row); the outputs as rows (request.OUTPUT_FIELDS). Tokens of rows
        whose request has finished meanwhile are discarded: the overshoot of a stop found one
        step late is never streamed."""
        outputs = self._pending_finished
        self._pending_finished = []
        if sampled is None:
            return outputs
        # One pass over the rows, the per-row work inline (this runs for every row of every
        # step): the stop checks read the request's derived stop_ids / max_output_tokens, and
        # a plain request (Request.plain_outputs) skips its sampling parameters altogether.
        finished = RequestStatus.FINISHED
        emit = outputs.append
        num_skipped = 0
        interval = self.stream_interval
        for (req, _, _, samples, _, _), token, lp in zip(sched.rows, sampled,
                                                        logprobs if logprobs is not None else _NO_LOGPROBS):
            if not samples or req.status is finished:
                # a non-final prefill chunk (its sample is meaningless), or a finished request
                num_skipped += 1
                continue
            req.num_output_placeholders -= 1
            out_ids = req.output_token_ids
            out_ids.append(token)
            n_out = len(out_ids)
            if req.plain_outputs:
                stop = token in req.stop_ids
                one_new_token = True
            else:
                sp = req.sampling
                n_lp = sp.logprobs
                if n_lp is not None:
                    req.output_logprobs.append(lp.as_dict(token, n_lp))
                    req.cumulative_logprob += lp.logprob
                stop = n_out >= sp.min_tokens and (token in req.stop_ids or (
                    bool(sp.stop_sequences) and _ends_with_any(out_ids, sp.stop_sequences)))
                one_new_token = n_lp is None
            if stop:
                self._finish(req, FinishReason.STOP, emit=False)
            elif n_out >= req.max_output_tokens:
                self._finish(req, FinishReason.LENGTH, emit=False)
            elif interval > 1 and (n_out - 1) % interval:
                continue  # held: it goes out with the interval's last token (or the request's end)
            elif one_new_token and req.num_streamed == n_out - 1:
                # The common case of _output: exactly this token is new, the request goes on.
                req.num_streamed = n_out
                emit((req.request_id, [token], False, None, req.num_prompt_tokens, n_out, None, None, None, req.index))
                continue
            emit(self._output(req))
        self.stats.generation_tokens_total += len(sched.rows) - num_skipped
        return outputs

    def _output(self, req: Request) -> OutputRow:
        start = req.num_streamed
        new = req.output_token_ids[start:]
        req.num_streamed = len(req.output_token_ids)
        reason = req.finish_reason.value if req.is_finished else None
        logprobs, cumulative = None, None
        if req.sampling.logprobs is not None:
            logprobs, cumulative = req.output_logprobs[start:], req.cumulative_logprob
        return (req.request_id, new, req.is_finished, reason, req.num_prompt_tokens, len(req.output_token_ids),
                None, logprobs, cumulative, req.index)

    def _finish(self, req: Request, reason: FinishReason, emit: bool = True) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.block_ids:
            self._release_blocks(req)
        self._fork_leader.pop(req.request_id, None)
        if req.slot >= 0:
            self.slots.release(req.slot)
            req.slot = -1
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        if emit:
            self._pending_finished.append(self._output(req))

    def take_finished(self) -> list[OutputRow]:
        outs, self._pending_finished = self._pending_finished, []
        return outs


_NO_LOGPROBS = itertools.repeat(None)   # update's logprobs when the step computed none


def _ends_with_any(tokens: list[int], sequences: list[list[int]]) -> bool:
    """True when the generated tokens end with one of the stop sequences (checked after each
    new token, so a sequence is found on the step that completes it)."""
    for seq in sequences:
        n = len(seq)
        if n <= len(tokens) and tokens[-1] == seq[-1] and tokens[-n:] == list(seq):
            return True
    return False
