"""PP=2 sync and PP=3 (uneven split) vs PP=1, and a dead stage -> errors (not a hang).
See conftest.py."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from backend_lib import AsyncEngine, FinishReason, LLMEngine, SamplingParams, envs
from pp_workload import MAX_LEN, _cfg, assert_matches_reference, assert_same, drive, make_workload


def test_pp2_sync_matches_pp1(tiny_llama_path, reference):
    eng = LLMEngine(_cfg(tiny_llama_path, pp=2, async_mode="off"))
    try:
        assert not eng.async_enabled and eng._max_inflight == 0
        assert_matches_reference(eng, reference, ((4, 12), (16, 14)))
    finally:
        eng.close()
    assert not dist.is_initialized()


def test_pp3_uneven_split_matches_pp1(tiny_llama_path, reference):
    eng = LLMEngine(_cfg(tiny_llama_path, pp=3, async_mode="on", max_num_batched_tokens=4))
    try:
        assert eng.runner.ranges == [(0, 2), (2, 3), (3, 4)]
        events, _ = make_workload(15, eng.vocab_size)
        assert_same(reference(15), drive(eng, events))
    finally:
        eng.close()


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_dead_stage_fails_requests_not_hang(tiny_llama_path, monkeypatch, how):
    """kill: the stage process dies (sentinel / closed connection). stop: it hangs alive
    (SIGSTOP); stage 0's receive timeout ends the wait."""
    if how == "stop":
        monkeypatch.setenv(envs.PP_TIMEOUT_ENV, "5")  # read by every wait: set before any starts
    aeng = AsyncEngine(_cfg(tiny_llama_path, pp=2, async_mode="on"))
    try:
        finals: dict[str, object] = {}
        first = threading.Event()
        done = threading.Event()
        n = 4

        def cb(out):
            if out.new_token_ids:
                first.set()
            if out.finished:
                finals[out.request_id] = out
                if len(finals) == n:
                    done.set()
        for i in range(n):
            aeng.add_request(f"k{i}", [5 + i, 6, 7], SamplingParams(max_tokens=MAX_LEN - 8, temperature=0.0,
                                                                    ignore_eos=True), callback=cb)
        assert first.wait(60), "no token streamed"
        proc = aeng.engine.runner._procs[0]
        if how == "kill":
            proc.kill()
        else:
            os.kill(proc.pid, signal.SIGSTOP)
        assert done.wait(60), "requests did not finish after the stage died"
        assert all(o.finish_reason == FinishReason.ERROR and o.error for o in finals.values())
        t0 = time.monotonic()
        while aeng.is_healthy() and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not aeng.is_healthy()
        with pytest.raises(RuntimeError, match="not healthy"):
            aeng.add_request("late", [1, 2], SamplingParams(max_tokens=2))
    finally:
        aeng.shutdown(timeout=20)
    assert not dist.is_initialized()


EXIT_BOUND_S = 3.0

_KILLED_DURING_STARTUP = r"""
import os, signal, sys, threading, time
from backend_lib import LLMEngine
sys.path.insert(0, "tests/pp")
from pp_workload import _cfg

threading.Thread(target=lambda: LLMEngine(_cfg(sys.argv[1], pp=3, async_mode="off")), daemon=True).start()
me = str(os.getpid())


def stage_child(pid):  # a process may exit between listdir and the reads: not a child then
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = f.read().rsplit(")", 1)[1].split()[1]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return parent == me and b"multiprocessing-fork" in f.read()
    except OSError:
        return False


deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # the stage processes exist: they are starting up
    kids = [p for p in os.listdir("/proc") if p.isdigit() and p != me and stage_child(p)]
    if len(kids) == 2:
        print(" ".join(kids), flush=True)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)
"""


def test_stage_processes_end_with_a_killed_stage_0_even_during_startup(tiny_llama_path, tmp_path):
    """Stage 0's process is killed while its stage processes are still starting (loading the
    model, waiting for the rendezvous): they end at once, not when their 120 s rendezvous
    timeout runs out."""
    import subprocess
    import sys

    def process_alive(pid: int) -> bool:  # not gone, not a zombie
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: the stage processes inherit them
        p = subprocess.run([sys.executable, "-c", _KILLED_DURING_STARTUP, str(tiny_llama_path)], stdout=o, stderr=e,
                           timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert p.returncode == -signal.SIGKILL, err.read_text()[-2000:]
    pids = [int(x) for x in out.read_text().split()]
    assert len(pids) == 2, out.read_text() + err.read_text()[-2000:]
    # Stage 0 died 0.5 s after its stages appeared, while they were still importing: the watch
    # on it is armed before those imports (pp_stage_entry), so they end within a process
    # start-up, not after torch's import (6-10 s on a loaded box).
    t0 = time.monotonic()
    deadline = t0 + EXIT_BOUND_S
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if process_alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"stage processes outlived stage 0 by {EXIT_BOUND_S} s"
    print(f"stages ended {time.monotonic() - t0:.2f} s after the test saw stage 0 gone")
