"""Exact block ids for one full-attention group: the contract a scheduler sees.

The pool hands out blocks from the head of its free queue; freed blocks
without a hash go to the head (reused first), hashed ones to the tail (LRU);
a request frees its blocks tail-first. Every expected id below follows from
those rules and nothing else.
"""

from __future__ import annotations

from typing import Any

import pytest

from kv_manager_service.core import (
    AllBlocksCleared,
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    CacheHit,
    FailedPreconditionError,
    ForkOp,
    FreeOp,
    FreeResult,
    GroupAllocation,
    GroupKind,
    GroupSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheManager,
    LoraRef,
    MMFeature,
    OutOfRangeError,
    RequestNotFoundError,
    ResourceExhaustedError,
)

OK = AllocateStatus.OK
NO_SPACE = AllocateStatus.NO_SPACE

# Three distinct full blocks of 16 tokens.
C = 16 * [0] + 16 * [1] + 16 * [2]


def make_manager(num_blocks: int = 11, block_size: int = 16, **kwargs: Any) -> KVCacheManager:
    config = KVCacheConfig(num_blocks=num_blocks, groups=(GroupSpec(GroupKind.FULL_ATTENTION, block_size),), **kwargs)
    return KVCacheManager(config)


def admit(manager: KVCacheManager, request_id: str, prompt: list[int], num_new_tokens: int | None = None, **kwargs):
    """A first allocate that schedules the whole prompt unless told otherwise."""
    num_new = len(prompt) if num_new_tokens is None else num_new_tokens
    result = manager.allocate(request_id, prompt, num_new, **kwargs)
    manager.check_invariants()
    return result


def step(manager: KVCacheManager, request_id: str, new_token_ids: list[int], num_new_tokens: int, **kwargs):
    result = manager.allocate(request_id, new_token_ids, num_new_tokens, **kwargs)
    manager.check_invariants()
    return result


def free_queue(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.pool.free_queue]


def table(manager: KVCacheManager, request_id: str) -> tuple[int, ...]:
    return manager.block_table(request_id).block_ids[0]


def one_group(hit: tuple[int, ...], new: tuple[int, ...], index: int) -> tuple[GroupAllocation, ...]:
    return (GroupAllocation(0, hit, new, index),)


def observable(manager: KVCacheManager) -> dict[str, Any]:
    return {
        "tables": {rid: manager.block_table(rid) for rid in sorted(manager.requests)},
        "num_tokens": {rid: r.num_tokens for rid, r in manager.requests.items()},
        "stats": manager.stats(),
        "pending_copies": manager.pending_copies(),
        "free_queue": free_queue(manager),
        "last_step_id": manager.last_step_id,
        "hashes": [b.block_hash for b in manager.pool.blocks],
    }


# -- the reference scenario ------------------------------------------------------------


