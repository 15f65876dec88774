"""BlsRoute with a stand-in pb_utils and `llm`: a request leaves the route's hooks exactly once
on every way out, so vllm_model's vllm:num_requests_waiting / _running read 0 when idle even
after requests the upstream or the tokenizer rejected; vllm_model words those errors as
vllm_backend does."""
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from pb_fakes import RecordingSender, Tensor as _Tensor, TritonError as _TritonError  # noqa: E402
from tokenizers_for_tests import llama_like  # noqa: E402

from triton_glue.bls import BlsRoute, RequestHooks, RouteHooks  # noqa: E402
from triton_glue.vllm_compat import parse_vllm_request  # noqa: E402
from triton_glue.vllm_metrics import VllmRouteHooks  # noqa: E402


class _Response:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t for t in output_tensors}
        self._error = error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error


class _Metric:
    def __init__(self):
        self.value = 0

    def set(self, v):
        self.value = v

    def increment(self, v):
        self.value += v

    def observe(self, v):
        pass


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels, buckets=None):
        m = _Metric()
        FakePb.metrics.setdefault(self.name, []).append((labels, m))
        return m


class FakePb:
    """pb_utils, with `llm` answering each request by FakePb.llm(request inputs by name)."""
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    Tensor = _Tensor
    TritonError = _TritonError
    InferenceResponse = _Response
    MetricFamily = _Family
    Logger = type("L", (), {"log_info": staticmethod(lambda m: None), "log_error": staticmethod(lambda m: None)})
    metrics: dict = {}
    llm = None
    cancels: list = []

    class InferenceRequest:
        def __init__(self, model_name, inputs, requested_output_names, request_id=""):
            self.inputs = {t.name(): t.as_numpy() for t in inputs}

        def exec(self, decoupled=False):
            if "cancel_request_id" in self.inputs:
                FakePb.cancels.append(self.inputs["cancel_request_id"])
                return iter([])
            return FakePb.llm(self.inputs)

    @staticmethod
    def get_output_tensor_by_name(resp, name):
        return resp.outputs.get(name)


def llm_tokens(ids, finish=""):
    """`llm`'s response carrying ids (finish: its finish_reason on the last one)."""
    return _Response([_Tensor("output_ids", np.array([ids], dtype=np.int32)),
                      _Tensor("finish_reason", np.array([[finish.encode()]], dtype=object))])


def llm_in_band_error(message):
    """How `llm` reports an error to a BLS route (bls.py's module docstring)."""
    return _Response([_Tensor("output_ids", np.zeros((1, 0), dtype=np.int32)),
                      _Tensor("finish_reason", np.array([[b"error"]], dtype=object)),
                      _Tensor("error_message", np.array([[message.encode()]], dtype=object))])


class _Request:
    def __init__(self):
        self.sender = RecordingSender()

    def request_id(self):
        return "client-1"

    def get_response_sender(self):
        return self.sender


def gauge(name):
    (labels, m), = FakePb.metrics[name]
    return m.value


@pytest.fixture
def vllm_route():
    FakePb.metrics, FakePb.cancels = {}, []
    hooks = VllmRouteHooks(FakePb, {"model": "vllm_model", "version": "1"}, metrics=True)
    route = BlsRoute(FakePb, llama_like(), make_response=lambda req, chunk: chunk, hooks=hooks,
                     route_name="vllm_model", upstream_timeout_s=0.3)
    yield route
    route.close()
    hooks.close()


def run(route, llm, **sampling):
    """One vllm_model request through the route; its responses once its worker has finished."""
    FakePb.llm = llm
    request = _Request()
    arrays = {"text_input": np.array([b"Hello world"], dtype=object),
              "sampling_parameters": np.array([json.dumps({"max_tokens": 3, **sampling}).encode()], dtype=object)}
    route.submit(request, parse_vllm_request(arrays))
    deadline = time.monotonic() + 10
    while route.inflight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert route.inflight() == 0
    return request.sender.sent


def only_error(sent):
    (response, flags), = sent
    assert flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response.has_error()
    return response.error().message()


def test_rejected_requests_leave_the_vllm_gauges(vllm_route):
    never = threading.Event()

    def silent(inputs):  # an upstream that never answers (released at the end)
        never.wait(10)
        return iter([])

    def tokens_then_error(inputs):  # a running request that then fails
        yield llm_tokens([5])
        yield _Response(error=_TritonError("model 'llm' failed mid-stream"))

    rejections = [
        (lambda inputs: iter([llm_in_band_error("temperature: must be a finite number")]), {"temperature": "inf"},
         "Error generating stream: temperature: must be a finite number"),
        (lambda inputs: iter([_Response(error=_TritonError("stop_token_ids must hold token ids in [0, 400)"))]),
         {"stop_token_ids": [399]}, "Error generating stream: stop_token_ids must hold token ids in [0, 400)"),
        (None, {"bad_words": ["a whole sentence here"]},
         "Error generating stream: bad_words: 'a whole sentence here' is 18 tokens; multi-token words are not supported"),
        (silent, {}, "Error generating stream: no response from model 'llm' within 0.3 s"),
        (tokens_then_error, {}, "Error generating stream: model 'llm' failed mid-stream"),
    ]
    try:
        for llm, sampling, error in rejections:
            message = only_error(run(vllm_route, llm, **sampling))
            assert (gauge("vllm:num_requests_waiting"), gauge("vllm:num_requests_running")) == (0, 0), message
            assert message.startswith(error), message
    finally:
        never.set()
    assert len(FakePb.cancels) == 1  # the silent upstream was asked to stop
    # none of them finished: vLLM counts no rejected request in its finished-request series
    assert all(m.value == 0 for _, m in FakePb.metrics["vllm:request_success_total"])
    # and a request that succeeds still counts once
    sent = run(vllm_route, lambda inputs: iter([llm_tokens([5]), llm_tokens([6], "length")]))
    assert sent[-1][1] == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and sent[-1][0].finish_reason == "length"
    assert (gauge("vllm:num_requests_waiting"), gauge("vllm:num_requests_running")) == (0, 0)
    success = {labels["finished_reason"]: m.value for labels, m in FakePb.metrics["vllm:request_success_total"]}
    assert success == {"stop": 0, "length": 1, "abort": 0}


