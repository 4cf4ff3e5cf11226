"""`KVCacheManager.step(max_new_blocks=...)`: a budget of blocks taken from the free queue, net of those returned.

An allocate past the budget gets NO_SPACE and changes nothing, as when the
pool is short; the service runs each tenant's step with its quota's room.
"""

from __future__ import annotations

from kv_manager_service.core import (
    AllocateOp,
    AllocateStatus,
    ForkOp,
    FreeOp,
    GroupKind,
    GroupSpec,
    KVCacheConfig,
    KVCacheManager,
)

OK, NO_SPACE = AllocateStatus.OK, AllocateStatus.NO_SPACE
BS = 4


def make_manager(num_blocks: int = 33, groups: tuple[GroupSpec, ...] = (GroupSpec(GroupKind.FULL_ATTENTION, BS),)):
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, groups=groups))


def state(manager: KVCacheManager) -> tuple:
    tables = {rid: manager.block_table(rid) for rid in manager.requests}
    return tables, manager.pool.get_num_free_blocks(), [b.block_id for b in manager.pool.free_queue]


def test_an_admission_past_the_budget_gets_no_space_and_changes_nothing():
    manager = make_manager()
    before = state(manager)
    result = manager.step([AllocateOp("a", list(range(12)), 12)], max_new_blocks=2).results[0]  # needs 3
    assert result.status is NO_SPACE
    assert state(manager) == before
    assert manager.step([AllocateOp("a", list(range(12)), 12)], max_new_blocks=3).results[0].status is OK
    manager.check_invariants()


def test_the_budget_spans_the_steps_ops_and_counts_what_they_return():
    manager = make_manager()
    assert manager.allocate("a", list(range(8)), 8).status is OK  # 2 blocks
    free_before = manager.pool.get_num_free_blocks()
    step = manager.step(
        [AllocateOp("b", list(range(100, 104)), 4), AllocateOp("c", list(range(200, 208)), 8)], max_new_blocks=2
    )
    assert [r.status for r in step.results] == [OK, NO_SPACE]  # the first took one of two; the second needs two
    # Freeing in the same step gives the blocks back to the budget: net zero.
    step = manager.step([FreeOp(["a"]), AllocateOp("c", list(range(200, 208)), 8)], max_new_blocks=0)
    assert step.results[1].status is OK
    assert manager.pool.get_num_free_blocks() == free_before - 1
    manager.check_invariants()


def test_a_cached_hit_leaving_the_free_queue_counts_and_a_held_one_does_not():
    manager = make_manager()
    prompt = list(range(9))  # two full blocks and one token
    manager.allocate("a", prompt, 9)
    manager.free(["a"])
    # The two cached blocks leave the free queue when adopted, plus one new block: three.
    assert manager.step([AllocateOp("b", prompt, 9)], max_new_blocks=2).results[0].status is NO_SPACE
    assert manager.step([AllocateOp("b", prompt, 9)], max_new_blocks=3).results[0].status is OK
    # Held by "b", the same hit costs a second request only its new block.
    result = manager.step([AllocateOp("c", prompt, 9)], max_new_blocks=1).results[0]
    assert result.status is OK and result.num_computed_tokens == 8
    manager.check_invariants()


def test_copy_on_write_and_decode_respect_the_budget():
    manager = make_manager()
    manager.allocate("p", list(range(6)), 6)  # one full block, one partial
    manager.step([ForkOp("p", ["q"])])
    before = state(manager)
    # q writes into the shared partial block: a copy needs one fresh block.
    assert manager.step([AllocateOp("q", [7], 1)], max_new_blocks=0).results[0].status is NO_SPACE
    assert state(manager) == before
    result = manager.step([AllocateOp("q", [7], 1)], max_new_blocks=1).results[0]
    assert result.status is OK and len(result.copies) == 1
    manager.check_invariants()


def test_blocks_a_sliding_window_recycles_come_back_to_the_budget():
    window = GroupSpec(GroupKind.SLIDING_WINDOW, BS, sliding_window=4)
    manager = make_manager(groups=(window,))
    assert manager.allocate("w", list(range(16)), 16).status is OK
    taken = manager.pool.num_blocks - 1 - manager.pool.get_num_free_blocks()
    # The next token opens a block; the window no longer reads the oldest ones, which are recycled first.
    result = manager.step([AllocateOp("w", [1], 1)], max_new_blocks=0).results[0]
    assert result.status is OK
    assert manager.pool.num_blocks - 1 - manager.pool.get_num_free_blocks() <= taken
    manager.check_invariants()


def test_no_budget_is_the_pool_alone():
    manager = make_manager(num_blocks=4)  # three usable blocks
    assert manager.step([AllocateOp("a", list(range(12)), 12)]).results[0].status is OK
    assert manager.step([AllocateOp("b", [1], 1)], max_new_blocks=10).results[0].status is NO_SPACE
    manager.check_invariants()