def test_reference_scenario_block_ids() -> None:
    m = make_manager(num_blocks=11)
    assert free_queue(m) == list(range(1, 11))

    r0 = admit(m, "r0", C + 7 * [3])
    assert r0 == AllocateResult(OK, 0, 55, one_group((), (1, 2, 3, 4), 0), (), 1)

    r1 = admit(m, "r1", C + 5 * [3])
    assert r1 == AllocateResult(OK, 48, 5, one_group((1, 2, 3), (5,), 3), (), 2)

    assert m.free(["r0"]) == FreeResult(1, 3)  # only block 4 was r0's alone
    assert m.free(["r1"]) == FreeResult(4, 4)
    m.check_invariants()
    assert free_queue(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    r2 = admit(m, "r2", C + 6 * [3])
    assert r2 == AllocateResult(OK, 48, 6, one_group((1, 2, 3), (5,), 3), (), 5)
    m.free(["r2"])
    m.check_invariants()

    r3 = admit(m, "r3", 160 * [99])
    assert r3 == AllocateResult(OK, 0, 160, one_group((), (5, 4, 6, 7, 8, 9, 10, 3, 2, 1), 0), (), 7)
    assert m.stats().num_evictions == 3
    assert m.find_cache_hit(C + [3]).num_cached_tokens == 0


# -- eviction order ----------------------------------------------------------------------


def test_request_frees_its_blocks_tail_first() -> None:
    m = make_manager(num_blocks=9, block_size=4)
    admit(m, "a", list(range(13)))  # blocks 1, 2, 3 full and cached, 4 partial
    assert table(m, "a") == (1, 2, 3, 4)
    m.free(["a"])
    # The partial block goes to the head; the cached ones to the tail, last block first.
    assert free_queue(m) == [4, 5, 6, 7, 8, 3, 2, 1]


def test_hashed_blocks_are_evicted_least_recently_freed_first() -> None:
    m = make_manager(num_blocks=9, block_size=4, enable_events=True)
    a = [1] * 4 + [2] * 4
    b = [3] * 4 + [4] * 4
    admit(m, "a", a)
    admit(m, "b", b)
    assert (table(m, "a"), table(m, "b")) == ((1, 2), (3, 4))
    m.free(["a"])
    m.free(["b"])
    assert free_queue(m) == [5, 6, 7, 8, 2, 1, 4, 3]
    m.take_events()

    # Six blocks: the four never-used ones, then a's blocks (freed first), last block first.
    result = admit(m, "x", [9] * 24)
    assert result.groups[0].new_block_ids == (5, 6, 7, 8, 2, 1)
    hasher = BlockHasher(4)
    a_hashes = hasher.hash_blocks(hasher.root_hash, a)
    events = m.take_events()
    assert events[0] == BlockRemoved(0, (a_hashes[1], a_hashes[0]))  # one event for the allocation's evictions
    assert m.find_cache_hit(a + [0]) == CacheHit(0, ((),))
    assert m.find_cache_hit(b + [0]) == CacheHit(8, ((3, 4),))
    assert m.stats().num_evictions == 2


def test_a_hit_refreshes_recency() -> None:
    m = make_manager(num_blocks=9, block_size=4)
    a = [1] * 4 + [2] * 4
    b = [3] * 4 + [4] * 4
    admit(m, "a", a)
    admit(m, "b", b)
    m.free(["a"])
    m.free(["b"])
    # Touching a's blocks takes them out of the queue; freed again, they are now the newest.
    assert admit(m, "a2", a + [5]).groups[0] == GroupAllocation(0, (1, 2), (5,), 2)
    assert free_queue(m) == [6, 7, 8, 4, 3]
    m.free(["a2"])
    assert free_queue(m) == [5, 6, 7, 8, 4, 3, 2, 1]
    admit(m, "x", [9] * 24)  # pops 5, 6, 7, 8, 4, 3: b is evicted, a survives
    assert m.find_cache_hit(a + [0]).num_cached_tokens == 8
    assert m.find_cache_hit(b + [0]).num_cached_tokens == 0


def test_unhashed_freed_blocks_are_reused_first() -> None:
    m = make_manager(num_blocks=9, block_size=4)
    admit(m, "a", list(range(6)))  # block 1 full (cached), block 2 partial
    m.free(["a"])
    assert free_queue(m) == [2, 3, 4, 5, 6, 7, 8, 1]
    assert admit(m, "b", [50, 51, 52]).groups[0].new_block_ids == (2,)


def test_unhashed_blocks_go_to_the_head_in_batch_order() -> None:
    m = make_manager(num_blocks=9, block_size=4)
    # Three prompt tokens plus ten lookahead slots: four blocks, none full when computed.
    assert admit(m, "a", [1, 2, 3], num_lookahead_tokens=10).groups[0].new_block_ids == (1, 2, 3, 4)
    assert m.free(["a"]) == FreeResult(4, 2)
    # The batch is the table reversed, and it keeps that order at the head.
    assert free_queue(m) == [4, 3, 2, 1, 5, 6, 7, 8]


def test_several_ids_in_one_free_are_freed_request_by_request() -> None:
    m = make_manager(num_blocks=9, block_size=4)
    admit(m, "a", [1] * 5)  # [1 cached, 2 partial]
    admit(m, "b", [2] * 5)  # [3 cached, 4 partial]
    assert m.free(["a", "b"]) == FreeResult(4, 3)
    m.check_invariants()
    # a: 2 to the head, 1 to the tail; then b: 4 to the head, 3 to the tail.
    assert free_queue(m) == [4, 2, 5, 6, 7, 8, 1, 3]


def test_freeing_shared_blocks_only_drops_references() -> None:
    m = make_manager(num_blocks=9, block_size=4)
    admit(m, "a", [1] * 8 + [2])  # [1, 2, 3]
    admit(m, "b", [1] * 8 + [3])  # hit [1, 2], new [4]
    assert m.free(["a"]) == FreeResult(1, 3)  # only block 3
    assert free_queue(m) == [3, 5, 6, 7, 8]
    assert m.pool.blocks[1].ref_cnt == m.pool.blocks[2].ref_cnt == 1
    assert m.free(["b"]) == FreeResult(3, 4)
    assert free_queue(m) == [4, 3, 5, 6, 7, 8, 2, 1]
    m.check_invariants()


# -- NO_SPACE ----------------------------------------------------------------------------


def test_first_call_no_space_changes_nothing_but_the_step_id() -> None:
    m = make_manager(num_blocks=5, enable_events=True)
    admit(m, "a", C[:33])  # [1, 2, 3], two cached
    m.take_events()
    before = observable(m)
    result = admit(m, "b", list(range(100, 165)))  # 65 tokens: 5 blocks, 1 free
    assert result == AllocateResult(NO_SPACE, 0, 0, (), (), 2)
    assert observable(m) == dict(before, last_step_id=2)
    assert m.take_events() == []
    with pytest.raises(RequestNotFoundError):
        m.block_table("b")
    stats = m.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (33, 0)  # NO_SPACE is not a query


def test_first_call_counts_free_cached_hit_blocks_against_the_space() -> None:
    m = make_manager(num_blocks=5)
    admit(m, "a", C[:33])  # [1, 2, 3]; 1 and 2 cached
    m.free(["a"])
    assert free_queue(m) == [3, 4, 2, 1]
    # Hit [1, 2] (both free) + 3 new blocks = 5 blocks leave the queue; only 4 are there.
    prompt = C[:32] + [7] * 33
    assert m.find_cache_hit(prompt) == CacheHit(32, ((1, 2),))
    before = observable(m)
    assert admit(m, "b", prompt) == AllocateResult(NO_SPACE, 0, 0, (), (), 3)
    assert observable(m) == dict(before, last_step_id=3)
    # Hit [1, 2] + 2 new blocks = exactly the 4 free blocks.
    result = admit(m, "c", C[:32] + [7] * 17)
    assert result == AllocateResult(OK, 32, 17, one_group((1, 2), (3, 4), 2), (), 4)
    assert m.stats().num_free_blocks == 0


def test_continuation_no_space_keeps_the_tokens_out_until_the_retry() -> None:
    m = make_manager(num_blocks=4, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    admit(m, "a", prompt)  # [1, 2]
    admit(m, "b", [9])  # [3]
    before = observable(m)
    result = step(m, "a", [10], 1)
    assert result == AllocateResult(NO_SPACE, 8, 0, (), (), 3)
    assert observable(m) == dict(before, last_step_id=3)
    assert m.requests["a"].num_tokens == 8, "a NO_SPACE continuation must not take its tokens"

    m.free(["b"])
    # The scheduler retries with the same token.
    assert step(m, "a", [10], 1) == AllocateResult(OK, 8, 1, one_group((), (3,), 2), (), 5)
    assert m.requests["a"].num_tokens == 9
    hasher = BlockHasher(4)
    assert m.requests["a"].block_hashes == hasher.hash_blocks(hasher.root_hash, prompt + [10])


# -- hits, chunked prefill, decode -----------------------------------------------------------


def test_hit_is_capped_so_the_last_token_is_computed() -> None:
    m = make_manager(num_blocks=11)
    admit(m, "a", C)  # [1, 2, 3], all three cached
    assert m.find_cache_hit(C) == CacheHit(32, ((1, 2),))
    assert admit(m, "b", C) == AllocateResult(OK, 32, 16, one_group((1, 2), (4,), 2), (), 2)
    # One block, fully cached: no hit at all.
    admit(m, "c", [5] * 16)
    assert m.find_cache_hit([5] * 16) == CacheHit(0, ((),))
    assert admit(m, "d", [5] * 16).num_computed_tokens == 0
    # One token more and the whole block is a hit.
    assert m.find_cache_hit([5] * 17).num_cached_tokens == 16


def test_chunked_prefill_through_continuations_without_new_tokens() -> None:
    m = make_manager(num_blocks=11)
    prompt = list(range(40))
    assert admit(m, "a", prompt, 16) == AllocateResult(OK, 0, 16, one_group((), (1,), 0), (), 1)
    assert m.find_cache_hit(prompt) == CacheHit(16, ((1,),))
    assert step(m, "a", [], 16) == AllocateResult(OK, 16, 16, one_group((), (2,), 1), (), 2)
    assert m.find_cache_hit(prompt) == CacheHit(32, ((1, 2),))
    assert step(m, "a", [], 16) == AllocateResult(OK, 32, 8, one_group((), (3,), 2), (), 3)
    assert m.block_table("a").num_computed_tokens == 40

    before = observable(m)
    with pytest.raises(FailedPreconditionError):
        m.allocate("a", [], 16)
    assert observable(m) == before

    # Decode: the sampled token comes in token_ids.
    assert step(m, "a", [7], 1) == AllocateResult(OK, 40, 1, one_group((), (), 3), (), 4)


def test_decode_continuations_grow_the_table_one_block_at_a_time() -> None:
    m = make_manager(num_blocks=11, block_size=4)
    sequence = [1, 2, 3, 4]
    admit(m, "a", sequence)
    results = []
    for token in (5, 6, 7, 8, 9):
        results.append(step(m, "a", [token], 1))
        sequence.append(token)
    assert results == [
        AllocateResult(OK, 4, 1, one_group((), (2,), 1), (), 2),
        AllocateResult(OK, 5, 1, one_group((), (), 2), (), 3),
        AllocateResult(OK, 6, 1, one_group((), (), 2), (), 4),
        AllocateResult(OK, 7, 1, one_group((), (), 2), (), 5),
        AllocateResult(OK, 8, 1, one_group((), (3,), 2), (), 6),
    ]
    # Block 2 filled up at 8 computed tokens and is cached.
    assert m.find_cache_hit(sequence[:8] + [0]) == CacheHit(8, ((1, 2),))
    # Lookahead slots are allocated beyond the computed tokens.
    assert step(m, "a", [10], 1, num_lookahead_tokens=4) == AllocateResult(OK, 9, 1, one_group((), (4,), 3), (), 7)
    assert m.block_table("a") == m.block_table("a")._replace(num_computed_tokens=10, block_ids=((1, 2, 3, 4),))


def test_continuation_with_nothing_to_compute_is_refused() -> None:
    m = make_manager(num_blocks=11, block_size=4)
    admit(m, "a", [1, 2, 3, 4, 5])
    before = observable(m)
    with pytest.raises(FailedPreconditionError) as excinfo:
        m.allocate("a", [], 1)
    assert excinfo.value.reason == "FAILED_PRECONDITION"
    assert observable(m) == before


# -- caching disabled ------------------------------------------------------------------------


def test_caching_disabled_frees_every_block_to_the_head() -> None:
    m = make_manager(num_blocks=11, enable_prefix_caching=False, enable_events=True)
    prompt = C + 7 * [3]
    assert admit(m, "r0", prompt).groups[0].new_block_ids == (1, 2, 3, 4)
    m.free(["r0"])
    assert free_queue(m) == [4, 3, 2, 1, 5, 6, 7, 8, 9, 10]
    assert m.find_cache_hit(prompt) == CacheHit(0, ((),))
    assert admit(m, "r1", prompt) == AllocateResult(OK, 0, 55, one_group((), (4, 3, 2, 1), 0), (), 3)
    assert all(block.block_hash is None for block in m.pool.blocks)
    assert m.take_events() == []
    stats = m.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_evictions) == (0, 0, 0)


# -- reset_prefix_cache ----------------------------------------------------------------------


def test_reset_prefix_cache_is_refused_while_blocks_are_held() -> None:
    m = make_manager(num_blocks=11, enable_events=True)
    admit(m, "a", C + [3])
    m.take_events()
    before = observable(m)
    assert m.reset_prefix_cache() is False
    assert observable(m) == before
    assert m.take_events() == []
    assert m.find_cache_hit(C + [3]).num_cached_tokens == 48

    m.free(["a"])
    queue = free_queue(m)
    assert m.reset_prefix_cache() is True
    m.check_invariants()
    assert m.take_events() == [AllBlocksCleared()]
    assert m.find_cache_hit(C + [3]) == CacheHit(0, ((),))
    assert all(block.block_hash is None for block in m.pool.blocks)
    assert free_queue(m) == queue  # forgetting hashes does not reorder the queue
    # A second reset on an empty cache is accepted too.
    assert m.reset_prefix_cache() is True


# -- events ------------------------------------------------------------------------------------


def test_events_store_remove_and_clear_in_commit_order() -> None:
    m = make_manager(num_blocks=11, enable_events=True)
    hasher = BlockHasher(16)
    sequence = C + 7 * [3]
    admit(m, "r0", sequence)
    h = hasher.hash_blocks(hasher.root_hash, C + 16 * [3])
    assert m.take_events() == [BlockStored(0, (h[0], h[1], h[2]), None, 16)]

    step(m, "r0", 9 * [3], 9)  # 64 computed: the fourth block fills up
    assert m.take_events() == [BlockStored(0, (h[3],), h[2], 16)]

    m.free(["r0"])
    assert m.take_events() == []
    assert free_queue(m) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]

    admit(m, "r3", 160 * [99])  # pops every block: r0's four are evicted, last first, in one event
    h3 = hasher.hash_blocks(hasher.root_hash, 160 * [99])
    assert m.take_events() == [
        BlockRemoved(0, (h[3], h[2], h[1], h[0])),
        BlockStored(0, tuple(h3), None, 16),
    ]
    m.free(["r3"])
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]


