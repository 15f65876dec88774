"""Stand-ins for pieces of triton_python_backend_utils that the glue tests share: a response
sender that records what a model sends, a tensor, an error."""
from __future__ import annotations

import numpy as np


class RecordingSender:
    def __init__(self):
        self.sent = []   # (response, flags) in send order

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class TritonError:
    CANCELLED = "CANCELLED"

    def __init__(self, message, code=None):
        self._message, self.code = message, code

    def message(self):
        return self._message
