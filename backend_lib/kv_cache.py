"""Paged KV block pool with automatic prefix caching: reference counts, a hash map of
cached full blocks, and an LRU queue of cached blocks nobody holds.

Pure host bookkeeping (no torch.cuda): the scheduler owns it and it tests on CPU. The device
tensors live in the model runner. Block 0 is reserved as the null block that padding rows
of a CUDA-graph bucket write into, so it is never handed out.

Prefix caching (the scheme of vLLM v1's block_pool / kv_cache_manager): a full block is
named by `block_hash(parent hash, its token ids)`, a chain, so equal hashes mean equal
*prefixes*, not only equal blocks. A block is registered under its hash once the scheduler
knows its KV is final (see Scheduler._commit_blocks); from then on any request whose tokens
chain to that hash may hold it (reference count + 1). A block whose count drops to 0 keeps
its KV and its hash and waits in the LRU queue; allocation takes never-cached blocks first,
then evicts from the LRU head. Blocks of a request are released last block first, so the
deepest (least shared) blocks of a prefix are evicted before the blocks they extend.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Optional, Sequence

from .int64_pack import int64_bytes

ROOT_HASH = b"prefix-cache-root"


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 of the parent block's hash and this block's ids (int64, native order):
    collision-safe (a false hit would silently serve another prompt's KV)."""
    return hashlib.sha256(parent + int64_bytes(token_ids)).digest()


def chain_hashes(parent: bytes, token_bytes: bytes, block_size: int) -> list[bytes]:
    """block_hash over consecutive full blocks given as their ids' int64 bytes (a slice of
    Request.prompt_bytes, say): the same hashes, without converting ids block by block
    (a mixed step hashes ~64 blocks, so the per-block Python is most of their cost)."""
    sha256 = hashlib.sha256
    step = 8 * block_size
    out = []
    for a in range(0, len(token_bytes), step):
        parent = sha256(parent + token_bytes[a:a + step]).digest()
        out.append(parent)
    return out


class BlockPool:
    NULL_BLOCK = 0

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[Optional[bytes]] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(1, num_blocks))    # hold no reusable KV
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; LRU first

    # ---- counts ---------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-cached ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free_uncached(self) -> int:
        """Free blocks that hold no cached KV: allocating up to this many evicts nothing."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request (a shared block counts once)."""
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash (held or evictable)."""
        return len(self._by_hash)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def blocks_needed(self, have: int, num_tokens: int) -> int:
        need = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, need - have)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # ---- allocation and release ---------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash[b]]
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; the last block of a sequence is released first
        so that the LRU queue evicts it before the blocks it extends."""
        for b in reversed(blocks):
            r = self._ref[b] - 1
            if r < 0:
                raise RuntimeError(f"KV block {b} released more often than it was held")
            self._ref[b] = r
            if r == 0:
                if self._hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def share(self, blocks: Sequence[int]) -> None:
        """Take one more reference to blocks whose KV is final (a cache hit, or the prompt
        blocks of an n > 1 fork); a held-free cached block leaves the LRU queue."""
        for b in blocks:
            if self._ref[b] == 0:
                if b not in self._evictable:
                    raise RuntimeError(f"KV block {b} is free and holds no cached KV: it cannot be shared")
                del self._evictable[b]
            self._ref[b] += 1

    def num_evictable_in(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit in the LRU queue (sharing them shrinks num_free)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    # ---- the prefix cache -------------------------------------------------------------------
    def cache(self, block: int, h: bytes) -> None:
        """Register a held block whose KV is final under its chained hash. A hash already
        cached keeps its first block (this one stays private and is freed uncached)."""
        if not self.enable_caching or self._hash[block] is not None or h in self._by_hash:
            return
        self._hash[block] = h
        self._by_hash[h] = block

    def longest_hit(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of a chain of block hashes."""
        hit = []
        if self.enable_caching:
            for h in hashes:
                b = self._by_hash.get(h)
                if b is None:
                    break
                hit.append(b)
        return hit

    def check_consistency(self, owners: Sequence[Sequence[int]]) -> None:
        """Every block is held (with a count equal to its owners), or free, or cached and
        evictable, exactly once; the hash map and the blocks agree. Tests call this."""
        held = [0] * self.num_blocks
        for blocks in owners:
            for b in blocks:
                held[b] += 1
        assert held[self.NULL_BLOCK] == 0, "the null block was handed out"
        assert held == self._ref, "reference counts differ from the owners' block lists"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is twice in the free queue"
        evict = set(self._evictable)
        assert not free & evict
        for b in range(1, self.num_blocks):
            states = (self._ref[b] > 0) + (b in free) + (b in evict)
            assert states == 1, f"block {b}: held={self._ref[b]} free={b in free} evictable={b in evict}"
        for h, b in self._by_hash.items():
            assert self._hash[b] == h
        assert sum(h is not None for h in self._hash) == len(self._by_hash)
        assert all(self._hash[b] is not None for b in evict)
        assert all(self._hash[b] is None for b in free)


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
