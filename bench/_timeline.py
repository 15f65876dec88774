"""GPU busy/idle timeline of consecutive engine steps (CUDA only), drawn as a PNG.

`StepRecorder` is a thin wrapper around `engine.runner.handoff.publish`: every step's
StepHandle already carries its CUDA timing events (`start`, recorded before the step's work
is enqueued, and `end`, the event after its token D2H copy) when the handoff times steps, so
the bench only keeps the handles; backend_lib is not changed. After the run (and a device
synchronize) each step is the interval start..end on the GPU clock; between two steps the
GPU is idle.

`write_png` draws one horizontal bar per lane (busy = filled, idle = blank) with matplotlib
when it is importable, else with a tiny pure-Python PNG writer (no text then: lane order is
top to bottom as given, ticks every 100 µs, or 1 ms when the span exceeds 5 ms; the JSON
holds the intervals).
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Optional

import torch


class StepRecorder:
    """Context manager: records the StepHandle of every step published while active."""

    def __init__(self, engine):
        self.handoff = engine.runner.handoff
        self.handles: list = []

    def __enter__(self) -> "StepRecorder":
        orig = type(self.handoff).publish.__get__(self.handoff)

        def publish(*args, **kwargs):
            handle = orig(*args, **kwargs)
            self.handles.append(handle)
            return handle

        self.handoff.publish = publish  # instance attribute shadows the method
        return self

    def __exit__(self, *exc) -> None:
        self.handoff.__dict__.pop("publish", None)

    def intervals_us(self, skip: int, count: int) -> list[tuple[float, float]]:
        """(start, end) in µs of `count` consecutive timed steps after the first `skip`,
        relative to the first one's start. Empty when the steps are not timed (CPU)."""
        timed = [h for h in self.handles if h.start is not None and h.end is not None]
        sel = timed[skip:skip + count]
        if len(sel) < count and len(timed) >= count:  # short run: take the last `count`
            sel = timed[-count:]
        if not sel:
            return []
        torch.cuda.synchronize()  # every event recorded and completed before elapsed_time
        t0 = sel[0].start
        return [(t0.elapsed_time(h.start) * 1e3, t0.elapsed_time(h.end) * 1e3) for h in sel]


def busy_fraction(iv: list[tuple[float, float]]) -> Optional[float]:
    if not iv:
        return None
    span = iv[-1][1] - iv[0][0]
    busy = sum(e - s for s, e in iv)
    return busy / span if span > 0 else None


def write_png(path: Path, lanes: list[tuple[str, list[tuple[float, float]]]], title: str) -> str:
    """Draw the lanes; returns which writer was used ('matplotlib' or 'builtin')."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - any import problem: fall back to the builtin writer
        _write_png_builtin(path, lanes)
        return "builtin"
    span = max((iv[-1][1] for _, iv in lanes if iv), default=1.0)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.8 * len(lanes)))
    for i, (label, iv) in enumerate(lanes):
        y = len(lanes) - 1 - i
        ax.broken_barh([(s, e - s) for s, e in iv], (y + 0.1, 0.8), facecolors="tab:green")
        ax.broken_barh([(0, span)], (y + 0.1, 0.8), facecolors="none", edgecolors="0.6")
        bf = busy_fraction(iv)
        ax.text(span * 1.005, y + 0.5, f"busy {bf * 100:.1f}%" if bf is not None else "",
                va="center", fontsize=9)
    ax.set_yticks([len(lanes) - 1 - i + 0.5 for i in range(len(lanes))])
    ax.set_yticklabels([label for label, _ in lanes])
    ax.set_xlim(0, span * 1.08)
    ax.set_xlabel("GPU time since the lane's first step start (µs); filled = a step running, blank = GPU idle")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"


def _write_png_builtin(path: Path, lanes: list[tuple[str, list[tuple[float, float]]]],
                       width: int = 1600, lane_h: int = 60, pad: int = 20) -> None:
    span = max((iv[-1][1] for _, iv in lanes if iv), default=1.0)
    height = pad + len(lanes) * (lane_h + pad)
    white, grey, green, black = (255, 255, 255), (200, 200, 200), (40, 160, 60), (0, 0, 0)
    px = [[white] * width for _ in range(height)]
    x0, x1 = pad, width - pad
    scale = (x1 - x0) / span
    for i, (_, iv) in enumerate(lanes):
        top = pad + i * (lane_h + pad)
        lane_end = min(x1, x0 + int(iv[-1][1] * scale) + 1) if iv else x0
        for y in range(top, top + lane_h):
            row = px[y]
            for x in range(x0, lane_end):  # idle (grey) inside the lane's span only
                row[x] = grey
            for s, e in iv:
                a, b = x0 + int(s * scale), max(x0 + int(s * scale) + 1, x0 + int(e * scale))
                for x in range(a, min(b, x1)):
                    row[x] = green
    tick_us = 100.0 if span <= 5000 else 1000.0  # ticks under the lanes: every 100 µs or 1 ms
    for x in range(x0, x1, max(1, int(tick_us * scale))):
        for y in range(height - pad // 2, height):
            px[y][x] = black
    raw = b"".join(b"\x00" + bytes(c for p in row for c in p) for row in px)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)
