"""n > 1 on the text routes: the request runs as n single-sequence requests (seeds seed + i,
as the engine derives them for its own n, so the sequences are the engine's), and their
responses are put back together as the peer does.

- TensorRT-LLM (`llm_bls`): each response is one sequence's and carries `sequence_index`; FINAL
  goes with the last sequence's end (BatchSender, one row per sequence).
- vllm_backend (`vllm_model`): its create_response writes one entry per sequence of vLLM's
  RequestOutput.outputs into every output tensor ([n] text_output, finish_reason, ...).
  Streaming: each response carries every sequence, "" / no tokens for those with nothing new
  and each finished sequence's finish_reason from then on; FINAL with the last. Otherwise one
  response with the n whole sequences. SequenceJoiner does this from the n sequences' chunks.
pb_utils is passed in; nothing here imports it.
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable, Optional

from .batch import PartSender
from .inputs import TextRequest

SEED_SPACE = 2**63  # SamplingParams.seed is in [0, 2**63)


def fan_out(req: TextRequest) -> list[TextRequest]:
    """The n single-sequence requests of req (req itself when n == 1)."""
    n = req.sampling.n
    if n == 1:
        return [req]
    seed = req.sampling.seed
    return [replace(req, sampling=replace(req.sampling, n=1, seed=None if seed is None else (seed + i) % SEED_SPACE),
                    sequence_index=i, num_sequences=n) for i in range(n)]


class SequenceJoiner:
    """The response sender of one vllm_model request with n > 1 sequences. Each sequence's
    driver sends (sequence index, Chunk) tuples (its make_response returns them) or, on an
    error, a ready response with FINAL, which ends the request at once."""

    def __init__(self, pb_utils: Any, sender: Any, n: int, stream: bool,
                 build: Callable[[list[Optional[Any]], list[Optional[str]]], Any]):
        """build(chunks, finish_reasons): the response for one chunk (or None) per sequence
        and each sequence's finish reason so far."""
        self._final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._sender = sender
        self._n = n
        self._stream = stream
        self._build = build
        self._done = [False] * n
        self._finish: list[Optional[str]] = [None] * n
        self._whole: list[Optional[Any]] = [None] * n  # non-streaming: each sequence's one chunk
        self._closed = False
        self._lock = threading.Lock()

    def sequence(self) -> PartSender:
        return PartSender(self)

    def _send(self, item: Any, flags: int) -> None:
        with self._lock:
            if self._closed:
                return
            if not isinstance(item, tuple):  # an error (or cancellation) response: the request ends
                self._closed = True
                self._sender.send(item, flags=self._final)
                return
            index, chunk = item
            if chunk.final:
                self._done[index] = True
                self._finish[index] = chunk.finish_reason
            last = all(self._done)
            if self._stream:
                chunks = [None] * self._n
                chunks[index] = chunk
                response = self._build(chunks, list(self._finish))
            elif not chunk.final:
                return
            else:
                self._whole[index] = chunk
                if not last:
                    return
                response = self._build(list(self._whole), list(self._finish))
            if last:
                self._closed = True
                self._sender.send(response, flags=self._final)
            else:
                self._sender.send(response)

    def is_cancelled(self) -> bool:
        with self._lock:
            closed = self._closed
        return closed or self._sender.is_cancelled()
