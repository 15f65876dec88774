"""Stand-ins for what Triton gives the `llm` model (model_repository/llm/1/model.py): the
triton_python_backend_utils module, requests and response senders. Torch-free, so that a
test can also check what the model itself imports."""
import threading
import types

import numpy as np

FINAL = 1


def fake_pb_utils() -> types.ModuleType:
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
    def __init__(self, inputs, sender, request_id=""):
        self._inputs, self.sender, self._id = inputs, sender, request_id

    def get_response_sender(self): return self.sender
    def request_id(self): return self._id
    def inputs(self): return [types.SimpleNamespace(name=lambda k=k: k, as_numpy=lambda v=v: np.asarray(v))
                              for k, v in self._inputs.items()]
    def parameters(self): return "{}"
