"""Small client helpers for the server tests: gRPC streams that collect every response of
several requests (multiplexed by request id) with their FINAL flags."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import tritonclient.grpc as grpcclient


def np_input(name: str, arr: np.ndarray):
    dt = {"O": "BYTES", "b": "BOOL", "i": "INT32", "f": "FP32", "u": "UINT64"}[arr.dtype.kind]
    if arr.dtype == np.int64:
        dt = "INT64"
    t = grpcclient.InferInput(name, list(arr.shape), dt)
    t.set_data_from_numpy(arr)
    return t


def inputs_from(body: dict, batched: bool) -> list:
    out = []
    for k, v in body.items():
        if isinstance(v, np.ndarray):
            arr = v
        elif isinstance(v, str):
            arr = np.array([v.encode("utf-8")], dtype=np.object_)
        elif isinstance(v, bytes):
            arr = np.array([v], dtype=np.object_)
        elif isinstance(v, bool):
            arr = np.array([v], dtype=np.bool_)
        elif isinstance(v, int):
            arr = np.array([v], dtype=np.int32)
        elif isinstance(v, float):
            arr = np.array([v], dtype=np.float32)
        elif isinstance(v, list) and v and isinstance(v[0], str):
            arr = np.array([s.encode() for s in v], dtype=np.object_)
        else:
            raise TypeError(k)
        if batched and not isinstance(v, np.ndarray):
            arr = arr.reshape(1, -1)
        out.append(np_input(k, arr))
    return out


@dataclass
class Collected:
    responses: list = field(default_factory=list)   # InferResult in arrival order
    errors: list = field(default_factory=list)      # str
    finals: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def texts(self, name: str = "text_output") -> list[str]:
        out = []
        for r in self.responses:
            a = r.as_numpy(name)
            if a is not None:
                out.append("".join(x.decode() if isinstance(x, bytes) else str(x) for x in a.reshape(-1)))
        return out

    def ids(self, name: str = "output_ids") -> list[list[int]]:
        return [r.as_numpy(name).reshape(-1).tolist() for r in self.responses if r.as_numpy(name) is not None]

    def last(self, name: str):
        for r in reversed(self.responses):
            a = r.as_numpy(name)
            if a is not None:
                return a.reshape(-1)
        return None


class StreamClient:
    """One gRPC stream, many requests. Each request's responses land in its own Collected."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.by_id: dict[str, Collected] = {}
        self.lock = threading.Lock()
        self.client.start_stream(callback=self._cb)

    def _cb(self, result, error):
        if error is not None:
            # errors carry no request id on older clients; attribute to the only open request
            rid = getattr(error, "request_id", None)
            with self.lock:
                open_ = [c for r, c in self.by_id.items() if not c.done.is_set()]
            target = self.by_id.get(rid) if rid else (open_[0] if len(open_) == 1 else None)
            if target is None and open_:
                target = open_[0]
            if target is not None:
                target.errors.append(str(error))
                target.finals += 1
                target.done.set()
            return
        resp = result.get_response()
        c = self.by_id[resp.id]
        final = resp.parameters.get("triton_final_response")
        is_final = bool(final is not None and final.bool_param)
        if resp.outputs:
            c.responses.append(result)
        if is_final:
            c.finals += 1
            c.done.set()

    def send(self, model: str, body: dict, request_id: str, batched: bool = True,
             outputs: Optional[list[str]] = None) -> Collected:
        c = Collected()
        with self.lock:
            self.by_id[request_id] = c
        outs = [grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None
        self.client.async_stream_infer(model, inputs_from(body, batched), request_id=request_id,
                                       outputs=outs, enable_empty_final_response=True)
        return c

    def close(self, cancel: bool = False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def grpc_stream_one(url: str, model: str, body: dict, batched: bool = True, timeout: float = 120,
                    outputs: Optional[list[str]] = None) -> Collected:
    sc = StreamClient(url)
    try:
        c = sc.send(model, body, "r0", batched, outputs)
        assert c.done.wait(timeout), f"no FINAL from {model} within {timeout} s"
        time.sleep(0.05)  # a second FINAL would arrive right after the first
        return c
    finally:
        sc.close()


def wait_for(pred, timeout=10.0, interval=0.1):
    """Poll pred() until it is true or timeout seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def http_post(url: str, path: str, body: dict, timeout: float = 120, headers: Optional[dict] = None):
    """(status, text) of a POST; an error status is returned, not raised."""
    req = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def http_stream_events(url: str, model: str, body: dict, timeout: float = 120) -> list[dict]:
    status, text = http_post(url, f"/v2/models/{model}/generate_stream", body, timeout)
    assert status == 200, text
    return [json.loads(l[5:]) for l in text.splitlines() if l.startswith("data:")]


def joined(v: Any) -> str:
    if isinstance(v, list):
        return "".join(joined(x) for x in v)
    return v if isinstance(v, str) else str(v)
