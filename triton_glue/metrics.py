"""Custom metrics of the `llm` model, exported through the Python backend's metrics API
(pb_utils.MetricFamily) on Triton's metrics port. pb_utils is passed in, never imported here.

Counters are exact: prompt/generation tokens and finished requests are counted once per
request, when its final output is sent. Gauges and step counters mirror EngineStats.

Each metric update is a round trip to the server that releases the stub's GIL and waits to take
it back. The per-request ones (TTFT, TPOT, the finish counters) are therefore recorded here in
memory by the sending thread and go to the server from the stats thread (`flush`, with every
stats export): the sender makes no metric call, and the counters trail by one stats interval.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Optional

from backend_lib.engine_stats import HOST_PHASES

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
TPOT_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                1.0, 2.5]
IDLE_GAP_BUCKETS = [1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 1e-2, 1e-1]
FINISH_REASONS = ("stop", "length", "abort", "error")
# A core that keeps missing the stats deadline (a starved host) still gets its finished
# requests counted: stale stats hold them back for at most this many exports in a row.
MAX_STALE_EXPORTS = 3

NAMES = {
    "ttft": "llm_time_to_first_token_seconds",
    "tpot": "llm_time_per_output_token_seconds",
    "prompt": "llm_prompt_tokens_total",
    "gen": "llm_generation_tokens_total",
    "finished": "llm_requests_finished_total",
    "rejected": "llm_requests_rejected_total",
    "running": "llm_num_requests_running",
    "waiting": "llm_num_requests_waiting",
    "kv_used": "llm_kv_blocks_used",
    "kv_total": "llm_kv_blocks_total",
    "healthy": "llm_engine_healthy",
    "async": "llm_async_steps_total",
    "sync": "llm_sync_steps_total",
    "prefill_steps": "llm_prefill_steps_total",
    "preempt": "llm_preemptions_total",
    "pc_queried": "llm_prefix_cache_queried_tokens_total",
    "pc_hit": "llm_prefix_cache_hit_tokens_total",
    "kv_cached": "llm_kv_blocks_cached",
    # vLLM v1's names of the same two counters (tokens), for dashboards written for vLLM.
    "vllm_pc_queried": "vllm:prefix_cache_queries",
    "vllm_pc_hit": "vllm:prefix_cache_hits",
    # ... and of the KV usage (vllm_backend / vLLM v0: gpu_cache_usage_perc; v1: kv_cache_usage_perc)
    # and the preemptions: the engine's, so on `llm` (the routes share its cache)
    "vllm_kv_usage_v0": "vllm:gpu_cache_usage_perc",
    "vllm_kv_usage": "vllm:kv_cache_usage_perc",
    "vllm_preempt": "vllm:num_preemptions_total",
    "idle": "llm_gpu_idle_gap_seconds",
    "step_s": "llm_step_seconds_total",
    "step_wait_s": "llm_step_gpu_wait_seconds_total",
    "step_phase_s": "llm_step_phase_seconds_total",
    "step_cpu_s": "llm_step_host_cpu_seconds_total",
    "sent": "llm_responses_sent_total",
    "send_s": "llm_response_send_seconds_total",
}


class _Locked:
    """Serializes calls into one pb_utils metric (they are IPC calls to the server)."""

    def __init__(self, metric: Any, lock: threading.Lock):
        self._m, self._lock = metric, lock

    def observe(self, v: float) -> None:
        with self._lock:
            self._m.observe(float(v))

    def increment(self, v: float) -> None:
        if v:
            with self._lock:
                self._m.increment(float(v))

    def set(self, v: float) -> None:
        with self._lock:
            self._m.set(float(v))


class PendingCounts(NamedTuple):
    """Per-request metrics the sending threads recorded, not yet sent to the server."""
    ttft: list            # seconds to each first token
    tpot: list            # seconds per output token of each finished request
    prompt_tokens: int
    generation_tokens: int
    finished: dict        # finish reason -> requests


class EngineMetrics:
    def __init__(self, pb_utils: Any, labels: dict[str, str]):
        MF = pb_utils.MetricFamily
        self._lock = threading.Lock()
        # The families must outlive their metrics: keep references to all of them.
        self._families: list[Any] = []

        def fam(key: str, kind: Any, desc: str) -> Any:
            f = MF(name=NAMES[key], description=desc, kind=kind)
            self._families.append(f)
            return f

        def metric(f: Any, extra: dict[str, str] | None = None, buckets=None) -> _Locked:
            lab = dict(labels, **(extra or {}))
            m = f.Metric(labels=lab, buckets=buckets) if buckets is not None else f.Metric(labels=lab)
            return _Locked(m, self._lock)

        self.ttft = metric(fam("ttft", MF.HISTOGRAM, "Time to first token (s), from execute to the first token"),
                           buckets=TTFT_BUCKETS)
        self.tpot = metric(fam("tpot", MF.HISTOGRAM, "Time per output token (s), per request: "
                                                     "(last - first token time) / (tokens - 1)"),
                           buckets=TPOT_BUCKETS)
        self.prompt_tokens = metric(fam("prompt", MF.COUNTER, "Prompt tokens of finished requests"))
        self.generation_tokens = metric(fam("gen", MF.COUNTER, "Generated tokens of finished requests"))
        f = fam("finished", MF.COUNTER, "Requests finished, by finish reason")
        self.finished = {r: metric(f, {"reason": r}) for r in FINISH_REASONS}
        self.rejected = metric(fam("rejected", MF.COUNTER, "Requests rejected before reaching the engine"))
        self.running = metric(fam("running", MF.GAUGE, "Requests in the running batch"))
        self.waiting = metric(fam("waiting", MF.GAUGE, "Requests waiting to be scheduled"))
        self.kv_used = metric(fam("kv_used", MF.GAUGE, "KV-cache blocks in use"))
        self.kv_total = metric(fam("kv_total", MF.GAUGE, "KV-cache blocks in the pool"))
        # created at the first export, when the engine is up: a series reading 0 means a dead
        # engine (the launcher's supervisor stops the server on it), never one still starting
        healthy = fam("healthy", MF.GAUGE, "1 while the engine thread is alive")
        self._new_healthy = lambda: metric(healthy)
        self.healthy: Optional[_Locked] = None
        self.async_steps = metric(fam("async", MF.COUNTER, "Engine steps run with the async token handoff engaged"))
        self.sync_steps = metric(fam("sync", MF.COUNTER, "Engine steps run synchronously"))
        self.prefill_steps = metric(fam("prefill_steps", MF.COUNTER, "Of the engine steps, those that carried "
                                                                     "prefill chunks (the rest decode only)"))
        self.preemptions = metric(fam("preempt", MF.COUNTER, "Requests preempted for KV space"))
        self.pc_queried = metric(fam("pc_queried", MF.COUNTER, "Prompt tokens looked up in the prefix cache "
                                                               "(at each admission, recomputation included)"))
        self.pc_hit = metric(fam("pc_hit", MF.COUNTER, "Of the queried tokens, those whose KV came from the "
                                                       "prefix cache (not computed)"))
        self.vllm_pc_queried = metric(fam("vllm_pc_queried", MF.COUNTER, "Prefix cache queries, in terms of "
                                                                         "number of queried tokens."))
        self.vllm_pc_hit = metric(fam("vllm_pc_hit", MF.COUNTER, "Prefix cache hits, in terms of number of "
                                                                 "cached tokens."))
        self.kv_cached = metric(fam("kv_cached", MF.GAUGE, "KV-cache blocks holding reusable prefix KV "
                                                           "(held or evictable)"))
        self.vllm_kv_usage_v0 = metric(fam("vllm_kv_usage_v0", MF.GAUGE, "GPU KV-cache usage. 1 means 100 percent usage."))
        self.vllm_kv_usage = metric(fam("vllm_kv_usage", MF.GAUGE, "KV-cache usage. 1 means 100 percent usage."))
        self.vllm_preempt = metric(fam("vllm_preempt", MF.COUNTER, "Cumulative number of preemption from the engine."))
        self.idle_gap = metric(fam("idle", MF.HISTOGRAM, "GPU idle gap between consecutive decode steps (s)"),
                               buckets=IDLE_GAP_BUCKETS)
        # The engine thread's pace: its time in step() and, of that, its waits on the device
        # (the rest is host work: scheduling, packing, launching, stops and outputs).
        self.step_seconds = metric(fam("step_s", MF.COUNTER, "Seconds the engine thread spent in step()"))
        self.step_wait_seconds = metric(fam("step_wait_s", MF.COUNTER, "Of those, seconds it waited on the "
                                                                       "device for a step's tokens"))
        f = fam("step_phase_s", MF.COUNTER, "Of the host part of step(), seconds in each phase: schedule, "
                                            "submit (plan and launch), update (tokens, stops, outputs)")
        self.step_phase_seconds = {p: metric(f, {"phase": p}) for p in HOST_PHASES}
        self.step_host_cpu_seconds = metric(fam("step_cpu_s", MF.COUNTER, "The engine thread's CPU seconds in "
                                                "step() outside its waits (host seconds - CPU seconds: the "
                                                "thread waited for the GIL or a core)"))
        # The stub's sends: counted in the sending thread, exported with the engine stats (a
        # metric update is itself a call to the server: one per send would double their cost).
        self.responses_sent = metric(fam("sent", MF.COUNTER, "Responses the llm model sent for requests in the engine"))
        self.response_send_seconds = metric(fam("send_s", MF.COUNTER, "Seconds spent in those sends "
                                                                      "(response_sender.send, a round trip to the server)"))
        self._sends_exported = (0, 0.0)
        self._pending_lock = threading.Lock()
        self._pending_ttft: list[float] = []
        self._pending_tpot: list[float] = []
        self._pending_prompt = self._pending_gen = 0
        self._pending_finished: dict[str, int] = {}
        self._stale_exports = 0  # exports in a row that held the finished counts back (export)
        # each EngineStats total exported so far: the counters grow by the difference
        self._last = {"async": 0, "sync": 0, "prefill_steps": 0, "preempt": 0, "pc_queried": 0, "pc_hit": 0,
                      "step_s": 0.0, "step_wait_s": 0.0, "step_cpu_s": 0.0, **{p: 0.0 for p in HOST_PHASES}}
        self._vllm_alias = {"pc_queried": self.vllm_pc_queried, "pc_hit": self.vllm_pc_hit,
                            "preempt": self.vllm_preempt}

    def first_token(self, seconds: float) -> None:
        with self._pending_lock:
            self._pending_ttft.append(seconds)

    def request_finished(self, reason: str, num_prompt: int, num_generated: int,
                         tpot: Optional[float] = None) -> None:
        """A request's final output: its counts, and its time per output token (None: fewer
        than two tokens)."""
        if reason not in self.finished:
            reason = "error"
        with self._pending_lock:
            self._pending_prompt += num_prompt
            self._pending_gen += num_generated
            self._pending_finished[reason] = self._pending_finished.get(reason, 0) + 1
            if tpot is not None:
                self._pending_tpot.append(tpot)

    def take_pending(self) -> PendingCounts:
        """What request_finished / first_token recorded since the last take, for flush()."""
        with self._pending_lock:
            pending = PendingCounts(self._pending_ttft, self._pending_tpot, self._pending_prompt,
                                    self._pending_gen, self._pending_finished)
            self._pending_ttft, self._pending_tpot = [], []
            self._pending_prompt, self._pending_gen, self._pending_finished = 0, 0, {}
        return pending

    def flush(self, pending: Optional[PendingCounts] = None) -> None:
        """Send `pending` (take_pending()'s), or what was recorded since the last take."""
        p = self.take_pending() if pending is None else pending
        for v in p.ttft:
            self.ttft.observe(v)
        for v in p.tpot:
            self.tpot.observe(v)
        self.prompt_tokens.increment(p.prompt_tokens)
        self.generation_tokens.increment(p.generation_tokens)
        for reason, n in p.finished.items():
            self.finished[reason].increment(n)

    def request_rejected(self) -> None:
        self.rejected.increment(1)

    def export(self, engine: Any, sends: Callable[[], tuple[int, float]]) -> None:
        """One stats export, ordered for a reader that waits until requests show as finished
        and then reads the rest (bench/serve.py reads a point's counters so): the requests
        finished so far are taken first, so each of their steps is in the engine stats read
        next, and their counts go out last, after the steps, idle gaps and sends. Stats the
        engine core did not answer in time (stale) may miss those steps: the finished counts
        then wait for a fresh reading, up to MAX_STALE_EXPORTS exports in a row."""
        finished = self.take_pending()
        stats, healthy = engine.stats(), engine.is_healthy()
        self.export_engine_stats(stats, healthy)
        self.export_sends(*sends())
        if getattr(stats, "stale", False) and healthy and self._stale_exports < MAX_STALE_EXPORTS:
            self._stale_exports += 1
            self._give_back(finished)
            return
        self._stale_exports = 0
        self.flush(finished)

    def _give_back(self, p: PendingCounts) -> None:
        """Put taken counts back in front of what was recorded since, for the next flush."""
        with self._pending_lock:
            self._pending_ttft = p.ttft + self._pending_ttft
            self._pending_tpot = p.tpot + self._pending_tpot
            self._pending_prompt += p.prompt_tokens
            self._pending_gen += p.generation_tokens
            for reason, n in p.finished.items():
                self._pending_finished[reason] = self._pending_finished.get(reason, 0) + n

    def export_engine_stats(self, st: Any, healthy: bool) -> None:
        self.running.set(st.num_running)
        self.waiting.set(st.num_waiting)
        self.kv_used.set(st.kv_blocks_used)
        self.kv_total.set(st.kv_blocks_total)
        self.kv_cached.set(getattr(st, "kv_blocks_cached", 0))
        # vLLM counts the blocks requests hold (cached blocks nobody holds are free to evict)
        usage = st.kv_blocks_used / st.kv_blocks_total if st.kv_blocks_total else 0.0
        self.vllm_kv_usage_v0.set(usage)
        self.vllm_kv_usage.set(usage)
        if self.healthy is None:
            self.healthy = self._new_healthy()
        self.healthy.set(1 if healthy else 0)
        for key, total, m in (("async", st.async_steps_total, self.async_steps),
                              ("sync", st.sync_steps_total, self.sync_steps),
                              ("prefill_steps", getattr(st, "prefill_steps_total", 0), self.prefill_steps),
                              ("preempt", getattr(st, "num_preemptions", 0), self.preemptions),
                              ("pc_queried", getattr(st, "prefix_cache_queried_tokens_total", 0), self.pc_queried),
                              ("pc_hit", getattr(st, "prefix_cache_hit_tokens_total", 0), self.pc_hit),
                              ("step_s", getattr(st, "step_time_s", 0.0), self.step_seconds),
                              ("step_wait_s", getattr(st, "wait_time_s", 0.0), self.step_wait_seconds),
                              ("step_cpu_s", getattr(st, "host_cpu_time_s", 0.0), self.step_host_cpu_seconds),
                              *((p, getattr(st, f"{p}_time_s", 0.0), self.step_phase_seconds[p]) for p in HOST_PHASES)):
            delta = total - self._last[key]
            if delta > 0:
                m.increment(delta)
                if key in self._vllm_alias:
                    self._vllm_alias[key].increment(delta)
                self._last[key] = total
        for gap_us in st.gpu_idle_gap_us or ():
            self.idle_gap.observe(gap_us * 1e-6)

    def export_sends(self, count: int, seconds: float) -> None:
        """Totals so far (count, seconds) of the stub's sends; exported as increments."""
        c0, s0 = self._sends_exported
        if count > c0:
            self.responses_sent.increment(count - c0)
            self.response_send_seconds.increment(seconds - s0)
            self._sends_exported = (count, seconds)

    def close(self) -> None:
        # Drop metrics before their families (the Python backend requires that order).
        for attr in list(vars(self)):
            if attr not in ("_families", "_lock"):
                setattr(self, attr, None)
        self._families.clear()
