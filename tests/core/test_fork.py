"""Fork and copy-on-write: shared blocks, BlockCopy, retention until ack."""

from __future__ import annotations

from typing import Any

import pytest

from kv_manager_service.core import (
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    BlockCopy,
    BlockHasher,
    ForkOp,
    ForkResult,
    FreeOp,
    GroupAllocation,
    GroupKind,
    GroupSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheManager,
    PendingCopy,
    RequestExistsError,
    RequestNotFoundError,
    ResourceExhaustedError,
)
from kv_manager_service.core.hashing import HashExtras

OK = AllocateStatus.OK


def make_manager(num_blocks: int = 11, block_size: int = 4, **kwargs: Any) -> KVCacheManager:
    groups = kwargs.pop("groups", (GroupSpec(GroupKind.FULL_ATTENTION, block_size),))
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, groups=groups, **kwargs))


def allocate(manager: KVCacheManager, request_id: str, token_ids: list[int], num_new_tokens: int, **kwargs: Any):
    result = manager.allocate(request_id, token_ids, num_new_tokens, **kwargs)
    manager.check_invariants()
    return result


def fork(manager: KVCacheManager, parent: str, children: list[str]) -> ForkResult:
    result = manager.fork(parent, children)
    manager.check_invariants()
    return result


def ref_cnts(manager: KVCacheManager, *block_ids: int) -> tuple[int, ...]:
    return tuple(manager.pool.blocks[b].ref_cnt for b in block_ids)


def free_queue(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.pool.free_queue]


def one_group(new: tuple[int, ...], index: int) -> tuple[GroupAllocation, ...]:
    return (GroupAllocation(0, (), new, index),)


def observable(manager: KVCacheManager) -> dict[str, Any]:
    return {
        "tables": {rid: manager.block_table(rid) for rid in sorted(manager.requests)},
        "stats": manager.stats(),
        "pending_copies": manager.pending_copies(),
        "free_queue": free_queue(manager),
        "ref_cnts": [b.ref_cnt for b in manager.pool.blocks[1:]],
        "last_step_id": manager.last_step_id,
    }


def test_fork_shares_every_block() -> None:
    m = make_manager()
    allocate(m, "p", [1, 2, 3, 4, 5, 6], 6)  # [1 full, 2 partial]
    assert fork(m, "p", ["c"]) == ForkResult(2)
    assert m.block_table("c") == m.block_table("p")._replace(request_id="c")
    assert m.block_table("c").block_ids == ((1, 2),)
    assert ref_cnts(m, 1, 2) == (2, 2)
    assert m.requests["c"].block_hashes == m.requests["p"].block_hashes
    assert m.stats().num_requests == 2


def test_child_writing_a_shared_partial_block_copies_it() -> None:
    m = make_manager()
    allocate(m, "p", [1, 2, 3, 4, 5, 6], 6)
    fork(m, "p", ["c"])

    result = allocate(m, "c", [100], 1)
    # The replaced index is 1: the new table from there on is (3,).
    assert result == AllocateResult(OK, 6, 1, one_group((3,), 1), (BlockCopy(2, 3),), 3)
    assert m.block_table("c").block_ids == ((1, 3),)
    assert m.block_table("p").block_ids == ((1, 2),)
    assert m.pending_copies() == [PendingCopy(3, BlockCopy(2, 3))]
    # 2: p's slot + the copy's retention. 3: c's slot + the retention.
    assert ref_cnts(m, 1, 2, 3) == (2, 2, 2)
    assert m.stats().num_pending_copies == 1

    # The second writer writes in place: the retention is not a sharer.
    result = allocate(m, "p", [200], 1)
    assert result == AllocateResult(OK, 6, 1, one_group((), 2), (), 4)
    assert m.block_table("p").block_ids == ((1, 2),)

    assert m.ack(2) == 0  # the copy was carried by step 3
    assert m.ack(3) == 1
    m.check_invariants()
    assert m.pending_copies() == []
    assert ref_cnts(m, 1, 2, 3) == (2, 1, 1)
    assert m.ack(3) == 0  # acknowledging again is a no-op


