"""The host-memory tier in the core: write-back on eviction, hits across tiers, pins until ack.

Block size 2 and pools of a few blocks throughout, so that every eviction is
spelled out. The free queue's order decides which blocks are evicted: a
request's blocks are freed last-to-first, so its last block is evicted first.
"""

from __future__ import annotations

import pytest

from kv_manager_service.core import (
    AllocateOp,
    AllocateStatus,
    FreeOp,
    GroupKind,
    GroupSpec,
    KVCacheConfig,
    KVCacheManager,
)
from kv_manager_service.core.hashing import NO_EXTRAS
from kv_manager_service.core.host_tier import HostBlock
from kv_manager_service.shared.ops import TierCopy

BLOCK_SIZE = 2
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # four full blocks


def make_manager(num_blocks: int, num_host_blocks: int) -> KVCacheManager:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),)
    config = KVCacheConfig(num_blocks=num_blocks, groups=groups, num_host_blocks=num_host_blocks)
    return KVCacheManager(config)


def unrelated(num_tokens: int, first: int = 100) -> list[int]:
    return list(range(first, first + num_tokens))


def chain(manager: KVCacheManager, token_ids: list[int]) -> list:
    """The block hashes of `token_ids` without extra keys."""
    return manager.hasher.hash_blocks(manager.hasher.root_hash, token_ids, 0, NO_EXTRAS)


def host_hashes(manager: KVCacheManager) -> set:
    return {block_hash for _, block_hash in manager.host_tier.cached_block_keys()}


def host_block_id(manager: KVCacheManager, block_hash: bytes) -> int:
    return manager.host_tier.find(0, block_hash).block_id


def run_and_ack(manager: KVCacheManager, *ops) -> object:
    result = manager.step(ops)
    manager.ack(result.step_id)
    manager.check_invariants()
    return result


def cache_prompt_then_evict_tail(manager: KVCacheManager, num_evicted: int) -> list[int]:
    """Cache PROMPT's four blocks, free them, and evict its last `num_evicted` with a live filler request.

    Returns PROMPT's device block ids. The pool must have exactly four free
    blocks besides PROMPT's, so the filler takes those first.
    """
    result = run_and_ack(manager, AllocateOp("a", PROMPT, len(PROMPT)))
    prompt_block_ids = list(result.results[0].groups[0].new_block_ids)
    run_and_ack(manager, FreeOp(["a"]))
    filler = unrelated((manager.pool.num_blocks - 1 - len(prompt_block_ids) + num_evicted) * BLOCK_SIZE)
    run_and_ack(manager, AllocateOp("filler", filler, len(filler)))
    return prompt_block_ids


# -- config --------------------------------------------------------------------------


def test_a_host_tier_with_another_group_kind_is_refused_naming_the_group() -> None:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, 4), GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8))
    message = r"num_host_blocks 16 needs full_attention groups only; groups\[1\] \(sliding_window\)"
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(num_blocks=8, groups=groups, num_host_blocks=16)
    KVCacheConfig(num_blocks=8, groups=groups)  # without the tier the same groups are fine


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_host_blocks": -1}, "num_host_blocks must be an integer >= 0, got -1"),
        ({"num_host_blocks": 2.5}, "num_host_blocks must be an integer >= 0, got 2.5"),
        ({"num_host_blocks": 4, "enable_prefix_caching": False}, "num_host_blocks 4 needs enable_prefix_caching"),
    ],
)
def test_bad_host_tier_configs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KVCacheConfig(num_blocks=8, **kwargs)


def test_without_a_tier_nothing_changes() -> None:
    manager = KVCacheManager(KVCacheConfig(num_blocks=5, groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),)))
    assert manager.host_tier is None and manager.pool.host_tier is None
    result = run_and_ack(manager, AllocateOp("a", PROMPT, len(PROMPT)))
    run_and_ack(manager, FreeOp(["a"]))
    evicting = run_and_ack(manager, AllocateOp("b", unrelated(8), 8))
    assert evicting.delta.offloads == () and evicting.results[0].offloads == ()
    assert manager.find_cache_hit(PROMPT + [9]).num_host_cached_tokens == 0
    assert manager.host_tier_stats() is None and manager.pending_tier_copies() == []
    assert result.results[0].onloads == ()


# -- write-back on eviction ---------------------------------------------------------------


def test_an_evicted_cached_block_is_offloaded_and_indexed_on_the_host() -> None:
    manager = make_manager(num_blocks=9, num_host_blocks=8)
    prompt_ids = cache_prompt_then_evict_tail(manager, num_evicted=2)
    hashes = chain(manager, PROMPT)
    # Freed last-to-first: the last two blocks were evicted, last first.
    assert manager.pending_tier_copies() == []  # acknowledged with the filler's step
    offloaded = [manager.host_tier.find(0, h) for h in hashes[2:]]
    assert all(type(b) is HostBlock for b in offloaded)
    assert host_hashes(manager) == set(hashes[2:])
    assert manager.host_tier_stats().num_offloaded_blocks == 2
    assert manager.pool.get_cached_block(0, hashes[3]) is None
    assert manager.pool.get_cached_block(0, hashes[0]).block_id == prompt_ids[0]


