"""Repetition / presence / frequency penalties with vLLM's semantics, and their per-slot
device state.

    seen = token in the prompt or the output so far
    logit = seen ? (logit > 0 ? logit / repetition : logit * repetition) : logit   (HF's formula)
    logit -= frequency * output_count + presence * (output_count > 0)            (OpenAI's)

State per slot, on the device: the three parameters (rows of the runner's admission floats,
written by its one admission scatter), the prompt's token set and the output token counts.
Each sampled token is counted inside the step, right after it is sampled: token n counts
before token n+1 is sampled, whatever the steps in flight. The set and the counts are reset
and filled from the host (prompt + the outputs a preempted request already has) only when a
request WITH penalties is admitted: a row with neutral parameters (1, 0, 0) never reads them
(the kernels skip it, the reference leaves it bit-identical), so what an earlier owner of the
slot left there is harmless, and an admission without penalties costs no reset. A stop
overshoot (a token sampled for a request already finished) lands in a slot that its next
penalized owner's admission resets first (same stream), so it never counts.
"""
from __future__ import annotations

import torch


class PenaltyState:
    def __init__(self, params: torch.Tensor, vocab: int):
        """params [3, num_slots] float32 (repetition, presence, frequency; neutral where no
        request with penalties was admitted), owned and written by the caller; num_slots
        includes the runner's scratch slot (the last row)."""
        num_slots, device = params.shape[1], params.device
        self.vocab = vocab
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)
        self.repetition, self.presence, self.frequency = params.unbind(0)  # contiguous rows

    def reset(self, slots: torch.Tensor) -> None:
        """slots [R] int64: slots just given to requests with penalties (their history follows)."""
        # index_fill_ takes the value as a kernel argument; `t[slots] = 0` copies a host
        # scalar tensor to the device, a pageable copy that synchronizes the stream (measured:
        # every admission step blocked the host until the GPU drained).
        self.counts.index_fill_(0, slots, 0)
        self.prompt_mask.index_fill_(0, slots, False)

    def load_history(self, hist: torch.Tensor) -> None:
        """hist [3, H] int64 (slot, token, is_output): the prompt tokens and the outputs a
        request had before this admission (after a preemption)."""
        slot, tok, is_out = hist[0], hist[1], hist[2] > 0
        # Output entries set their bit in the scratch row (never read with penalties on):
        # every write is then True, so duplicates don't race.
        scratch = torch.full_like(slot, self.counts.shape[0] - 1)
        # A device True (not a Python scalar, whose copy to the device would sync the stream).
        self.prompt_mask.index_put_((torch.where(is_out, scratch, slot), tok),
                                    torch.ones((), dtype=torch.bool, device=slot.device))
        self.counts.view(-1).scatter_add_(0, slot * self.vocab + tok, is_out.to(torch.int32))

    def count_sampled(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """In the step, right after sampling: slots [S] (scratch slot for rows that don't
        sample), tokens [S]."""
        # scatter_add on the flat table: plain atomics, capturable in a CUDA graph.
        flat = slots * self.vocab + tokens
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def upcast_apply(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """float32 copy of model-dtype logits [S, V] with each row's penalties applied, in one
        pass (Triton kernels on CUDA; `native_logits_ok` says when)."""
        from . import sampling_kernels
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        return sampling_kernels.apply_penalties_kernel(
            logits, slots, self.counts, self.prompt_mask, self.repetition, self.presence,
            self.frequency, out=out)

    def upcast_apply_sparse(self, logits: torch.Tensor, slots: torch.Tensor, st) -> tuple[torch.Tensor, torch.Tensor]:
        """upcast_apply for the rows something writes into (penalties, banned ids, min_tokens
        stop ids; `st` the step's SamplingTensors): (float32 [S, V] holding those rows, written
        [S] int32, 1 for them). The other rows are not copied: the split sampler reads them
        from `logits` (sampler.sample's clean_rows)."""
        from . import sampling_kernels
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        written = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
        sampling_kernels.apply_penalties_kernel(
            logits, slots, self.counts, self.prompt_mask, self.repetition, self.presence,
            self.frequency, out=out, sparse_for=st, written=written)
        return out, written

    def apply_(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """In place on logits [S, V] (rows gather their slot's state)."""
        if logits.device.type == "cuda":
            from . import sampling_kernels
            if sampling_kernels.available():
                return sampling_kernels.apply_penalties_kernel(
                    logits, slots, self.counts, self.prompt_mask, self.repetition, self.presence,
                    self.frequency)
        counts = self.counts[slots]
        apply_penalties_reference(logits, counts, self.prompt_mask[slots], self.repetition[slots],
                                  self.presence[slots], self.frequency[slots])
        return logits


def apply_penalties_reference(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                              repetition: torch.Tensor, presence: torch.Tensor,
                              frequency: torch.Tensor) -> torch.Tensor:
    """The definition, in place: logits [S, V], output_counts [S, V] int, prompt_mask [S, V]
    bool, per-row penalties [S]. Neutral values leave a row bit-identical."""
    seen = prompt_mask | (output_counts > 0)
    rp = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rp, logits * rp)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency.unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits
