"""Fixed-size KV blocks: a free list and reference counts.

A block may be shared by several sequences (prefix caching): it returns to the free list only
when its last holder lets go.
"""

from __future__ import annotations

import itertools
from collections import deque


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def occupancy(self, buckets: int) -> list[float]:
        """Fraction of blocks in use in each of `buckets` equal ranges of block ids: a compact
        map of the cache for dashboards. Reads the counts without locking (a snapshot that may
        be one step stale, never inconsistent in length)."""
        counts = self.ref_counts
        n = len(counts)
        buckets = max(1, min(buckets, n))
        edges = [n * i // buckets for i in range(buckets + 1)]
        return [
            sum(1 for c in counts[lo:hi] if c) / (hi - lo) for lo, hi in itertools.pairwise(edges)
        ]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Another sequence holds these blocks too."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            count = self.ref_counts[b]
            if count < 1:
                raise ValueError(f"block {b} released more often than it was held")
            self.ref_counts[b] = count - 1
            if count == 1:
                self._free.append(b)
