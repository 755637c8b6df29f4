"""Fixed-size KV blocks: reference counts, a free list and the prefix cache.

A block is in one of three states:
- held: one or more sequences reference it (ref count > 0);
- cached: nobody holds it, but its contents are registered under a block hash, so a later
  request with the same prefix can take it back instead of recomputing it. Cached blocks wait
  in an LRU list and are evicted (least recently released first) when the free list is empty;
- free: nobody holds it and it caches nothing.

Allocation takes free blocks first, then evicts cached ones; held blocks are never evicted.
A held block may be registered too (its hash is kept while sequences use it): a request that
arrives meanwhile shares it by reference.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # The prefix cache: hash -> block, the block's hash, and the unheld cached blocks in
        # LRU order (first = evicted first).
        self.enable_caching = True
        self._cached: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0  # cumulative

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocation can take: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Held blocks."""
        return self.num_blocks - self.num_free

    @property
    def num_empty(self) -> int:
        """Blocks that are neither held nor cached."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the cache, held or not."""
        return len(self._cached)

    def occupancy(self, buckets: int) -> list[float]:
        """Fraction of blocks held in each of `buckets` equal ranges of block ids: a compact
        map of the cache for dashboards. Reads the counts without locking (a snapshot that may
        be one step stale, never inconsistent in length)."""
        counts = self.ref_counts
        return self._bucketed(buckets, lambda lo, hi: sum(1 for c in counts[lo:hi] if c))

    def cached_occupancy(self, buckets: int) -> list[float]:
        """Fraction of blocks in each bucket (the edges of `occupancy`) that are cached and
        unheld: reusable prefixes that allocation may still evict."""
        counts, hashes = self.ref_counts, self._hash_of
        return self._bucketed(
            buckets,
            lambda lo, hi: sum(1 for b in range(lo, hi) if hashes[b] is not None and not counts[b]),
        )

    def _bucketed(self, buckets: int, count: Callable[[int, int], int]) -> list[float]:
        n = self.num_blocks
        buckets = max(1, min(buckets, n))
        edges = [n * i // buckets for i in range(buckets + 1)]
        return [count(lo, hi) / (hi - lo) for lo, hi in itertools.pairwise(edges)]

    # -- holding and letting go -----------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._forget(b)
                self.num_evictions += 1
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Another sequence holds these blocks too (a fork of parallel sampling)."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Let go of a sequence's blocks. Cached ones become evictable, tail first: the end of
        a sequence is the part least likely to be shared, so it is evicted before its head."""
        for b in reversed(blocks):
            count = self.ref_counts[b]
            if count < 1:
                raise ValueError(f"block {b} released more often than it was held")
            self.ref_counts[b] = count - 1
            if count > 1:
                continue
            if self._hash_of[b] is not None and self.enable_caching:
                self._evictable[b] = None
            else:
                self._forget(b)
                self._free.append(b)

    # -- the prefix cache -----------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks for the longest prefix of `hashes` (touches nothing)."""
        hits = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of these cached blocks nobody holds (taking them uses up free capacity)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def take(self, blocks: list[int]) -> None:
        """Hold cached blocks found by `lookup`: held ones gain a reference, evictable ones
        leave the LRU list."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """A held block is full and computed: cache it under its hash. A second block with
        the same contents (two requests computed the same prefix at once) stays uncached."""
        if self._hash_of[block] is None and block_hash not in self._cached:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def reset(self) -> int:
        """Drop the cache: evictable blocks become free, held ones forget their hash (they go
        to the free list when released). Returns how many evictable blocks were dropped."""
        dropped = len(self._evictable)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        return dropped

    def _forget(self, b: int) -> None:
        h = self._hash_of[b]
        if h is not None:
            self._hash_of[b] = None
            del self._cached[h]
