"""Expected requests (core/expectations.py): the cached blocks a waiting request's prompt holds are evicted
after the blocks nobody waits for, until it is admitted or withdrawn; the rest of the contract is untouched."""

from __future__ import annotations

import pytest

from pool_support import BLOCK, cached_blocks, make_manager, prompt, run

from kv_manager_service.core import (
    ExpectOp,
    ExpectResult,
    FreeOp,
    InvalidArgumentError,
    KVCacheManager,
    RequestExistsError,
    RequestNotFoundError,
)
from kv_manager_service.shared.ops import AllocateOp, DecodeBatch, ForkOp, Retention


@pytest.mark.parametrize("policy", ["lru", "frequency"])
def test_the_blocks_an_expected_request_needs_outlive_more_recent_ones(policy):
    m = make_manager(policy=policy)
    needed, recent = prompt(1, 3), prompt(2, 3)
    run(m, "a", needed)
    run(m, "b", recent)  # more recent: LRU would evict `needed` first
    result = m.step([ExpectOp("waiting", needed + [9])]).results[0]
    assert result == ExpectResult(3 * BLOCK, m.last_step_id)
    m.check_invariants()
    run(m, "pressure", prompt(3, 8))  # 9 of the 12 blocks: 6 unhashed, then 3 cached ones go
    assert cached_blocks(m, needed) == 3 and cached_blocks(m, recent) == 0
    admitted = m.allocate("waiting", needed + [9], len(needed) + 1)
    assert admitted.num_computed_tokens == 3 * BLOCK  # the whole prompt hit
    assert "waiting" not in m.expectations and not m.pool.wanted
    m.check_invariants()


def test_without_expectations_the_order_is_lrus():
    m = make_manager()
    older, recent = prompt(1, 3), prompt(2, 3)
    run(m, "a", older)
    run(m, "b", recent)
    run(m, "pressure", prompt(3, 8))
    assert cached_blocks(m, older) == 0 and cached_blocks(m, recent) == 3


def test_a_withdrawn_expectation_protects_nothing_and_its_id_may_be_expected_again():
    m = make_manager()
    needed, recent = prompt(1, 3), prompt(2, 3)
    run(m, "a", needed)
    m.step([ExpectOp("waiting", needed)])
    run(m, "b", recent)
    result = m.step([FreeOp(["waiting"])]).results[0]
    assert result.num_freed_blocks == 0 and "waiting" not in m.expectations and not m.pool.wanted
    assert not m.pool.segment_keys
    m.check_invariants()
    m.step([ExpectOp("waiting", recent)])  # the id is free again
    m.step([FreeOp(["waiting"], [0])])  # a count of 0: an expected request has computed nothing
    m.check_invariants()


def test_blocks_freed_while_expected_land_in_the_protected_band_and_the_earliest_expected_are_kept_longest():
    m = make_manager(num_blocks=16)
    first, second, other = prompt(1, 3), prompt(2, 3), prompt(3, 3)
    run(m, "a", first)
    run(m, "b", second)
    m.step([ExpectOp("w1", first), ExpectOp("w2", second)])
    run(m, "c", other)  # not needed: evicted first
    run(m, "pressure", prompt(4, 11))  # 12 blocks: the 6 unhashed, `other`'s 3, then `second`'s 3, expected later
    assert cached_blocks(m, other) == 0 and cached_blocks(m, second) == 0 and cached_blocks(m, first) == 3
    m.check_invariants()


def test_a_retention_priority_still_outranks_an_expectation():
    m = make_manager()
    kept, needed = prompt(1, 3), prompt(2, 3)
    run(m, "a", kept, Retention(priority=1))
    run(m, "b", needed)
    m.step([ExpectOp("waiting", needed)])
    run(m, "pressure", prompt(3, 8))
    assert cached_blocks(m, kept) == 3 and cached_blocks(m, needed) == 0


def test_the_room_keeps_a_prefix_of_the_prompt_and_then_nothing():
    assert make_manager(num_blocks=5).expectations.max_blocks == 16 * 5  # the default room
    m = make_manager(max_expected_blocks=5)
    first = m.step([ExpectOp("w1", prompt(1, 3) + [1])]).results[0]
    second = m.step([ExpectOp("w2", prompt(2, 3))]).results[0]
    third = m.step([ExpectOp("w3", prompt(3, 3))]).results[0]
    assert (first.num_expected_tokens, second.num_expected_tokens, third.num_expected_tokens) == (12, 8, 0)
    assert m.expectations.num_blocks == 5 and len(m.expectations) == 3
    m.step([FreeOp(["w1"])])
    assert m.step([ExpectOp("w4", prompt(4, 3))]).results[0].num_expected_tokens == 12
    m.check_invariants()