def test_hooks_are_left_once_when_an_error_follows_the_finish():
    events = []

    class Hooks(RouteHooks):
        def request(self, req):
            events.append("request")
            h = RequestHooks()
            h.finished = lambda reason, n_prompt, n_gen: events.append(f"finished {reason}")
            h.failed = lambda: events.append("failed")
            return h

    FakePb.metrics, FakePb.cancels = {}, []
    route = BlsRoute(FakePb, llama_like(), make_response=lambda req, chunk: chunk, hooks=Hooks(),
                     upstream_timeout_s=5)

    def error_after_final(inputs):  # the upstream read-out after the client's FINAL fails
        yield llm_tokens([5, 6, 7], "length")
        raise RuntimeError("read-out failed")
    try:
        sent = run(route, error_after_final)
    finally:
        route.close()
    assert events == ["request", "finished length"]
    assert sent[0][0].finish_reason == "length"  # its FINAL went out: the later error is dropped


def test_parse_errors_are_worded_as_vllm_backend_and_deep_json_logs_nothing(vllm_route, caplog):
    def parse(arrays, request):
        if "temprature" in arrays:  # vllm_model's own check of the request parameters
            from triton_glue.inputs import InputError
            raise InputError("temprature", "unknown parameter")
        return parse_vllm_request(arrays)

    deep = {"text_input": np.array([b"Hi"], dtype=object),
            "sampling_parameters": np.array([b"[" * 100000], dtype=object)}
    misspelt = {"text_input": np.array([b"Hi"], dtype=object), "temprature": np.array([0.5])}
    requests = []
    for arrays in (deep, misspelt):
        r = _Request()
        r.inputs = lambda arrays=arrays: [_Tensor(k, v) for k, v in arrays.items()]
        requests.append(r)
    vllm_route.execute(requests, parse)
    assert [only_error(r.sender.sent) for r in requests] == [
        "Error generating stream: sampling_parameters: is nested too deeply",
        "Error generating stream: temprature: unknown parameter"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no traceback in the log


def test_caller_cancels_keep_only_requests_in_flight():
    """A control request cancels every part of a request in flight under its id, and nothing
    else; once the request's parts have ended, its id leaves no trace (a late cancel is a no-op)."""
    from triton_glue.bls import CallerCancels
    aborted = []
    cc = CallerCancels(aborted.append)
    row0, row1, other = cc.started("bls-a"), cc.started("bls-a"), cc.started("bls-b")
    cc.upstream("bls-a", "k0"), cc.upstream("bls-b", "kb")
    assert not cc.cancel("bls-unknown")
    assert cc.cancel("bls-a")
    assert (row0(), row1(), other()) == (True, True, False)
    assert aborted == ["k0"]  # at once: a request queued in the engine sends no token to notice
    cc.upstream("bls-a", "k1")  # a part that reaches llm after the cancel is aborted as it goes
    assert aborted == ["k0", "k1"]
    cc.ended("bls-a")
    assert row1()  # one part still runs
    cc.ended("bls-a")
    assert not cc.cancel("bls-a") and not cc.started("bls-a")()  # the id reused later starts clean
    cc.ended("bls-a"), cc.ended("bls-b")
    assert cc._parts == {} and cc._cancelled == set() and cc._keys == {}


def test_a_request_queued_for_minutes_is_served_by_default(monkeypatch):
    """By default a BLS route waits on `llm` as long as the engine keeps the request (queued
    behind max_num_seqs under a burst, as vLLM does): the silence bound is off. With it on
    (upstream_timeout_s 60, the old default) the same request fails after 60 s of queueing."""
    from triton_glue import upstream

    class Clock:  # every reading of the watch's clock is 25 s later: 1 s of waiting, minutes
        now = 0.0

        @classmethod
        def monotonic(cls):
            cls.now += 25.0
            return cls.now

    monkeypatch.setattr(upstream, "time", types.SimpleNamespace(monotonic=Clock.monotonic, sleep=time.sleep))

    def queued_then_served(inputs):
        time.sleep(1.2)  # several polls of the watch (0.5 s each) before the first token
        yield llm_tokens([5])
        yield llm_tokens([6], "length")

    FakePb.metrics, FakePb.cancels = {}, []
    for timeout_s, served in ((None, True), (60.0, False)):
        bound = {} if timeout_s is None else {"upstream_timeout_s": timeout_s}  # None: the default
        route = BlsRoute(FakePb, llama_like(), make_response=lambda req, chunk: chunk, route_name="vllm_model", **bound)
        try:
            sent = run(route, queued_then_served)
        finally:
            route.close()
        if served:
            assert sent[-1][1] == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and sent[-1][0].finish_reason == "length"
        else:
            assert "no response from model 'llm' within 60 s" in only_error(sent)
