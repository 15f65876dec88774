"""Pipeline parallelism: the decoder layers split across `pipeline_parallel_size` stage
processes on one node, with the sampled tokens handed from the last stage back to stage 0
as device tensors.

    stage 0 (this process, driven by LLMEngine)      stages 1..pp-1 (worker processes)
    --------------------------------------------      -----------------------------------
    schedule -> pack step metadata (int64 tensor)
    meta  --isend (cpu group)-------------------->    recv meta, forward it to the next stage
    embed + layers [0, a) over the paged KV
    hidden --isend (device group)---------------->    recv hidden, layers [a, b), send on ...
                                                      last stage: norm + lm_head + sampler
    tokens <--irecv (device group)----------------    send sampled ids [S] (only if a row samples)
    relay[slot] = tokens (on the device), then TokenHandoff.publish (D2H + event) for the host

Transport: torch.distributed, NCCL between GPUs (one GPU per stage, cuda:rank) and gloo on
CPU; the step metadata always travels over a gloo group as a CPU int64 tensor (the workers
need its sizes on the host, and the host already has it), activations and tokens over the
device group. Several stages sharing one GPU cannot use NCCL (it refuses duplicate GPUs):
then the device group is gloo, staged through host memory (a debugging mode, logged).
Rendezvous: MASTER_ADDR / MASTER_PORT (envs.py); a free port when unset.

No CPU objects on the token path: no send_object_list/broadcast_object_list/pickle; every
message is a tensor of a size both sides derive from the fixed-size header. A step in which
no row samples (every row mid-prefill) sends no tokens and stage 0 posts no receive, so
nobody waits for results that would be discarded; stage 0 only waits for earlier tokens
(on the device stream on CUDA) when a row of the new step reads the relay buffer.

Failure: a worker's death is seen by stage 0 through its process sentinel, a closed
connection (gloo raises at once) or the receive timeout; the executor then kills the other
workers and raises, so LLMEngine.step raises and AsyncEngine fails the in-flight requests.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import struct
import sys
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from . import envs
from .config import AsyncDecision, EngineConfig
from .free_port import free_port
from .handoff import StepHandle, TokenHandoff, _DoneEvent
from .interpreter import python_executable
from .layers.logprobs import packed_width
from .model_runner import ADMISSION_FLOATS, ModelRunner
from .pp_stage_entry import stage_process_main
from .scheduler import SchedulerOutput

logger = logging.getLogger("backend_lib")

# ---- the packed step description ------------------------------------------------------------
HEADER_LEN = 13
# _PEN: the first _PEN admissions have penalties (runner.apply_admissions resets their state)
_OP, _STEP, _S, _T, _A, _G, _GREEDY, _MASKS, _NSAMP, _PLEN, _LOGPROBS, _HIST, _PEN = range(13)
OP_STEP, OP_STOP = 1, 2
# Idle workers block on the next header for as long as the engine idles: the group timeout
# is effectively infinite; stage 0 bounds its own waits with envs.pp_timeout_s().
_GROUP_TIMEOUT = datetime.timedelta(days=7)
_OBJECT_COLLECTIVES = ("send_object_list", "recv_object_list", "broadcast_object_list",
                       "all_gather_object", "gather_object", "scatter_object_list")


class PipelineError(RuntimeError):
    """A pipeline stage died, failed or timed out."""


def split_layers(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, as even as possible; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for i in range(pp):
        n = base + (1 if i < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def validate_pipeline(cfg: EngineConfig, hf_config) -> None:
    pp, layers = cfg.pipeline_parallel_size, hf_config.num_hidden_layers
    if pp > layers:
        raise ValueError(f"EngineConfig.pipeline_parallel_size: {pp} stages cannot split the model's "
                         f"{layers} decoder layers (must be <= {layers}) (got {pp})")


@dataclass
class _Sections:
    adm_ints: torch.Tensor   # [A, W]
    adm_floats: torch.Tensor  # [A, len(ADMISSION_FLOATS)] f32
    history: torch.Tensor    # [3, H] penalty rows' known tokens (slot, token, is_output)
    growth: torch.Tensor     # [3, G]
    tok: torch.Tensor        # [4, T] ids, relay_src, pos, tok_slot
    row: torch.Tensor        # [4, S] slot, seq_len, last_idx, samples
    cu: torch.Tensor         # [S + 1]


def _sections(payload: torch.Tensor, h: list[int], width: int) -> _Sections:
    a, g, t, s, nf = h[_A], h[_G], h[_T], h[_S], len(ADMISSION_FLOATS)
    o = 0

    def take(n: int) -> torch.Tensor:
        nonlocal o
        out = payload[o:o + n]
        o += n
        return out
    adm_i = take(a * width).view(a, width)
    adm_f = take(nf * a).view(torch.float64).view(a, nf).to(torch.float32)
    hist = take(3 * h[_HIST]).view(3, h[_HIST])
    growth = take(3 * g).view(3, g)
    tok = take(4 * t).view(4, t)
    row = take(4 * s).view(4, s)
    cu = take(s + 1)
    return _Sections(adm_i, adm_f, hist, growth, tok, row, cu)


def pack_step(runner: ModelRunner, sched: SchedulerOutput, eos_ids: tuple[int, ...]):
    """Host side of one step: (header list, payload CPU int64 tensor, seq_lens, q_lens).
    Table updates (admissions, KV growth) and the per-token/per-row arrays in one tensor."""
    up = runner.pack_table_updates(sched, eos_ids)
    ints, floats, growth = up.ints, up.floats, up.growth
    greedy, masks, logprobs = runner.step_flags(sched)
    packed = runner.pack_mixed(sched)
    flat: list[int] = [v for r in ints for v in r]
    fl = [v for r in floats for v in r]
    if fl:
        flat.extend(struct.unpack(f"<{len(fl)}q", struct.pack(f"<{len(fl)}d", *fl)))
    for part in (up.history, growth):
        for r in part:
            flat.extend(r)
    # pageable: gloo sends it from host memory; the device copy goes through runner.staging
    # (a pinned ring: no cudaHostAlloc per step, see HostStaging)
    payload = torch.from_numpy(np.concatenate([np.array(flat, dtype=np.int64), packed.tok.ravel(),
                                               packed.row.ravel(), packed.cu]))
    n_samples = int(packed.row[3].sum())
    header = [0] * HEADER_LEN
    header[_OP], header[_STEP], header[_S], header[_T] = OP_STEP, sched.step_id, packed.row.shape[1], packed.num_tokens
    header[_A], header[_G], header[_GREEDY], header[_MASKS] = len(ints), len(growth[0]), int(greedy), int(masks)
    header[_NSAMP], header[_PLEN] = n_samples, payload.numel()
    header[_LOGPROBS], header[_HIST], header[_PEN] = int(logprobs), len(up.history[0]), up.num_penalized
    return header, payload, packed.seq_lens, packed.q_lens


def stage_forward(runner: ModelRunner, h: list[int], payload_dev: torch.Tensor, seq_lens: list[int],
                  q_lens: list[int], hidden_in: Optional[torch.Tensor]):
    """Device side of one step on one stage: table updates, attention metadata, this
    stage's layers. Stage 0 gathers input ids (relay); later stages take hidden_in."""
    sec = _sections(payload_dev, h, runner.admission_width)
    if runner.model.is_last and h[_A]:
        runner.apply_admissions(sec.adm_ints, sec.adm_floats, sec.adm_ints[:h[_PEN], 0] if h[_PEN] else None)
    if runner.model.is_last and h[_HIST]:
        runner.apply_history(sec.history)
    if h[_G]:
        runner.apply_growth(sec.growth)
    p, attn = runner.mixed_attention(sec.tok[2], sec.tok[3], sec.row, sec.cu.to(torch.int32), seq_lens, q_lens)
    x = runner.gather_input_ids(sec.tok[0], sec.tok[1]) if runner.model.is_first else hidden_in
    return runner.model(x, p, runner.kv_caches, attn), sec


