"""Run the choices of one request (prompts x n) on the route and merge their pieces.

Every choice is its own route request (own gRPC stream). However the caller stops (the HTTP
client went away, an error in another choice, the last piece), the choices still running are
cancelled and awaited, so their upstream requests are cancelled too.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from .logprobs import TokenLogprob
from .triton_stream import Piece, TritonRoute


@dataclass
class Choice:
    index: int
    prompt_index: int
    prompt: str
    sampling: dict


@dataclass
class ChoiceResult:
    """A choice's pieces folded together (non-streamed replies, usage)."""
    text: list[str] = field(default_factory=list)
    num_output_tokens: int = 0
    num_input_tokens: int = 0
    finish_reason: Optional[str] = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, piece: Piece) -> None:
        self.text.append(piece.text)
        self.logprobs += piece.logprobs or []
        self.num_output_tokens += piece.num_output_tokens
        self.num_input_tokens = piece.num_input_tokens or self.num_input_tokens
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason


async def merged(route: TritonRoute, choices: list[Choice], prompt_param: str
                 ) -> AsyncIterator[tuple[Choice, Piece]]:
    """(choice, piece) in arrival order until every choice has its last piece; the first
    error of any choice is raised (after the others are cancelled)."""
    if len(choices) == 1:
        only = choices[0]
        async with contextlib.aclosing(route.generate(only.prompt, only.sampling, prompt_param)) as gen:
            async for piece in gen:
                yield only, piece
        return

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async with contextlib.aclosing(route.generate(choice.prompt, choice.sampling, prompt_param)) as gen:
                async for piece in gen:
                    await queue.put((choice, piece, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((choice, None, e))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            choice, piece, error = await queue.get()
            if error is not None:
                raise error
            if piece.finish_reason is not None:
                remaining -= 1
            yield choice, piece
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Usage:
    """Token counts of a request: the prompt once per prompt (not once per choice), every
    choice's generated tokens (as vLLM counts them)."""

    def __init__(self) -> None:
        self._prompt: dict[int, int] = {}
        self.completion_tokens = 0

    def add(self, choice: Choice, piece: Piece) -> None:
        if piece.num_input_tokens:
            self._prompt[choice.prompt_index] = piece.num_input_tokens
        self.completion_tokens += piece.num_output_tokens

    def as_dict(self) -> dict:
        prompt = sum(self._prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}
