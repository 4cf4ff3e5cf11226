"""The core's invariants, checked whole: what every mutation path must preserve."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_manager_service.core.block_pool import FREQUENCY_CLASSES, BlockPool
from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.shared.ops import MAX_RETENTION_PRIORITY
from kv_manager_service.core.host_index import EMPTY

if TYPE_CHECKING:
    from kv_manager_service.core.manager import KVCacheManager


def check_invariants(manager: "KVCacheManager") -> None:
    """Raise AssertionError, with the counts that disagree, if the state is corrupt.

    For every block b != 0: ref_cnt == table slots holding b + copy
    retentions + retention pins; b is in the free queue iff ref_cnt == 0; a hashed block is in
    its group's map, full, and named by the chain hash of every request
    holding it at that index. free + used == num_blocks - 1. The null block
    is never free nor cached. Every lost request is live. O(pool + tables): for tests.
    """
    pool = manager.pool
    null = pool.null_block
    holders = [0] * pool.num_blocks
    stale = [request_id for request_id in manager.lost if request_id not in manager.requests]
    assert not stale, f"lost requests {stale} are not live"
    check_expectation_invariants(manager)
    for request in manager.requests.values():
        assert 0 <= request.num_computed_tokens <= request.num_tokens, (
            f"{request.request_id}: computed {request.num_computed_tokens} > tokens {request.num_tokens}"
        )
        if manager.enable_caching:
            assert len(request.block_hashes) == request.num_tokens // manager.hash_block_size, (
                f"{request.request_id}: {len(request.block_hashes)} hashes for {request.num_tokens} tokens"
            )
            assert len(request.tail_token_ids) == request.num_tokens % manager.hash_block_size
        for group, table in zip(manager.managers, request.tables):
            num_cached = request.num_cached_blocks[group.group_id]
            assert num_cached <= len(table)
            k = group.hashes_per_block
            for index, block in enumerate(table):
                if block is null:
                    continue
                holders[block.block_id] += 1
                if block.block_hash is not None:
                    assert block.group_id == group.group_id
                    assert (index + 1) * group.block_size <= request.num_computed_tokens, (
                        f"block {block.block_id} is hashed but not full in {request.request_id}"
                    )
                    assert block.block_hash == request.block_hashes[(index + 1) * k - 1], (
                        f"block {block.block_id} at index {index} of {request.request_id} has a foreign hash"
                    )
            for block in table[:num_cached]:
                assert block is null or block.block_hash is not None, (
                    f"{request.request_id}: block {block.block_id} below the cached count has no hash"
                )
    for block, count in manager._retained.items():
        holders[block.block_id] += count
    assert sum(manager._retained.values()) == 2 * len(manager._pending_copies)
    for block, count in manager.pins.counts.items():
        holders[block.block_id] += count

    in_queue = set()
    for block in pool.free_queue:
        assert block.block_id not in in_queue, f"block {block.block_id} is twice in the free queue"
        in_queue.add(block.block_id)
    assert len(in_queue) == pool.free_queue.num_free_blocks, (
        f"free queue holds {len(in_queue)} blocks but counts {pool.free_queue.num_free_blocks}"
    )
    assert null.block_id not in in_queue and null.block_hash is None, "the null block is free or cached"
    num_used = 0
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders"
        )
        assert (block.ref_cnt == 0) == (block.block_id in in_queue), (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue: {block.block_id in in_queue}"
        )
        num_used += block.ref_cnt > 0
    assert num_used + len(in_queue) == pool.num_blocks - 1, (
        f"used {num_used} + free {len(in_queue)} != {pool.num_blocks - 1}"
    )
    num_hashed = 0
    for block in pool.blocks:
        if block.block_hash is None:
            continue
        num_hashed += 1
        entry = pool.cached[block.group_id].get(block.block_hash)
        assert entry is block or (isinstance(entry, dict) and entry.get(block.block_id) is block), (
            f"hashed block {block.block_id} is missing from the cache map"
        )
    num_entries = sum(
        1 if isinstance(entry, KVCacheBlock) else len(entry) for cached in pool.cached for entry in cached.values()
    )
    assert num_entries == num_hashed, f"cache map has {num_entries} entries for {num_hashed} hashed blocks"
    check_retention_invariants(manager)
    if manager.host_tier is not None:
        check_host_tier_invariants(manager)


def check_retention_invariants(manager: "KVCacheManager") -> None:
    """Pins and priorities (pins.py, BlockPool): what makes the quota hard and the eviction order hold.

    Pins: `counts` is exactly the pins' references, each pin naming distinct
    cached blocks; the distinct pinned blocks never exceed the quota; ids are
    below `next_pin_id`, oldest first. Priorities: each is in
    1..MAX_RETENTION_PRIORITY, on a cached block. The free queue is its
    segments: priorities never decrease from head to tail, each segment's
    recorded head is its first block, and the segment list names exactly
    the priorities the queue holds, in ascending order.
    """
    pins = manager.pins
    recount: dict[KVCacheBlock, int] = {}
    last_pin_id = 0
    for pin_id, pin in pins.pins.items():
        assert pin.pin_id == pin_id and last_pin_id < pin_id < pins.next_pin_id, (
            f"pin {pin_id} is out of order (after {last_pin_id}, next id {pins.next_pin_id})"
        )
        last_pin_id = pin_id
        assert pin.blocks and len(set(pin.blocks)) == len(pin.blocks), f"pin {pin_id} holds {pin.blocks}"
        for block in pin.blocks:
            assert block.block_hash is not None and not block.is_null, f"pin {pin_id} holds uncached {block}"
            recount[block] = recount.get(block, 0) + 1
    assert recount == pins.counts, f"pin counts {len(pins.counts)} blocks, the pins hold {len(recount)}"
    assert len(pins.counts) <= pins.max_pinned_blocks, (
        f"{len(pins.counts)} pinned blocks exceed the quota of {pins.max_pinned_blocks}"
    )
    pool = manager.pool
    for block, priority in pool.priorities.items():
        assert 0 < priority <= MAX_RETENTION_PRIORITY, f"{block} has priority {priority}"
        assert block.block_hash is not None and not block.is_null, f"uncached {block} has priority {priority}"
    check_segment_invariants(pool)


def check_expectation_invariants(manager: "KVCacheManager") -> None:
    """Expected requests (expectations.py): none is live, they hold at most the room's blocks, and the
    pool's `wanted` lists exactly the sequence numbers of the expectations holding each kept hash, ascending."""
    expectations = manager.expectations
    both = [request_id for request_id in expectations.by_request if request_id in manager.requests]
    assert not both, f"requests {both[:4]} are both live and expected"
    assert expectations.by_request.keys() == expectations.seqs.keys()
    seqs = list(expectations.seqs.values())
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and all(s < expectations.next_seq for s in seqs)
    holders: dict = {}
    for request_id, hashes in expectations.by_request.items():
        for block_hash in hashes:
            holders.setdefault(block_hash, []).append(expectations.seqs[request_id])
    num_kept = sum(len(hashes) for hashes in expectations.by_request.values())
    assert expectations.num_blocks == num_kept <= expectations.max_blocks, (
        f"expectations count {expectations.num_blocks} blocks, hold {num_kept}, room {expectations.max_blocks}"
    )
    assert holders == manager.pool.wanted, "the pool's wanted hashes are not the expected prompts' kept hashes"


