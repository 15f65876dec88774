"""Every environment variable the engine reads, in one module."""
from __future__ import annotations

import contextlib
import os
from typing import Optional

# "module:Class" the engine process (engine_core) builds instead of LLMEngine, with LLMEngine's
# interface: a stand-in for measuring the serving path without the model
# (bench/emulated_engine.py). Unset: LLMEngine.
ENGINE_CLASS_ENV = "BACKEND_LIB_ENGINE_CLASS"


def engine_class():
    """The class engine_core builds: LLMEngine, or the one ENGINE_CLASS_ENV names."""
    spec = os.environ.get(ENGINE_CLASS_ENV, "").strip()
    if not spec:
        from .engine import LLMEngine
        return LLMEngine
    import importlib
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{ENGINE_CLASS_ENV}={spec!r}: must be module:Class")
    return getattr(importlib.import_module(module), name)


# Kill switch: forces the synchronous token path everywhere, whatever the config says.
FORCE_SYNC_ENV = "BACKEND_LIB_FORCE_SYNC"
# Log level of the backend_lib logger (DEBUG, INFO, ...).
LOG_LEVEL_ENV = "BACKEND_LIB_LOG_LEVEL"


# Triton's own switch: run @triton.jit kernels in its interpreter, on CPU tensors too (the
# kernels' tests without a GPU).
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


def triton_interpret() -> bool:
    return os.environ.get(TRITON_INTERPRET_ENV, "0") == "1"


# Skinny-GEMM path of the decode projections (backend_lib/layers/skinny_gemm.py): on (the
# default: per shape, only where the start-up measurement inside a CUDA graph beats cuBLAS;
# the H200 run in bench/RESULTS.md: 0.5B batch 1 1.075 -> 1.005 ms, 8B 4.650 -> 4.478 ms, a
# few seconds more start-up), off (cuBLAS everywhere), force (every tuned shape through the
# Triton kernel, faster or not: tests). CUDA engines only.
SKINNY_GEMM_ENV = "BACKEND_LIB_SKINNY_GEMM"


_OFF_WORDS = ("0", "off", "false", "no")


def _switch(name: str, others: tuple[str, ...] = (), default: str = "on") -> str:
    """An on/off switch (unset: `default`), with `others` as further modes."""
    v = (os.environ.get(name, "").strip() or default).lower()
    if v in _OFF_WORDS:
        return "off"
    if v in ("1", "on", "true", "yes"):
        return "on"
    if v in others:
        return v
    modes = ("off", "on") + others
    raise ValueError(f"{name}={v!r}: must be {', '.join(modes[:-1])} or {modes[-1]}")


def skinny_gemm() -> str:
    return _switch(SKINNY_GEMM_ENV, ("force",))


# One-token forwards (batch-1 decode) on CUDA (backend_lib/layers/decode_gemv.py): each
# projection one kernel with the add + norm or silu * mul before it folded in, launched with
# programmatic dependent launch where the GPU has it (Hopper). on (PDL where supported, and
# the rope + KV-cache write in the q/k/v projection's epilogue), pdl (PDL, rope its own kernel),
# implicit (on, but each projection releases the next kernel only as it exits), nopdl (the
# kernels of pdl, plain launches), off (the batched path at every size).
DECODE_GEMV_ENV = "BACKEND_LIB_DECODE_GEMV"


def decode_gemv() -> str:
    return _switch(DECODE_GEMV_ENV, ("implicit", "pdl", "nopdl"))


# Split-K one-token projections (decode_gemv's split_k: o_proj and down spread K over several
# programs per column block, fp32 atomics into a per-layer accumulator): on (start-up timing
# tries them beside the unsplit tiles and keeps the fastest) or off (unsplit tiles only).
DECODE_GEMV_SPLIT_K_ENV = "BACKEND_LIB_DECODE_GEMV_SPLIT_K"


def decode_gemv_split_k() -> str:
    return _switch(DECODE_GEMV_SPLIT_K_ENV)


# One-token MLPs as one kernel each (backend_lib/layers/decode_mlp.py: add + norm, gate/up,
# silu * mul and down, the down projection split over the intermediate channels with fp32
# atomics): on (where start-up timing beats decode_gemv's two kernels), force (every layer,
# untimed: tests), off (the default: on the H100 it lost on both shapes, forced 0.5B batch 1
# 0.729 -> 0.796 ms and 8B 5.70 -> 7.28 ms, so `on` only added ~3 s of start-up timing to
# keep the two kernels; bench/RESULTS.md, eighteenth session). Needs BACKEND_LIB_DECODE_GEMV
# on; CUDA engines only.
DECODE_MLP_ENV = "BACKEND_LIB_DECODE_MLP"