def test_events_carry_group_ids_and_chain_parents() -> None:
    config = KVCacheConfig(
        num_blocks=20,
        groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4), GroupSpec(GroupKind.FULL_ATTENTION, 8)),
        enable_events=True,
    )
    m = KVCacheManager(config)
    hasher = BlockHasher(4)
    sequence = list(range(24))
    h = hasher.hash_blocks(hasher.root_hash, sequence)
    admit(m, "a", sequence[:17])
    assert m.take_events() == [
        BlockStored(0, (h[0], h[1], h[2], h[3]), None, 4),
        BlockStored(1, (h[1], h[3]), None, 8),  # an 8-token block is named by its last 4-token hash
    ]
    step(m, "a", sequence[17:], 7)
    assert m.take_events() == [BlockStored(0, (h[4], h[5]), h[3], 4), BlockStored(1, (h[5],), h[3], 8)]


# -- stats ----------------------------------------------------------------------------------------


def test_stats_counters() -> None:
    m = make_manager(num_blocks=11)
    assert m.stats() == m.stats()._replace(
        num_blocks=11,
        num_free_blocks=10,
        usage=0.0,
        num_requests=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_evictions=0,
        num_pending_copies=0,
    )
    admit(m, "r0", C + 7 * [3])
    admit(m, "r1", C + 5 * [3])
    stats = m.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (55 + 53, 48)
    assert (stats.num_requests, stats.num_free_blocks) == (2, 5)
    assert stats.usage == pytest.approx(0.5)

    admit(m, "r2", C + [4], skip_prefix_cache=True)  # not a cache query
    assert admit(m, "r3", 200 * [8]).status is NO_SPACE  # not a query either
    stats = m.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (108, 48)
    assert (stats.num_requests, stats.num_free_blocks) == (3, 1)

    m.free(["r0", "r1", "r2"])
    # Every block: 1, 2, 3 and r2's three duplicates of them were cached.
    admit(m, "r4", 160 * [9])
    assert m.stats().num_evictions == 6


