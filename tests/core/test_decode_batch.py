"""A DecodeBatch against its allocate ops, step by step, through every path of `_decode`.

Each case drives two managers built alike: one applies the batch, the other
the same entries as `AllocateOp(request_id, [token], 1)`. Every step must give
the same results (in columns), the same delta, the same tables, pool and
events. The cases put entries on each path: in place, growing a table by a
block (one group or both), copy-on-write after a fork, NO_SPACE, a budget,
and groups that recycle slots (which take `_continue` itself).
"""

from __future__ import annotations

import random

import pytest

from kv_manager_service.core import (
    AllocateStatus,
    DecodeBatch,
    DecodeResults,
    ForkOp,
    FreeOp,
    GroupKind,
    GroupSpec,
    KVCacheConfig,
    KVCacheManager,
)

FULL_4 = GroupSpec(GroupKind.FULL_ATTENTION, 4)
FULL_8 = GroupSpec(GroupKind.FULL_ATTENTION, 8)
WINDOW = GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=6)


def twins(num_blocks: int, groups: tuple[GroupSpec, ...]) -> tuple[KVCacheManager, KVCacheManager]:
    config = KVCacheConfig(num_blocks=num_blocks, groups=groups, enable_events=True, max_model_len=256)
    return KVCacheManager(config), KVCacheManager(config)


def state(manager: KVCacheManager) -> tuple:
    return (
        {rid: manager.block_table(rid) for rid in manager.requests},
        [block.block_id for block in manager.pool.free_queue],
        [(block.ref_cnt, block.block_hash) for block in manager.pool.blocks],
        manager.pending_copies(),
        manager.take_events(),
    )


def step_both(
    batched: KVCacheManager, by_ops: KVCacheManager, batch: DecodeBatch, max_new_blocks: int | None = None
) -> DecodeResults:
    """One decode step on each twin; asserts they agree and returns the batch's results."""
    result = batched.step((), max_new_blocks=max_new_blocks, decode=batch)
    expected = by_ops.step(batch.as_ops(), max_new_blocks=max_new_blocks)
    assert result.results == ()
    assert result.delta == expected.delta
    decoded = result.decode
    assert decoded.statuses == [r.status for r in expected.results]
    assert decoded.num_computed_tokens == [r.num_computed_tokens for r in expected.results]
    assert decoded.changes == [(i, g) for i, r in enumerate(expected.results) for g in r.groups if g.new_block_ids]
    assert decoded.copies == [c for r in expected.results for c in r.copies]
    assert state(batched) == state(by_ops)
    batched.check_invariants()
    return decoded


def admit_both(managers: tuple[KVCacheManager, ...], prompts: dict[str, list[int]]) -> None:
    for manager in managers:
        for request_id, prompt in prompts.items():
            assert manager.allocate(request_id, prompt, len(prompt)).status is AllocateStatus.OK


@pytest.mark.parametrize("groups", [(FULL_4,), (FULL_4, FULL_8), (FULL_4, WINDOW)], ids=["one", "two", "window"])
def test_decode_steps_across_block_boundaries_match_allocate_ops(groups: tuple[GroupSpec, ...]) -> None:
    rng = random.Random(7)
    managers = twins(200, groups)
    prompts = {f"r{i}": [rng.randrange(50) for _ in range(5 + 3 * i)] for i in range(4)}
    admit_both(managers, prompts)
    num_grown = 0
    for _ in range(40):
        decoded = step_both(*managers, DecodeBatch(sorted(prompts), [rng.randrange(50) for _ in prompts]))
        assert decoded.statuses == [AllocateStatus.OK] * len(prompts)
        num_grown += len(decoded.changes)
    # 40 tokens cross a 4-token block's boundary 10 times per request, and an 8-token one's 5 times.
    assert num_grown >= 10 * len(prompts)


def test_entries_of_forked_requests_copy_on_write_as_allocate_ops_do() -> None:
    managers = twins(64, (FULL_4, FULL_8))
    admit_both(managers, {"parent": list(range(6))})  # a partly filled block in each group
    for manager in managers:
        manager.step([ForkOp("parent", ["child-a", "child-b"])])
    assert state(managers[0]) == state(managers[1])
    batch = DecodeBatch(["parent", "child-a", "child-b"], [1, 2, 3])
    step_both(*managers, batch)
    assert managers[0].pending_copies(), "the shared partly filled blocks were copied"
    for token in range(10):
        step_both(*managers, DecodeBatch(["child-b", "parent", "child-a"], [token, token + 1, token + 2]))


def test_no_space_and_budgets_refuse_the_same_entries() -> None:
    managers = twins(9, (FULL_4,))  # 8 usable blocks
    admit_both(managers, {"a": list(range(8)), "b": list(range(10, 18)), "c": list(range(20, 27))})
    seen = set()
    for step in range(12):
        budget = None if step % 3 else 1
        decoded = step_both(*managers, DecodeBatch(["a", "b", "c"], [step, step, step]), max_new_blocks=budget)
        seen.update(decoded.statuses)
    assert seen == {AllocateStatus.OK, AllocateStatus.NO_SPACE}


def test_an_entry_after_nested_ops_sees_their_effects() -> None:
    managers = twins(32, (FULL_4,))
    admit_both(managers, {"a": list(range(4)), "b": list(range(4, 8))})
    batch = DecodeBatch(["a"], [9])
    result = managers[0].step([FreeOp(["b"])], decode=batch)
    expected = managers[1].step([FreeOp(["b"]), *batch.as_ops()])
    assert result.results == expected.results[:1]
    assert result.delta == expected.delta
    assert result.decode.changes == [(0, g) for g in expected.results[1].groups if g.new_block_ids]
    assert state(managers[0]) == state(managers[1])