def test_with_prefix_caching_off_nothing_is_kept():
    m = make_manager(enable_prefix_caching=False)
    assert m.step([ExpectOp("w", prompt(1, 3))]).results[0].num_expected_tokens == 0
    assert m.allocate("w", prompt(1, 3), 12).num_computed_tokens == 0 and "w" not in m.expectations


@pytest.mark.parametrize(
    "ops, error, field",
    [
        ([ExpectOp("live", [1, 2])], RequestExistsError, "request_id"),
        ([ExpectOp("expected", [1, 2])], RequestExistsError, "request_id"),
        ([ExpectOp("new", [])], InvalidArgumentError, "token_ids"),
        ([ExpectOp("new", [1 << 32])], InvalidArgumentError, "token_ids"),
        ([ExpectOp("", [1])], InvalidArgumentError, "request_id"),
        ([ExpectOp("new", [1] * 65)], InvalidArgumentError, "token_ids"),
        ([ExpectOp("new", [1]), ExpectOp("new", [2])], InvalidArgumentError, "request_id"),
        ([ForkOp("live", ["expected"])], RequestExistsError, "child_request_ids"),
        ([FreeOp(["expected"], [1])], InvalidArgumentError, "num_computed_tokens"),
    ],
)
def test_a_bad_expect_is_refused_naming_its_field_and_changes_nothing(ops, error, field):
    m = make_manager(max_model_len=64)
    m.allocate("live", prompt(1, 2) + [9], 9)
    m.step([ExpectOp("expected", prompt(2, 2))])
    before = m.export_state()
    with pytest.raises(error) as raised:
        m.step(ops)
    assert raised.value.field.endswith(field), raised.value.field
    assert m.export_state() == before


def test_an_expected_request_is_not_live():
    m = make_manager()
    m.step([ExpectOp("w", prompt(1, 2))])
    with pytest.raises(RequestNotFoundError):
        m.step([AllocateOp("x", [1], 1)], decode=DecodeBatch(["w"], [1]))
    with pytest.raises(RequestNotFoundError):
        m.block_table("w")
    assert m.stats().num_requests == 0


def test_an_exported_state_with_expectations_restores_a_twin():
    m = make_manager()
    needed, recent = prompt(1, 3), prompt(2, 3)
    run(m, "a", needed)
    run(m, "b", recent)
    m.step([ExpectOp("waiting", needed)])
    twin = KVCacheManager.from_state(m.config, m.export_state())
    twin.check_invariants()
    assert twin.export_state() == m.export_state()
    for core in (m, twin):
        run(core, "pressure", prompt(3, 8))
    assert twin.export_state() == m.export_state()
    assert cached_blocks(twin, needed) == 3


def test_a_room_of_zero_ignores_expect_ops_and_a_bad_room_is_refused():
    m = make_manager(max_expected_blocks=0)
    assert m.step([ExpectOp("w", prompt(1, 3))]).results[0].num_expected_tokens == 0
    m.check_invariants()
    with pytest.raises(ValueError, match="max_expected_blocks must be an integer >= 0, got -1"):
        make_manager(max_expected_blocks=-1)


def host_cached(m: KVCacheManager, tokens: list[int]) -> int:
    hashes = m.hasher.hash_blocks(m.hasher.root_hash, tokens)
    return sum(m.host_tier.find(0, block_hash) is not None for block_hash in hashes)


@pytest.mark.parametrize("expect", [False, True])
def test_the_host_keeps_the_blocks_of_an_expected_prompt_longer(expect):
    m = make_manager(num_blocks=5, num_host_blocks=6)  # 4 device blocks, 6 host blocks
    prompts = [prompt(seed, 2) for seed in range(1, 7)]
    for index, tokens in enumerate(prompts):
        if index == 4 and expect:
            m.step([ExpectOp("waiting", prompts[0])])  # its blocks on the host become the most recently used
        run(m, f"r{index}", tokens)  # from the third on, each sends blocks of earlier prompts to the host
        m.ack(m.last_step_id)  # the offloads are done: their host blocks are free again
    on_host = [host_cached(m, tokens) for tokens in prompts]
    assert on_host == ([2, 0, 1, 2, 1, 0] if expect else [0, 1, 2, 2, 1, 0])
    m.check_invariants()