def decode_mlp() -> str:
    return _switch(DECODE_MLP_ENV, ("force",), default="off")


# The decode program's per-row inputs (ids, slots, KV slots, block tables, lengths; see
# backend_lib/layers/decode_prep.py) on CUDA: on (one Triton kernel, the default) or off (the
# ~20 torch ops it replaces).
DECODE_PREP_ENV = "BACKEND_LIB_DECODE_PREP"


def decode_prep() -> str:
    return _switch(DECODE_PREP_ENV)


# Split decode attention (backend_lib/layers/triton_attention.py): kernel (a second kernel
# merges the splits' partial results, the default) or fused (the last split of each sequence
# and kv head to finish merges them, counted with an atomic: one kernel less per layer). Off: on
# the H200 it was slower (0.5B batch 1 0.666 -> 0.776 ms, bench/RESULTS.md fourteenth session)
# while its last split merged the group's heads one after another; the merge of all heads at
# once that replaced it is not measured yet. oproj: one-token forwards (batch 1) leave the
# merge to o_proj's gemv prologue (layers/decode_gemv.py MERGE_SPLITS): no atomics, one kernel
# less per layer; not measured yet either. splitk: one-token forwards merge and project in one
# kernel split over the heads, with fp32 atomics (layers/decode_oproj.py), where start-up
# timing beats the reduce kernel + gemv; splitk-force: everywhere, untimed (tests). Batched
# decode keeps the reduce kernel.
DECODE_ATTN_REDUCE_ENV = "BACKEND_LIB_DECODE_ATTN_REDUCE"
DECODE_ATTN_REDUCE_MODES = ("kernel", "fused", "oproj", "splitk", "splitk-force")


def decode_attn_reduce() -> str:
    v = os.environ.get(DECODE_ATTN_REDUCE_ENV, "kernel").strip().lower() or "kernel"
    if v not in DECODE_ATTN_REDUCE_MODES:
        raise ValueError(f"{DECODE_ATTN_REDUCE_ENV}={v!r}: must be one of {', '.join(DECODE_ATTN_REDUCE_MODES)}")
    return v


# Sampling kernels on CUDA: split (the default: each row spread across many programs,
# layers/sampling_split.py and logprobs_kernels.py) or rows (one program per row,
# layers/sampling_kernels.py, torch logprobs and masks). On the H200 split is faster at every
# batch and sampling mode (bench/RESULTS.md, "Sampler kernels: split vs rows").
SAMPLER_ENV = "BACKEND_LIB_SAMPLER"


def sampler_impl() -> str:
    v = os.environ.get(SAMPLER_ENV, "split").strip().lower() or "split"
    if v not in ("split", "rows"):
        raise ValueError(f"{SAMPLER_ENV}={v!r}: must be split or rows")
    return v


# One-token decode attention with the newest K/V from the q/k/v projection
# (triton_attention newest_kv): on (each split's first KV tile loads before the PDL wait, while
# the projection runs) or off (after the wait, as the other tiles).
DECODE_KV_PREFETCH_ENV = "BACKEND_LIB_DECODE_KV_PREFETCH"


def decode_kv_prefetch() -> str:
    return _switch(DECODE_KV_PREFETCH_ENV)


# One-token decode attention takes this step's K/V from the q/k/v projection's output
# (triton_attention newest_kv) instead of the cache: auto (where a split's first KV tile is
# small enough that holding it across the PDL wait was measured faster:
# triton_attention.newest_kv_pays), on, or off.
DECODE_NEWEST_KV_ENV = "BACKEND_LIB_DECODE_NEWEST_KV"


def decode_newest_kv() -> str:
    return _switch(DECODE_NEWEST_KV_ENV, ("auto",), default="auto")


# One-token projections ask L2 for their own weights before their PDL wait
# (layers/decode_gemv.py, L2_PREFETCH): off, oproj (only the projection after attention,
# whose wait covers the attention's latency-bound run, when HBM is otherwise idle) or all.
DECODE_GEMV_L2_PREFETCH_ENV = "BACKEND_LIB_DECODE_GEMV_L2_PREFETCH"


def decode_gemv_l2_prefetch() -> str:
    return _switch(DECODE_GEMV_L2_PREFETCH_ENV, ("oproj", "all"), default="off")


