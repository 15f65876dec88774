"""EngineMetrics (triton_glue/metrics.py) with a recording stand-in for pb_utils' metric API:
the per-request metrics the sending thread records make no call to the server until the stats
thread's flush, which sends each exactly once (every observation, the summed counters)."""
import threading
import types

from triton_glue.metrics import EngineMetrics


def _recording_pb_utils(calls: list):
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
