"""Paged KV block pool: free list, per-request block lists, slot arithmetic.

Pure host bookkeeping (no torch.cuda): the scheduler owns it and it tests on CPU. The device
tensors live in the model runner. Block 0 is reserved as the null block that padding rows
of a CUDA-graph bucket write into, so it is never handed out.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def blocks_needed(self, have: int, num_tokens: int) -> int:
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - have)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class SlotPool:
    """Rows of the persistent device tables (block table, relay buffer, sampling state)."""

    def __init__(self, num_slots: int):
        self._free: deque[int] = deque(range(num_slots))

    def acquire(self) -> int:
        return self._free.popleft()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
