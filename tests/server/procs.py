"""Process-table and /dev/shm helpers for the fault tests: which processes belong to a
server's process group, which of them are Python-backend stubs, and which /dev/shm regions
those stubs use (the region name is the stub's second argument)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

STUB_NAME = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str
    argv: tuple[str, ...]

    @property
    def is_stub(self) -> bool:
        return bool(self.argv) and os.path.basename(self.argv[0]) == STUB_NAME

    @property
    def stub_model(self) -> Optional[str]:
        """The model a stub serves (its model path is <repo>/<model>/<version>/model.py)."""
        if not self.is_stub or len(self.argv) < 2:
            return None
        parts = Path(self.argv[1]).parts
        return parts[-3] if len(parts) >= 3 else None

    @property
    def shm_region(self) -> Optional[str]:
        return self.argv[2] if self.is_stub and len(self.argv) > 2 else None


def read_proc(pid: int) -> Optional[Proc]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    argv = tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)
    return Proc(pid, int(fields[1]), int(fields[2]), fields[0], argv)


def all_procs() -> list[Proc]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            p = read_proc(int(d))
            if p is not None:
                out.append(p)
    return out


def group(pgid: int) -> list[Proc]:
    """Live (not zombie) processes of a process group."""
    return [p for p in all_procs() if p.pgid == pgid and p.state != "Z"]


def stubs(pgid: int) -> list[Proc]:
    return [p for p in group(pgid) if p.is_stub]


def shm_left(regions: set[Optional[str]]) -> list[str]:
    # None: a stub seen before its argv was readable in full (it has no region to leave)
    return sorted(r for r in regions if r and (SHM_DIR / r).exists())


def maps_library(pid: int, name: str) -> bool:
    """Whether process `pid` has a shared library whose file name starts with `name` mapped
    (e.g. "libtorch_cpu": torch was imported there)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return any(os.path.basename(line.rsplit(" ", 1)[-1]).startswith(name) for line in text.splitlines())
