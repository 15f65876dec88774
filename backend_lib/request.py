"""Requests, sampling parameters, outputs and finish reasons: the typed seam between the
Triton glue, the engine thread and the scheduler."""
from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .config import is_number
from .int64_pack import int64_bytes

# The engine-wide top-K of logprobs every step computes (layers/logprobs.py packs them); a
# request asks for at most this many.
MAX_LOGPROBS = 20

MAX_N = 16  # SamplingParams.n


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS or a stop token id
    LENGTH = "length"    # max_tokens or max_model_len reached
    ABORT = "abort"      # cancelled by the client, or the engine shut down
    ERROR = "error"      # the engine failed while the request was in flight

    def __str__(self) -> str:  # "stop", not "FinishReason.STOP"
        return self.value


# Multi-token stop sequences are matched on the host (Scheduler.update), so their limits are
# independent of the device-side stop-id table (EngineConfig.max_stop_token_ids).
MAX_STOP_SEQUENCES = 256
MAX_STOP_SEQUENCE_LEN = 64


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# vLLM's rule (sampling_params._SAMPLING_EPS): a temperature below this samples greedily;
# dividing logits by it would overflow.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1            # -1 (or 0): no top-k
    top_p: float = 1.0
    seed: Optional[int] = None  # reproducible per request; None: drawn from the engine seed
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    bad_token_ids: list[int] = field(default_factory=list)  # never sampled
    # token sequences that end the request once generated in full (TensorRT-LLM's stop words);
    # the stop sequence's tokens stay in the output, finish reason "stop"
    stop_sequences: list[list[int]] = field(default_factory=list)
    # vLLM's semantics: repetition over prompt + output tokens (HF's formula), presence and
    # frequency over output tokens (OpenAI's).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0          # keep tokens with prob >= min_p * the top prob
    logprobs: Optional[int] = None  # None: none; N: the sampled token's plus the top-N raw logprobs
    n: int = 1                  # parallel samples of one prompt (derived seeds, own index each)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, max_model_len: int, vocab_size: int, max_stop_ids: int) -> None:
        """Raise ValueError naming the field and its limit."""
        def fail(name: str, limit: str) -> None:
            raise ValueError(f"{name} must be {limit} (got {getattr(self, name)!r})")

        if not _is_int(self.max_tokens) or not (1 <= self.max_tokens <= max_model_len):
            fail("max_tokens", f"an integer in [1, {max_model_len}] (max_model_len)")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            fail("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.temperature, (int, float)) or not (self.temperature >= 0.0) \
                or self.temperature != self.temperature:
            fail("temperature", ">= 0")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "-1 (disabled), 0 (disabled) or a positive integer")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            fail("top_p", "in (0, 1]")
        if not is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            fail("min_p", "in [0, 1]")
        if not is_number(self.repetition_penalty) or not (0.0 < self.repetition_penalty < math.inf):
            fail("repetition_penalty", "a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_number(getattr(self, name)) or not (-2.0 <= getattr(self, name) <= 2.0):
                fail(name, "in [-2, 2] (0 = off)")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not (0 <= self.logprobs <= MAX_LOGPROBS)):
            fail("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            fail("n", f"an integer in [1, {MAX_N}]")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**63)):
            fail("seed", "an integer in [0, 2**63)")
        for name in ("stop_token_ids", "bad_token_ids"):
            ids = getattr(self, name)
            if any(not _is_int(t) or not (0 <= t < vocab_size) for t in ids):
                raise ValueError(f"{name} must hold token ids in [0, {vocab_size}) (got {list(ids)!r})")
        if len(self.stop_token_ids) > max_stop_ids:
            raise ValueError(f"stop_token_ids may hold at most {max_stop_ids} ids (got {len(self.stop_token_ids)})")
        if len(self.bad_token_ids) > max_stop_ids:
            raise ValueError(f"bad_token_ids may hold at most {max_stop_ids} ids (got {len(self.bad_token_ids)})")
        if len(self.stop_sequences) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop_sequences may hold at most {MAX_STOP_SEQUENCES} sequences "
                             f"(got {len(self.stop_sequences)})")
        for seq in self.stop_sequences:
            if not isinstance(seq, (list, tuple)) or not (1 <= len(seq) <= MAX_STOP_SEQUENCE_LEN) \
                    or any(not _is_int(t) or not (0 <= t < vocab_size) for t in seq):
                raise ValueError(f"stop_sequences must hold sequences of 1 to {MAX_STOP_SEQUENCE_LEN} "
                                 f"token ids in [0, {vocab_size}) (got {seq!r})")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_request_counter = itertools.count()


