"""The host tier's cache events: what a consumer of the event stream learns about each tier.

Block size 2 and a pool of 5 blocks (4 usable): caching a 4-block prompt,
freeing it and running an unrelated 4-block request evicts the whole prompt
from the device, last block first (freed last-to-first), into the host.
"""

from __future__ import annotations

from collections import Counter

from kv_manager_service.core import AllocateOp, FreeOp, GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_manager_service.shared.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kv_manager_service.core.hashing import NO_EXTRAS

BLOCK_SIZE = 2
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # four full blocks
FILLER = list(range(100, 108))  # four other full blocks


def make_manager(num_host_blocks: int) -> KVCacheManager:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),)
    config = KVCacheConfig(num_blocks=5, groups=groups, num_host_blocks=num_host_blocks, enable_events=True)
    return KVCacheManager(config)


def chain(manager: KVCacheManager, token_ids: list[int]) -> list[bytes]:
    return manager.hasher.hash_blocks(manager.hasher.root_hash, token_ids, 0, NO_EXTRAS)


def run_and_ack(manager: KVCacheManager, *ops: object) -> None:
    result = manager.step(ops)
    manager.ack(result.step_id)


def cache_then_evict(manager: KVCacheManager) -> None:
    for ops in ([AllocateOp("a", PROMPT, len(PROMPT))], [FreeOp(["a"])], [AllocateOp("f", FILLER, len(FILLER))]):
        run_and_ack(manager, *ops)


def replay(events: list[KVEvent]) -> dict[Tier, Counter]:
    """Each tier's cached (group, hash) counts, rebuilt from events as the mirror writer does."""
    tiers = {Tier.DEVICE: Counter(), Tier.HOST: Counter()}
    for event in events:
        if type(event) is AllBlocksCleared:
            for counts in tiers.values():
                counts.clear()
            continue
        sign = 1 if type(event) is BlockStored else -1
        for block_hash in event.block_hashes:
            tiers[event.tier][(event.group_id, block_hash)] += sign
    return {tier: +counts for tier, counts in tiers.items()}


def test_without_a_tier_every_event_is_the_device_tiers_as_before() -> None:
    manager = make_manager(0)
    cache_then_evict(manager)
    events = manager.take_events()
    assert all(e.tier is Tier.DEVICE for e in events if type(e) is not AllBlocksCleared)
    h = chain(manager, PROMPT)
    assert [e for e in events if type(e) is BlockRemoved] == [BlockRemoved(0, tuple(h[::-1]))]


def test_an_eviction_into_the_host_stores_the_hash_there_before_the_device_removes_it() -> None:
    manager = make_manager(8)
    cache_then_evict(manager)
    h = chain(manager, PROMPT)
    events = manager.take_events()
    evictions = events[1:-1]  # between the prompt's and the filler's DEVICE BlockStored
    # Each evicted hash stored on the host, then one DEVICE BlockRemoved for the allocation's evictions.
    expected = [BlockStored(0, (block_hash,), None, 0, Tier.HOST) for block_hash in h[::-1]]
    assert evictions == [*expected, BlockRemoved(0, tuple(h[::-1]), Tier.DEVICE)]
    tiers = replay(events)
    assert set(tiers[Tier.HOST]) == {(0, block_hash) for block_hash in h} == set(manager.host_tier.cached_block_keys())
    assert set(tiers[Tier.DEVICE]) == {(0, block_hash) for block_hash in chain(manager, FILLER)}


def test_a_host_eviction_removes_the_oldest_host_hash_and_an_onload_stores_on_the_device_too() -> None:
    manager = make_manager(2)
    h = chain(manager, PROMPT)
    run_and_ack(manager, AllocateOp("a", PROMPT, len(PROMPT)))
    run_and_ack(manager, FreeOp(["a"]))
    run_and_ack(manager, AllocateOp("f1", FILLER[:4], 4))  # evicts h[3], h[2] into the host
    run_and_ack(manager, AllocateOp("f2", FILLER[4:], 4))  # evicts h[1], h[0]: the host evicts h[3], h[2]
    events = manager.take_events()
    assert [e for e in events if type(e) is BlockRemoved and e.tier is Tier.HOST] == [
        BlockRemoved(0, (h[3],), Tier.HOST),
        BlockRemoved(0, (h[2],), Tier.HOST),
    ]
    assert set(replay(events)[Tier.HOST]) == {(0, h[0]), (0, h[1])} == set(manager.host_tier.cached_block_keys())

    run_and_ack(manager, FreeOp(["f1", "f2"]))
    run_and_ack(manager, AllocateOp("b", PROMPT[:4] + [9], 5))  # a hit on two host blocks: onloads
    assert manager.host_tier.num_onloaded_blocks == 2
    events += manager.take_events()
    tiers = replay(events)
    assert {(0, h[0]), (0, h[1])} <= set(tiers[Tier.DEVICE])
    assert set(tiers[Tier.HOST]) == {(0, h[0]), (0, h[1])} == set(manager.host_tier.cached_block_keys())  # kept there


def test_a_reset_clears_both_tiers_with_one_event() -> None:
    manager = make_manager(8)
    cache_then_evict(manager)
    run_and_ack(manager, FreeOp(["f"]))
    manager.take_events()
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]
    assert set(manager.host_tier.cached_block_keys()) == set()
