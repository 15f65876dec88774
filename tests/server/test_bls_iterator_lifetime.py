"""A decoupled BLS response iterator that has ended must be freed by Python, with the GIL
(triton_glue.upstream.HeldIterators): python_backend r24.10 (tritonserver 2.51) otherwise frees
it, with its responses' NumPy arrays, on a stub thread that holds no GIL, and the stub dies
with SIGSEGV in _PyObject_Malloc. In the soak test that stub was vllm_model or llm_bls, and
`llm`'s sender then blocked for good in send() to one of its requests.

Two BLS models read the same decoupled `streamer` and make the race certain: they queue log
messages on the stub's stub-to-server thread just before the final response (so the
iterator's cleanup, queued behind them, comes after the model has let go of the iterator), and
allocate right after letting go. `reader_dropping` lets go at once, as a plain `for resp in
request.exec(decoupled=True)` does: its stub dies within a few requests (if it ever stops
dying, tritonserver has fixed the bug and HeldIterators can go). `reader_held` hands the
iterator to HeldIterators: its stub serves every request.
"""
from __future__ import annotations

import numpy as np

from . import procs
from .conftest import start_server
from .util import StreamClient

REQUESTS = 60
# The control's stub usually dies within a few requests, but the race needs the stub's threads
# to interleave: on a loaded 2-core machine it can take longer, so the control may run longer.
CONTROL_REQUESTS = 400
RESPONSES = 64

STREAMER = '''
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            for i in range(n):
                text = np.array([f"w{i}-{j}".encode() for j in range(64)], dtype=np.object_)
                sender.send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("TEXT", text), pb_utils.Tensor("IDS", np.arange(64, dtype=np.int32) + i)]),
                    flags=FINAL if i == n - 1 else 0)
        return None
'''

READER = '''
import numpy as np
import triton_python_backend_utils as pb_utils

from triton_glue.upstream import HeldIterators

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
HOLD = {hold}


class TritonPythonModel:
    def initialize(self, args):
        self.held = HeldIterators() if HOLD else None

    def execute(self, requests):
        if self.held is not None:
            self.held.barrier(requests)
        for request in requests:
            count = pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()
            n = int(count.reshape(-1)[0])
            responses = pb_utils.InferenceRequest(
                model_name="streamer", inputs=[pb_utils.Tensor("COUNT", count)],
                requested_output_names=["TEXT", "IDS"]).exec(decoupled=True)
            got = 0
            for resp in responses:
                got += 1
                [t.as_numpy() for t in resp.output_tensors()]
                if got == n - 1:  # ahead of the cleanup that the final response queues
                    for _ in range(20):
                        pb_utils.Logger.log_verbose("reader: ahead of the iterator's cleanup")
            if self.held is not None:
                self.held.hold(responses)
            del responses
            junk = [str(i).encode() for i in range(100000)]  # while the stub erases the iterator
            del junk
            request.get_response_sender().send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("GOT", np.array([got], dtype=np.int32))]), flags=FINAL)
        return None
'''

CONFIG = '''backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {outputs} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
'''


def _model(repo, name, source, outputs):
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(outputs=outputs))


def _repo(tmp_path):
    repo = tmp_path / "repo"
    _model(repo, "streamer", STREAMER, '{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }, '
                                       '{ name: "IDS" data_type: TYPE_INT32 dims: [ -1 ] }')
    for name, hold in (("reader_held", True), ("reader_dropping", False)):
        _model(repo, name, READER.format(hold=hold), '{ name: "GOT" data_type: TYPE_INT32 dims: [ 1 ] }')
    return repo


def _serve(srv, model: str, requests: int = REQUESTS) -> tuple[int, str]:
    """Requests one at a time until one fails: (how many succeeded, the failure or "")."""
    stub = next(p.pid for p in procs.stubs(srv.proc.pid) if p.stub_model == model)
    sc = StreamClient(srv.grpc_url)
    try:
        for i in range(requests):
            c = sc.send(model, {"COUNT": np.array([RESPONSES], dtype=np.int32)}, f"{model}-{i}", batched=False)
            if not c.done.wait(30):
                return i, "no FINAL within 30 s"
            if c.errors:
                return i, c.errors[0]
            got = int(c.last("GOT")[0])
            if got != RESPONSES:
                return i, f"read {got} of {RESPONSES} upstream responses"
            if stub not in {p.pid for p in procs.stubs(srv.proc.pid)}:
                return i + 1, "the stub died"
        return requests, ""
    finally:
        try:
            sc.close()
        except Exception:  # noqa: BLE001 - a server whose stub died may have dropped the stream
            pass


def test_ended_bls_iterators_are_freed_with_the_gil(tmp_path):
    srv = start_server(tmp_path, model_repository=_repo(tmp_path), wait_model="reader_dropping")
    try:
        served, failure = _serve(srv, "reader_held")
        assert (served, failure) == (REQUESTS, ""), f"reader_held failed after {served} requests: {failure}"
        served, failure = _serve(srv, "reader_dropping", CONTROL_REQUESTS)
        assert failure, (f"reader_dropping served all {CONTROL_REQUESTS} requests: the race this test forces no longer "
                         "kills the stub (tritonserver fixed it?), so it proves nothing about HeldIterators")
    finally:
        srv.stop()
