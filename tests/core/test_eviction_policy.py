"""The frequency eviction order: a hash seen more often is evicted later, its count outlives eviction in a
bounded history; retention priorities still come first. lru is vLLM's order (tests/core/test_conformance.py)."""

from __future__ import annotations

import pytest

from pool_support import cached_blocks, prompt, run
from pool_support import make_manager as make_pool

from kv_manager_service.core import KVCacheConfig, KVCacheManager
from kv_manager_service.core.block_pool import FREQUENCY_CLASSES, HISTORY_PER_BLOCK
from kv_manager_service.shared.ops import Retention


def make_manager(num_blocks: int = 13, policy: str = "frequency") -> KVCacheManager:
    return make_pool(num_blocks, policy)


@pytest.mark.parametrize("policy, survivor", [("lru", "recent"), ("frequency", "frequent")])
def test_under_pressure_lru_keeps_the_recent_prompt_and_frequency_the_one_seen_twice(policy, survivor):
    m = make_manager(policy=policy)
    frequent, recent = prompt(1, 3), prompt(2, 3)
    run(m, "a", frequent)
    run(m, "b", frequent)  # a hit: seen twice
    run(m, "c", recent)  # seen once, and more recently used than `frequent`
    run(m, "pressure", prompt(3, 8))  # 9 of the 12 blocks: 6 unhashed, then 3 cached ones go
    kept = {"frequent": cached_blocks(m, frequent), "recent": cached_blocks(m, recent)}
    assert kept[survivor] == 3 and sum(kept.values()) == 3


def test_the_history_outlives_eviction_so_a_recomputed_hash_counts_as_seen_before():
    m = make_manager(num_blocks=9)
    returning = prompt(1, 2)
    run(m, "first", returning)
    run(m, "flush", prompt(2, 7))  # every block: `returning` is evicted and computed again below
    assert cached_blocks(m, returning) == 0
    run(m, "again", returning)
    run(m, "once", prompt(3, 2))  # more recent, but seen once
    # 6 blocks: the unhashed one, flush's 3 left, then `once` (lru would take `returning`, less recent).
    run(m, "pressure", prompt(4, 5))
    assert cached_blocks(m, returning) == 2 and cached_blocks(m, prompt(3, 2)) == 0


def test_counts_are_capped_and_the_history_forgets_the_least_recently_seen_beyond_its_size():
    m = make_manager(num_blocks=3)
    pool = m.pool
    assert pool.history_size == HISTORY_PER_BLOCK * 3
    for _ in range(FREQUENCY_CLASSES + 2):
        run(m, "same", prompt(1, 1))
    (block,) = [b for b in pool.free_queue if b.block_hash is not None]
    often = block.block_hash
    assert pool.segment_keys[block] == FREQUENCY_CLASSES - 1 and pool.seen[often] == FREQUENCY_CLASSES
    for seed in range(2, 2 + pool.history_size):  # as many other hashes as the history holds
        run(m, f"r{seed}", prompt(seed, 1))
    assert len(pool.seen) == pool.history_size and often not in pool.seen


def test_a_retention_priority_outranks_any_frequency():
    m = make_manager()
    frequent, kept = prompt(1, 3), prompt(2, 3)
    for name in ("a", "b", "c", "d"):
        run(m, name, frequent)
    run(m, "kept", kept, Retention(priority=1))  # seen once, but of priority 1
    run(m, "pressure", prompt(3, 8))
    assert cached_blocks(m, kept) == 3 and cached_blocks(m, frequent) == 0


def test_an_unknown_policy_is_refused_naming_the_field_and_the_choices():
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, frequency, got 'lfu'"):
        KVCacheConfig(num_blocks=8, eviction_policy="lfu")


def test_a_reset_forgets_the_history():
    m = make_manager()
    run(m, "a", prompt(1, 2))
    assert m.pool.seen
    assert m.reset_prefix_cache()
    assert not m.pool.seen and not m.pool.segment_keys
    m.check_invariants()