def _host_lens(payload: torch.Tensor, h: list[int], width: int) -> tuple[list[int], list[int]]:
    sec = _sections(payload, h, width)
    cu = sec.cu.tolist()  # a CPU tensor received over the gloo group: no device sync
    return sec.row[1].tolist(), [b - a for a, b in zip(cu, cu[1:])]


def install_object_guard() -> list:
    """Test hook (envs.pp_forbid_objects): make every object collective raise, so a token or
    step description moved through a pickled CPU object fails loudly. Returns what
    `restore_object_guard` needs to undo it."""
    def forbidden(name):
        def f(*a, **k):
            raise RuntimeError(f"torch.distributed.{name} is forbidden on the pipeline path")
        f.pipeline_guard = True
        return f
    import torch.distributed.distributed_c10d as c10d
    saved = []
    for name in _OBJECT_COLLECTIVES:
        for mod in (dist, c10d):
            fn = getattr(mod, name, None)
            if fn is not None and not getattr(fn, "pipeline_guard", False):
                saved.append((mod, name, fn))
                setattr(mod, name, forbidden(name))
    return saved


def restore_object_guard(saved: list) -> None:
    for mod, name, fn in saved:
        setattr(mod, name, fn)


class _Comm:
    """The two process groups and the device/host staging rule of the device group."""

    def __init__(self, device: torch.device, backend: str):
        self.device = device
        self.backend = backend
        self.meta = dist.new_group(backend="gloo", timeout=_GROUP_TIMEOUT)
        self.data = None  # the default group
        self.staged = device.type == "cuda" and backend == "gloo"

    def isend(self, t: torch.Tensor, dst: int):
        if self.staged:
            t = t.cpu()  # shared-GPU debugging mode: host staging (a sync, by design)
        return dist.isend(t.contiguous(), dst, group=self.data), t

    def irecv(self, shape, dtype, src: int):
        buf = torch.empty(shape, dtype=dtype, device="cpu" if self.staged else self.device)
        return dist.irecv(buf, src, group=self.data), buf

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True) if self.staged else t