# Split decode attention launched with PDL: on (splits without a KV tile exit before the PDL
# wait, freeing the SM for the projection still running) or off (they wait, then exit). Off:
# on the H100 it changed nothing at 8B batch 1 and cost ~13 µs at 0.5B batch 1 in one sample
# (bench/RESULTS.md, twenty-fourth session).
DECODE_ATTN_EARLY_EXIT_ENV = "BACKEND_LIB_DECODE_ATTN_EARLY_EXIT"


def decode_attn_early_exit() -> str:
    return _switch(DECODE_ATTN_EARLY_EXIT_ENV, default="off")


# The most programs per (sequence, kv head) of the split decode attention (its grid is fixed
# by shapes: at batch 1 most splits of a short sequence have no tile and exit, yet with PDL
# they sit resident beside the running projection until its end).
DECODE_ATTN_MAX_SPLITS_ENV = "BACKEND_LIB_DECODE_ATTN_MAX_SPLITS"


def _whole_number(name: str, minimum: int) -> Optional[int]:
    """The variable as a whole number >= minimum; None when unset or empty."""
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < minimum:
        raise ValueError(f"{name}={v!r}: must be a whole number >= {minimum}")
    return int(v)


def decode_attn_max_splits() -> int:
    v = _whole_number(DECODE_ATTN_MAX_SPLITS_ENV, 1)
    return 64 if v is None else v


# The split decode attention's tile: auto (triton_attention._decode_tiling: 32 KV tokens a tile
# for fp32 caches and for 16-bit ones with head_dim >= 128 while the context splits, 64 for the
# others; 4 warps) or BLOCK_NxWARPS, e.g. 64x8 or 32x4, to time another (bench/RESULTS.md
# twenty-sixth and twenty-seventh sessions).
DECODE_ATTN_TILE_ENV = "BACKEND_LIB_DECODE_ATTN_TILE"
DECODE_ATTN_TILE_BLOCK_N = (16, 32, 64, 128)
DECODE_ATTN_TILE_WARPS = (1, 2, 4, 8)


def decode_attn_tile() -> Optional[tuple[int, int]]:
    """(block_n, num_warps), or None for the automatic tile."""
    v = os.environ.get(DECODE_ATTN_TILE_ENV, "auto").strip().lower() or "auto"
    if v == "auto":
        return None
    block_n, sep, warps = v.partition("x")
    if (not sep or not block_n.isdigit() or not warps.isdigit() or int(block_n) not in DECODE_ATTN_TILE_BLOCK_N
            or int(warps) not in DECODE_ATTN_TILE_WARPS):
        raise ValueError(f"{DECODE_ATTN_TILE_ENV}={v!r}: must be auto or BLOCK_NxWARPS with BLOCK_N one of "
                         f"{DECODE_ATTN_TILE_BLOCK_N} and WARPS one of {DECODE_ATTN_TILE_WARPS}")
    return int(block_n), int(warps)


# Threads that compile start-up tuning's Triton candidates at once (layers/triton_support.py
# compile_in_parallel, Triton's AsyncCompileMode): they are most of the kernels an engine
# compiles at start, and with a cold Triton cache its start grew with them (0.5B on an H100:
# 38.4 s against 3.6 s for the issue-12 tree, which compiles no gemv; bench/RESULTS.md
# twenty-fourth session). 0 or 1: one at a time. Default: the CPUs, at most 16.
COMPILE_THREADS_ENV = "BACKEND_LIB_COMPILE_THREADS"


def compile_threads() -> int:
    v = _whole_number(COMPILE_THREADS_ENV, 0)
    return min(16, os.cpu_count() or 1) if v is None else v


# Where start-up tuning keeps its picks (layers/tuning_cache.py): a folder (default
# $XDG_CACHE_HOME/backend_lib/tuning, ~/.cache/backend_lib/tuning without it), or off to time
# every candidate at every start.
TUNING_CACHE_ENV = "BACKEND_LIB_TUNING_CACHE"


def tuning_cache_dir() -> Optional[str]:
    """The folder, absolute; None: off (also without a home folder to put the default in)."""
    raw = os.environ.get(TUNING_CACHE_ENV, "").strip()
    if raw.lower() in _OFF_WORDS + ("none",):
        return None
    if raw:
        return os.path.abspath(os.path.expanduser(raw))
    cache_home = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not os.path.isabs(cache_home):   # the XDG spec: a relative value is ignored
        cache_home = os.path.join("~", ".cache")
    folder = os.path.expanduser(os.path.join(cache_home, "backend_lib", "tuning"))
    return folder if os.path.isabs(folder) else None


