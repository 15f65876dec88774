"""The `llm` model (model_repository/llm/1/model.py) on the engine process, without Triton: a
stand-in triton_python_backend_utils, requests and response senders. A cancellation (or an
unload's abort-all) that lands while execute is still adding the request must still end it
early: the abort must not reach the engine before the request does (and be lost). One execute()
call's requests reach the engine in one message."""
import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from test_async_engine import KW

ROOT = Path(__file__).resolve().parents[2]
FINAL = 1


def _fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")

    class _Metric:
        def observe(self, v): pass
        def increment(self, v): pass
        def set(self, v): pass

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind): pass
        def Metric(self, labels, buckets=None): return _Metric()

    class Logger:
        @staticmethod
        def log_info(msg): pass
        log_warn = log_error = log_verbose = log_info

    class Tensor:
        def __init__(self, name, array): self._name, self._array = name, np.asarray(array)
        def name(self): return self._name
        def as_numpy(self): return self._array

    class TritonError:
        CANCELLED = "CANCELLED"

        def __init__(self, message, code=None): self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None): self.output_tensors, self.error = output_tensors or [], error

    class TritonModelException(Exception):
        pass

    pb.MetricFamily, pb.Logger, pb.Tensor, pb.TritonError = MetricFamily, Logger, Tensor, TritonError
    pb.InferenceResponse, pb.TritonModelException = InferenceResponse, TritonModelException
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.using_decoupled_model_transaction_policy = lambda cfg: True
    return pb


class Sender:
    def __init__(self, cancelled=False):
        self.responses, self.finals, self.cancelled = [], 0, cancelled
        self.done = threading.Event()

    def send(self, response=None, flags=0):
        self.responses.append(response)
        if flags & FINAL:
            self.finals += 1
            self.done.set()

    def is_cancelled(self):
        return self.cancelled

    def tokens(self):
        return sum(t.as_numpy().size for r in self.responses if r is not None
                   for t in r.output_tensors if t.name() == "output_ids")


class Request:
    def __init__(self, inputs, sender):
        self._inputs, self.sender = inputs, sender

    def get_response_sender(self): return self.sender
    def request_id(self): return ""
    def inputs(self): return [types.SimpleNamespace(name=lambda k=k: k, as_numpy=lambda v=v: np.asarray(v))
                              for k, v in self._inputs.items()]
    def parameters(self): return "{}"


@pytest.fixture
def llm_model(path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TRITON_HTTP_PORT", raising=False)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    spec = importlib.util.spec_from_file_location("llm_model_under_test", ROOT / "model_repository/llm/1/model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    params = dict(KW, model_path=path, cancel_poll_ms=5, engine_process="on")
    cfg = {"name": "llm", "parameters": {k: {"string_value": str(v)} for k, v in params.items()}}
    m = mod.TritonPythonModel()
    m.initialize({"model_config": json.dumps(cfg), "model_name": "llm", "model_version": "1",
                  "model_instance_name": "llm_0", "model_repository": str(ROOT / "model_repository/llm")})
    yield m
    m.finalize()


def _slow_adds(m, seconds):
    """add_request takes `seconds` before it reaches the engine (a long prompt's checks and
    transfer, or the earlier rows of a batch request)."""
    real = m.engine.add_request

    def slow(*a, **kw):
        time.sleep(seconds)
        return real(*a, **kw)

    m.engine.add_request = slow


def _long_request(sender):
    return Request({"input_ids": [[5, 6, 7]], "request_output_len": [[400]], "streaming": [[True]]}, sender)


def test_cancel_seen_while_the_request_is_being_added_still_aborts_it(llm_model):
    _slow_adds(llm_model, 0.3)
    sender = Sender(cancelled=True)  # the client gave up at once: the first poll sees it
    llm_model.execute([_long_request(sender)])
    assert sender.done.wait(60)
    assert sender.finals == 1 and sender.responses[-1].error.code == "CANCELLED"
    assert sender.tokens() < 100, f"the cancelled request ran on ({sender.tokens()} tokens streamed)"


def test_unload_abort_while_a_request_is_being_added_still_aborts_it(llm_model):
    _slow_adds(llm_model, 0.3)
    sender = Sender()
    t = threading.Thread(target=llm_model.execute, args=([_long_request(sender)],))
    t.start()
    time.sleep(0.1)  # execute is adding the request
    llm_model._stop_serving("unload requested")
    t.join(10)
    assert sender.done.wait(60)
    assert sender.finals == 1
    assert sender.tokens() < 100, f"the request ran on past the unload's abort ({sender.tokens()} tokens)"


def test_a_batch_row_the_engine_refuses_ends_the_request_with_its_reason(llm_model):
    """A [B, ...] request whose row 2 the engine refuses after rows 0-1 were added (e.g. it
    stopped being healthy meanwhile): the rows in the engine are aborted and the one FINAL
    response carries the refusal's message, not a 'request cancelled' the client never asked for."""
    real = llm_model.engine.add_request
    calls = []

    def refuse_third(*a, **kw):
        calls.append(a[0])
        if len(calls) == 3:
            raise RuntimeError("engine is not healthy: stand-in refusal")
        return real(*a, **kw)

    llm_model.engine.add_request = refuse_third
    sender = Sender()
    llm_model.execute([Request({"input_ids": [[5, 6, 7], [8, 9, 10], [11, 12, 13]],
                                "input_lengths": [[3], [3], [3]], "request_output_len": [[400], [400], [400]],
                                "streaming": [[True], [True], [True]]}, sender)])
    assert sender.done.wait(60)
    assert len(calls) == 3 and sender.finals == 1
    err = sender.responses[-1].error
    assert err is not None and "batch row 2" in err.message and "stand-in refusal" in err.message, err.message
    assert err.code != "CANCELLED"
    assert sender.tokens() < 300


def test_one_execute_reaches_the_engine_as_one_message(llm_model):
    """Six requests in one execute() (Triton's dynamic batch): one write to the engine core,
    holding their six ADDs, and each request streams its tokens and one FINAL."""
    writes = []
    real_send = llm_model.engine._send

    def counting_send(cmds, timeout=None):
        writes.append([c[0] for c in cmds])
        return real_send(cmds, timeout)

    llm_model.engine._send = counting_send
    senders = [Sender() for _ in range(6)]
    llm_model.execute([Request({"input_ids": [[5 + i, 6, 7]], "request_output_len": [[8]], "streaming": [[True]],
                                "ignore_eos": [[True]]}, s) for i, s in enumerate(senders)])
    assert writes[0] == ["add"] * 6
    for s in senders:
        assert s.done.wait(60)
        assert s.finals == 1 and s.tokens() == 8
