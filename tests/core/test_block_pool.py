"""BlockPool: the null block, the free-order contract, lazy eviction, touch."""

from __future__ import annotations

import hashlib

import pytest

from kv_manager_service.core.block_pool import BlockPool
from kv_manager_service.shared.events import AllBlocksCleared, BlockRemoved, BlockStored


def h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def make_pool(num_blocks: int = 10, num_groups: int = 1) -> BlockPool:
    return BlockPool(num_blocks, num_groups, enable_caching=True, enable_events=True)


def free_ids(pool: BlockPool) -> list[int]:
    return [block.block_id for block in pool.free_queue]


def cache(pool: BlockPool, blocks, names: list[str], group_id: int = 0, parent: bytes | None = None) -> None:
    pool.cache_full_blocks(group_id, blocks, [h(n) for n in names], parent, 4)


def test_the_null_block_is_never_free() -> None:
    pool = make_pool(10)
    null = pool.null_block
    assert null is pool.blocks[0] and null.is_null and null.block_id == 0
    assert 0 not in free_ids(pool)
    assert free_ids(pool) == list(range(1, 10))
    assert pool.get_num_free_blocks() == 9 and pool.get_usage() == 0.0
    # Popping every block never hands out the null block.
    assert [b.block_id for b in pool.get_new_blocks(9)] == list(range(1, 10))
    assert pool.get_usage() == 1.0


def test_freeing_or_touching_the_null_block_does_nothing() -> None:
    pool = make_pool(5)
    (block,) = pool.get_new_blocks(1)
    null_ref_cnt = pool.null_block.ref_cnt
    assert pool.free_blocks([pool.null_block, block, pool.null_block]) == 1
    assert pool.null_block.ref_cnt == null_ref_cnt
    pool.touch([pool.null_block])
    assert 0 not in free_ids(pool)
    assert pool.get_num_free_blocks() == 4


def test_a_pool_needs_a_block_besides_the_null_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(1, 1, True, False)
    assert BlockPool(2, 1, True, False).get_num_free_blocks() == 1


def test_new_blocks_have_one_reference() -> None:
    pool = make_pool(10)
    blocks = pool.get_new_blocks(3)
    assert [(b.block_id, b.ref_cnt) for b in blocks] == [(1, 1), (2, 1), (3, 1)]
    assert pool.get_usage() == pytest.approx(3 / 9)
    with pytest.raises(ValueError):
        pool.get_new_blocks(7)
    assert pool.get_num_free_blocks() == 6


def test_free_order_unhashed_to_head_hashed_to_tail_in_batch_order() -> None:
    pool = make_pool(10)
    b1, b2, b3, b4, b5 = pool.get_new_blocks(5)
    cache(pool, [b2, b4], ["x", "y"])
    assert free_ids(pool) == [6, 7, 8, 9]
    assert pool.free_blocks([b5, b4, b3, b2, b1]) == 5
    # Unhashed (5, 3, 1) go to the head in batch order, hashed (4, 2) to the tail.
    assert free_ids(pool) == [5, 3, 1, 6, 7, 8, 9, 4, 2]


def test_blocks_still_referenced_stay_out_of_the_queue() -> None:
    pool = make_pool(5)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    assert pool.free_blocks([block]) == 0
    assert block.ref_cnt == 1 and 1 not in free_ids(pool)
    assert pool.free_blocks([block]) == 1
    assert free_ids(pool) == [1, 2, 3, 4]


def test_eviction_is_lazy() -> None:
    pool = make_pool(4)
    b1, b2, b3 = pool.get_new_blocks(3)
    cache(pool, [b1, b2], ["a", "b"])
    assert pool.take_events() == [BlockStored(0, (h("a"), h("b")), None, 4)]
    pool.free_blocks([b2, b1])  # hashed: to the tail, b2 first
    pool.free_blocks([b3])  # unhashed: to the head
    assert free_ids(pool) == [3, 2, 1]
    # Free, but still cached and findable.
    assert pool.get_cached_block(0, h("a")) is b1
    assert pool.get_cached_block(0, h("b")) is b2
    assert b2.block_hash == h("b")

    assert pool.get_new_blocks(2) == [b3, b2]  # b2 is evicted only now
    assert b2.block_hash is None and b2.group_id == -1
    assert pool.get_cached_block(0, h("b")) is None
    assert pool.get_cached_block(0, h("a")) is b1
    assert pool.num_evictions == 1
    assert pool.take_events() == [BlockRemoved(0, (h("b"),))]


