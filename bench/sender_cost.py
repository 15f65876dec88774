"""What one streamed response costs the Python stub that sends it, by phase, on the real
tritonserver (issue 13 item 4: the sender off the engine's critical path).

A probe model (decoupled Python backend, written into a temporary repository) sends N
responses per request, building each the way a variant says, and times on its own clock:
numpy arrays, pb_utils.Tensor objects, the InferenceResponse, and response_sender.send().
A gRPC streaming client receives them; the table gives microseconds per response.

    .venv/bin/python -m bench.sender_cost                  (CPU: the pytriton tritonserver)
    .venv/bin/python -m bench.sender_cost --responses 2000 --tokens 1,32
    .venv/bin/python -m bench.sender_cost --concurrent 1,2,4     (does send() overlap across threads?)

send() releases the GIL while it waits for the server, so several stub threads could overlap
their round trips; but in the llm model, 4 sender threads beside the cancellation poller
deadlocked tritonserver 2.51 on the 2-core box (every sender and is_cancelled() stuck in calls
into the server, bench/RESULTS.md), so the llm model sends from one thread.

Variants (what `llm` could send per response):
    llm          output_ids [1,1,k], sequence_length, prefix_ids [1,p], finish_reason (today's)
    ids+length   output_ids and sequence_length (TensorRT-LLM's required pair)
    ids          output_ids alone
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

VARIANTS = ("llm", "ids+length", "ids")

CONFIG = """name: "sender_probe"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "responses" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "tokens" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "variant" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [
  { name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1, -1 ] },
  { name: "sequence_length" data_type: TYPE_INT32 dims: [ -1, -1 ] },
  { name: "prefix_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] },
  { name: "finish_reason" data_type: TYPE_STRING dims: [ -1, -1 ] },
  { name: "probe_stats" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

MODEL = '''
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

VARIANTS = %r
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        # each request sends from a thread of its own: concurrent requests send concurrently
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def _serve(self, request):
        if True:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "responses").as_numpy()[0])
            k = int(pb_utils.get_input_tensor_by_name(request, "tokens").as_numpy()[0])
            variant = VARIANTS[int(pb_utils.get_input_tensor_by_name(request, "variant").as_numpy()[0])]
            ids = list(range(1000, 1000 + k))
            tail = list(range(7, 12))
            spent = {"numpy": 0.0, "tensor": 0.0, "response": 0.0, "send": 0.0}
            t_all = time.perf_counter()
            for i in range(n):
                t0 = time.perf_counter()
                arrays = [("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, 1, -1))]
                if variant != "ids":
                    arrays.append(("sequence_length", np.asarray([[k]], dtype=np.int32)))
                if variant == "llm":
                    arrays.append(("prefix_ids", np.asarray(tail, dtype=np.int32).reshape(1, -1)))
                    arrays.append(("finish_reason", np.asarray([[b""]], dtype=np.object_)))
                t1 = time.perf_counter()
                tensors = [pb_utils.Tensor(name, a) for name, a in arrays]
                t2 = time.perf_counter()
                response = pb_utils.InferenceResponse(output_tensors=tensors)
                t3 = time.perf_counter()
                sender.send(response)
                t4 = time.perf_counter()
                spent["numpy"] += t1 - t0
                spent["tensor"] += t2 - t1
                spent["response"] += t3 - t2
                spent["send"] += t4 - t3
            spent["total"] = time.perf_counter() - t_all
            stats = json.dumps({k2: v / max(1, n) * 1e6 for k2, v in spent.items()})
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("probe_stats", np.asarray([stats.encode()], dtype=np.object_))]), flags=FINAL)
'''


def make_repository(root: Path) -> Path:
    repo = root / "repo"
    (repo / "sender_probe" / "1").mkdir(parents=True)
    (repo / "sender_probe" / "config.pbtxt").write_text(CONFIG)
    (repo / "sender_probe" / "1" / "model.py").write_text(MODEL % (VARIANTS,))
    return repo


def probe(url: str, variant: str, responses: int, tokens: int, concurrent: int = 1) -> dict:
    """`concurrent` requests at once (each sent from its own stub thread): the probe's
    per-response phase times (µs, averaged over the requests) and the client's wall time per
    response over all of them."""
    import tritonclient.grpc as grpcclient

    got: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), got))
    inputs = []
    for name, value in (("responses", responses), ("tokens", tokens), ("variant", VARIANTS.index(variant))):
        t = grpcclient.InferInput(name, [1], "INT32")
        t.set_data_from_numpy(np.asarray([value], dtype=np.int32))
        inputs.append(t)
    t0 = time.perf_counter()
    for i in range(concurrent):
        client.async_stream_infer("sender_probe", inputs, request_id=str(i), enable_empty_final_response=True)
    received, all_stats = 0, []
    try:
        while len(all_stats) < concurrent:
            result, error = got.get(timeout=300)
            if error is not None:
                raise RuntimeError(f"probe failed: {error}")
            out = result.as_numpy("probe_stats")
            if out is not None:
                all_stats.append(json.loads(out[0]))
            elif result.as_numpy("output_ids") is not None:
                received += 1
    finally:
        client.stop_stream()
        client.close()
    wall = time.perf_counter() - t0
    if received != responses * concurrent:
        raise RuntimeError(f"{variant}: received {received} of {responses * concurrent} responses")
    stats = {k: sum(s[k] for s in all_stats) / concurrent for k in all_stats[0]}
    stats["client"] = wall / (responses * concurrent) * 1e6
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--responses", type=int, default=2000, help="responses per request (per variant)")
    ap.add_argument("--tokens", default="1,32", help="tokens per response, comma list")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=2, help="requests per point; the fastest is reported")
    ap.add_argument("--concurrent", default="1", help="requests sending at once (one stub thread each), "
                                                      "comma list: does send() overlap across threads?")
    a = ap.parse_args(argv)
    from bench.serve import TritonServer

    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: {v!r} is not one of {VARIANTS}")
    with tempfile.TemporaryDirectory(prefix="sender-cost-") as tmp:
        srv = TritonServer(make_repository(Path(tmp)), Path(tmp) / "server.log", start_timeout_s=120)
        try:
            url = f"127.0.0.1:{srv.grpc}"
            probe(url, variants[0], 50, 1)  # warm-up: the stub's first send, the client's channel
            print(f"one streamed response, µs on the probe stub's clock ({a.responses} responses a request, "
                  f"fastest of {a.repeats}); client = wall per response seen by the gRPC client\n")
            print("| variant | tokens/response | concurrent | numpy | pb_utils.Tensor | InferenceResponse | send | "
                  "total | client (all requests) |")
            print("|---|---|---|---|---|---|---|---|---|")
            for k in (int(x) for x in a.tokens.split(",") if x):
                for c in (int(x) for x in a.concurrent.split(",") if x):
                    for v in variants:
                        best = min((probe(url, v, a.responses, k, c) for _ in range(a.repeats)),
                                   key=lambda s: s["client"])
                        print(f"| {v} | {k} | {c} | {best['numpy']:.1f} | {best['tensor']:.1f} | "
                              f"{best['response']:.1f} | {best['send']:.1f} | {best['total']:.1f} | "
                              f"{best['client']:.1f} |", flush=True)
        finally:
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