@dataclass(eq=False, slots=True)
class Request:
    """Engine-side state of one request. The scheduler owns the counters; the runner never
    mutates them. Equality is identity (eq=False): a request is one entity, and the scheduler's
    list removals compared every field of every request before it (~60 µs at 256 rows).
    Slots: the scheduler's and update's per-row loops read and write a handful of fields of
    every running request each step, and a slot is cheaper to reach than an instance dict
    entry; no one sets other attributes on a request or pickles one.

    num_computed_tokens counts tokens whose KV has been *scheduled* (steps in flight
    included). num_output_placeholders counts decode tokens sampled on the device whose
    values the host has not seen yet: the async path's honest bookkeeping (seed 001).
    """
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = field(default_factory=lambda: next(_request_counter))
    arrival_time: float = 0.0      # the scheduler's clock when it took the request (admission delay)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    slot: int = -1                 # row in the persistent device tables, -1 when none
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    effective_seed: int = 0
    num_streamed: int = 0          # output tokens already handed to the client
    # Prefix caching (the scheduler's): chained hashes of the request's full blocks of known
    # tokens, and how many leading blocks of block_ids hold final KV (cached or shareable).
    block_hashes: list[bytes] = field(default_factory=list)
    num_committed_blocks: int = 0
    # Parallel sampling (n > 1): the client-visible request id and this sequence's index.
    parent_id: Optional[str] = None
    index: int = 0
    output_logprobs: list[dict[int, float]] = field(default_factory=list)  # when sampling.logprobs is set
    cumulative_logprob: float = 0.0

    num_prompt_tokens: int = field(init=False, default=0)
    # Derived once, read per step: the ids that end the request (EOS unless ignore_eos, plus
    # stop_token_ids), and the most outputs it may get (the scheduler also applies max_model_len).
    stop_ids: frozenset = field(init=False, default=frozenset(), repr=False)
    max_output_tokens: int = field(init=False, default=0)
    # No min_tokens, stop sequences or logprobs: a new token needs only the stop-id lookup
    # and the length check (Scheduler.update's short path; most requests).
    plain_outputs: bool = field(init=False, default=True)
    # The prompt's ids as native int64 bytes, converted once: block hashing and the mixed
    # packing slice it instead of converting Python ints block by block.
    prompt_bytes: bytes = field(init=False, default=b"", repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.prompt_bytes = int64_bytes(self.prompt_token_ids)
        sp = self.sampling
        self.stop_ids = frozenset(sp.stop_token_ids) | frozenset(() if sp.ignore_eos else self.eos_token_ids)
        self.max_output_tokens = sp.max_tokens
        self.plain_outputs = sp.min_tokens == 0 and not sp.stop_sequences and sp.logprobs is None

    @property
    def num_tokens(self) -> int:
        """Tokens the host knows (prompt + confirmed outputs)."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_generated_with_placeholders(self) -> int:
        return len(self.output_token_ids) + self.num_output_placeholders

    def token_at(self, index: int) -> int:
        p = self.num_prompt_tokens
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one engine step produced for one request: only the NEW tokens."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[FinishReason] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0      # total generated so far
    error: Optional[str] = None
    # One dict per new token (the sampled id plus the top-N: raw logprobs), when requested.
    new_logprobs: Optional[list[dict[int, float]]] = None
    cumulative_logprob: Optional[float] = None   # of the whole sequence so far, when requested
    # n > 1: which sequence these tokens belong to. `finish_reason` is that sequence's;
    # `finished` is True once, on the last output of the whole request.
    index: int = 0


# A RequestOutput's row form: a plain tuple in OUTPUT_FIELDS order, the finish reason as its
# string value. The engine makes one per running request per step, so it makes rows (a tuple
# costs the host ~0.1 µs, the dataclass ~0.4 and its pickle several times a tuple's); they
# cross the engine process's socket as they are, and RequestOutput is built only for callers.
OUTPUT_FIELDS = ("request_id", "new_token_ids", "finished", "finish_reason", "num_prompt_tokens",
                 "num_output_tokens", "error", "new_logprobs", "cumulative_logprob", "index")
OutputRow = tuple


def output_row(o: RequestOutput) -> OutputRow:
    reason = o.finish_reason.value if o.finish_reason is not None else None
    return (o.request_id, o.new_token_ids, o.finished, reason, o.num_prompt_tokens, o.num_output_tokens,
            o.error, o.new_logprobs, o.cumulative_logprob, o.index)


def final_row(request_id: str, reason: "FinishReason", error: Optional[str] = None) -> OutputRow:
    """The last output of a request that ends without new tokens (an error, an abort)."""
    return (request_id, [], True, reason.value, 0, 0, error, None, None, 0)


_REASONS = {r.value: r for r in FinishReason}


def output_of_row(t: OutputRow) -> RequestOutput:
    rid, toks, finished, reason, n_prompt, n_out, error, lps, cum, index = t
    return RequestOutput(rid, toks, finished, _REASONS[reason] if reason is not None else None,
                         n_prompt, n_out, error, lps, cum, index)


@dataclass
class CompletionOutput:
    """The whole result of one request (LLMEngine.generate)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: Optional[str]
    logprobs: Optional[list[dict[int, float]]] = None  # per token, when requested
    cumulative_logprob: Optional[float] = None
    index: int = 0                                     # n > 1: the sequence's index


def validate_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> list[int]:
    ids = list(prompt_token_ids)
    if len(ids) == 0:
        raise ValueError("prompt must not be empty (input_ids has 0 tokens)")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than max_model_len={max_model_len}")
    # The common case in C (the engine core checks every arriving prompt on its step loop's
    # thread: 256 ids in ~15 µs instead of ~27); the loop finds the first bad id for the message.
    if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    for t in ids:
        if not _is_int(t) or not (0 <= t < vocab_size):
            raise ValueError(f"input_ids must be token ids in [0, {vocab_size}) (vocab size); got {t!r}")
    return ids


def validate_request(prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int,
                     vocab_size: int, max_stop_ids: int) -> list[int]:
    """Every check of one request against an engine's limits (ValueError names the field);
    the prompt as a list. The engine and its out-of-process client share it, so their
    messages are the same."""
    ids = validate_prompt(prompt_token_ids, max_model_len, vocab_size)
    params.validate(max_model_len, vocab_size, max_stop_ids)
    return ids
