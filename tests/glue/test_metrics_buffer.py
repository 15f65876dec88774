"""EngineMetrics (triton_glue/metrics.py) with a recording stand-in for pb_utils' metric API:
the per-request metrics the sending thread records make no call to the server until the stats
thread's flush, which sends each exactly once (every observation, the summed counters)."""
import threading
import types

from triton_glue.metrics import EngineMetrics


def _recording_pb_utils(calls: list, created: list | None = None):
    class _Metric:
        def __init__(self, name, labels):
            self.key = (name, labels.get("reason"))

        def observe(self, v):
            calls.append(("observe", self.key, v))

        def increment(self, v):
            calls.append(("increment", self.key, v))

        def set(self, v):
            calls.append(("set", self.key, v))

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels, buckets=None):
            if created is not None:
                created.append(self.name)
            return _Metric(self.name, labels)

    return types.SimpleNamespace(MetricFamily=MetricFamily)


def test_per_request_metrics_wait_for_the_flush_and_arrive_once():
    calls = []
    m = EngineMetrics(_recording_pb_utils(calls), {"model": "llm", "version": "1"})

    def sender(k):
        for i in range(50):
            m.first_token(0.01 * (k + 1))
            m.request_finished("length" if i % 5 else "stop", num_prompt=10, num_generated=3,
                               tpot=0.002 if i % 2 else None)

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == []  # the senders made no call to the server
    m.flush()
    obs = [c for c in calls if c[0] == "observe"]
    assert sorted(v for _, key, v in obs if key[0] == "llm_time_to_first_token_seconds") == \
        sorted([0.01 * (k + 1) for k in range(4) for _ in range(50)])
    assert [v for _, key, v in obs if key[0] == "llm_time_per_output_token_seconds"] == [0.002] * 100
    inc = {key: v for op, key, v in calls if op == "increment"}
    assert inc[("llm_prompt_tokens_total", None)] == 2000
    assert inc[("llm_generation_tokens_total", None)] == 600
    assert inc[("llm_requests_finished_total", "length")] == 160
    assert inc[("llm_requests_finished_total", "stop")] == 40
    calls.clear()
    m.request_finished("something-odd", num_prompt=1, num_generated=0)  # counted as an error
    m.flush()
    m.flush()  # nothing twice
    inc = [(key, v) for op, key, v in calls if op == "increment"]
    assert (("llm_requests_finished_total", "error"), 1) in inc
    assert sum(v for key, v in inc if key[0] == "llm_requests_finished_total") == 1


def test_an_export_sends_the_finished_requests_last_and_only_those_its_stats_cover():
    """bench/serve.py reads a point's counters once the finished requests cover the point: so
    in one export the finished counts go out after the steps and sends, and a request that
    finishes while the engine stats are read is left to the next export (its last step may
    not be in those stats)."""
    from backend_lib.engine_stats import EngineStats
    calls = []
    m = EngineMetrics(_recording_pb_utils(calls), {"model": "llm", "version": "1"})
    m.request_finished("length", num_prompt=4, num_generated=2)
    steps = iter([5, 9])

    class Engine:
        def stats(self):
            m.request_finished("stop", num_prompt=4, num_generated=3)   # the sender thread, meanwhile
            return EngineStats(async_steps_total=next(steps), generation_tokens_total=2)

        def is_healthy(self):
            return True

    m.export(Engine(), lambda: (7, 0.5))
    order = [key[0] for op, key, v in calls if op == "increment"]
    finished_at = order.index("llm_requests_finished_total")
    assert {"llm_async_steps_total", "llm_responses_sent_total"} <= set(order[:finished_at])
    assert order[finished_at:] == ["llm_requests_finished_total"]
    inc = [(key, v) for op, key, v in calls if op == "increment" and key[0] == "llm_requests_finished_total"]
    assert inc == [(("llm_requests_finished_total", "length"), 1)]
    calls.clear()
    m.export(Engine(), lambda: (9, 0.6))
    inc = [(key, v) for op, key, v in calls if op == "increment" and key[0] == "llm_requests_finished_total"]
    assert inc == [(("llm_requests_finished_total", "stop"), 1)]


def test_stale_engine_stats_hold_the_finished_counts_back_until_fresh_ones():
    """Stats an engine core did not answer in time (stale: its last ones) may lack the steps of
    requests that have finished since: exported with them, a reader waiting for the finished
    counts would read a point without its steps. The counts wait for a fresh reading, for at
    most MAX_STALE_EXPORTS exports in a row, and at once when the engine is gone."""
    from backend_lib.engine_stats import EngineStats
    from triton_glue.metrics import MAX_STALE_EXPORTS
    calls = []
    m = EngineMetrics(_recording_pb_utils(calls), {"model": "llm", "version": "1"})

    def finished_sent():
        got = [(key[1], v) for op, key, v in calls if op == "increment" and key[0] == "llm_requests_finished_total"]
        tokens = sum(v for op, key, v in calls if op == "increment" and key[0] == "llm_generation_tokens_total")
        ttft = [v for op, key, v in calls if op == "observe" and key[0] == "llm_time_to_first_token_seconds"]
        calls.clear()
        return got, tokens, ttft

    class Engine:
        stale, healthy, steps = False, True, 0

        def stats(self):
            return EngineStats(async_steps_total=self.steps, stale=self.stale)

        def is_healthy(self):
            return self.healthy

    eng = Engine()
    m.first_token(0.25)
    m.request_finished("length", num_prompt=4, num_generated=2)
    eng.stale = True
    m.export(eng, lambda: (0, 0.0))
    assert finished_sent() == ([], 0, [])
    m.request_finished("stop", num_prompt=4, num_generated=3)     # finished meanwhile
    eng.stale, eng.steps = False, 6
    m.export(eng, lambda: (0, 0.0))
    assert finished_sent() == ([("length", 1), ("stop", 1)], 5, [0.25])

    eng.stale = True   # a core that keeps missing the deadline: counted after the limit
    m.request_finished("length", num_prompt=4, num_generated=1)
    for _ in range(MAX_STALE_EXPORTS):
        m.export(eng, lambda: (0, 0.0))
        assert finished_sent() == ([], 0, [])
    m.export(eng, lambda: (0, 0.0))
    assert finished_sent() == ([("length", 1)], 1, [])
    m.request_finished("stop", num_prompt=4, num_generated=1)   # and the limit starts again
    m.export(eng, lambda: (0, 0.0))
    assert finished_sent() == ([], 0, [])

    eng.healthy = False  # gone: its last stats are all there will be
    m.export(eng, lambda: (0, 0.0))
    assert finished_sent() == ([("stop", 1)], 1, [])


def test_the_engine_health_series_appears_with_the_first_export():
    """llm_engine_healthy 0 means a dead engine (the supervisor stops the server on it): no
    series exists while the model is still starting its engine, only from the first export."""
    from backend_lib.engine_stats import EngineStats
    calls, created = [], []
    m = EngineMetrics(_recording_pb_utils(calls, created), {"model": "llm", "version": "1"})
    assert "llm_engine_healthy" not in created and "llm_kv_blocks_total" in created

    class Engine:
        healthy = True

        def stats(self):
            return EngineStats()

        def is_healthy(self):
            return self.healthy

    eng = Engine()
    m.export(eng, lambda: (0, 0.0))
    eng.healthy = False
    m.export(eng, lambda: (0, 0.0))
    assert created.count("llm_engine_healthy") == 1
    assert [v for op, key, v in calls if op == "set" and key[0] == "llm_engine_healthy"] == [1, 0]
