"""Shared helpers of the engine tests (tests/engine): engines, HF references, a step driver.

Everything here is deterministic (seeded) and CPU-only.
"""
from __future__ import annotations

import contextlib
import functools
import random
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from backend_lib import EngineConfig, LLMEngine, SamplingParams
from backend_lib.layers.attention import AttentionMetadata

EOS = 2          # tiny models' </s> (scripts/make_model.py)
LOW_ID = 4       # first non-special id: random prompts use [LOW_ID, vocab)


def make_engine(path, **kw) -> LLMEngine:
    # 400 blocks of 16 tokens: plenty for these tests, and cheap to allocate (the CPU default
    # pool is 2048 blocks); tests that want preemption pass a small num_kv_blocks.
    base = dict(model_path=str(path), device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=400)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def process_alive(pid: int) -> bool:
    """pid is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def random_prompt(rng: random.Random, n: int, vocab: int = 768) -> list[int]:
    return [rng.randrange(LOW_ID, vocab) for _ in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


# ---- HF references -------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=256)
def _hf_generate_cached(path: str, prompt: tuple, max_new: int, stop_at_eos: bool, min_new: int):
    m = hf_model(path)
    kw = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=3)
    if stop_at_eos:
        kw["eos_token_id"] = EOS
        if min_new:
            kw["min_new_tokens"] = min_new
    else:
        kw["eos_token_id"] = None
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        # An explicit mask: generate() would infer one from pad_token_id and mask out every
        # prompt token equal to it (a multi-turn prompt holds model outputs, any id).
        out = m.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, len(prompt):].tolist()
    if stop_at_eos and EOS in out:  # HF pads after EOS (only in batches; be safe)
        out = out[:out.index(EOS) + 1]
    return tuple(out)


def hf_greedy(path, prompt: Sequence[int], max_new: int, stop_at_eos: bool = False,
              min_new: int = 0) -> list[int]:
    """HF `generate(do_sample=False)` for one unpadded prompt (cached)."""
    return list(_hf_generate_cached(str(path), tuple(prompt), max_new, stop_at_eos, min_new))


# ---- model forward with our paged KV (prefill logits) ----------------------------------------

def forward_logits(eng, seqs, starts=None):
    """Run our model on `seqs` (each [token ids], continuing at `starts[i]` with the KV of the
    earlier positions already in the cache) in ONE varlen batch; returns per-sequence logits of
    every new position. Uses the engine's model and KV cache with a block table built here."""
    runner = eng.runner
    bs = runner.block_size
    starts = starts or [0] * len(seqs)
    ids, pos, slots, seq_lens, q_lens, tables = [], [], [], [], [], []
    next_block = 1  # block 0 is the null block
    width = runner.max_blocks_per_seq
    for s, st in zip(seqs, starts):
        total = st + len(s)
        nblk = (total + bs - 1) // bs
        blocks = list(range(next_block, next_block + nblk))
        next_block += nblk
        tables.append(blocks + [0] * (width - nblk))
        ids.extend(s)
        pos.extend(range(st, total))
        slots.extend(blocks[p // bs] * bs + p % bs for p in range(st, total))
        seq_lens.append(total)
        q_lens.append(len(s))
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32),
                             max(q_lens), all(q == 1 for q in q_lens), seq_lens, q_lens)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.tensor(pos), runner.kv_caches, meta)
        logits = runner.model.compute_logits(hidden)
    return list(logits.split(q_lens))


def hf_logits(path, prompt):
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([prompt])).logits[0].float()


# ---- a step driver with staggered arrivals and aborts -----------------------------------------

@dataclass
class Spec:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0                 # step index at which the request is added
    abort_at: Optional[int] = None   # step index at which it is aborted (if still unfinished)
    # Abort once the request is computing: 0 = as soon as part of its prompt is computed
    # (mid-prefill when chunked), k > 0 = once k output tokens were received (decoding; in
    # async mode a step is then in flight for it).
    abort_after_tokens: Optional[int] = None


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_outputs: int = 0
    logprobs: list = field(default_factory=list)   # one dict per token, for requests that ask


@dataclass
class RunInfo:
    results: dict
    steps: int
    launched_with_inflight: int      # steps launched while an earlier step was still unread
    launched: int
    stats: object = None
    aborts_with_inflight: int = 0    # aborts of requests that had a step in flight (placeholders)


