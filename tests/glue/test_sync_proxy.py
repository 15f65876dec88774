"""triton_glue.sync_proxy's TensorRT-LLM stop requests without Triton: a stand-in pb_utils whose
upstream (`llm`) generates until a cancel_request_id control request names its key."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

import numpy as np

from triton_glue.sync_proxy import SyncProxy
from triton_glue.trtllm import STOP_WITHOUT_ID

sys.path.insert(0, str(Path(__file__).parent))
from pb_fakes import RecordingSender, Tensor, TritonError  # noqa: E402

FINAL = 1


class FakePb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    TritonError = TritonError
    Tensor = Tensor

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self._outputs, self._error = output_tensors or [], error

        def has_error(self):
            return self._error is not None

        def error(self):
            return self._error

        def output_tensors(self):
            return self._outputs

    cancelled: dict = {}     # upstream key -> Event, set by its control cancel
    delivered: dict = {}     # upstream key -> Event, set once llm has the request

    class InferenceRequest:
        def __init__(self, model_name, inputs, request_id, requested_output_names):
            self.inputs, self.request_id = {t.name(): t.as_numpy() for t in inputs}, request_id

        def exec(self, decoupled=True):
            pb = FakePb
            if "cancel_request_id" in self.inputs:
                key = self.inputs["cancel_request_id"].reshape(-1)[0].decode()
                pb.cancelled.setdefault(key, threading.Event()).set()
                return iter([])
            stop = pb.cancelled.setdefault(self.request_id, threading.Event())
            pb.delivered.setdefault(self.request_id, threading.Event()).set()

            def responses():
                n = 0
                while n < 1000 and not stop.wait(0.002):  # a token every 2 ms until cancelled
                    n += 1
                yield pb.InferenceResponse([pb.Tensor("output_ids", np.arange(n, dtype=np.int32).reshape(1, 1, n))])
            return responses()


class _Request:
    def __init__(self, inputs, request_id=""):
        self._inputs, self._id, self.sender = inputs, request_id, RecordingSender()

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return self._id

    def inputs(self):
        return [FakePb.Tensor(k, v) for k, v in self._inputs.items()]

    def requested_output_names(self):
        return []

    def is_cancelled(self):
        return False


def _generate(request_id):
    return _Request({"input_ids": np.array([[1, 2, 3]], np.int32), "request_output_len": np.array([[1000]], np.int32)},
                    request_id)


def _stop(request_id):
    return _Request({"input_ids": np.zeros((1, 1), np.int32), "stop": np.array([[True]])}, request_id)


def _wait_final(req, timeout=10):
    deadline = time.monotonic() + timeout
    while not req.sender.sent and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(req.sender.sent) == 1 and req.sender.sent[0][1] == FINAL, req.sender.sent
    return req.sender.sent[0][0]


def _tokens(response):
    return response.output_tensors()[0].as_numpy().shape[2]


@contextlib.contextmanager
def serving_proxy(max_workers=4, cancel_upstream=True):
    FakePb.cancelled, FakePb.delivered = {}, {}
    proxy = SyncProxy(FakePb, "llm", max_workers=max_workers, cancel_upstream=cancel_upstream)
    try:
        yield proxy
    finally:
        proxy.close()


def test_stop_by_id_returns_the_partial_output_and_an_empty_reply():
    with serving_proxy() as proxy:
        first = _generate("7")
        proxy.execute([first])
        time.sleep(0.05)
        stop = _stop("7")
        proxy.execute([stop])
        reply = _wait_final(stop)
        assert not reply.has_error() and reply.output_tensors() == []
        assert 0 < _tokens(_wait_final(first)) < 1000
        # the id is free again: the next request under it is stopped by the next stop
        again = _generate("7")
        proxy.execute([again])
        time.sleep(0.05)
        proxy.execute([_stop("7")])
        assert 0 < _tokens(_wait_final(again)) < 1000


def test_a_stop_without_id_or_for_no_request_in_flight():
    with serving_proxy() as proxy:
        no_id = _stop("")
        proxy.execute([no_id])
        assert _wait_final(no_id).error().message() == STOP_WITHOUT_ID
        unknown = _stop("nobody")
        proxy.execute([unknown])
        assert not _wait_final(unknown).has_error() and not FakePb.cancelled


def test_the_latest_request_under_an_id_is_the_one_stopped():
    with serving_proxy() as proxy:
        older, newer = _generate("dup"), _generate("dup")
        proxy.execute([older])
        proxy.execute([newer])
        time.sleep(0.05)
        proxy.execute([_stop("dup")])
        assert 0 < _tokens(_wait_final(newer)) < 1000
        assert _tokens(_wait_final(older, timeout=30)) == 1000


def test_a_stop_does_not_wait_for_a_free_request_worker():
    """Every request worker busy with a request (max_concurrent_requests 1): the stop still
    reaches the request it names."""
    with serving_proxy(max_workers=1) as proxy:
        running = _generate("busy")
        proxy.execute([running])
        time.sleep(0.05)
        stop = _stop("busy")
        proxy.execute([stop])
        assert 0 < _tokens(_wait_final(running)) < 1000
        assert not _wait_final(stop).has_error()


def test_a_stop_without_cancel_upstream_is_refused():
    with serving_proxy(max_workers=2, cancel_upstream=False) as proxy:
        stop = _stop("x")
        proxy.execute([stop])
        assert "cancel_upstream" in _wait_final(stop).error().message()
        batched = _Request({"input_ids": np.zeros((2, 1), np.int32), "stop": np.array([[True], [True]])}, "x")
        proxy.execute([batched])  # one response naming the input, not an exception out of execute
        assert "stop" in _wait_final(batched).error().message()
