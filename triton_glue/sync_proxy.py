"""TensorRT-LLM's non-decoupled deployment (`decoupled_mode: false`) of a decoupled model of
ours: `tensorrt_llm` over `llm`, `tensorrt_llm_bls` over `llm_bls`. Triton's HTTP /infer and
gRPC ModelInfer refuse decoupled models (and ensembles containing one), yet TensorRT-LLM's
clients call these names that way (end_to_end_test.py, benchmark_core_model.py without
--decoupled); over a gRPC stream they work too (one response per request).

Each request is forwarded unchanged through BLS (exec(decoupled=True)) on a worker thread, its
responses collected and sent back as ONE response through the request's response sender, so
execute returns at once and requests run concurrently. A batched request ([B, ...] inputs:
one upstream response per row, with batch_index) is merged along the batch dimension in
batch_index order, padded with -1 (ids) or "" (text). As in TensorRT-LLM, streaming=true is an
error here ("Streaming is only supported in decoupled mode."). The upstream request is a BLS
caller's (id "bls-..."): failures come back in-band in `error_message` (tritonserver 2.51
loses the iterator id of an error response to a decoupled BLS request; see triton_glue/bls.py)
and are turned into the client's error response here. Ended upstream iterators are released
only at a later execute (upstream.HeldIterators, as in triton_glue/bls.py).

A gRPC client that goes away (deadline, cancelled call) cancels the request (tritonserver 2.51's
HTTP front flags no cancellation: an HTTP client's disconnect goes unseen): with
`cancel_upstream` (a target that takes `cancel_request_id` control requests, as `llm` and
`llm_bls` do) the proxy polls the request's cancellation while it waits, sends that control
request for the upstream request's id, and answers CANCELLED at once, so the engine frees the
request's slot and KV blocks instead of generating for nobody. Without it the upstream runs to
its end (r24.10's response iterators have no cancel()). A TensorRT-LLM stop request (`stop`
true, under the request id of a request in flight) aborts that request's upstream the same way;
the stopped request answers with what it generated so far and the stop request with an empty
response, as TensorRT-LLM's backend does (a stop that overtakes its request's delivery to `llm`
is remembered there and aborts it on arrival). pb_utils is passed in.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .bls import CANCEL_PREFIX, ERROR_OUTPUT
from .config import parameters_of
from .inputs import get_bool
from .trtllm import STOP_WITHOUT_ID
from .upstream import HeldIterators, cancel_upstream_request

log = logging.getLogger("triton_glue.sync_proxy")
STREAMING_ERROR = "Streaming is only supported in decoupled mode."
# how often a request waiting on its upstream asks whether the client cancelled it
CANCEL_POLL_S = 0.25
_END = object()


class _Cancelled(Exception):
    """The client cancelled the request while it waited on the upstream."""


def merge_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One output per name from per-row outputs ([1, ...] each), stacked on axis 0 in
    (batch_index, sequence_index) order; ragged trailing dims padded (-1 for numbers, b"" for
    strings)."""
    if len(rows) == 1:
        return rows[0]

    def index(r: dict, name: str) -> int:
        return int(np.asarray(r.get(name, [[0]])).reshape(-1)[0])

    rows = sorted(rows, key=lambda r: (index(r, "batch_index"), index(r, "sequence_index")))
    out = {}
    for name in rows[0]:
        arrs = [np.asarray(r[name]) for r in rows if name in r]
        shape = tuple(max(a.shape[d] for a in arrs) for d in range(1, arrs[0].ndim))
        fill = b"" if arrs[0].dtype == np.object_ else -1
        padded = []
        for a in arrs:
            p = np.full((a.shape[0],) + shape, fill, dtype=a.dtype)
            p[(slice(None),) + tuple(slice(0, s) for s in a.shape[1:])] = a
            padded.append(p)
        out[name] = np.concatenate(padded, axis=0)
    return out


def _text(a: Any) -> str:
    if a is None or not np.asarray(a).size:
        return ""
    v = np.asarray(a).reshape(-1)[0]
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


