"""Start-up tuning's picks, kept for the next engine and the next start.

Timing every candidate configuration of every projection shape is most of an engine's start
once the kernels must compile (each candidate compiles before it can be timed), and every
engine in a process did it again. A pick is kept under its tuner's key (the shape, dtype and
whatever else changes the kernel) in one JSON file per card model, Triton, torch and kernel
source: another card, compiler or kernel file finds a file of its own and tunes anew. The
engines of one process share the picks in memory, so they also run the same kernels (an A/B
of two engine variants then differs only in what the variants change).

BACKEND_LIB_TUNING_CACHE (envs.tuning_cache_dir): the folder, or off (tune every time). A
folder that cannot be written leaves the picks in memory only.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

from .. import envs

logger = logging.getLogger("backend_lib")

# What get() returns where no pick is kept (None is a pick: the unfused ops won).
MISS = object()
_UNFUSED = "unfused"

# Picks of this process, per file: read once, shared by every engine.
_loaded: dict[Path, dict[str, Any]] = {}
_unwritable: set[Path] = set()


def device_tag(device: torch.device) -> str:
    """The card model and what else decides a kernel's speed on it: compute capability and SMs
    (a MIG slice of the same card has fewer), the CUDA torch was built with."""
    if device.type != "cuda":
        return device.type
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} sm{p.major}{p.minor} {p.multi_processor_count}sms cuda{torch.version.cuda}"


def source_digest(paths: Iterable[str]) -> str:
    """Of the kernels' source files: an edited kernel's picks are not reused."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


class TuningCache:
    """One tuner's picks for one device: get(key, candidates) -> the kept candidate, None
    (unfused) or MISS; put(key, pick, us) keeps one and writes the file."""

    def __init__(self, path: Optional[Path]):
        self.path = path   # None: off

    @classmethod
    def open(cls, tuner: str, device: torch.device, sources: Iterable[str]) -> "TuningCache":
        folder = envs.tuning_cache_dir()
        if folder is None:
            return cls(None)
        try:
            import triton
            compiler = f"triton{triton.__version__}"
        except ImportError:
            compiler = "notriton"
        if envs.triton_interpret():   # the interpreter's timings say nothing of the device's
            compiler += "-interpreted"
        try:
            digest = source_digest(sources)
        except OSError as e:   # sources not readable as files (an installed .pyc or zip): tune every start
            logger.warning("tuning cache off: kernel sources unreadable (%s)", e)
            return cls(None)
        tag = f"{device_tag(device)} {compiler} torch{torch.__version__} {digest}"
        return cls(Path(folder) / f"{tuner}-{re.sub(r'[^A-Za-z0-9.+-]+', '_', tag)}.json")

    def _read(self) -> dict[str, Any]:
        """The file's picks ({} without a file); OSError or ValueError where unreadable."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        return data if isinstance(data, dict) else {}

    def _picks(self) -> dict[str, Any]:
        if self.path not in _loaded:
            try:
                _loaded[self.path] = self._read()
            except (OSError, ValueError) as e:   # unreadable or not JSON: tuned again, rewritten
                logger.warning("tuning cache %s unreadable (%s): tuning anew", self.path, e)
                _loaded[self.path] = {}
        return _loaded[self.path]

    def get(self, key: str, candidates: Sequence[Any]) -> Any:
        if self.path is None:
            return MISS
        entry = self._picks().get(key)
        if not isinstance(entry, dict) or "pick" not in entry:
            return MISS
        if entry["pick"] == _UNFUSED:
            return None
        for c in candidates:   # only a configuration this tree would still try
            if dataclasses.asdict(c) == entry["pick"]:
                return c
        return MISS

    def put(self, key: str, pick: Any, us: float) -> None:
        if self.path is None:
            return
        picks = self._picks()
        picks[key] = {"pick": _UNFUSED if pick is None else dataclasses.asdict(pick), "us": round(us, 3)}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:   # what another process kept meanwhile stays; this process's picks win
                picks.update({k: v for k, v in self._read().items() if k not in picks})
            except (OSError, ValueError):
                pass
            # whole or not at all: another process may be reading it
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(picks, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            tmp = None
        except OSError as e:
            if self.path not in _unwritable:   # once: every later pick would say the same
                _unwritable.add(self.path)
                logger.warning("tuning cache %s not written (%s): picks kept for this process only", self.path, e)
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