def check_segment_invariants(pool: BlockPool) -> None:
    """The free queue's segments (BlockPool): keys never decrease from head to tail, each segment's
    recorded head is its first block, and the segment list names exactly the keys the queue holds, in
    ascending order. Only free cached blocks have a key, and its rank key is the one the state gives now
    (under frequency the class is fixed when the key is set, so only the rank key is checked); a replay's
    ranker owns its keys. The frequency history stays within its size and its counts within
    1..FREQUENCY_CLASSES, empty under lru.
    """
    heads: dict[int, KVCacheBlock] = {}
    last_key = 0
    for block in pool.free_queue:
        key = pool.segment_keys.get(block, 0)
        assert key >= last_key, f"free block {block.block_id} of segment {key} follows one of segment {last_key}"
        last_key = key
        if key:
            heads.setdefault(key, block)
        if pool.ranker is None and block.block_hash is not None:
            rank_key = key // FREQUENCY_CLASSES if pool.by_frequency else key
            assert rank_key == pool.rank_key(block), (
                f"{block} is in segment {key} ({pool.eviction_policy.value}) but its rank key is "
                f"{pool.rank_key(block)}: priority {pool.priorities.get(block, 0)}, "
                f"wanted by {pool.wanted.get(block.block_hash)}"
            )
    assert heads == pool._segment_heads and pool._segment_order == sorted(heads), (
        f"segments {sorted(pool._segment_heads)} (order {pool._segment_order}) but the queue holds {sorted(heads)}"
    )
    for block, key in pool.segment_keys.items():
        assert key > 0 and block.block_hash is not None and block.prev_free is not None, (
            f"{block} has segment key {key} but is not a free cached block"
        )
    assert len(pool.seen) <= pool.history_size and (pool.by_frequency or not pool.seen), (
        f"the frequency history holds {len(pool.seen)} hashes (at most {pool.history_size}, {pool.eviction_policy.value})"
    )
    assert all(1 <= count <= FREQUENCY_CLASSES for count in pool.seen.values()), "a count outside 1..FREQUENCY_CLASSES"


