"""The core's invariants, checked whole: what every mutation path must preserve."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_manager_service.core.block_queue import KVCacheBlock

if TYPE_CHECKING:
    from kv_manager_service.core.manager import KVCacheManager


def check_invariants(manager: "KVCacheManager") -> None:
    """Raise AssertionError, with the counts that disagree, if the state is corrupt.

    For every block b != 0: ref_cnt == table slots holding b + copy
    retentions; b is in the free queue iff ref_cnt == 0; a hashed block is in
    its group's map, full, and named by the chain hash of every request
    holding it at that index. free + used == num_blocks - 1. The null block
    is never free nor cached. Every lost request is live. O(pool + tables): for tests.
    """
    pool = manager.pool
    null = pool.null_block
    holders = [0] * pool.num_blocks
    stale = [request_id for request_id in manager.lost if request_id not in manager.requests]
    assert not stale, f"lost requests {stale} are not live"
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
    if manager.host_tier is not None:
        check_host_tier_invariants(manager)


def check_host_tier_invariants(manager: "KVCacheManager") -> None:
    """The host tier's invariants, and how it agrees with the device pool.

    Conservation: every host block is either free (in the queue, ref_cnt 0)
    or pinned, with ref_cnt == the pending tier copies naming it, so free +
    pinned == num_host_blocks. The index is a bijection: each (group, hash)
    names one host block that carries exactly that hash, and each hashed
    host block is indexed. No hash pinned by a pending copy was evicted: the
    pinned block still carries the hash it was pinned under (or none, after
    a reset). Pending copies are in step order, none later than the last
    step. A hash on both tiers names blocks of the same group that both carry it.
    """
    host_tier = manager.host_tier
    pins = [0] * host_tier.num_blocks
    last_step_id = 0
    for step_id, host_block, block_hash, copy, is_onload in host_tier.pending:
        assert last_step_id <= step_id <= manager.last_step_id, (
            f"pending tier copy of step {step_id} after step {last_step_id} (last issued {manager.last_step_id})"
        )
        last_step_id = step_id
        assert copy.host_block_id == host_block.block_id
        assert 0 < copy.device_block_id < manager.pool.num_blocks, f"tier copy {copy} names no device block"
        pins[host_block.block_id] += 1
        assert host_block.block_hash in (block_hash, None), (
            f"host block {host_block.block_id} pinned under one hash now carries another"
        )
    in_queue = set()
    for block in host_tier.free_queue:
        assert block.block_id not in in_queue, f"host block {block.block_id} is twice in the free queue"
        in_queue.add(block.block_id)
    assert len(in_queue) == host_tier.free_queue.num_free_blocks
    num_pinned = 0
    num_hashed = 0
    for block in host_tier.blocks:
        assert block.ref_cnt == pins[block.block_id], (
            f"host block {block.block_id}: ref_cnt {block.ref_cnt} but {pins[block.block_id]} pending copies"
        )
        assert (block.ref_cnt == 0) == (block.block_id in in_queue), (
            f"host block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue: {block.block_id in in_queue}"
        )
        num_pinned += block.ref_cnt > 0
        if block.block_hash is not None:
            num_hashed += 1
            assert host_tier.cached[block.group_id].get(block.block_hash) is block, (
                f"hashed host block {block.block_id} is missing from the host index"
            )
    assert num_pinned + len(in_queue) == host_tier.num_blocks, (
        f"host pinned {num_pinned} + free {len(in_queue)} != {host_tier.num_blocks}"
    )
    num_entries = sum(len(cached) for cached in host_tier.cached)
    assert num_entries == num_hashed, f"host index has {num_entries} entries for {num_hashed} hashed host blocks"
    for group_id, cached in enumerate(host_tier.cached):
        device_cached = manager.pool.cached[group_id]
        for block_hash, host_block in cached.items():
            assert host_block.block_hash == block_hash and host_block.group_id == group_id
            entry = device_cached.get(block_hash)
            if entry is None:
                continue
            for device_block in (entry,) if isinstance(entry, KVCacheBlock) else entry.values():
                assert device_block.block_hash == block_hash and device_block.group_id == group_id, (
                    f"device block {device_block.block_id} and host block {host_block.block_id} disagree on a hash"
                )
