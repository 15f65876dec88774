"""An engine with the real one's interface and none of its model: the serving path at GPU speed
on a machine without a GPU.

    BACKEND_LIB_ENGINE_CLASS=bench.emulated_engine:EmulatedEngine
    BENCH_EMULATED_STEP_US=2000        # every step takes this long (a GPU step of that batch)

set in tritonserver's environment makes the llm model's engine core (engine_process=on) run
this instead of LLMEngine: requests are admitted first come first served up to max_num_seqs,
each running request gets one token per step (never an EOS id), a request ends at max_tokens
or max_model_len, and a step ends step_us after the last one began (the wait sleeps, releasing
the GIL as a CUDA event wait does). What is measured through it is everything but the model:
Triton, the stub, the engine process's wire and delivery, the client (bench/serve.py
`--emulated-step-us`). Not a product path: bench only.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections import OrderedDict, deque
from typing import Sequence

from backend_lib.config import EngineConfig
from backend_lib.engine import EngineStats
from backend_lib.models.loader import load_hf_config
from backend_lib.request import FinishReason, OutputRow, RequestOutput, SamplingParams, output_of_row, validate_request

STEP_US_ENV = "BENCH_EMULATED_STEP_US"


class _Row:
    __slots__ = ("rid", "prompt_len", "max_tokens", "made", "first_id")

    def __init__(self, rid: str, prompt_len: int, max_tokens: int, first_id: int):
        self.rid, self.prompt_len, self.max_tokens, self.made, self.first_id = rid, prompt_len, max_tokens, 0, first_id


class _Scheduler:
    """What engine_core reads of LLMEngine.scheduler."""

    def __init__(self, engine: "EmulatedEngine"):
        self._engine = engine
        self.has_pending_outputs = False

    @property
    def requests(self) -> list[str]:
        return [r.rid for r in self._engine._waiting] + list(self._engine._running)


class EmulatedEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        hf = load_hf_config(config.model_path)
        self.vocab_size = hf.vocab_size
        self.max_model_len = config.max_model_len or hf.max_position_embeddings
        eos = hf.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.step_s = float(os.environ.get(STEP_US_ENV, "2000")) / 1e6
        self.max_rows = config.max_num_seqs
        self._waiting: deque[_Row] = deque()
        self._running: "OrderedDict[str, _Row]" = OrderedDict()
        self._aborted: list[str] = []
        self._next_step_at = 0.0
        self._stats = EngineStats(kv_blocks_total=1)
        self.scheduler = _Scheduler(self)
        # never an EOS or a special id: a band of ordinary ids
        self._ids = [i for i in range(min(self.vocab_size, 1000)) if i not in self.eos_token_ids][10:]

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        ids = validate_request(prompt_token_ids, params, self.max_model_len, self.vocab_size,
                               self.config.max_stop_token_ids)
        if params.n != 1:
            raise ValueError("n must be 1 (the emulated engine samples one sequence)")
        limit = min(params.max_tokens, self.max_model_len - len(ids))
        self._waiting.append(_Row(request_id, len(ids), limit, hash(request_id) % len(self._ids)))

    def abort(self, request_id: str) -> None:
        self._aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._aborted)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self._stats, num_running=len(self._running), num_waiting=len(self._waiting))

    def step(self) -> list[RequestOutput]:
        return [output_of_row(row) for row in self.step_rows()]

    def step_rows(self) -> list[OutputRow]:
        t0 = time.perf_counter()
        outs = self._take_aborts()
        while self._waiting and len(self._running) < self.max_rows:
            row = self._waiting.popleft()
            self._running[row.rid] = row
            self._stats.prompt_tokens_total += row.prompt_len
            self._stats.prefill_tokens_total += row.prompt_len
        ended = []
        for row in self._running.values():
            row.made += 1
            done = row.made >= row.max_tokens
            tok = self._ids[(row.first_id + row.made) % len(self._ids)]
            outs.append((row.rid, [tok], done, FinishReason.LENGTH.value if done else None,
                         row.prompt_len, row.made, None, None, None, 0))
            if done:
                ended.append(row.rid)
        for rid in ended:
            del self._running[rid]
        self._stats.generation_tokens_total += len(outs)
        self._stats.async_steps_total += 1
        # the step's device time: a step begins when the last one ended or now, whichever is later
        start = max(t0, self._next_step_at)
        self._next_step_at = start + self.step_s
        wait = self._next_step_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        self._stats.step_time_s += time.perf_counter() - t0
        self._stats.wait_time_s += max(0.0, wait)
        return outs

    def _take_aborts(self) -> list[OutputRow]:
        outs = []
        for rid in self._aborted:
            row = self._running.pop(rid, None)
            if row is None:
                row = next((r for r in self._waiting if r.rid == rid), None)
                if row is None:
                    continue
                self._waiting.remove(row)
            outs.append((rid, [], True, FinishReason.ABORT.value, row.prompt_len, row.made, None, None, None, 0))
        self._aborted.clear()
        return outs

    def close(self) -> None:
        pass