# All-greedy steps on CUDA with the split sampler: on (layers/greedy_argmax.py, each row's
# argmax split across ~150 chunk programs and a combine, launched with PDL, for steps of up to
# GREEDY_ARGMAX_MAX_ROWS rows) or off (torch.argmax, which walks a row of the vocabulary with
# one block: ~8.5 us at batch 1 on the H200, bench/RESULTS.md fourteenth session).
GREEDY_ARGMAX_ENV = "BACKEND_LIB_GREEDY_ARGMAX"


def greedy_argmax() -> str:
    return _switch(GREEDY_ARGMAX_ENV)


# Seconds the engine process may go without a message while requests are in flight before the
# client declares it stalled (a hung kernel, a deadlock), kills it and fails those requests.
# Steps send their outputs as they finish; a legitimately silent stretch (a long prompt's
# prefill chunks, a first-use kernel compile or graph capture) is far shorter. 300 s as vLLM's
# execute-model timeout and our pipeline stages' (BACKEND_LIB_PP_TIMEOUT_S).
ENGINE_STALL_TIMEOUT_ENV = "BACKEND_LIB_ENGINE_STALL_TIMEOUT_S"


def engine_stall_timeout_s() -> float:
    v = os.environ.get(ENGINE_STALL_TIMEOUT_ENV, "300").strip() or "300"
    s = _positive_number(v)
    if s is None:
        raise ValueError(f"{ENGINE_STALL_TIMEOUT_ENV}={v!r}: must be a number of seconds > 0")
    return s


def _positive_number(raw: str) -> Optional[float]:
    """float(raw) when it is a number > 0 (not nan), else None."""
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if v > 0 else None


def force_sync() -> bool:
    return os.environ.get(FORCE_SYNC_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def log_level() -> str:
    return os.environ.get(LOG_LEVEL_ENV, "WARNING").upper()

# ---- pipeline parallelism (backend_lib/pipeline.py) -------------------------------------------
# Rendezvous of the stage processes (the standard torch.distributed variables).
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
# Seconds stage 0 waits for a stage's result before declaring the pipeline dead.
PP_TIMEOUT_ENV = "BACKEND_LIB_PP_TIMEOUT_S"
# Seconds the worker stages may take to load their layers.
PP_STARTUP_TIMEOUT_ENV = "BACKEND_LIB_PP_STARTUP_TIMEOUT_S"
# Benchmarks: the engine core process profiles its loop thread with cProfile and writes the
# stats (pstats format) to this path when it ends (bench/engine_process.py --core-profile).
CORE_PROFILE_ENV = "BACKEND_LIB_CORE_PROFILE"


def core_profile_path() -> str:
    return os.environ.get(CORE_PROFILE_ENV, "").strip()


# The engine core process's sys.setswitchinterval, in ms (unset: Python's 5 ms); the llm model's
# gil_switch_interval_ms sets it for the core it starts.
CORE_SWITCH_INTERVAL_ENV = "BACKEND_LIB_CORE_SWITCH_INTERVAL_MS"


def core_switch_interval_s() -> Optional[float]:
    """None: leave Python's default; else seconds (> 0), or ValueError naming the variable."""
    raw = os.environ.get(CORE_SWITCH_INTERVAL_ENV, "").strip()
    if not raw:
        return None
    ms = _positive_number(raw)
    if ms is None:
        raise ValueError(f"{CORE_SWITCH_INTERVAL_ENV} must be a positive number of milliseconds, not {raw!r}")
    return ms / 1e3


# Test hook: object collectives (send_object_list, ...) raise in every stage.
PP_FORBID_OBJECTS_ENV = "BACKEND_LIB_PP_FORBID_OBJECT_COLLECTIVES"


def master_addr() -> str:
    return os.environ.get(MASTER_ADDR_ENV, "127.0.0.1").strip() or "127.0.0.1"


def master_port() -> "int | None":
    v = os.environ.get(MASTER_PORT_ENV, "").strip()
    return int(v) if v else None


def pp_timeout_s() -> float:
    return float(os.environ.get(PP_TIMEOUT_ENV, "300"))


def pp_startup_timeout_s() -> float:
    return float(os.environ.get(PP_STARTUP_TIMEOUT_ENV, "600"))


def pp_forbid_objects() -> bool:
    return os.environ.get(PP_FORBID_OBJECTS_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def overridden(env: dict):
    """os.environ with `env` set, restored on exit (benchmarks' variants, tests)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