def test_the_offload_copy_is_in_the_ops_result_and_the_step_delta_and_pins_until_ack() -> None:
    manager = make_manager(num_blocks=5, num_host_blocks=8)
    result = run_and_ack(manager, AllocateOp("a", PROMPT, len(PROMPT)))
    prompt_ids = result.results[0].groups[0].new_block_ids
    run_and_ack(manager, FreeOp(["a"]))
    evicting = manager.step((AllocateOp("b", unrelated(4), 4),))  # two blocks: PROMPT's last two
    manager.check_invariants()
    hashes = chain(manager, PROMPT)
    pinned = [host_block_id(manager, hashes[3]), host_block_id(manager, hashes[2])]
    expected = (TierCopy(prompt_ids[3], pinned[0]), TierCopy(prompt_ids[2], pinned[1]))
    assert evicting.results[0].offloads == expected == evicting.delta.offloads
    ref_cnts = manager.host_tier.ref_cnts
    assert [ref_cnts[b] for b in pinned] == [1, 1]
    assert not any(b in pinned for b in manager.host_tier.free_queue)
    assert [p.step_id for p in manager.pending_tier_copies()] == [evicting.step_id] * 2
    manager.ack(evicting.step_id)
    manager.check_invariants()
    assert [ref_cnts[b] for b in pinned] == [0, 0] and manager.pending_tier_copies() == []
    assert list(manager.host_tier.free_queue)[-2:] == pinned  # free again, most recently used, still indexed
    assert host_hashes(manager) == set(hashes[2:])


def test_a_hash_still_on_the_device_in_another_block_is_not_offloaded() -> None:
    manager = make_manager(num_blocks=9, num_host_blocks=8)
    # Two requests compute the same first block without sharing it (both admitted in one step).
    run_and_ack(manager, AllocateOp("a", [1, 2, 3], 3), AllocateOp("b", [1, 2, 4], 3))
    run_and_ack(manager, FreeOp(["a"]))
    run_and_ack(manager, AllocateOp("c", unrelated(12), 12))  # evicts a's copy; b still holds the hash
    assert manager.host_tier_stats().num_offloaded_blocks == 0
    assert host_hashes(manager) == set()


def test_with_every_host_block_pinned_an_evicted_block_is_dropped() -> None:
    manager = make_manager(num_blocks=5, num_host_blocks=1)
    run_and_ack(manager, AllocateOp("a", PROMPT, len(PROMPT)))
    run_and_ack(manager, FreeOp(["a"]))
    evicting = manager.step((AllocateOp("b", unrelated(4), 4),))
    manager.check_invariants()
    assert len(evicting.delta.offloads) == 1
    stats = manager.host_tier_stats()
    assert (stats.num_offloaded_blocks, stats.num_dropped_offloads, stats.num_free_host_blocks) == (1, 1, 0)


def test_the_host_evicts_its_least_recently_used_block() -> None:
    manager = make_manager(num_blocks=5, num_host_blocks=2)
    run_and_ack(manager, AllocateOp("a", PROMPT, len(PROMPT)))
    run_and_ack(manager, FreeOp(["a"]))
    hashes = chain(manager, PROMPT)
    run_and_ack(manager, AllocateOp("b", unrelated(2), 2))  # evicts block 3 -> host
    run_and_ack(manager, AllocateOp("c", unrelated(2, first=200), 2))  # evicts block 2 -> host (now full)
    assert host_hashes(manager) == {hashes[3], hashes[2]}
    run_and_ack(manager, AllocateOp("d", unrelated(2, first=300), 2))  # evicts block 1: the host drops hash 3
    assert host_hashes(manager) == {hashes[2], hashes[1]}
    stats = manager.host_tier_stats()
    assert (stats.num_offloaded_blocks, stats.num_host_evictions) == (3, 1)


# -- hits across tiers --------------------------------------------------------------------


