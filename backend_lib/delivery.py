"""The order in which a lagging callback hears from the engine.

When the callbacks (the Triton stub's response sends, ~0.1-0.5 ms each) fall behind the engine
(a step every ~2 ms with hundreds of streams), outputs wait. DeliveryQueue keeps what waits
merged per sequence (one response carries every token the sequence made meanwhile) and hands
it out most urgent first:
  1. a sequence's first output, alone (time to first token stays the engine's);
  2. the requests that have ended, in the order they ended, each one's other sequences before
     its final output (a closed-loop client sends its next request when the final arrives);
  3. every other sequence, the one waiting longest first (a sequence handed out goes to the
     back: streams take turns).
Handing out one output at a time and adding new steps in between lets an urgent output overtake
a backlog that was queued before it.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from typing import Optional

from .request import RequestOutput


@dataclasses.dataclass
class _Pending:
    latest: RequestOutput            # the sequence's newest output: its state and flags
    tokens: list[int]
    logprobs: Optional[list]

    def merged(self) -> RequestOutput:
        return dataclasses.replace(self.latest, new_token_ids=self.tokens, new_logprobs=self.logprobs)


def _is_first(out: RequestOutput) -> bool:
    return bool(not out.finished and out.new_token_ids and out.num_output_tokens == len(out.new_token_ids))


class DeliveryQueue:
    def __init__(self) -> None:
        self._firsts: deque[RequestOutput] = deque()
        # (request id, sequence index) -> what it has waiting; insertion order is the age order
        self._pending: "OrderedDict[tuple[str, int], _Pending]" = OrderedDict()
        self._keys_of: dict[str, dict[tuple[str, int], None]] = {}  # a request's pending sequences
        self._ended: "OrderedDict[str, None]" = OrderedDict()  # requests whose final output waits

    def __len__(self) -> int:
        return len(self._firsts) + len(self._pending)

    def add(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid in self._ended:
            return  # nothing after a request's final output
        key = (rid, out.index)
        p = self._pending.get(key)
        if p is None and _is_first(out):
            self._firsts.append(out)
            return
        if p is None:
            self._pending[key] = _Pending(out, list(out.new_token_ids),
                                          list(out.new_logprobs) if out.new_logprobs is not None else None)
            self._keys_of.setdefault(rid, {})[key] = None
        else:
            p.latest = out
            p.tokens.extend(out.new_token_ids)
            if out.new_logprobs is not None:
                if p.logprobs is None:
                    p.logprobs = []
                p.logprobs.extend(out.new_logprobs)
        if out.finished:
            self._ended[rid] = None

    def pop(self) -> RequestOutput:
        """The most urgent waiting output (IndexError when none waits)."""
        if self._firsts:
            return self._firsts.popleft()
        if self._ended:
            rid = next(iter(self._ended))
            keys = self._keys_of[rid]
            key = next((k for k in keys if not self._pending[k].latest.finished), None)
            if key is None:  # only the final output is left
                key = next(iter(keys))
                del self._ended[rid]
            return self._take(key)
        return self._take(next(iter(self._pending)))

    def _take(self, key: tuple[str, int]) -> RequestOutput:
        p = self._pending.pop(key)
        keys = self._keys_of[key[0]]
        del keys[key]
        if not keys:
            del self._keys_of[key[0]]
        return p.merged()

    def drain(self) -> list[RequestOutput]:
        out = []
        while self:
            out.append(self.pop())
        return out

