"""BlockPool: free list and reference counts, including blocks shared by several sequences."""

import pytest

from controlplane.engine.block_pool import BlockPool, OutOfBlocksError


def test_allocate_release_and_exhaustion():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1 and pool.num_used == 3
    with pytest.raises(OutOfBlocksError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
    pool.release(a)
    assert pool.num_free == 4


def test_shared_blocks_return_only_when_the_last_holder_releases():
    pool = BlockPool(4)
    shared = pool.allocate(2)
    pool.share(shared)  # a second sequence holds the same prefix blocks
    assert [pool.ref_counts[b] for b in shared] == [2, 2]
    pool.release(shared)
    assert pool.num_free == 2 and all(pool.ref_counts[b] == 1 for b in shared)
    pool.release(shared)
    assert pool.num_free == 4


def test_misuse_is_an_error_not_a_corruption():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only held blocks can be shared"):
        pool.share([0])
    b = pool.allocate(1)
    pool.release(b)
    with pytest.raises(ValueError, match="released more often than it was held"):
        pool.release(b)
    assert pool.num_free == 2


def test_occupancy_map():
    pool = BlockPool(8)
    assert pool.occupancy(4) == [0.0, 0.0, 0.0, 0.0]
    held = pool.allocate(3)  # blocks 0, 1, 2 (the free list is FIFO)
    assert held == [0, 1, 2]
    assert pool.occupancy(4) == [1.0, 0.5, 0.0, 0.0]
    assert pool.occupancy(100) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # at most one per block
    pool.release(held)
    assert pool.occupancy(2) == [0.0, 0.0]