def run_specs(engine: LLMEngine, specs: Sequence[Spec], order_rng: Optional[random.Random] = None,
              on_step: Optional[Callable[[LLMEngine, int], None]] = None, max_steps: int = 200000) -> RunInfo:
    """Drive `engine` step by step: add each spec at its arrival step, abort at abort_at
    (aborts of one step in scrambled order), collect outputs. Checks the streaming contract
    on the way: nothing after a finished output, num_output_tokens consistent."""
    by_arrival: dict[int, list[Spec]] = {}
    by_abort: dict[int, list[str]] = {}
    for s in specs:
        by_arrival.setdefault(s.arrival, []).append(s)
        if s.abort_at is not None:
            by_abort.setdefault(s.abort_at, []).append(s.rid)
    results = {s.rid: Result() for s in specs}
    watch = {s.rid: s.abort_after_tokens for s in specs if s.abort_after_tokens is not None}
    last_arrival = max(by_arrival) if by_arrival else 0

    launched = [0, 0]
    aborts_inflight = 0
    orig_execute = engine.runner.execute

    def counting_execute(sched, eos):
        launched[0] += 1
        if engine._inflight:
            launched[1] += 1
        return orig_execute(sched, eos)

    engine.runner.execute = counting_execute
    try:
        step = 0
        while step <= last_arrival or engine.has_unfinished() or engine.scheduler._pending_finished:
            assert step < max_steps, "engine made no progress"
            for s in by_arrival.get(step, []):
                engine.add_request(s.rid, s.prompt, s.params)
            aborts = list(by_abort.get(step, []))
            for rid, k in list(watch.items()):
                req = engine.scheduler.requests.get(rid)
                if results[rid].finish_reason is not None:
                    del watch[rid]
                elif req is not None and ((k == 0 and req.num_computed_tokens > 0) or
                                          (k > 0 and len(results[rid].tokens) >= k)):
                    aborts.append(rid)
                    del watch[rid]
            if order_rng is not None:
                aborts.sort()
                order_rng.shuffle(aborts)
            for rid in aborts:
                req = engine.scheduler.requests.get(rid)
                if req is not None and req.num_output_placeholders > 0:
                    aborts_inflight += 1
                engine.abort(rid)
            for out in engine.step():
                r = results[out.request_id]
                assert r.finish_reason is None, f"{out.request_id}: output after the final one"
                r.tokens.extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    assert len(out.new_logprobs) == len(out.new_token_ids)
                    r.logprobs.extend(out.new_logprobs)
                r.num_outputs += 1
                assert out.num_output_tokens == len(r.tokens), (out, len(r.tokens))
                if out.finished:
                    assert out.finish_reason is not None
                    r.finish_reason = str(out.finish_reason)
                else:
                    assert out.finish_reason is None
            if on_step is not None:
                on_step(engine, step)
            step += 1
    finally:
        engine.runner.execute = orig_execute
    return RunInfo(results, step, launched[1], launched[0], engine.stats(), aborts_inflight)


def expected_from_reference(ref: Sequence[int], params: SamplingParams, eos_ids=(EOS,)) -> tuple[list[int], str]:
    """Greedy output of a request from the ignore_eos reference continuation `ref` (at least
    max_tokens long): cut at the first EOS / stop id at or after min_tokens."""
    out = []
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    if stops & set(ref[:params.min_tokens]):
        raise ValueError("min_tokens masks a stop id the reference emits: the reference does not apply")
    for i, t in enumerate(ref[:params.max_tokens]):
        out.append(t)
        if len(out) > params.min_tokens and ((not params.ignore_eos and t in eos_ids) or t in params.stop_token_ids):
            return out, "stop"
    assert len(out) == params.max_tokens, "reference too short"
    return out, "length"


def preempt_when_scheduling_output(eng, request_id: str, n_outputs: int) -> list:
    """Make the scheduler preempt `request_id` once, when its n-th output (placeholders
    included) is about to be scheduled. Returns a list that gets (outputs, placeholders) of
    the request at that moment appended (empty: it never happened)."""
    sched = eng.scheduler
    orig_schedule = sched.schedule
    forced = []

    def schedule():
        r = sched.requests.get(request_id)
        if not forced and r is not None and r in sched.running \
                and len(r.output_token_ids) + r.num_output_placeholders == n_outputs:
            sched._preempt(r)
            forced.append((len(r.output_token_ids), r.num_output_placeholders))
        return orig_schedule()

    sched.schedule = schedule
    return forced


def set_env(monkeypatch, name: str, raw) -> None:
    """An environment switch as a user leaves it: unset (raw None) or set to raw."""
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)


class CallbackLog:
    """What a client's delivery threads handed each request's callback: its outputs in order,
    the threads that ran the callbacks, and every request whose callbacks overlapped (two at
    once for one request would reorder its tokens)."""

    def __init__(self):
        self.calls: dict[str, list] = {}
        self.threads: set[str] = set()
        self.overlaps: list[str] = []
        self._running: set[str] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def entered(self, out):
        """Record `out` for the callback's duration (the body is the callback's own work)."""
        with self._lock:
            self.calls.setdefault(out.request_id, []).append(out)
            self.threads.add(threading.current_thread().name)
            if out.request_id in self._running:
                self.overlaps.append(out.request_id)
            self._running.add(out.request_id)
        try:
            yield
        finally:
            with self._lock:
                self._running.discard(out.request_id)

    def all_finished(self, n_requests: int) -> bool:
        return len(self.calls) == n_requests and all(c[-1].finished for c in self.calls.values())

    def streams_match(self, ref: Sequence[tuple[list[int], str]]) -> list[list]:
        """Request r{i}'s callbacks carried ref[i]'s tokens in order, one final output last
        with ref[i]'s finish reason; gives each request's outputs."""
        streams = []
        for i, (toks, reason) in enumerate(ref):
            outs = self.calls[f"r{i}"]
            assert [t for o in outs for t in o.new_token_ids] == toks, i
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], i
            assert str(outs[-1].finish_reason) == reason and outs[-1].num_output_tokens == len(toks), i
            streams.append(outs)
        return streams
