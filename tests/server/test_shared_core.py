"""Two llm instances (instance_group count 2) over one engine core: one core process for both
stubs, greedy streams from many concurrent clients equal the in-process engine's tokens, cancels
mid-stream leave nothing held, the engine's counters are exported once (not once per instance),
and an unload ends both stubs and the core."""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import time

import numpy as np

from . import procs
from .conftest import ACCESS_KEY, ROOT, engine_env, start_server
from .test_faults import (BROKEN_OFF, SIGNAL_BOUND_S, assert_all_ended, assert_nothing_left, launch_server,
                          snapshot, start_streams, wait_ready)
from .test_metrics_unload import engine_cores
from .util import StreamClient, http_post, wait_for


def _two_instance_repo(tmp_path, whole: bool = False):
    """llm with instance_group count 2 (whole: the whole shipped repository around it)."""
    repo = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__")
    if whole:
        shutil.copytree(ROOT / "model_repository", repo, ignore=ignore)
    else:
        shutil.copytree(ROOT / "model_repository" / "llm", repo / "llm", ignore=ignore)
    cfg = repo / "llm" / "config.pbtxt"
    text, n = re.subn(r"instance_group \[ \{ count: 1 ", "instance_group [ { count: 2 ", cfg.read_text())
    assert n == 1
    cfg.write_text(text)
    return repo


def _stream(sc, prompt, max_tokens, rid):
    return sc.send("llm", {"input_ids": np.array([prompt], dtype=np.int32), "max_tokens": max_tokens,
                           "ignore_eos": True, "temperature": 0.0, "stream": True,
                           "exclude_input_in_output": True}, rid)


def test_two_instances_share_one_engine(tmp_path, reference_engine):
    from backend_lib import SamplingParams
    srv = start_server(tmp_path, model_control="explicit", load_models=("llm",),
                       model_repository=_two_instance_repo(tmp_path), wait_model="llm")
    try:
        llm_stubs = [p for p in procs.stubs(srv.proc.pid) if p.stub_model == "llm"]
        assert len(llm_stubs) == 2, [p.argv for p in procs.stubs(srv.proc.pid)]
        assert len(engine_cores(srv)) == 1, [p.argv for p in engine_cores(srv)]
        log = srv.log_path.read_text(errors="replace")
        assert log.count("[llm] engine ready") == 2
        # the stubs only talk to the core: torch is loaded in the core, never in a stub
        assert procs.maps_library(engine_cores(srv)[0].pid, "libtorch_cpu")
        assert [p.pid for p in llm_stubs if procs.maps_library(p.pid, "libtorch")] == []

        rng = random.Random(5)
        prompts = [[rng.randrange(4, 700) for _ in range(rng.randint(3, 40))] for _ in range(24)]
        lens = [rng.randint(4, 24) for _ in prompts]
        refs = [o.token_ids for o in reference_engine.generate(
            prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lens])]
        queried0 = srv.metric("llm_prefix_cache_queried_tokens_total")
        gen0 = srv.metric("llm_generation_tokens_total")
        # two rounds of 24 concurrent streams, each on its own client connection half the time
        for rnd in range(2):
            clients = [StreamClient(srv.grpc_url) for _ in range(4)]
            try:
                got = [_stream(clients[i % 4], p, m, f"r{rnd}-{i}") for i, (p, m) in enumerate(zip(prompts, lens))]
                for c in got:
                    assert c.done.wait(120), "stream left hanging"
                time.sleep(0.1)
                for i, c in enumerate(got):
                    assert c.finals == 1 and not c.errors, c.errors
                    assert sum(c.ids(), []) == refs[i], f"round {rnd} prompt {i}"
            finally:
                for sc in clients:
                    sc.close()

        # each instance exports its own requests' counts and its share of the engine's own
        # counters: the sums are the totals (every admission looks its prompt up in the prefix
        # cache), not once per instance
        # a stats export after the last step, on both instances (later on a loaded box)
        assert wait_for(lambda: srv.metric("llm_generation_tokens_total") - gen0 >= 2 * sum(lens), 20)
        time.sleep(0.5)  # one more export: a count past the expected would show now
        assert srv.metric("llm_generation_tokens_total") - gen0 == 2 * sum(lens)
        assert srv.metric("llm_prefix_cache_queried_tokens_total") - queried0 == 2 * sum(map(len, prompts))
        # one series per instance: two instances that made the same series would share one
        # Prometheus object in the server, freed by the first to unload under the other
        series = [l.split("{", 1)[1].split("}", 1)[0] for l in srv.metrics_text().splitlines()
                  if l.startswith("llm_generation_tokens_total{")]
        assert sorted(l for s in series for l in s.split(",") if l.startswith("instance=")) == [
            'instance="llm_0_0"', 'instance="llm_0_1"'], series

        # cancels at random points: the engine keeps nothing of them
        sc = StreamClient(srv.grpc_url)
        long = [_stream(sc, p, 300, f"c{i}") for i, p in enumerate(prompts[:8])]
        assert wait_for(lambda: all(len(c.responses) >= rng.randint(1, 6) for c in long), 60, 0.01)
        sc.close(cancel=True)
        assert wait_for(lambda: srv.metric("llm_kv_blocks_used") == 0 and srv.metric("llm_num_requests_running") == 0,
                        30), (srv.metric("llm_kv_blocks_used"), srv.metric("llm_num_requests_running"))
        # and the engine still answers on both instances
        sc = StreamClient(srv.grpc_url)
        try:
            again = [_stream(sc, p, m, f"a{i}") for i, (p, m) in enumerate(zip(prompts[:6], lens[:6]))]
            for i, c in enumerate(again):
                assert c.done.wait(60)
                assert c.finals == 1 and sum(c.ids(), []) == refs[i]
        finally:
            sc.close()

        status, text = http_post(srv.http_url, "/v2/repository/models/llm/unload", {},
                                 headers={"triton-access-key": ACCESS_KEY}, timeout=60)
        assert status == 200, text
        # both stubs finalize (each up to ~10 s: the monitor's join, the engine's stop) before the
        # last one's STOP ends the core; on a loaded 2-core box that has taken tens of seconds
        assert wait_for(lambda: not engine_cores(srv), 90), _where_cores_wait(srv)
        assert wait_for(lambda: not [p for p in procs.stubs(srv.proc.pid) if p.stub_model == "llm"], 30)
    finally:
        srv.stop()


