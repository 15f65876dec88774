"""A helper process that must not outlive another one: an engine core shared by several
model instances (it outlives the stub that spawned it, not the server), a pipeline stage
(it ends with stage 0's process even while it is still starting up, before its connections
to stage 0 exist to fail)."""
from __future__ import annotations

import os
import select
import signal

from .os_threads import NamedThread


def signal_name(signum: int) -> str:
    """"SIGKILL" for 9; "signal 77" for a number the signal module does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def die_with_process(pid: int, thread_name: str) -> None:
    """End this process when process `pid` ends (at once when it is gone already). Watched
    through a pidfd, so unlike the parent-death signal it follows the process, not the thread
    that spawned this one. Without pidfds (Linux < 5.3) nothing is watched."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):
        return

    def watch() -> None:
        select.select([fd], [], [])
        os._exit(1)

    NamedThread(target=watch, name=thread_name, daemon=True).start()
