"""Fan-in of a batched request's rows onto its one response sender (TensorRT-LLM clients send
[B, ...] inputs; each row is generated on its own and its responses carry batch_index). The
FINAL flag goes out with the last row's last response; a row that ends earlier sends its last
response without it. pb_utils is passed in; nothing here imports it."""
from __future__ import annotations

import threading
from typing import Any


class BatchSender:
    def __init__(self, pb_utils: Any, sender: Any, rows: int):
        self._final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._sender = sender
        self._remaining = rows
        self._lock = threading.Lock()

    def row(self) -> "PartSender":
        return PartSender(self)

    def _send(self, response: Any, flags: int) -> None:
        with self._lock:
            if self._remaining <= 0:
                return
            if flags & self._final:
                self._remaining -= 1
                if self._remaining > 0:
                    if response is not None:
                        self._sender.send(response)
                    return
            if response is None:
                self._sender.send(flags=flags)
            else:
                self._sender.send(response, flags=flags)

    def is_cancelled(self) -> bool:
        with self._lock:
            return self._remaining > 0 and self._sender.is_cancelled()


class PartSender:
    """What the driver of one part of a request (a batch row, one of n sequences) sees as its
    response sender: sends go to the whole request's fan-in (its `_send`)."""

    def __init__(self, whole: Any):
        self._whole = whole

    def send(self, response: Any = None, flags: int = 0) -> None:
        self._whole._send(response, flags)

    def is_cancelled(self) -> bool:
        return self._whole.is_cancelled()