def _where_cores_wait(srv) -> str:
    """The server's processes still alive, and the cores' threads' Python stacks (SIGUSR1:
    faulthandler, into the server log), as one string (pytest prints a string message whole)."""
    cores = engine_cores(srv)
    for p in cores:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)
    alive = "\n".join(f"{p.pid} ppid={p.ppid} {p.state} {' '.join(p.argv)[:160]}" for p in procs.group(srv.proc.pid))
    return f"still alive:\n{alive}\n--- server log ---\n{srv.log_tail(200)}"


def test_stops_and_cancels_reach_the_request_on_either_instance(tmp_path):
    """Triton gives a TensorRT-LLM stop (or a BLS route's cancel_request_id) to any instance of
    llm, not the one streaming the request it names: the engine core ends the request of that
    id for whichever instance added it. Before, about half of them did nothing."""
    srv = start_server(tmp_path, model_control="explicit", load_models=("llm",),
                       model_repository=_two_instance_repo(tmp_path), wait_model="llm")
    sc, ctl = StreamClient(srv.grpc_url), StreamClient(srv.grpc_url)
    try:
        body = {"input_ids": np.array([[1, 300, 301]], np.int32), "request_output_len": np.array([[1500]], np.int32),
                "streaming": np.array([[True]]), "ignore_eos": np.array([[True]])}
        # 0-3 stopped as TensorRT-LLM's clients do, 4-7 cancelled as the BLS routes do (their keys)
        ids = [f"stop-{i}" for i in range(4)] + [f"bls-route-{i}" for i in range(4, 8)]
        streams = [sc.send("llm", body, rid) for rid in ids]
        assert wait_for(lambda: all(c.responses for c in streams), 60)
        stop = {"input_ids": np.zeros((1, 1), np.int32), "request_output_len": np.array([[0]], np.int32),
                "stop": np.array([[True]])}
        stops = [ctl.send("llm", stop, rid) for rid in ids[:4]]
        cancels = [ctl.send("llm", {"cancel_request_id": np.array([[rid.encode()]], object)}, f"{rid}-cancel")
                   for rid in ids[4:]]
        for c in streams + stops + cancels:
            assert c.done.wait(60), "left hanging"
        n = [sum(r.as_numpy("output_ids").shape[2] for r in c.responses) for c in streams]
        assert all(k < 1500 for k in n) and all(c.finals == 1 and not c.errors for c in streams), n
        assert wait_for(lambda: srv.metric("llm_num_requests_running") == 0, 10)
    finally:
        sc.close()
        ctl.close()
        srv.stop()