def test_both_copy_ends_outlive_their_requests_until_ack() -> None:
    m = make_manager()
    allocate(m, "p", [1, 2, 3, 4, 5, 6], 6)
    fork(m, "p", ["c"])
    copy_step = allocate(m, "c", [100], 1).step_id
    m.free(["p", "c"])
    m.check_invariants()
    assert ref_cnts(m, 2, 3) == (1, 1)
    assert 2 not in free_queue(m) and 3 not in free_queue(m)
    assert m.stats().num_free_blocks == 8
    assert m.reset_prefix_cache() is False  # the pending copy still holds blocks

    assert m.ack(copy_step) == 1
    m.check_invariants()
    # Released together, neither hashed: both to the head.
    assert sorted(free_queue(m)[:2]) == [2, 3]
    stats = m.stats()
    assert (stats.num_free_blocks, stats.usage, stats.num_pending_copies) == (10, 0.0, 0)
    assert m.reset_prefix_cache() is True


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    m = make_manager()
    allocate(m, "p", list(range(8)), 8)  # [1, 2], both full and cached
    fork(m, "p", ["c"])
    assert allocate(m, "c", [100], 1) == AllocateResult(OK, 8, 1, one_group((3,), 2), (), 3)
    assert allocate(m, "p", [200], 1) == AllocateResult(OK, 8, 1, one_group((4,), 2), (), 4)
    assert m.pending_copies() == []
    assert ref_cnts(m, 1, 2, 3, 4) == (2, 2, 1, 1)


def test_fork_into_several_children_copies_once_per_writer() -> None:
    m = make_manager(num_blocks=11)
    allocate(m, "p", [1, 2, 3, 4, 5, 6], 6)
    fork(m, "p", ["c1", "c2", "c3"])
    assert ref_cnts(m, 1, 2) == (4, 4)
    copies = [allocate(m, child, [100 + i], 1).copies for i, child in enumerate(["c1", "c2", "c3"])]
    assert copies == [(BlockCopy(2, 3),), (BlockCopy(2, 4),), (BlockCopy(2, 5),)]
    # p is the last holder of block 2 (three retentions besides it): in place.
    assert allocate(m, "p", [200], 1).copies == ()
    assert ref_cnts(m, 2) == (4,)
    assert m.ack(m.last_step_id) == 3
    m.check_invariants()
    assert ref_cnts(m, 1, 2, 3, 4, 5) == (4, 1, 1, 1, 1)


def test_shared_lookahead_blocks_are_replaced_without_a_copy() -> None:
    m = make_manager()
    # 5 computed tokens, 4 lookahead slots: [1 full, 2 partial, 3 uncomputed].
    allocate(m, "p", [1, 2, 3, 4, 5], 5, num_lookahead_tokens=4)
    fork(m, "p", ["c"])
    result = allocate(m, "c", [100], 1, num_lookahead_tokens=4)
    # Block 2 holds computed KV: copied. Block 3 holds none: just replaced.
    assert result == AllocateResult(OK, 5, 1, one_group((4, 5), 1), (BlockCopy(2, 4),), 3)
    assert m.block_table("c").block_ids == ((1, 4, 5),)
    assert ref_cnts(m, 1, 2, 3, 4, 5) == (2, 2, 1, 2, 1)
    assert m.pending_copies() == [PendingCopy(3, BlockCopy(2, 4))]


def test_child_continues_the_parent_hash_chain() -> None:
    m = make_manager(num_blocks=20)
    prompt = [1, 2, 3, 4, 5, 6]
    allocate(m, "p", prompt, 6, cache_salt="salt")
    fork(m, "p", ["c"])
    allocate(m, "c", [7, 8], 2)
    allocate(m, "p", [9, 9], 2)
    hasher = BlockHasher(4)
    extras = HashExtras(cache_salt="salt")
    assert m.requests["c"].block_hashes == hasher.hash_blocks(hasher.root_hash, prompt + [7, 8], 0, extras)
    assert m.requests["p"].block_hashes == hasher.hash_blocks(hasher.root_hash, prompt + [9, 9], 0, extras)
    # Both second blocks are cached under their own chains.
    assert m.find_cache_hit(prompt + [7, 8, 0], cache_salt="salt").block_ids == ((1, 3),)
    assert m.find_cache_hit(prompt + [9, 9, 0], cache_salt="salt").block_ids == ((1, 2),)


def test_freeing_the_parent_leaves_the_child_intact() -> None:
    m = make_manager()
    allocate(m, "p", list(range(9)), 9)  # [1, 2 cached, 3 partial]
    fork(m, "p", ["c"])
    assert m.free(["p"]).num_freed_blocks == 0
    m.check_invariants()
    assert m.block_table("c").block_ids == ((1, 2, 3),)
    assert ref_cnts(m, 1, 2, 3) == (1, 1, 1)
    # c is now the only holder: it writes its partial block in place.
    assert allocate(m, "c", [9], 1).copies == ()


