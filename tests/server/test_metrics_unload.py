"""Exact metrics; unload with streams in flight; restricted APIs."""
from __future__ import annotations

import os
import signal
import time
import urllib.request

import numpy as np
import pytest

from . import procs
from .conftest import ACCESS_KEY, engine_env, BOTH_ENGINES, ENGINE_MODES, ROOT, start_server
from .util import StreamClient, http_post, wait_for


@BOTH_ENGINES
def test_metrics_are_exact(server):
    assert wait_for(server.idle, 15)
    names = ["llm_prompt_tokens_total", "llm_generation_tokens_total", "llm_time_to_first_token_seconds_count",
             "llm_time_per_output_token_seconds_count", "llm_sync_steps_total", "llm_async_steps_total",
             "llm_requests_rejected_total", "llm_responses_sent_total", "llm_response_send_seconds_total",
             "llm_step_seconds_total", "llm_step_gpu_wait_seconds_total", "llm_prefill_steps_total"]
    before = {n: server.metric(n) for n in names}
    length0 = server.metric("llm_requests_finished_total", reason="length")
    prompts = [[1 + i] * (3 + i) for i in range(5)]           # 3..7 tokens: 25 in all
    max_tokens = [2, 3, 4, 5, 6]                              # 20 in all
    sc = StreamClient(server.grpc_url)
    try:
        got = [sc.send("llm", {"input_ids": np.array([p], dtype=np.int32), "max_tokens": m, "ignore_eos": True,
                               "temperature": 0.0, "stream": True, "exclude_input_in_output": True}, f"m{i}")
               for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        for c in got:
            assert c.done.wait(60)
    finally:
        sc.close()
    assert [len(sum(c.ids(), [])) for c in got] == max_tokens
    status, _ = http_post(server.http_url, "/v2/models/llm/generate", {"input_ids": [1], "max_tokens": 0})
    assert status == 400
    assert wait_for(server.idle, 10)
    # the counters reach the server with the next stats export (every stats_interval_ms; later
    # on a loaded box): wait for the last of them, the finish counts, then read them all
    assert wait_for(lambda: server.metric("llm_requests_finished_total", reason="length") - length0 >= 5
                    and server.metric("llm_time_per_output_token_seconds_count")
                    - before["llm_time_per_output_token_seconds_count"] >= 5, 20)
    time.sleep(0.5)  # one more export: a count past the expected would show now
    d = {n: server.metric(n) - before[n] for n in names}
    assert d["llm_prompt_tokens_total"] == 25
    assert d["llm_generation_tokens_total"] == 20
    assert d["llm_time_to_first_token_seconds_count"] == 5
    assert d["llm_time_per_output_token_seconds_count"] == 5
    assert d["llm_requests_rejected_total"] == 1
    # one count per response the clients got (however the stream coalesced them), and their time
    assert d["llm_responses_sent_total"] == sum(len(c.ids()) for c in got) >= 5
    assert 0 < d["llm_response_send_seconds_total"] < 5
    assert server.metric("llm_requests_finished_total", reason="length") - length0 == 5
    # every engine step is counted as either async (handoff engaged) or sync; on CPU with
    # async_token_handoff=auto the engine runs synchronously
    steps = d["llm_sync_steps_total"] + d["llm_async_steps_total"]
    assert steps >= max(max_tokens)
    assert d["llm_async_steps_total"] == 0
    # of which those carrying a prompt: each prompt (3-7 tokens) fits one step, so 1 to 5 of them
    assert 1 <= d["llm_prefill_steps_total"] <= 5 < steps
    # the engine thread's time in those steps, of which its waits on the device
    assert 0 < d["llm_step_seconds_total"] < 60
    assert 0 <= d["llm_step_gpu_wait_seconds_total"] <= d["llm_step_seconds_total"]
    text = server.metrics_text()
    for fam in ("llm_gpu_idle_gap_seconds", "llm_kv_blocks_total", "llm_engine_healthy"):
        assert fam in text
    assert server.metric("llm_engine_healthy") == 1
    assert server.metric("llm_kv_blocks_total") > 0


@BOTH_ENGINES
def test_prefix_cache_metrics(server):
    """The second request with the same 40-token prompt takes its 2 full blocks of 16 from
    the prefix cache (the last token is always computed), and answers the same."""
    assert wait_for(server.idle, 15)
    names = ["llm_prefix_cache_queried_tokens_total", "llm_prefix_cache_hit_tokens_total",
             "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"]
    prompt = [[600 + (i * 37) % 150 for i in range(40)]]   # used by no other test
    sc = StreamClient(server.grpc_url)
    outs, deltas = [], []
    try:
        for i in range(2):
            before = {n: server.metric(n) for n in names}
            c = sc.send("llm", {"input_ids": np.array(prompt, dtype=np.int32), "max_tokens": 4, "ignore_eos": True,
                                "temperature": 0.0, "stream": True, "exclude_input_in_output": True}, f"pc{i}")
            assert c.done.wait(60)
            assert not c.errors, c.errors
            outs.append(sum(c.ids(), []))
            assert wait_for(server.idle, 10)
            # the counters reach the server with the next stats export (later on a loaded box)
            assert wait_for(lambda: server.metric(names[0]) - before[names[0]] >= 40, 20)
            time.sleep(0.5)  # one more export: a count past the expected would show now
            deltas.append({n: server.metric(n) - before[n] for n in names})
    finally:
        sc.close()
    assert len(outs[0]) == 4 and outs[0] == outs[1]
    assert deltas == [dict(zip(names, (40, 0, 40, 0))), dict(zip(names, (40, 32, 40, 32)))]
    assert server.metric("llm_kv_blocks_cached") >= 2


def _scrape(server, names: list[str]) -> dict[str, float]:
    """The samples of `names` (llm's labels) from one scrape. A scrape can fall between two gauge
    sets of one stats export: compare gauges only in a scrape that waited for agreement."""
    out = {}
    for line in server.metrics_text().splitlines():
        for n in names:
            if line.startswith(n + "{") and 'model="llm"' in line:
                out[n] = float(line.rsplit(" ", 1)[1])
    return out


@BOTH_ENGINES
def test_vllm_kv_cache_usage_follows_the_engine(server):
    """vllm_backend's KV-usage gauge (and vLLM v1's name) = blocks held / blocks in the pool,
    non-zero while a request runs and 0 when idle; preemptions under vLLM's name too."""
    names = ["vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "llm_kv_blocks_used",
             "llm_kv_blocks_total", "vllm:num_preemptions_total", "llm_preemptions_total"]
    assert wait_for(server.idle, 15)
    sc = StreamClient(server.grpc_url)
    try:
        c = sc.send("llm", {"input_ids": np.array([[5, 6, 7, 8]], dtype=np.int32), "max_tokens": 1500,
                            "ignore_eos": True, "temperature": 0.0, "stream": True}, "kvu")
        # One stats export sets the gauges one after another, and a scrape can land between two
        # of those sets (Triton's metrics are not a transaction): wait for a scrape that falls
        # between exports. A wrong mapping never gives one.
        def consistent(m):
            return (m.get("llm_kv_blocks_used", 0) > 0
                    and m["vllm:gpu_cache_usage_perc"] == m["vllm:kv_cache_usage_perc"]
                    and m["vllm:kv_cache_usage_perc"] == pytest.approx(m["llm_kv_blocks_used"]
                                                                       / m["llm_kv_blocks_total"]))
        seen = []
        assert wait_for(lambda: seen.append(_scrape(server, names)) or consistent(seen[-1]), 20), seen[-3:]
        m = seen[-1]
        assert 0 < m["vllm:kv_cache_usage_perc"] < 1
        assert m["vllm:num_preemptions_total"] == m["llm_preemptions_total"]
    finally:
        sc.close(cancel=True)
    assert wait_for(server.idle, 30)
    assert wait_for(lambda: _scrape(server, names)["vllm:kv_cache_usage_perc"] == 0, 5)


def test_restricted_apis_need_the_key(server):
    status, text = http_post(server.http_url, "/v2/repository/index", {})
    assert status != 200 and "triton-access-key" in text
    status, text = http_post(server.http_url, "/v2/repository/index", {}, headers={"triton-access-key": ACCESS_KEY})
    assert status == 200 and '"llm"' in text
    # model control is off: even with the key, no remote load/unload
    status, text = http_post(server.http_url, "/v2/repository/models/llm/unload", {},
                             headers={"triton-access-key": ACCESS_KEY})
    assert status != 200


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_unload_with_streams_in_flight(tmp_path, mode):
    srv = start_server(tmp_path, model_control="explicit", load_models=("llm",), wait_model="llm",
                       extra_env=engine_env(mode))
    try:
        sc = StreamClient(srv.grpc_url)
        got = [sc.send("llm", {"input_ids": np.array([[1, 2, 3 + i]], dtype=np.int32), "max_tokens": 1900,
                               "ignore_eos": True, "temperature": 0.0, "stream": True,
                               "exclude_input_in_output": True}, f"u{i}") for i in range(4)]
        assert wait_for(lambda: all(len(c.responses) >= 2 for c in got), 60, 0.01)
        status, text = http_post(srv.http_url, "/v2/repository/models/llm/unload", {})
        assert status != 200  # restricted without the key
        t0 = time.monotonic()
        status, text = http_post(srv.http_url, "/v2/repository/models/llm/unload", {},
                                 headers={"triton-access-key": ACCESS_KEY}, timeout=60)
        assert status == 200, text
        for c in got:  # every stream ends, promptly, with exactly one FINAL
            assert c.done.wait(30), "stream left hanging by unload"
        time.sleep(0.1)
        for c in got:
            assert c.finals == 1
            assert len(sum(c.ids(), [])) < 1900
        assert time.monotonic() - t0 < 30
        assert wait_for(lambda: urllib_status(f"http://{srv.http_url}/v2/models/llm/ready") != 200, 30)
        sc.close()
        # 2.51 finalizes the model once its clients' streams are closed: the engine process ends with it
        assert wait_for(lambda: not engine_cores(srv), 20), engine_cores(srv)
    finally:
        srv.stop()


def engine_cores(srv) -> list:
    """The engine processes (engine_process=on) among the server's processes."""
    return [p for p in procs.group(srv.proc.pid) if "backend_lib.engine_core" in p.argv]


def urllib_status(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:  # noqa: BLE001
        return -1


@pytest.mark.parametrize("mode,how", [("in-process", "fault"), ("engine-process", "fault"),
                                      ("engine-process", "core-killed")])
def test_engine_death_fails_requests_fast(tmp_path, mode, how):
    """The engine loop dies (test hook; or its process is killed), here with
    async_token_handoff=on: in-flight requests get an error with FINAL, new requests fail fast
    instead of hanging, the health gauge drops to 0; the async steps it ran were exported."""
    import shutil
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / "llm", repo / "llm")
    cfg = repo / "llm" / "config.pbtxt"
    text = cfg.read_text().replace('key: "async_token_handoff" value: { string_value: "auto" }',
                                   'key: "async_token_handoff" value: { string_value: "on" }')
    if how == "fault":
        text += '\nparameters { key: "test_fault_after_steps" value: { string_value: "40" } }\n'
    cfg.write_text(text)
    srv = start_server(tmp_path, model_control="explicit", load_models=("llm",), model_repository=repo,
                       wait_model="llm", extra_env=engine_env(mode))
    try:
        sc = StreamClient(srv.grpc_url)
        got = [sc.send("llm", {"input_ids": np.array([[1, 2, 3 + i]], dtype=np.int32), "max_tokens": 1000,
                               "ignore_eos": True, "temperature": 0.0, "stream": True,
                               "exclude_input_in_output": True}, f"d{i}") for i in range(2)]
        if how == "core-killed":
            assert wait_for(lambda: all(len(c.responses) >= 2 for c in got), 60, 0.01)
            time.sleep(0.5)  # a stats export with steps in it
            (core,) = engine_cores(srv)
            os.kill(core.pid, signal.SIGKILL)
        for c in got:
            assert c.done.wait(60), "in-flight request left hanging by engine death"
        time.sleep(0.1)
        for c in got:
            assert c.finals == 1 and len(c.errors) == 1 and "engine failed" in c.errors[0], c.errors
            assert 0 < len(sum(c.ids(), [])) < 1000
            if how == "core-killed":
                assert "engine process" in c.errors[0] and "was killed by SIGKILL" in c.errors[0], c.errors
        assert wait_for(lambda: not engine_cores(srv), 10), engine_cores(srv)  # a failed core exits
        t0 = time.monotonic()
        status, text = http_post(srv.http_url, "/v2/models/llm/generate", {"input_ids": [1, 2], "max_tokens": 2},
                                 timeout=10)
        assert status == 400 and "not healthy" in text, text
        assert time.monotonic() - t0 < 5
        assert wait_for(lambda: srv.metric("llm_engine_healthy") == 0, 5)
        # async_token_handoff=on runs the overlapped path (emulated on CPU): its steps are counted
        assert srv.metric("llm_async_steps_total") > 0
        sc.close()
    finally:
        srv.stop()