def _stage_device(cfg: EngineConfig, rank: int) -> torch.device:
    if cfg.device != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _device_backend(cfg: EngineConfig) -> str:
    if cfg.device == "cuda":
        if torch.cuda.device_count() >= cfg.pipeline_parallel_size:
            return "nccl"
        logger.warning("pipeline: %d stages share %d GPU(s); NCCL refuses duplicate GPUs, so the device "
                       "group is gloo staged through host memory (debugging mode)",
                       cfg.pipeline_parallel_size, torch.cuda.device_count())
    return "gloo"


# ---- worker processes ----------------------------------------------------------------------------
def worker_main(cfg: EngineConfig, rank: int, world: int, addr: str, port: int, layers: tuple[int, int],
                num_kv_blocks: int, max_model_len: int, backend: str, ready_q) -> None:
    """A stage process's life (after pp_stage_entry armed its watch on stage 0)."""
    try:
        if envs.pp_forbid_objects():
            install_object_guard()
        from .models.loader import load_hf_config
        device = _stage_device(cfg, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        hf = load_hf_config(cfg.model_path)
        runner = ModelRunner(cfg, hf, AsyncDecision(False, False, ()), num_kv_blocks, max_model_len,
                             layers[0], layers[1], device)
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
        ready_q.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported to stage 0, which raises it
        ready_q.put((rank, traceback.format_exc()))
        return
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_GROUP_TIMEOUT)
    comm = _Comm(device, backend)
    try:
        with torch.inference_mode():
            _worker_loop(runner, comm, rank, world)
    except Exception:  # noqa: BLE001 - a peer died or the step failed: exit, closing our pairs
        logger.error("pipeline stage %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _worker_loop(runner: ModelRunner, comm: _Comm, rank: int, world: int) -> None:
    last = rank == world - 1
    width = runner.admission_width
    hidden_size = runner.shape.hidden_size
    sends: deque = deque()  # (work, tensor) of the last two steps: waited before reuse
    while True:
        hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
        dist.recv(hdr, rank - 1, group=comm.meta)
        h = hdr.tolist()
        if not last:
            sends.append((dist.isend(hdr, rank + 1, group=comm.meta), hdr))
        if h[_OP] == OP_STOP:
            break
        payload = torch.empty(h[_PLEN], dtype=torch.int64)
        dist.recv(payload, rank - 1, group=comm.meta)
        if not last:
            sends.append((dist.isend(payload, rank + 1, group=comm.meta), payload))
        seq_lens, q_lens = _host_lens(payload, h, width)
        payload_dev = runner.staging.upload_tensor(payload)  # truly async H2D: through pinned memory
        work, hidden_in = comm.irecv((h[_T], hidden_size), runner.dtype, rank - 1)
        work.wait()
        hidden, sec = stage_forward(runner, h, payload_dev, seq_lens, q_lens, comm.to_device(hidden_in))
        if not last:
            sends.append(comm.isend(hidden, rank + 1))
        else:
            tokens = runner.sample_rows(hidden[sec.row[2]], sec.row[0], sec.row[1], bool(h[_GREEDY]),
                                        bool(h[_MASKS]), bool(h[_LOGPROBS]), sec.row[3] > 0)
            if h[_NSAMP] > 0:  # rounds where no row samples send nothing: stage 0 posts no recv
                sends.append(comm.isend(tokens, 0))
        while len(sends) > 6:
            sends.popleft()[0].wait()
    while sends:
        sends.popleft()[0].wait()


# ---- stage 0 ---------------------------------------------------------------------------------------
@dataclass
class _Pending:
    handle: "PipelineStepHandle"
    num_rows: int
    work: Any = None                       # irecv of the tokens (None: no row samples)
    buf: Optional[torch.Tensor] = None
    row: Optional[torch.Tensor] = None     # [4, S] device: slot, seq_len, last_idx, samples


class PipelineStepHandle:
    """StepHandle of a pipelined step: resolved (tokens received, relay written, D2H queued)
    in step order, at the latest when its tokens are read or a later step needs the relay."""
    start = None
    end = None

    def __init__(self, ex: "PipelineExecutor"):
        self._ex = ex
        self.inner: Optional[StepHandle] = None

    def get(self) -> list[int]:
        if self.inner is None:
            self._ex._resolve_through(self)
        if isinstance(self.inner.done, torch.cuda.Event):  # poll: a dead stage must not hang us
            deadline = time.monotonic() + envs.pp_timeout_s()
            while not self.inner.done.query():
                self._ex._check_alive()
                if time.monotonic() > deadline:
                    self._ex._fail(PipelineError("pipeline step timed out waiting for sampled tokens"))
                time.sleep(5e-5)
        return self.inner.get()

    def logprobs(self, vocab: int):
        self.get()
        return self.inner.logprobs(vocab)


class PipelineExecutor:
    """Drives stage 0 in-process and pp-1 worker processes; the interface LLMEngine uses on a
    ModelRunner: execute(sched, eos_ids) -> handle, .handoff, .vocab_size, close()."""

    def __init__(self, cfg: EngineConfig, hf_config, decision: AsyncDecision, num_kv_blocks: int,
                 max_model_len: int):
        validate_pipeline(cfg, hf_config)
        if dist.is_initialized():
            raise ValueError("EngineConfig.pipeline_parallel_size: torch.distributed is already initialized "
                             "in this process (one pipeline-parallel engine per process)")
        self._guard = install_object_guard() if envs.pp_forbid_objects() else []
        self.cfg = cfg
        self.pp = pp = cfg.pipeline_parallel_size
        self.ranges = split_layers(hf_config.num_hidden_layers, pp)
        self.device = _stage_device(cfg, 0) if cfg.device == "cuda" else torch.device("cpu")
        self.backend = _device_backend(cfg)
        self._closed = False
        self._failed: Optional[BaseException] = None
        self._pending: deque[_Pending] = deque()
        self._sends: deque = deque()
        self.num_token_recvs = 0   # steps whose tokens came back over the device group
        self.num_steps = 0
        self.num_steps_without_samples = 0  # every row mid-prefill: no token message at all
        addr, port = envs.master_addr(), envs.master_port()
        if port is None:
            port = free_port(addr)
        # The TCPStore server lives here (rank 0): bound before any worker starts.
        self._store = dist.TCPStore(addr, port, pp, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=120))
        ctx = torch.multiprocessing.get_context("spawn")
        exe = python_executable()
        if exe != sys.executable:  # embedded interpreters (Triton's Python stub) are not python
            ctx.set_executable(exe)
        ready_q = ctx.Queue()
        self._procs = []
        for rank in range(1, pp):
            p = ctx.Process(target=stage_process_main, name=f"pp-stage-{rank}", daemon=True,
                            args=(os.getpid(), cfg, rank, pp, addr, port, self.ranges[rank], num_kv_blocks,
                                  max_model_len, self.backend, ready_q))
            p.start()
            self._procs.append(p)
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs))
        try:
            self.runner = ModelRunner(cfg, hf_config, decision, num_kv_blocks, max_model_len,
                                      self.ranges[0][0], self.ranges[0][1], self.device)
            self._await_workers(ready_q, envs.pp_startup_timeout_s())
            dist.init_process_group(self.backend, store=self._store, rank=0, world_size=pp,
                                    timeout=_GROUP_TIMEOUT)
            self.comm = _Comm(self.device, self.backend)
        except BaseException:
            self._kill_workers()
            if dist.is_initialized():
                dist.destroy_process_group()
            restore_object_guard(self._guard)
            raise
        self.vocab_size = self.runner.vocab_size
        self.handoff = TokenHandoff(self.device, width=max(cfg.max_num_seqs, 1), depth=pp + 3,
                                    max_cols=packed_width())
        self._hidden_size = self.runner.shape.hidden_size
        self._zeros = torch.zeros(max(cfg.max_num_seqs, 1), dtype=torch.int64)
        logger.info("pipeline: %d stages, layers %s, device group %s", pp, self.ranges, self.backend)

    def _await_workers(self, ready_q, timeout: float) -> None:
        waiting = set(range(1, self.pp))
        deadline = time.monotonic() + timeout
        while waiting:
            try:
                rank, err = ready_q.get(timeout=0.2)
            except Exception:  # queue.Empty
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    raise PipelineError(f"pipeline stage process(es) {dead} exited during start-up")
                if time.monotonic() > deadline:
                    raise PipelineError(f"pipeline stages {sorted(waiting)} did not start within {timeout} s")
                continue
            if err is not None:
                raise PipelineError(f"pipeline stage {rank} failed to start:\n{err}")
            waiting.discard(rank)

    # ---- health ------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._failed is not None:
            raise PipelineError(f"pipeline is down: {self._failed}")
        if self._closed:
            raise PipelineError("pipeline executor is closed")
        sentinels = [p.sentinel for p in self._procs]
        if multiprocessing.connection.wait(sentinels, timeout=0):
            dead = [f"{p.name} (exit code {p.exitcode})" for p in self._procs if not p.is_alive()]
            self._fail(PipelineError(f"pipeline stage process died: {', '.join(dead)}"))

    def _fail(self, err: BaseException) -> None:
        if self._failed is None:
            self._failed = err
            logger.error("pipeline failed: %s", err)
            self._kill_workers()
        raise err

    def is_healthy(self) -> bool:
        return self._failed is None and not self._closed and all(p.is_alive() for p in self._procs)

    def _wait(self, work, what: str = "receive") -> None:
        """Wait for a send or receive: on gloo bounded by the timeout (a dead peer raises at
        once); on NCCL this only orders the current stream after it (no host wait)."""
        try:
            if self.backend == "gloo":
                work.wait(timeout=datetime.timedelta(seconds=envs.pp_timeout_s()))
            else:
                work.wait()
        except Exception as e:  # noqa: BLE001
            try:
                self._check_alive()
            except PipelineError:
                raise
            self._fail(PipelineError(f"pipeline {what} failed: {e}"))

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, eos_ids: tuple[int, ...]) -> PipelineStepHandle:
        self._check_alive()
        try:
            return self._execute(sched, eos_ids)
        except PipelineError:
            raise
        except Exception as e:  # noqa: BLE001 - a send to a dead peer, ...
            self._check_alive()
            self._fail(PipelineError(f"pipeline step failed: {e!r}"))

    def _execute(self, sched: SchedulerOutput, eos_ids: tuple[int, ...]) -> PipelineStepHandle:
        if any(r.first_from_relay for r in sched.rows):
            # Placeholders read the relay buffer: earlier steps' tokens must be written first
            # (on CUDA a stream wait; steps whose rows all prefill never wait here).
            self._resolve_all()
        h, payload, seq_lens, q_lens = pack_step(self.runner, sched, eos_ids)
        hdr = torch.tensor(h, dtype=torch.int64)
        meta = self.comm.meta
        self._sends.append((dist.isend(hdr, 1, group=meta), hdr))
        self._sends.append((dist.isend(payload, 1, group=meta), payload))
        payload_dev = self.runner.staging.upload_tensor(payload)
        hidden, sec = stage_forward(self.runner, h, payload_dev, seq_lens, q_lens, None)
        self._sends.append(self.comm.isend(hidden, 1))
        handle = PipelineStepHandle(self)
        pending = _Pending(handle, h[_S], row=sec.row)
        if h[_NSAMP] > 0:
            shape = (h[_S], packed_width()) if h[_LOGPROBS] else (h[_S],)
            pending.work, pending.buf = self.comm.irecv(shape, torch.int64, self.pp - 1)
        else:
            self.num_steps_without_samples += 1
        self._pending.append(pending)
        self.num_steps += 1
        # Sends of older steps have been consumed by now (or the peer is gone: raises).
        while len(self._sends) > 3 * (self.pp + 1):
            self._wait(self._sends.popleft()[0], "send")
        return handle

    def _resolve_all(self) -> None:
        while self._pending:
            self._resolve_one()

    def _resolve_through(self, handle: PipelineStepHandle) -> None:
        self._check_alive()
        with torch.inference_mode():
            while handle.inner is None:
                if not self._pending:
                    raise PipelineError("pipeline step handle has no pending step")
                self._resolve_one()

    def _resolve_one(self) -> None:
        p = self._pending.popleft()
        if p.work is None:
            p.handle.inner = StepHandle(self._zeros, p.num_rows, _DoneEvent())
            return
        self._wait(p.work)
        self.num_token_recvs += 1
        out = self.comm.to_device(p.buf)  # [S] ids, or [S, packed_width] ids + logprobs
        tokens = out[:, 0] if out.dim() == 2 else out
        r = self.runner
        # The relay write happens on the device: step n+1 gathers its input ids from here.
        r.relay[torch.where(p.row[3] > 0, p.row[0], r.scratch_slot)] = tokens
        p.handle.inner = self.handoff.publish(out, p.num_rows, keepalive=(p.buf, p.row))

    # ---- shutdown -----------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._failed is None and all(p.is_alive() for p in self._procs):
            try:
                stop = torch.zeros(HEADER_LEN, dtype=torch.int64)
                stop[_OP] = OP_STOP
                w = dist.isend(stop, 1, group=self.comm.meta)
                for p in self._procs:
                    p.join(timeout)
                if all(not p.is_alive() for p in self._procs):
                    w.wait()
            except Exception:  # noqa: BLE001
                logger.warning("pipeline: clean stop failed; killing stages", exc_info=True)
        self._kill_workers()
        self._sends.clear()
        self._pending.clear()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        self._store = None
        restore_object_guard(self._guard)

    def _kill_workers(self) -> None:
        _kill_all(self._procs)


def _kill_all(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5.0)


__all__ = ["PipelineExecutor", "PipelineError", "split_layers", "validate_pipeline", "pack_step",
           "stage_forward", "install_object_guard", "restore_object_guard"]
