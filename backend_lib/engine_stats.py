"""EngineStats: the engine's gauges and counters, as the step loop keeps them and the engine
process sends them to its clients (torch-free: the client imports it)."""
from __future__ import annotations

from dataclasses import dataclass, field

# The host phases of a step, each kept as EngineStats.<phase>_time_s (the llm metric
# llm_step_phase_seconds_total labels them so)
HOST_PHASES = ("schedule", "submit", "update")


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    async_steps_total: int = 0
    sync_steps_total: int = 0
    prefill_steps_total: int = 0    # steps that carried prefill chunks (mixed steps): more host work than a decode step
    num_preemptions: int = 0
    prefill_tokens_total: int = 0               # known tokens whose KV was computed (recomputation included)
    prefix_cache_queried_tokens_total: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hit_tokens_total: int = 0      # of which served from the cache (not computed)
    kv_blocks_cached: int = 0                   # blocks holding reusable prefix KV (held or evictable)
    step_time_s: float = 0.0        # wall time inside step() since start
    wait_time_s: float = 0.0        # of which: waiting on step events (host idle)
    # the rest (host work), by phase: Scheduler.schedule, getting the step launched (inline:
    # plan + launch; thread: plan + the queue put), the token readback and Scheduler.update
    schedule_time_s: float = 0.0
    submit_time_s: float = 0.0
    update_time_s: float = 0.0
    host_cpu_time_s: float = 0.0    # the engine thread's CPU time in step() outside the waits
    gpu_idle_gap_us: list[float] = field(default_factory=list)
    # the last stats an engine core sent, given again because it did not answer in time: they
    # may not hold the steps of requests its outputs already finished
    stale: bool = False