class SyncProxy:
    def __init__(self, pb_utils: Any, target: str, max_workers: int = 256, cancel_upstream: bool = False,
                 cancel_poll_s: float = CANCEL_POLL_S):
        self.pb = pb_utils
        self.target = target
        self.cancel_upstream = cancel_upstream
        self.cancel_poll_s = cancel_poll_s
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"sync-{target}")
        # stop requests must not queue behind the requests they stop (those hold the pool)
        self.stops = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"stop-{target}")
        self.iterators = HeldIterators()
        self._lock = threading.Lock()
        self._upstream_keys: dict[str, str] = {}   # client request id -> its upstream request's id

    def execute(self, requests: Any) -> None:
        pb = self.pb
        self.iterators.barrier(requests)
        for request in requests:
            sender = request.get_response_sender()
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            stop = False
            try:
                streaming = any(get_bool(arrays, n, False) for n in ("streaming", "stream") if n in arrays)
                stop = "stop" in arrays and get_bool(arrays, "stop", False)
            except ValueError as e:
                streaming, err = None, str(e)
            if streaming is not None and stop:
                self.stops.submit(self._stop, sender, request.request_id() or "")
                continue
            if streaming is None or streaming:
                sender.send(pb.InferenceResponse(error=pb.TritonError(err if streaming is None else STREAMING_ERROR)),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            wanted = list(request.requested_output_names())
            key = f"{CANCEL_PREFIX}{uuid.uuid4().hex}"
            upstream = pb.InferenceRequest(model_name=self.target, inputs=list(request.inputs()), request_id=key,
                                           requested_output_names=wanted + [ERROR_OUTPUT] if wanted else [])
            client_id = request.request_id() or ""
            if client_id:
                with self._lock:  # the latest request under an id is the one a stop names, as in TensorRT-LLM
                    self._upstream_keys[client_id] = key
            self.pool.submit(self._run_safe, sender, upstream, key, ERROR_OUTPUT in wanted, client_id)
        return None

    def _forget(self, client_id: str, key: str) -> None:
        if client_id:
            with self._lock:
                if self._upstream_keys.get(client_id) == key:
                    del self._upstream_keys[client_id]

    def _stop(self, sender: Any, client_id: str) -> None:
        pb = self.pb
        response = pb.InferenceResponse(output_tensors=[])
        try:
            if not client_id:
                raise ValueError(STOP_WITHOUT_ID)
            if not self.cancel_upstream:
                raise ValueError(f"stop: {self.target} takes no cancel requests here (cancel_upstream is false)")
            with self._lock:
                key = self._upstream_keys.get(client_id)
            if key is not None:  # else it already ended: nothing to stop
                cancel_upstream_request(pb, self.target, key, self.iterators)
        except ValueError as e:
            response = pb.InferenceResponse(error=pb.TritonError(str(e)))
        except Exception as e:  # noqa: BLE001 - the stop request must get its one response
            log.exception("sync proxy stop failed")
            response = pb.InferenceResponse(error=pb.TritonError(f"internal error: {e!r}"))
        sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _pump(self, upstream: Any, q: "queue.SimpleQueue") -> None:
        responses = None
        try:
            responses = upstream.exec(decoupled=True)
            for resp in responses:
                q.put((resp, None))
        except Exception as e:  # noqa: BLE001 - re-raised on the reading side
            q.put((None, e))
        finally:
            if responses is not None:
                self.iterators.hold(responses)
            q.put((_END, None))

    def _watched(self, sender: Any, upstream: Any) -> Any:
        """The upstream's responses, read on a helper thread (neither exec() nor the iterator
        can be interrupted) while the client's cancellation is polled; raises _Cancelled."""
        q: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._pump, args=(upstream, q), name=f"sync-{self.target}-upstream",
                         daemon=True).start()
        while True:
            try:
                item, err = q.get(timeout=self.cancel_poll_s)
            except queue.Empty:
                if sender.is_cancelled():
                    raise _Cancelled() from None
                continue
            if err is not None:
                raise err
            if item is _END:
                return
            yield item

    def _run_safe(self, sender: Any, upstream: Any, key: str, keep_error_output: bool, client_id: str = "") -> None:
        pb = self.pb
        try:
            rows, error = [], None
            responses = self._watched(sender, upstream) if self.cancel_upstream else upstream.exec(decoupled=True)
            try:
                for resp in responses:
                    if resp.has_error():
                        error = error or resp.error().message()
                        continue
                    row = {t.name(): t.as_numpy() for t in resp.output_tensors()}
                    message = _text(row.get(ERROR_OUTPUT) if keep_error_output else row.pop(ERROR_OUTPUT, None))
                    if message:
                        error = error or message
                        continue
                    if row:
                        rows.append(row)
            finally:
                if not self.cancel_upstream:
                    self.iterators.hold(responses)
            if error is not None:
                response = pb.InferenceResponse(error=pb.TritonError(error))
            elif not rows:
                response = pb.InferenceResponse(error=pb.TritonError(f"{self.target} returned no output"))
            else:
                response = pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in merge_rows(rows).items()])
        except _Cancelled:
            try:
                # llm ends it with a final response, read out by its helper thread
                cancel_upstream_request(self.pb, self.target, key, self.iterators)
            except Exception:  # noqa: BLE001 - best effort: the client is gone
                log.exception("sync proxy upstream cancel failed")
            response = pb.InferenceResponse(error=pb.TritonError("request cancelled", pb.TritonError.CANCELLED))
        except Exception as e:  # noqa: BLE001 - the request must get its one response
            log.exception("sync proxy request failed")
            response = pb.InferenceResponse(error=pb.TritonError(f"internal error: {e!r}"))
        # before the response: a client that reuses its id at once must find it free
        self._forget(client_id, key)
        sender.send(response, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def close(self) -> None:
        self.stops.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        self.iterators.close()


def proxy_model(pb_utils: Any, default_target: str) -> type:
    """The TritonPythonModel class of a proxy model (parameters `target_model`,
    `max_concurrent_requests`, `cancel_upstream`)."""
    class TritonPythonModel:
        def initialize(self, args):
            params = parameters_of(json.loads(args["model_config"]))
            self.proxy = SyncProxy(pb_utils, params.get("target_model", default_target),
                                   int(params.get("max_concurrent_requests", "256")),
                                   params.get("cancel_upstream", "false").lower() == "true")

        def execute(self, requests):
            return self.proxy.execute(requests)

        def finalize(self):
            self.proxy.close()

    return TritonPythonModel
