"""Hybrid KV-cache groups: recycling, group-specific hits and the agreed hit length.

Block ids are exact: the pool pops from the head of its free queue, freed
hashed blocks go to the tail in batch order, unhashed ones to the head.
"""

from __future__ import annotations

from typing import Any

import pytest

from kv_manager_service.core import (
    AllocateResult,
    AllocateStatus,
    BlockHasher,
    BlockStored,
    CacheHit,
    GroupAllocation,
    GroupKind,
    GroupSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheManager,
)

OK = AllocateStatus.OK
FULL = GroupKind.FULL_ATTENTION
SLIDING = GroupKind.SLIDING_WINDOW
CHUNKED = GroupKind.CHUNKED_LOCAL
MAMBA = GroupKind.MAMBA
CROSS = GroupKind.CROSS_ATTENTION


def make_manager(num_blocks: int, *groups: GroupSpec, **kwargs: Any) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, groups=groups, **kwargs))


def allocate(manager: KVCacheManager, request_id: str, token_ids: list[int], num_new_tokens: int, **kwargs: Any):
    result = manager.allocate(request_id, token_ids, num_new_tokens, **kwargs)
    manager.check_invariants()
    return result


def admit(manager: KVCacheManager, request_id: str, prompt: list[int], **kwargs: Any):
    return allocate(manager, request_id, prompt, len(prompt), **kwargs)


def tables(manager: KVCacheManager, request_id: str) -> tuple[tuple[int, ...], ...]:
    return manager.block_table(request_id).block_ids


def free_queue(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.pool.free_queue]


def new_blocks(result: AllocateResult) -> tuple[tuple[int, ...], ...]:
    return tuple(group.new_block_ids for group in result.groups)


# -- sliding window ----------------------------------------------------------------------------


def test_sliding_window_recycles_leading_blocks_into_null_slots() -> None:
    # Token p reads [p - 4, p]: once 12 tokens are computed, tokens 0..7 are never read again.
    m = make_manager(11, GroupSpec(SLIDING, 4, sliding_window=5))
    prompt = list(range(12))
    assert admit(m, "a", prompt) == AllocateResult(OK, 0, 12, (GroupAllocation(0, (), (1, 2, 3), 0),), (), 1)

    result = allocate(m, "a", [12], 1)
    assert result == AllocateResult(OK, 12, 1, (GroupAllocation(0, (), (4,), 3),), (), 2)
    assert tables(m, "a") == ((0, 0, 3, 4),)
    # Blocks 1 and 2 are free again, the later one first, at the tail: still cached.
    assert free_queue(m) == [5, 6, 7, 8, 9, 10, 2, 1]
    assert m.pool.blocks[1].ref_cnt == m.pool.blocks[2].ref_cnt == 0
    assert m.find_cache_hit(prompt[:8] + [99]) == CacheHit(8, ((0, 2),))

    # Tokens 13..15: the window start moves inside block index 2, nothing more to recycle.
    for token in (13, 14, 15):
        assert allocate(m, "a", [token], 1).groups[0].new_block_ids == ()
    assert tables(m, "a") == ((0, 0, 3, 4),)
    # At 16 computed tokens the next token reads [12, 16]: block index 2 goes.
    assert allocate(m, "a", [16], 1).groups[0] == GroupAllocation(0, (), (5,), 4)
    assert tables(m, "a") == ((0, 0, 0, 4, 5),)
    assert free_queue(m) == [6, 7, 8, 9, 10, 2, 1, 3]


def test_sliding_window_hit_is_a_table_prefix_with_nulls_before_the_window() -> None:
    m = make_manager(11, GroupSpec(SLIDING, 4, sliding_window=5))
    prompt = list(range(12))
    admit(m, "a", prompt)
    allocate(m, "a", [12], 1)  # a holds (0, 0, 3, 4); blocks 1 and 2 are free but cached

    # 12 cached tokens: the next token reads tokens 8..11 only, block index 2.
    assert m.find_cache_hit(prompt + [99]) == CacheHit(12, ((0, 0, 3),))
    result = admit(m, "b", prompt + [99])
    assert result == AllocateResult(OK, 12, 1, (GroupAllocation(0, (0, 0, 3), (5,), 3),), (), 3)
    assert m.pool.blocks[3].ref_cnt == 2
    assert free_queue(m) == [6, 7, 8, 9, 10, 2, 1]  # the free cached blocks were not adopted

    # A miss in block index 2: the rightmost covering run ends at block index 1.
    other = prompt[:8] + [77] * 4 + [1]
    assert m.find_cache_hit(other) == CacheHit(8, ((0, 2),))
    assert admit(m, "c", other).groups[0] == GroupAllocation(0, (0, 2), (6, 7), 2)
    assert free_queue(m) == [8, 9, 10, 1]