def test_a_hit_continues_from_the_device_into_the_host_and_is_onloaded() -> None:
    manager = make_manager(num_blocks=9, num_host_blocks=8)
    prompt_ids = cache_prompt_then_evict_tail(manager, num_evicted=2)
    run_and_ack(manager, FreeOp(["filler"]))
    hashes = chain(manager, PROMPT)
    host_ids = [host_block_id(manager, hashes[2]), host_block_id(manager, hashes[3])]
    ref_cnts = manager.host_tier.ref_cnts

    hit = manager.find_cache_hit(PROMPT + [9])
    assert hit.num_cached_tokens == 8 and hit.num_host_cached_tokens == 4
    assert hit.block_ids == ((prompt_ids[0], prompt_ids[1], -1, -1),)

    result = manager.step((AllocateOp("c", PROMPT + [9], 9),))
    manager.check_invariants()
    allocation = result.results[0]
    assert allocation.status is AllocateStatus.OK
    assert allocation.num_computed_tokens == 8 and allocation.num_scheduled_tokens == 1
    hit_ids = allocation.groups[0].hit_block_ids
    assert hit_ids[:2] == tuple(prompt_ids[:2])
    assert allocation.onloads == (TierCopy(hit_ids[2], host_ids[0]), TierCopy(hit_ids[3], host_ids[1]))
    assert result.delta.onloads == allocation.onloads
    assert manager.block_table("c").num_computed_tokens == 9
    # The loaded blocks are on the device under the same hashes, and the host keeps its copies.
    assert [manager.pool.get_cached_block(0, h).block_id for h in hashes] == list(hit_ids)
    assert host_hashes(manager) >= set(hashes[2:])
    # The host blocks it reads stay pinned until the step is acknowledged.
    assert [ref_cnts[b] for b in host_ids] == [1, 1]
    manager.ack(result.step_id)
    manager.check_invariants()
    assert [ref_cnts[b] for b in host_ids] == [0, 0]
    assert manager.host_tier_stats().prefix_cache_host_hits == 4
    assert manager.stats().prefix_cache_hits == 8


def test_a_chain_stops_at_the_first_block_in_neither_tier() -> None:
    manager = make_manager(num_blocks=9, num_host_blocks=1)
    # Block 3 is offloaded and pins the only host block, so block 2 is dropped in the same step.
    cache_prompt_then_evict_tail(manager, num_evicted=2)
    hashes = chain(manager, PROMPT)
    assert host_hashes(manager) == {hashes[3]}
    assert manager.host_tier_stats().num_dropped_offloads == 1
    hit = manager.find_cache_hit(PROMPT + [9])
    assert hit.num_cached_tokens == 4 and hit.num_host_cached_tokens == 0  # block 3 is past the miss


def test_an_onloaded_block_evicted_again_needs_no_new_copy() -> None:
    manager = make_manager(num_blocks=9, num_host_blocks=8)
    cache_prompt_then_evict_tail(manager, num_evicted=2)
    run_and_ack(manager, FreeOp(["filler"]))
    run_and_ack(manager, AllocateOp("c", PROMPT + [9], 9))
    run_and_ack(manager, FreeOp(["c"]))
    hashes = chain(manager, PROMPT)
    device_ids = [manager.pool.get_cached_block(0, h).block_id for h in hashes]
    evicting = run_and_ack(manager, AllocateOp("d", unrelated(16, first=500), 16))  # evicts every block
    offloaded_ids = {c.device_block_id for c in evicting.delta.offloads}
    # PROMPT's first two blocks travel now; its last two, loaded from the host, are there already.
    assert set(device_ids[:2]) <= offloaded_ids and not set(device_ids[2:]) & offloaded_ids
    assert host_hashes(manager) >= set(hashes)


def test_an_admission_without_room_for_the_onloads_is_no_space_and_changes_nothing() -> None:
    manager = make_manager(num_blocks=9, num_host_blocks=8)
    cache_prompt_then_evict_tail(manager, num_evicted=2)  # the filler holds every other block
    pins = manager.host_tier.ref_cnts.tolist()
    result = manager.step((AllocateOp("c", PROMPT + [9], 9),))
    manager.check_invariants()
    assert result.results[0].status is AllocateStatus.NO_SPACE
    assert result.delta.onloads == () and result.delta.offloads == ()
    assert manager.host_tier.ref_cnts.tolist() == pins


# -- reset -----------------------------------------------------------------------------------


def test_reset_clears_both_tiers_and_pinned_host_blocks_wait_for_their_ack() -> None:
    manager = make_manager(num_blocks=5, num_host_blocks=8)
    run_and_ack(manager, AllocateOp("a", PROMPT, len(PROMPT)))
    run_and_ack(manager, FreeOp(["a"]))
    evicting = manager.step((AllocateOp("b", unrelated(4), 4),))  # offloads pinned, not acknowledged
    manager.step((FreeOp(["b"]),))
    assert manager.reset_prefix_cache() is True
    manager.check_invariants()
    assert host_hashes(manager) == set()
    assert all(manager.host_tier.block_hash(b) is None for b in range(manager.host_tier.num_blocks))
    pinned = [c.host_block_id for c in evicting.delta.offloads]
    assert [manager.host_tier.ref_cnts[b] for b in pinned] == [1, 1]
    assert manager.find_cache_hit(PROMPT + [9]).num_cached_tokens == 0
    manager.ack(manager.last_step_id)
    manager.check_invariants()
    assert list(manager.host_tier.free_queue)[:2] == pinned[::-1]  # hashless: reused first
    assert manager.host_tier_stats().num_free_host_blocks == 8


def test_reset_is_refused_for_both_tiers_while_a_device_block_is_held() -> None:
    manager = make_manager(num_blocks=5, num_host_blocks=8)
    cache_prompt_then_evict_tail(manager, num_evicted=2)
    before = host_hashes(manager)
    assert manager.reset_prefix_cache() is False
    assert host_hashes(manager) == before