# -- caller mistakes change nothing ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "call"),
    [
        (OutOfRangeError, lambda m: m.ack(m.last_step_id + 1)),
        (InvalidArgumentError, lambda m: m.ack(-1)),
        (RequestNotFoundError, lambda m: m.free(["nobody"])),
        (InvalidArgumentError, lambda m: m.free([])),
        (InvalidArgumentError, lambda m: m.free(["a", "a"])),
        (InvalidArgumentError, lambda m: m.allocate("new", [], 1)),
        (InvalidArgumentError, lambda m: m.allocate("new", [1, 2], 0)),
        (InvalidArgumentError, lambda m: m.allocate("new", [1, 2], 2, num_lookahead_tokens=-1)),
        (InvalidArgumentError, lambda m: m.allocate("new", [1, 1 << 32], 2)),
        (InvalidArgumentError, lambda m: m.allocate("new", [-1], 1)),
        (InvalidArgumentError, lambda m: m.allocate("new", [1.5], 1)),
        (InvalidArgumentError, lambda m: m.allocate("new", ["7"], 1)),
        (InvalidArgumentError, lambda m: m.allocate("a", [1 << 32], 1)),
        (InvalidArgumentError, lambda m: m.allocate("new", [1] * 65, 65)),  # max_model_len 64
        (InvalidArgumentError, lambda m: m.allocate("new", [1] * 60, 60, num_lookahead_tokens=5)),
        (InvalidArgumentError, lambda m: m.allocate("new", [1, 2], 2, mm_features=[MMFeature("img", 1, 2)])),
        (InvalidArgumentError, lambda m: m.allocate("a", [1], 1, cache_salt="other")),
        (InvalidArgumentError, lambda m: m.allocate("a", [1], 1, lora=LoraRef("x", "/x"))),
        (InvalidArgumentError, lambda m: m.allocate("a", [1], 1, num_encoder_tokens=3)),
        (InvalidArgumentError, lambda m: m.allocate("a", [1] * 60, 1)),  # a holds 5 tokens: 65 > 64
        (ResourceExhaustedError, lambda m: m.step([AllocateOp("n1", [1], 1), AllocateOp("n2", [1], 1)])),
        (ResourceExhaustedError, lambda m: m.fork("a", ["c1", "c2"])),
        # One invalid op rejects the whole step, valid ops before it included.
        (RequestNotFoundError, lambda m: m.step([AllocateOp("a", [1], 1), FreeOp(["nobody"])])),
        (InvalidArgumentError, lambda m: m.step([FreeOp(["a"]), AllocateOp("a", [1], 1)])),
        (InvalidArgumentError, lambda m: m.step([AllocateOp("a", [1], 1), ForkOp("a", ["c"])])),
        (InvalidArgumentError, lambda m: m.step([object()])),
    ],
)
def test_a_rejected_call_changes_nothing(error: type, call) -> None:
    m = make_manager(num_blocks=11, block_size=4, max_model_len=64, max_num_requests=2)
    admit(m, "a", [1, 2, 3, 4, 5])
    before = observable(m)
    with pytest.raises(error):
        call(m)
    assert observable(m) == before
    m.check_invariants()


