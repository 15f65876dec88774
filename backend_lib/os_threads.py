"""Threads whose OS thread carries their name (Linux), so that `top -H`, py-spy and
/proc/<pid>/task/*/comm tell which of the engine's threads uses a CPU (bench/serve.py reads them
per point). Python before 3.14 leaves every thread named after its process."""
from __future__ import annotations

import ctypes
import threading
from typing import Optional

_PR_SET_NAME = 15
_COMM_BYTES = 15  # the kernel keeps 16 bytes, NUL included

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: names stay Python's own
    _prctl = None


def name_os_thread(name: str) -> None:
    """Name the calling OS thread (its first 15 bytes)."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_COMM_BYTES]), 0, 0, 0)


class NamedThread(threading.Thread):
    """threading.Thread whose OS thread is named `os_name` (default: its Python name) while it runs."""

    def __init__(self, *args, os_name: Optional[str] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.os_name = os_name or self.name

    def run(self) -> None:
        name_os_thread(self.os_name)
        super().run()