def test_sliding_window_needs_the_whole_window_cached() -> None:
    # Window 9 with blocks of 4: a hit must end in two cached blocks (tokens p-8..p-1).
    m = make_manager(11, GroupSpec(SLIDING, 4, sliding_window=9))
    prompt = list(range(16))
    admit(m, "a", prompt)
    assert m.find_cache_hit(prompt + [99]) == CacheHit(16, ((0, 0, 3, 4),))
    assert m.find_cache_hit(prompt[:12] + [99]) == CacheHit(12, ((0, 2, 3),))
    # A run that reaches block 0 is a hit even when shorter than the window.
    assert m.find_cache_hit(prompt[:4] + [99]) == CacheHit(4, ((1,),))


# -- chunked local attention -----------------------------------------------------------------


def test_chunked_local_recycles_earlier_chunks() -> None:
    m = make_manager(11, GroupSpec(CHUNKED, 4, chunk_size=8), GroupSpec(FULL, 4))
    sequence = list(range(8))
    result = admit(m, "a", sequence)
    assert new_blocks(result) == ((1, 2), (3, 4))

    # Token 8 starts the second chunk: chunk 0 (blocks 1 and 2) is never read again.
    result = allocate(m, "a", [8], 1)
    assert result.groups == (GroupAllocation(0, (), (5,), 2), GroupAllocation(1, (), (6,), 2))
    assert tables(m, "a") == ((0, 0, 5), (3, 4, 6))
    assert free_queue(m) == [7, 8, 9, 10, 2, 1]
    sequence.append(8)

    for token in (9, 10, 11):
        assert new_blocks(allocate(m, "a", [token], 1)) == ((), ())
        sequence.append(token)
    assert tables(m, "a") == ((0, 0, 5), (3, 4, 6))

    # Hits: the earlier chunk is all nulls, then the cached blocks of the current chunk.
    assert m.find_cache_hit(sequence + [50]) == CacheHit(12, ((0, 0, 5), (3, 4, 6)))
    assert m.find_cache_hit(sequence[:8] + [50]) == CacheHit(8, ((0, 0), (3, 4)))
    assert m.find_cache_hit(sequence[:10] + [50]) == CacheHit(8, ((0, 0), (3, 4)))

    for token in (12, 13, 14, 15):
        allocate(m, "a", [token], 1)
    assert tables(m, "a") == ((0, 0, 5, 7), (3, 4, 6, 8))
    # Token 16 starts chunk 2: blocks 5 and 7 go, later one first.
    assert allocate(m, "a", [16], 1).groups[0] == GroupAllocation(0, (), (9,), 4)
    assert tables(m, "a") == ((0, 0, 0, 0, 9), (3, 4, 6, 8, 10))
    assert free_queue(m) == [2, 1, 7, 5]


# -- mamba -------------------------------------------------------------------------------------


def test_mamba_keeps_only_the_latest_state_block() -> None:
    m = make_manager(11, GroupSpec(MAMBA, 4))
    sequence = list(range(10))
    assert new_blocks(admit(m, "a", sequence)) == ((1, 2, 3),)

    # The state after 10 tokens lives in block index 2: states @4 and @8 are recycled.
    assert allocate(m, "a", [10], 1).groups[0] == GroupAllocation(0, (), (), 3)
    assert tables(m, "a") == ((0, 0, 3),)
    assert free_queue(m) == [4, 5, 6, 7, 8, 9, 10, 2, 1]
    assert allocate(m, "a", [11], 1).groups[0] == GroupAllocation(0, (), (), 3)
    # 12 tokens computed: block 3 holds the state @12; token 12 writes a new state block.
    assert allocate(m, "a", [12], 1).groups[0] == GroupAllocation(0, (), (4,), 3)
    assert tables(m, "a") == ((0, 0, 3, 4),)
    assert allocate(m, "a", [13], 1).groups[0] == GroupAllocation(0, (), (), 4)
    assert tables(m, "a") == ((0, 0, 0, 4),)
    assert free_queue(m) == [5, 6, 7, 8, 9, 10, 2, 1, 3]


def test_mamba_hit_is_the_latest_cached_state_behind_nulls() -> None:
    m = make_manager(11, GroupSpec(MAMBA, 4))
    sequence = list(range(14))
    admit(m, "a", sequence[:10])
    for token in sequence[10:]:
        allocate(m, "a", [token], 1)
    # States @4 (1), @8 (2), @12 (3) are free but cached; a holds (0, 0, 0, 4).
    assert m.find_cache_hit(sequence[:12] + [99]) == CacheHit(12, ((0, 0, 3),))
    assert m.find_cache_hit(sequence[:9] + [99]) == CacheHit(8, ((0, 2),))
    assert m.find_cache_hit(sequence[:3] + [99]) == CacheHit(0, ((),))
    result = admit(m, "b", sequence[:12] + [99])
    assert result == AllocateResult(OK, 12, 1, (GroupAllocation(0, (0, 0, 3), (5,), 3),), (), 6)
    assert free_queue(m) == [6, 7, 8, 9, 10, 2, 1]