def test_fork_copy_on_write_in_every_group_but_cross_attention() -> None:
    groups = (
        GroupSpec(GroupKind.FULL_ATTENTION, 4),
        GroupSpec(GroupKind.SLIDING_WINDOW, 2, sliding_window=5),
        GroupSpec(GroupKind.CROSS_ATTENTION, 4),
    )
    m = make_manager(num_blocks=21, groups=groups)
    result = allocate(m, "p", [1, 2, 3, 4, 5], 5, num_encoder_tokens=8)
    assert tuple(g.new_block_ids for g in result.groups) == ((1, 2), (3, 4, 5), (6, 7))
    fork(m, "p", ["c"])
    result = allocate(m, "c", [6], 1)
    # Token 5 lands in full block index 1 (holds tokens 4, 5) and window block index 2
    # (holds token 4): both shared, both copied. The window drops nothing yet (5 - 5 + 1 = 1 token).
    assert result.copies == (BlockCopy(2, 8), BlockCopy(5, 9))
    assert result.groups == (
        GroupAllocation(0, (), (8,), 1),
        GroupAllocation(1, (), (9,), 2),
        GroupAllocation(2, (), (), 2),
    )
    assert m.block_table("c").block_ids == ((1, 8), (3, 4, 9), (6, 7))
    assert ref_cnts(m, 6, 7) == (2, 2)  # cross-attention blocks stay shared


def test_copy_needs_space_like_any_block() -> None:
    m = make_manager(num_blocks=3)  # two blocks
    allocate(m, "p", [1, 2, 3, 4, 5, 6], 6)
    fork(m, "p", ["c"])
    before = observable(m)
    result = allocate(m, "c", [100], 1)
    assert result == AllocateResult(AllocateStatus.NO_SPACE, 6, 0, (), (), 3)
    assert observable(m) == dict(before, last_step_id=3)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "call"),
    [
        (RequestNotFoundError, lambda m: m.fork("nobody", ["c"])),
        (RequestExistsError, lambda m: m.fork("p", ["q"])),
        (RequestExistsError, lambda m: m.fork("p", ["p"])),
        (InvalidArgumentError, lambda m: m.fork("p", [])),
        (InvalidArgumentError, lambda m: m.fork("p", [""])),
        (InvalidArgumentError, lambda m: m.fork("p", ["c", "c"])),
        (InvalidArgumentError, lambda m: m.step([ForkOp("p", ["c"]), AllocateOp("c", [1], 1)])),
        (InvalidArgumentError, lambda m: m.step([ForkOp("p", ["c"]), FreeOp(["p"])])),
        (InvalidArgumentError, lambda m: m.step([ForkOp("p", ["c"]), ForkOp("q", ["c"])])),
        (InvalidArgumentError, lambda m: m.step([AllocateOp("p", [1], 1), ForkOp("p", ["c"])])),
        (ResourceExhaustedError, lambda m: m.fork("p", ["c1", "c2", "c3"])),
    ],
)
def test_fork_validation_errors_change_nothing(error: type, call) -> None:
    m = make_manager(max_num_requests=4)
    allocate(m, "p", [1, 2, 3, 4, 5, 6], 6)
    allocate(m, "q", [7, 8], 2)
    before = observable(m)
    with pytest.raises(error):
        call(m)
    assert observable(m) == before
    m.check_invariants()


def test_fork_in_a_step_with_other_requests() -> None:
    m = make_manager()
    allocate(m, "p", [1, 2, 3, 4, 5, 6], 6)
    allocate(m, "q", [7, 8], 2)
    allocate(m, "r", [9], 1)
    result = m.step([ForkOp("p", ["c"]), AllocateOp("q", [9], 1), FreeOp(["r"])])
    m.check_invariants()
    assert [type(r).__name__ for r in result.results] == ["ForkResult", "AllocateResult", "FreeResult"]
    assert all(r.step_id == result.step_id == 4 for r in result.results)
    assert m.block_table("c").block_ids == ((1, 2),)
    assert ref_cnts(m, 1, 2) == (2, 2)
    assert result.results[2].num_freed_blocks == 1