def test_touch_rescues_a_cached_free_block() -> None:
    pool = make_pool(5)
    b1, b2 = pool.get_new_blocks(2)
    cache(pool, [b1], ["a"])
    pool.free_blocks([b2, b1])
    assert free_ids(pool) == [2, 3, 4, 1]
    pool.touch([b1])
    assert b1.ref_cnt == 1 and free_ids(pool) == [2, 3, 4]
    assert pool.get_cached_block(0, h("a")) is b1
    assert b1 not in pool.get_new_blocks(3)
    assert pool.num_evictions == 0 and b1.block_hash == h("a")


def test_the_cache_map_does_not_deduplicate() -> None:
    pool = make_pool(6)
    b1, b2, b3 = pool.get_new_blocks(3)
    cache(pool, [b1], ["same"])
    cache(pool, [b2], ["same"])
    cache(pool, [b3], ["same"], group_id=0)
    assert pool.cached[0][h("same")] == {1: b1, 2: b2, 3: b3}
    assert pool.get_cached_block(0, h("same")) in (b1, b2, b3)
    pool.free_blocks([b2])
    pool.free_blocks([b1])
    assert free_ids(pool) == [4, 5, 2, 1]
    pool.get_new_blocks(3)  # evicts b2
    assert pool.cached[0][h("same")] == {1: b1, 3: b3}
    pool.get_new_blocks(1)  # evicts b1: one entry left, stored as the block itself
    assert pool.cached[0][h("same")] is b3
    assert pool.get_cached_block(0, h("same")) is b3


def test_groups_have_separate_cache_maps() -> None:
    pool = make_pool(6, num_groups=2)
    b1, b2 = pool.get_new_blocks(2)
    cache(pool, [b1], ["x"], group_id=0)
    cache(pool, [b2], ["x"], group_id=1, parent=h("p"))
    assert pool.get_cached_block(0, h("x")) is b1
    assert pool.get_cached_block(1, h("x")) is b2
    assert (b1.group_id, b2.group_id) == (0, 1)
    assert pool.take_events() == [BlockStored(0, (h("x"),), None, 4), BlockStored(1, (h("x"),), h("p"), 4)]
    pool.free_blocks([b1, b2])
    pool.get_new_blocks(5)
    assert pool.take_events() == [BlockRemoved(0, (h("x"),)), BlockRemoved(1, (h("x"),))]


def test_reset_prefix_cache_only_when_every_block_is_free() -> None:
    pool = make_pool(5)
    b1, b2 = pool.get_new_blocks(2)
    cache(pool, [b1, b2], ["a", "b"])
    pool.take_events()
    pool.free_blocks([b2])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(0, h("a")) is b1 and b2.block_hash == h("b")
    assert pool.take_events() == []
    pool.free_blocks([b1])
    order = free_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert all(b.block_hash is None and b.group_id == -1 for b in pool.blocks)
    assert pool.cached == [{}]
    assert free_ids(pool) == order
    assert pool.take_events() == [AllBlocksCleared()]
    pool.get_new_blocks(4)
    assert pool.num_evictions == 0  # nothing was cached any more


def test_no_events_when_disabled() -> None:
    pool = BlockPool(5, 1, enable_caching=True, enable_events=False)
    (b1,) = pool.get_new_blocks(1)
    cache(pool, [b1], ["a"])
    pool.free_blocks([b1])
    pool.get_new_blocks(4)
    pool.reset_prefix_cache()
    assert pool.take_events() == []