# -- hybrid: full + sliding window + mamba ---------------------------------------------------


def hybrid_manager(num_blocks: int) -> KVCacheManager:
    return make_manager(
        num_blocks,
        GroupSpec(FULL, 4),
        GroupSpec(SLIDING, 2, sliding_window=5),
        GroupSpec(MAMBA, 4),
    )


def test_hybrid_hit_and_recycling_per_group() -> None:
    m = hybrid_manager(21)
    assert (m.config.hash_block_size, m.config.lcm_block_size) == (2, 4)
    prompt = list(range(12))
    assert new_blocks(admit(m, "a", prompt)) == ((1, 2, 3), (4, 5, 6, 7, 8, 9), (10, 11, 12))

    hit = m.find_cache_hit(prompt + [99])
    assert hit == CacheHit(12, ((1, 2, 3), (0, 0, 0, 0, 8, 9), (0, 0, 12)))
    result = admit(m, "b", prompt + [99])
    assert result == AllocateResult(
        OK,
        12,
        1,
        (
            GroupAllocation(0, (1, 2, 3), (13,), 3),
            GroupAllocation(1, (0, 0, 0, 0, 8, 9), (14,), 6),
            GroupAllocation(2, (0, 0, 12), (15,), 3),
        ),
        (),
        2,
    )

    # a decodes: the window drops tokens 0..7 (blocks 4..7), mamba the states @4 and @8.
    result = allocate(m, "a", [12], 1)
    assert new_blocks(result) == ((16,), (17,), (18,))
    assert tables(m, "a") == ((1, 2, 3, 16), (0, 0, 0, 0, 8, 9, 17), (0, 0, 12, 18))
    assert free_queue(m) == [19, 20, 7, 6, 5, 4, 11, 10]

    # b decodes: its hit already had nulls; mamba drops the shared state @12 (a still holds it).
    result = allocate(m, "b", [13], 1)
    assert new_blocks(result) == ((), (), ())
    assert tables(m, "b") == ((1, 2, 3, 13), (0, 0, 0, 0, 8, 9, 14), (0, 0, 0, 15))
    assert m.pool.blocks[12].ref_cnt == 1


def test_hit_blocks_of_a_later_group_are_not_handed_out_to_an_earlier_group() -> None:
    """All hits are adopted before any group takes fresh blocks from the queue.

    Here the sliding-window hit (block 4) is free and sits at the head of the
    queue once the full-attention hit is adopted; the full-attention group's
    fresh block must not be that block.
    """
    m = make_manager(9, GroupSpec(FULL, 4), GroupSpec(SLIDING, 4, sliding_window=3))
    p = [1] * 4 + [2] * 4
    q = [5] * 4 + [6] * 4
    assert new_blocks(admit(m, "a1", p)) == ((1, 2), (3, 4))
    assert new_blocks(admit(m, "a2", q)) == ((5, 6), (7, 8))
    m.free(["a1"])
    m.free(["a2"])
    assert free_queue(m) == [2, 1, 4, 3, 6, 5, 8, 7]

    assert m.find_cache_hit(p + [9]) == CacheHit(8, ((1, 2), (0, 4)))
    result = allocate(m, "b", p + [9], 9)
    # Adopting [1, 2] and [4] leaves [3, 6, 5, 8, 7]: full takes 3, the window group 6.
    assert result.groups == (GroupAllocation(0, (1, 2), (3,), 2), GroupAllocation(1, (0, 4), (6,), 2))
    assert tables(m, "b") == ((1, 2, 3), (0, 4, 6))
    assert m.pool.blocks[4].block_hash is not None, "the adopted hit block lost its hash"
    assert m.pool.blocks[4].ref_cnt == 1


def test_groups_disagree_and_the_hit_is_their_fixed_point() -> None:
    # Full attention has 64 tokens cached; the mamba group only still has its state @32.
    m = make_manager(25, GroupSpec(FULL, 16), GroupSpec(MAMBA, 16))
    x = list(range(1000, 1065))
    assert new_blocks(admit(m, "a", x)) == ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10))
    # e holds twelve blocks it never fills; freed later, they go back to the head.
    assert new_blocks(admit(m, "e", [700], num_lookahead_tokens=95)) == (
        (11, 12, 13, 14, 15, 16),
        (17, 18, 19, 20, 21, 22),
    )
    allocate(m, "a", [7], 1)  # mamba recycles the states @16..@64 (blocks 6..9)
    assert tables(m, "a") == ((1, 2, 3, 4, 5), (0, 0, 0, 0, 10))
    assert free_queue(m) == [23, 24, 9, 8, 7, 6]
    admit(m, "d", [500] * 32)  # takes 23, 24, 9, 8: the states @64 and @48 are evicted
    assert free_queue(m) == [7, 6]

    prompt = x[:64] + [5]
    assert m.find_cache_hit(prompt) == CacheHit(32, ((1, 2), (0, 7)))
    m.free(["e"])
    result = admit(m, "b", prompt)
    assert result == AllocateResult(
        OK,
        32,
        33,
        (GroupAllocation(0, (1, 2), (22, 21, 20), 2), GroupAllocation(1, (0, 7), (19, 18, 17), 2)),
        (),
        6,
    )