def test_largest_token_id_is_accepted() -> None:
    m = make_manager(num_blocks=11, block_size=4)
    assert admit(m, "a", [(1 << 32) - 1] * 5).status is OK


def test_a_continuation_may_repeat_its_first_call_arguments() -> None:
    m = make_manager(num_blocks=11, block_size=4)
    lora = LoraRef("adapter", "/a")
    admit(m, "a", [1, 2, 3, 4, 5], cache_salt="s", lora=lora)
    assert step(m, "a", [6], 1, cache_salt="s", lora=lora).status is OK


def test_a_free_earlier_in_the_step_makes_room_for_an_admission() -> None:
    m = make_manager(num_blocks=11, block_size=4, max_num_requests=2)
    admit(m, "a", [1, 2, 3])
    admit(m, "b", [4, 5, 6])
    result = m.step([FreeOp(["a"]), AllocateOp("c", [7, 8], 2)])
    m.check_invariants()
    assert result.results[1].status is OK
    assert sorted(m.requests) == ["b", "c"]
    # The other way round the step would hold three live requests in between.
    before = observable(m)
    with pytest.raises(ResourceExhaustedError):
        m.step([AllocateOp("d", [9], 1), FreeOp(["b"])])
    assert observable(m) == before


def test_a_rejected_step_names_the_offending_op_and_field() -> None:
    m = make_manager(num_blocks=11, block_size=4)
    admit(m, "a", [1, 2, 3])
    with pytest.raises(RequestNotFoundError) as excinfo:
        m.step([AllocateOp("a", [4], 1), FreeOp(["nobody"])])
    assert excinfo.value.field == "ops[1].request_ids"
    with pytest.raises(InvalidArgumentError) as excinfo:
        m.step([AllocateOp("b", [1], 0)])
    assert excinfo.value.field == "ops[0].num_new_tokens"
