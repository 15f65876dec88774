"""CPU time per thread of a process tree (Linux /proc), for the serving benchmark: which thread of
the Triton server, the llm model's Python stub or the engine core is busy during a point.

Threads are keyed "process/thread": the process by role (tritonserver, stub:<model>, core) and
the thread by its OS name (backend_lib names its threads: os_threads.NamedThread; Triton's own
and the stub's unnamed threads carry their process's name). Threads of the same key are summed.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: Path) -> Optional[tuple[str, int, float]]:
    """(comm, ppid, user + system CPU seconds) of a /proc/<pid>[/task/<tid>]/stat, None if gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    head, rest = text.rsplit(")", 1)
    fields = rest.split()
    return head.split("(", 1)[1], int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _role(pid: int, comm: str) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    text = " ".join(a.decode(errors="replace") for a in argv)
    if "backend_lib.engine_core" in text:
        return "core"
    if "triton_python_backend_stub" in text:
        model = next((Path(a.decode(errors="replace")).parts for a in argv if a.endswith(b"model.py")), None)
        return f"stub:{model[-3]}" if model and len(model) >= 3 else "stub"
    return comm


def descendants(root: int) -> dict[int, str]:
    """pid -> process name of root and every process below it."""
    children: dict[int, list[int]] = {}
    comm: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(d / "stat")
            if st is not None:
                comm[int(d.name)] = st[0]
                children.setdefault(st[1], []).append(int(d.name))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in comm:
            out[pid] = comm[pid]
        todo.extend(children.get(pid, []))
    return out


def thread_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far per "process/thread" of root's process tree."""
    totals: dict[str, float] = {}
    for pid, name in descendants(root).items():
        role = _role(pid, name)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            t = _stat(Path(f"/proc/{pid}/task/{tid}/stat"))
            if t is not None:
                key = f"{role}/{t[0]}"
                totals[key] = totals.get(key, 0.0) + t[2]
    return totals


def busy_threads(before: dict[str, float], after: dict[str, float], seconds: float,
                 at_least: float = 0.05) -> dict[str, float]:
    """Each key's share of one CPU over `seconds` (>= at_least), busiest first."""
    share = {k: (v - before.get(k, 0.0)) / seconds for k, v in after.items()} if seconds > 0 else {}
    return dict(sorted(((k, round(v, 3)) for k, v in share.items() if v >= at_least), key=lambda kv: -kv[1]))