# -- cross attention ---------------------------------------------------------------------------


def test_cross_attention_is_sized_by_encoder_tokens_and_never_cached() -> None:
    m = make_manager(11, GroupSpec(FULL, 16), GroupSpec(CROSS, 16), enable_events=True)
    prompt = list(range(20))
    result = admit(m, "a", prompt, num_encoder_tokens=40)
    assert result.groups == (GroupAllocation(0, (), (1, 2), 0), GroupAllocation(1, (), (3, 4, 5), 0))
    hasher = BlockHasher(16)
    events = m.take_events()
    assert events == [BlockStored(0, tuple(hasher.hash_blocks(hasher.root_hash, prompt)), None, 16)]
    assert all(m.pool.blocks[b].block_hash is None for b in (3, 4, 5))

    assert m.find_cache_hit(prompt) == CacheHit(16, ((1,), ()))
    result = admit(m, "b", prompt, num_encoder_tokens=40)
    assert result.groups == (GroupAllocation(0, (1,), (6,), 1), GroupAllocation(1, (), (7, 8, 9), 0))

    # Decoding never adds cross-attention blocks.
    result = allocate(m, "a", [20], 1)
    assert result.groups == (GroupAllocation(0, (), (), 2), GroupAllocation(1, (), (), 3))
    with pytest.raises(InvalidArgumentError):
        m.allocate("a", [21], 1, num_encoder_tokens=8)
    # Repeating the same encoder length is allowed.
    assert allocate(m, "a", [21], 1, num_encoder_tokens=40).status is OK

    # No encoder tokens: no cross-attention blocks.
    assert admit(m, "c", [9, 9, 9]).groups[1] == GroupAllocation(1, (), (), 0)
    m.free(["a"])
    assert free_queue(m) == [5, 4, 3, 2]  # all unhashed, to the head; block 1 is also b's


# -- hash block size and hit alignment ---------------------------------------------------------


def test_hash_block_size_is_the_gcd_and_hits_land_on_the_lcm() -> None:
    m = make_manager(21, GroupSpec(FULL, 16), GroupSpec(FULL, 32))
    assert (m.config.hash_block_size, m.config.lcm_block_size) == (16, 32)
    sequence = list(range(81))
    assert new_blocks(admit(m, "a", sequence)) == ((1, 2, 3, 4, 5, 6), (7, 8, 9))

    hasher = BlockHasher(16)
    chain = hasher.hash_blocks(hasher.root_hash, sequence)
    assert m.requests["a"].block_hashes == chain
    assert [m.pool.blocks[b].block_hash for b in (1, 2, 3, 4, 5)] == chain
    # A 32-token block is named by the chain hash at its last 16-token boundary.
    assert [m.pool.blocks[b].block_hash for b in (7, 8)] == [chain[1], chain[3]]

    # 80 cached tokens for the 16-token group, 64 for the 32-token group: the hit is 64.
    assert m.find_cache_hit(sequence[:80] + [9999]) == CacheHit(64, ((1, 2, 3, 4), (7, 8)))
    # 48 tokens match, which is not a multiple of 32: the hit is cut to 32.
    assert m.find_cache_hit(sequence[:48] + [9999] * 10) == CacheHit(32, ((1, 2), (7,)))
    assert m.find_cache_hit(sequence[:31] + [9999] * 10) == CacheHit(0, ((), ()))


def test_full_and_wider_sliding_window_align_on_the_lcm() -> None:
    m = make_manager(21, GroupSpec(FULL, 16), GroupSpec(SLIDING, 32, sliding_window=17))
    assert (m.config.hash_block_size, m.config.lcm_block_size) == (16, 32)
    sequence = list(range(81))
    assert new_blocks(admit(m, "a", sequence)) == ((1, 2, 3, 4, 5, 6), (7, 8, 9))
    # At 64 tokens the next token reads 48..63: only the second window block.
    assert m.find_cache_hit(sequence[:80] + [9999]) == CacheHit(64, ((1, 2, 3, 4), (0, 8)))
    assert m.find_cache_hit(sequence[:48] + [9999] * 10) == CacheHit(32, ((1, 2), (7,)))
