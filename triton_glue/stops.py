"""Stop strings on streamed text.

The matcher sees text pieces as they are detokenized. It emits text as early as it can but
holds back the longest tail that could still be the start of a stop string, so a stop string
never reaches the client, even when it is split across chunks. When a stop string appears,
the text before it is emitted and `stopped` is set; the caller cancels the upstream request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class StopResult:
    text: str                      # text safe to send now
    stopped: bool = False
    stop_string: Optional[str] = None


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str], include_stop_str: bool = False):
        self.stops = [s for s in dict.fromkeys(stop_strings) if s]
        self.include = include_stop_str
        self.pending = ""
        self.stopped = False

    @property
    def active(self) -> bool:
        return bool(self.stops)

    def feed(self, piece: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        if not self.stops:
            return StopResult(piece)
        buf = self.pending + piece
        # earliest complete stop string
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        if best is not None:
            i, s = best
            self.stopped = True
            self.pending = ""
            return StopResult(buf[: i + (len(s) if self.include else 0)], True, s)
        # hold back the longest suffix that is a proper prefix of some stop string
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self.pending = buf[len(buf) - hold:] if hold else ""
        return StopResult(buf[: len(buf) - hold])

    def flush(self) -> str:
        """At the end of the stream: the held-back tail was not a stop string after all."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