def check_host_tier_invariants(manager: "KVCacheManager") -> None:
    """The host tier's invariants over its flat arrays, and how it agrees with the device pool.

    Conservation: every host block is either free (in the queue, ref_cnt 0)
    or pinned, with ref_cnt == the pending tier copies naming it, so free +
    pinned == num_host_blocks. The free queue is one well-linked chain from
    the sentinel back to it (each id's previous link names the id before
    it), visiting each id at most once, and an id is linked iff it is on the
    chain. The index is a bijection: each hashed host block is found by a
    lookup of its own (group, hash), so it sits in the probe run of its home
    slot and no other block holds that key; the table holds exactly the
    hashed blocks, once each. No hash pinned by a pending copy was evicted:
    the pinned block still carries the hash it was pinned under (or none,
    after a reset). Pending copies are in step order, none later than the
    last step. A hash on both tiers names blocks of the same group that both
    carry it.
    """
    host_tier = manager.host_tier
    index, queue, ref_cnts = host_tier.index, host_tier.free_queue, host_tier.ref_cnts
    num_blocks = host_tier.num_blocks
    pins = [0] * num_blocks
    last_step_id = 0
    for step_id, block_id, block_hash, copy, is_onload in host_tier.pending:
        assert last_step_id <= step_id <= manager.last_step_id, (
            f"pending tier copy of step {step_id} after step {last_step_id} (last issued {manager.last_step_id})"
        )
        last_step_id = step_id
        assert copy.host_block_id == block_id
        assert 0 < copy.device_block_id < manager.pool.num_blocks, f"tier copy {copy} names no device block"
        pins[block_id] += 1
        assert index.block_hash(block_id) in (block_hash, None), (
            f"host block {block_id} pinned under one hash now carries another"
        )
    in_queue = bytearray(num_blocks)
    previous = sentinel = queue.num_ids
    for block_id in queue:
        assert not in_queue[block_id], f"host block {block_id} is twice in the free queue"
        assert queue.prev_of(block_id) == previous, f"host block {block_id}'s free-queue links disagree"
        in_queue[block_id] = 1
        previous = block_id
    num_free = sum(in_queue)
    assert queue.next_of(previous) == sentinel and queue.prev_of(sentinel) == previous, "the free queue is not closed"
    assert num_free == queue.num_free, f"free queue holds {num_free} host blocks but counts {queue.num_free}"
    num_pinned = 0
    num_hashed = 0
    for block_id in range(num_blocks):
        assert ref_cnts[block_id] == pins[block_id], (
            f"host block {block_id}: ref_cnt {ref_cnts[block_id]} but {pins[block_id]} pending copies"
        )
        assert (ref_cnts[block_id] == 0) == in_queue[block_id] == (block_id in queue), (
            f"host block {block_id}: ref_cnt {ref_cnts[block_id]}, in free queue: {bool(in_queue[block_id])}"
        )
        num_pinned += ref_cnts[block_id] > 0
        group_id = index.group_id(block_id)
        if group_id != EMPTY:
            num_hashed += 1
            assert index.get(group_id, index.block_hash(block_id)) == block_id, (
                f"hashed host block {block_id} is not found under its hash"
            )
    assert num_pinned + num_free == num_blocks, f"host pinned {num_pinned} + free {num_free} != {num_blocks}"
    in_table = [block_id for block_id in index.slots() if block_id != EMPTY]
    assert len(in_table) == len(set(in_table)) == num_hashed == len(index), (
        f"host index table has {len(in_table)} entries ({len(set(in_table))} distinct, {len(index)} counted) "
        f"for {num_hashed} hashed host blocks"
    )
    for group_id, block_hash, block_id in index.items():
        entry = manager.pool.cached[group_id].get(block_hash)
        if entry is None:
            continue
        for device_block in (entry,) if isinstance(entry, KVCacheBlock) else entry.values():
            assert device_block.block_hash == block_hash and device_block.group_id == group_id, (
                f"device block {device_block.block_id} and host block {block_id} disagree on a hash"
            )
