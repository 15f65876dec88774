"""LLMEngine (the step loop) and AsyncEngine (the loop on a background thread, streaming
each request's tokens and aborting by id).

The overlapped step (async token handoff) launches step n+1 before the host waits for step
n's tokens; step n+1's input ids come from the relay buffer on the device:

    schedule(n+1) -> launch(n+1) -> wait(n) -> update(n)

The synchronous step is the same loop with zero steps in flight. Who launches a step
(the engine thread, or the submission thread from a plan built here) is submission.py's.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import random
import time
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Sequence

import torch

from . import envs
from .admission_delay import AdmissionDelay
from .config import EngineConfig, resolve_async_handoff
from .engine_stats import EngineStats
from .kv_cache import BlockPool
from .model_runner import ModelRunner
from .models.loader import load_hf_config
from .request import (CompletionOutput, OutputRow, Request, RequestOutput, SamplingParams, output_of_row,
                      validate_request)
from .scheduler import Scheduler, SchedulerOutput
from .submission import make_submission

logger = logging.getLogger("backend_lib")
logger.setLevel(envs.log_level())

_CPU_DEFAULT_KV_BLOCKS = 2048


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = cfg = config
        self.decision = resolve_async_handoff(cfg)
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device: 'cuda' requested but CUDA is not available")
        hf = load_hf_config(cfg.model_path)
        self.max_model_len = cfg.context_window(hf)
        if self.max_model_len > hf.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len: {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={hf.max_position_embeddings}")
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must fit one step's budget; a longer one would wait forever.
            raise ValueError(f"EngineConfig.max_num_batched_tokens: {cfg.max_num_batched_tokens} is smaller than "
                             f"max_model_len={self.max_model_len}; with enable_chunked_prefill=false every prompt "
                             f"must fit one step (raise it, lower max_model_len, or enable chunked prefill)")
        self.eos_token_ids = _eos_ids(cfg.model_path, hf)
        num_blocks = self._num_kv_blocks(hf)
        min_blocks = (self.max_model_len + cfg.block_size - 1) // cfg.block_size + 1
        if num_blocks < min_blocks:
            raise ValueError(f"EngineConfig.num_kv_blocks: {num_blocks} blocks cannot hold one sequence of "
                             f"max_model_len={self.max_model_len} (need >= {min_blocks})")
        if cfg.pipeline_parallel_size > 1:
            from .pipeline import PipelineExecutor  # stage 0 here, the other stages in worker processes
            self.runner = PipelineExecutor(cfg, hf, self.decision, num_blocks, self.max_model_len)
        else:
            self.runner = ModelRunner(cfg, hf, self.decision, num_blocks, self.max_model_len)
        self.vocab_size = self.runner.vocab_size
        self.scheduler = Scheduler(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len,
                                   cfg.enable_chunked_prefill,
                                   BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching),
                                   AdmissionDelay(cfg.scheduler_delay_factor), cfg.stream_interval)
        self.async_enabled = self.decision.enabled
        self.submission = make_submission(cfg.step_submission, self.runner, self.eos_token_ids)
        # Stops a submission thread also when the engine is dropped without close().
        self._close_submission = weakref.finalize(self, self.submission.close)
        # (step, ticket): submission.launched(ticket) is the step's StepHandle.
        self._inflight: deque[tuple[SchedulerOutput, object]] = deque()
        # Steps launched but unread: step_lookahead (1: n+1 launches before n is read; 2: n+2
        # too, so a slow host step never leaves the device without queued work); pipeline
        # parallel, up to one per stage.
        self._max_inflight = max(cfg.step_lookahead, cfg.pipeline_parallel_size) if self.async_enabled else 0
        self._seed_rng = random.Random(cfg.seed)
        self._parents: dict[str, _Parent] = {}
        self._async_steps = 0
        self._sync_steps = 0
        self._prefill_steps = 0
        self._step_s = 0.0
        self._wait_s = 0.0
        # Where the host part of step() goes (EngineStats.schedule_time_s ...): wall time per
        # phase, and the thread's CPU time outside the waits (host wall time - host CPU time =
        # time the thread could not run: the GIL held by another thread, or descheduled).
        self._schedule_s = self._submit_s = self._update_s = self._host_cpu_s = 0.0
        # The heap is at its largest and longest-lived now (torch, transformers, the model):
        # move it out of the cyclic collector's view, so that the step loop's short-lived
        # garbage never triggers a full collection that walks all of it (measured on CPU at
        # batch 256: 186 ms pauses without this, 2 ms max with it).
        gc.collect()
        gc.freeze()
        logger.info("engine ready: async_token_handoff=%s (%s)", self.async_enabled,
                    "; ".join(self.decision.reasons) or "all requirements met")

    def _num_kv_blocks(self, hf) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            if cfg.device != "cpu":
                _check_kv_fits(cfg, hf, cfg.num_kv_blocks)
            return cfg.num_kv_blocks
        per_seq = (self.max_model_len + cfg.block_size - 1) // cfg.block_size
        if cfg.device == "cpu":
            return max(per_seq + 1, min(_CPU_DEFAULT_KV_BLOCKS, per_seq * cfg.max_num_seqs + 1))
        return _cuda_kv_blocks(cfg, hf)

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The request checks against this engine's limits (ValueError names the field);
        returns the prompt as a list."""
        return validate_request(prompt_token_ids, params, self.max_model_len, self.vocab_size,
                                self.config.max_stop_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        ids = self.validate(prompt_token_ids, params)
        if not isinstance(request_id, str) or "\x00" in request_id:
            # the ids of n > 1 sequences are the client's id + _CHILD_SEP + index
            raise ValueError(f"request_id {request_id!r}: must be a string without NUL characters")
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n == 1:
            self.scheduler.add(self._request(request_id, ids, params, params.seed))
            return
        # Parallel sampling: n sequences, each its own request in the scheduler, seeds
        # seed + index as vLLM derives them; the scheduler's forks share the prompt's blocks.
        child = replace(params, n=1)
        children = [self._request(_child_id(request_id, i), ids, child,
                                  None if params.seed is None else (params.seed + i) % 2**63,
                                  parent_id=request_id, index=i) for i in range(params.n)]
        for c in children:
            if c.request_id in self.scheduler.requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
        self.scheduler.add_forks(children)
        self._parents[request_id] = _Parent([c.request_id for c in children], params.n)

    def _request(self, request_id: str, ids: list[int], params: SamplingParams, seed: Optional[int],
                 parent_id: Optional[str] = None, index: int = 0) -> Request:
        if seed is None:
            seed = self._seed_rng.getrandbits(63)
        return Request(request_id, ids, params, eos_token_ids=self.eos_token_ids, effective_seed=seed,
                       parent_id=parent_id, index=index)

    def abort(self, request_id: str) -> bool:
        parent = self._parents.get(request_id)
        if parent is None:
            return self.scheduler.abort(request_id)
        aborted = [self.scheduler.abort(c) for c in parent.child_ids]
        return any(aborted)

    def _to_parents(self, rows: list[OutputRow]) -> list[OutputRow]:
        """n > 1: child outputs under the client's request id; `finished` only on the last."""
        if not self._parents:
            return rows
        for i, row in enumerate(rows):
            rid, toks, finished, *rest = row
            child = _parent_of(rid)
            if child is None:
                continue
            parent_id, _ = child
            parent = self._parents.get(parent_id)
            if parent is None:
                continue
            if finished:
                parent.remaining -= 1
                finished = parent.remaining == 0
                if finished:
                    del self._parents[parent_id]
            rows[i] = (parent_id, toks, finished, *rest)
        return rows

    def has_unfinished(self) -> bool:
        # Pending finished outputs (e.g. the "abort" final of a request aborted between steps)
        # count: the next step() delivers them.
        return self.scheduler.has_unfinished() or bool(self._inflight) or self.scheduler.has_pending_outputs

    # ---- the step loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: what it produced, one RequestOutput per request."""
        return [output_of_row(row) for row in self.step_rows()]

    def step_rows(self) -> list[OutputRow]:
        """step() with its outputs as rows (request.OUTPUT_FIELDS), as the engine loops use it."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        self._schedule_s += t1 - t0
        if not sched.is_empty:
            self._inflight.append((sched, self.submission.submit(sched)))
            self._submit_s += time.perf_counter() - t1
            if self.async_enabled:
                self._async_steps += 1
            else:
                self._sync_steps += 1
            if not sched.is_decode_only:
                self._prefill_steps += 1
        elif not self._inflight:
            self.runner.handoff.reset_gap_chain()
        outputs = self.scheduler.take_finished()
        # Keep at most _max_inflight steps launched but unread; if nothing new was scheduled,
        # drain one so the loop always makes progress.
        while self._inflight and (len(self._inflight) > self._max_inflight or sched.is_empty):
            done_sched, ticket = self._inflight.popleft()
            w0, wait_cpu0 = time.perf_counter(), time.thread_time()
            handle = self.submission.launched(ticket)
            tokens = handle.get()
            w1 = time.perf_counter()
            self._wait_s += w1 - w0
            cpu0 += time.thread_time() - wait_cpu0  # a spinning wait's CPU is not host work
            self.runner.handoff.collect_gap(handle)
            outputs.extend(self.scheduler.update(done_sched, tokens, handle.logprobs(self.vocab_size)))
            self._update_s += time.perf_counter() - w1
            if sched.is_empty:
                break
        self._step_s += time.perf_counter() - t0
        self._host_cpu_s += time.thread_time() - cpu0
        return self._to_parents(outputs)

    def generate(self, prompts: Iterable[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[CompletionOutput]:
        prompts = [list(p) for p in prompts]
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        # Validate everything before adding anything: a bad prompt must not leave the ones
        # before it running in the engine with nobody collecting their outputs.
        for p, sp in zip(prompts, plist):
            self.validate(p, sp)
        base = f"gen-{os.getpid()}-{id(prompts)}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, plist):
            self.add_request(rid, p, sp)
        results = {(rid, i): CompletionOutput(rid, p, [], None, [] if sp.logprobs is not None else None,
                                              None, i)
                   for rid, p, sp in zip(ids, prompts, plist) for i in range(sp.n)}
        while self.has_unfinished():
            for out in self.step():
                res = results.get((out.request_id, out.index))
                if res is None:
                    continue
                res.token_ids.extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    res.logprobs.extend(out.new_logprobs)
                    res.cumulative_logprob = out.cumulative_logprob
                if out.finish_reason is not None:
                    res.finish_reason = str(out.finish_reason)
        return [results[(r, i)] for r, sp in zip(ids, plist) for i in range(sp.n)]

    def close(self) -> None:
        """Stop the submission thread and what the runner owns outside this process
        (pipeline stages); idempotent."""
        self._close_submission()
        if self.submission.is_alive():   # a launch that never returned may still replay a graph
            logger.error("the step submission thread did not stop: the runner is left open")
            return
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_blocks_used=s.blocks.num_used, kv_blocks_total=s.blocks.num_usable,
            prompt_tokens_total=s.stats.prompt_tokens_total,
            generation_tokens_total=s.stats.generation_tokens_total,
            async_steps_total=self._async_steps, sync_steps_total=self._sync_steps,
            prefill_steps_total=self._prefill_steps,
            num_preemptions=s.stats.num_preemptions,
            prefill_tokens_total=s.stats.prefill_tokens_total,
            prefix_cache_queried_tokens_total=s.stats.prefix_cache_queried_tokens_total,
            prefix_cache_hit_tokens_total=s.stats.prefix_cache_hit_tokens_total,
            kv_blocks_cached=s.blocks.num_cached,
            step_time_s=self._step_s, wait_time_s=self._wait_s, schedule_time_s=self._schedule_s,
            submit_time_s=self._submit_s, update_time_s=self._update_s, host_cpu_time_s=self._host_cpu_s,
            gpu_idle_gap_us=self.runner.handoff.take_gaps_us())


@dataclass
class _Parent:
    """A request with n > 1: its sequences' scheduler ids and how many are still running."""
    child_ids: list[str]
    remaining: int


_CHILD_SEP = "\x00n"  # child ids: f"{request_id}\x00n{index}" (no client id holds a NUL)


def _child_id(request_id: str, index: int) -> str:
    return f"{request_id}{_CHILD_SEP}{index}"


def _parent_of(request_id: str) -> Optional[tuple[str, int]]:
    head, sep, tail = request_id.rpartition(_CHILD_SEP)
    return (head, int(tail)) if sep else None


def _eos_ids(path: str, hf) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (what GenerationConfig.from_pretrained reads), else
    config.json's."""
    ids: list[int] = []
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        eos = None
    if eos is None:
        eos = getattr(hf, "eos_token_id", None)
    if isinstance(eos, int):
        ids = [eos]
    elif eos:
        ids = list(eos)
    return tuple(ids)


_ACTIVATIONS_BYTES = 4 * 2**30  # logits of the largest batch, prefill activations, graph pool


def _kv_sizes(cfg: EngineConfig, hf) -> tuple[int, int]:
    """(bytes of one KV block over all layers, bytes of the weights), from the config."""
    from .models.llama import ModelShape
    s = ModelShape.from_hf_config(hf)
    elem = 4 if cfg.dtype == "float32" else 2
    return s.num_layers * 2 * cfg.block_size * s.num_kv_heads * s.head_dim * elem, _param_count(s) * elem


def _cuda_kv_blocks(cfg: EngineConfig, hf) -> int:
    """Blocks that fit in gpu_memory_utilization of the device after the weights (the runner
    loads weights before allocating KV; here we estimate weights from the config)."""
    per_block, weights = _kv_sizes(cfg, hf)
    free, total = torch.cuda.mem_get_info()
    budget = total * cfg.gpu_memory_utilization - (total - free) - weights - _ACTIVATIONS_BYTES
    return max(int(budget // per_block), 2)


def _check_kv_fits(cfg: EngineConfig, hf, blocks: int) -> None:
    """An explicit num_kv_blocks that cannot fit beside the weights fails here, naming the
    field and the limit, rather than as an out-of-memory error from the allocation."""
    per_block, weights = _kv_sizes(cfg, hf)
    free, _ = torch.cuda.mem_get_info()
    room = free - weights - _ACTIVATIONS_BYTES
    if blocks * per_block > room:
        gib = 2.0**30
        raise ValueError(
            f"EngineConfig.num_kv_blocks: {blocks} blocks need {blocks * per_block / gib:.1f} GiB of KV cache "
            f"({per_block / 2**20:.2f} MiB a block); the GPU has {free / gib:.1f} GiB free, "
            f"{(weights + _ACTIVATIONS_BYTES) / gib:.1f} GiB of it for the weights and activations: at most "
            f"{max(int(room // per_block), 0)} blocks fit (0 sizes the cache from gpu_memory_utilization)")


def _param_count(s) -> int:
    attn = s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim + s.num_heads * s.head_dim * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    emb = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    return s.num_layers * (attn + mlp) + emb