def test_killed_server_leaves_no_shared_core(tmp_path):
    """tritonserver killed with streams in flight on both instances: the shared core (which
    outlives the stub that spawned it, not the server) is gone within seconds, whatever the
    stubs do (a 2.51 stub outlives its killed server for a while; the launcher's supervisor
    ends them, tests/server/test_faults.py)."""
    srv = start_server(tmp_path, model_control="explicit", load_models=("llm",),
                       model_repository=_two_instance_repo(tmp_path), wait_model="llm")
    try:
        (core,) = engine_cores(srv)
        stubs = [p.pid for p in procs.stubs(srv.proc.pid) if p.stub_model == "llm"]
        assert len(stubs) == 2
        sc = StreamClient(srv.grpc_url)
        got = [_stream(sc, [5 + i, 6, 7], 1000, f"k{i}") for i in range(6)]
        assert wait_for(lambda: all(len(c.responses) >= 2 for c in got), 60, 0.01)
        srv.proc.kill()
        srv.proc.wait(10)
        gone = procs.Proc(0, 0, 0, "Z", ())
        assert wait_for(lambda: (procs.read_proc(core.pid) or gone).state == "Z", 10), procs.read_proc(core.pid)
        sc.close()
    finally:
        srv.stop()


def test_ctrl_c_with_streams_on_two_instances_leaves_nothing(tmp_path):
    """`make serve`'s Ctrl-C (SIGINT to the launcher's group) with streams in flight on every
    route over two llm instances: every client hears a FINAL or an error, the server exits, and
    no process (the shared core included) and no shared-memory region is left."""
    srv = launch_server(tmp_path, extra_env=engine_env("engine-process"),
                        model_repository=_two_instance_repo(tmp_path, whole=True))
    regions: set[str] = set()
    streams: list = []
    try:
        wait_ready(srv)
        members, regions = snapshot(srv, "engine-process")  # one engine core
        assert sum(p.stub_model == "llm" for p in members) == 2
        streams = start_streams(srv)
        t0 = time.monotonic()
        os.killpg(srv.pgid, signal.SIGINT)
        summary = assert_all_ended(streams, t0, SIGNAL_BOUND_S)
        assert all(s.out.end in ("final", "error") and not s.out.message.startswith(BROKEN_OFF)
                   for s in streams), summary
        srv.proc.wait(max(0.1, t0 + SIGNAL_BOUND_S - time.monotonic()))
        assert_nothing_left(srv, members, regions, time.monotonic() + 5)
    finally:
        for s in streams:
            s.close()
        srv.cleanup(regions)


def test_two_instances_load_and_unload_again_and_again(tmp_path):
    """Unload with two instances exporting stats every few ms, several times over one server: no
    instance writes a metric the other's unload freed (tritonserver aborted on a corrupt heap
    when both had made the same series), and each cycle's streams end whole."""
    repo = _two_instance_repo(tmp_path)
    cfg = repo / "llm" / "config.pbtxt"
    text, n = re.subn(r'(key: "stats_interval_ms"\s*value: \{ string_value: )"\d+"', r'\1"2"', cfg.read_text())
    assert n == 1
    cfg.write_text(text)
    srv = start_server(tmp_path, model_control="explicit", load_models=("llm",), model_repository=repo,
                       wait_model="llm")
    headers = {"triton-access-key": ACCESS_KEY}
    try:
        for cycle in range(4):
            if cycle:
                status, text = http_post(srv.http_url, "/v2/repository/models/llm/load", {}, headers=headers,
                                         timeout=120)
                assert status == 200, (cycle, text)
            sc = StreamClient(srv.grpc_url)
            try:
                got = [_stream(sc, [5 + i, 6, 7], 6, f"u{cycle}-{i}") for i in range(8)]
                for c in got:
                    assert c.done.wait(60), cycle
                    assert c.finals == 1 and not c.errors and len(sum(c.ids(), [])) == 6, (cycle, c.errors)
            finally:
                sc.close()
            status, text = http_post(srv.http_url, "/v2/repository/models/llm/unload", {}, headers=headers,
                                     timeout=60)
            assert status == 200, (cycle, text)
            assert wait_for(lambda: not [p for p in procs.stubs(srv.proc.pid) if p.stub_model == "llm"], 60), \
                (cycle, srv.log_tail())
            assert srv.proc.poll() is None, (cycle, srv.log_tail())
        log = srv.log_path.read_text(errors="replace")
        assert "Signal (" not in log and "malloc" not in log, log[-3000:]
    finally:
        srv.stop()
