"""The core's whole state as plain data, and a core rebuilt from it (snapshots).

`export_state` and `restore_state` are exact inverses: a core restored from
another's state gives the same results, block ids, free-queue order, cache
hits, pending copies and step ids on every later op. What a core holds that
is not here is derived from its config (hasher, group managers) or from the
data here (reference counts, copy retentions and host pins, the free queues'
links).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from kv_manager_service.core.block_pool import FREQUENCY_CLASSES, BlockPool
from kv_manager_service.core.block_queue import FreeBlockQueue, KVCacheBlock
from kv_manager_service.core.hashing import NO_EXTRAS, BlockHash, HashExtras
from kv_manager_service.core.host_index import EMPTY
from kv_manager_service.core.host_tier import HostTier
from kv_manager_service.core.id_queue import IdQueue
from kv_manager_service.core.invariants import check_invariants
from kv_manager_service.core.pins import Pin
from kv_manager_service.shared.ops import KVLossCause, KVLossCount, Retention, TierCopy
from kv_manager_service.core.request import RequestState

if TYPE_CHECKING:
    from kv_manager_service.core.manager import KVCacheManager


@dataclass(frozen=True)
class RequestExport:
    """One live request; tables list block ids per group, 0 for the null block."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int
    num_encoder_tokens: int
    extras: HashExtras
    block_hashes: tuple[BlockHash, ...]
    tail_token_ids: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    num_cached_blocks: tuple[int, ...]
    lost_cause: KVLossCause | None = None  # None: its KV is not lost
    retention: Retention | None = None


@dataclass(frozen=True)
class PinExport:
    """One retention pin (pins.py); its block ids in token order."""

    pin_id: int
    request_id: str
    ttl_ms: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class HostTierState:
    """The host tier's state between steps (it has no copies of a running step then).

    Columns, not an object per block, so that a tier of millions of blocks
    exports compactly (int arrays on export). `free_host_block_ids`: its
    free queue, head (reused first) to tail. The cached host blocks, in host
    block id order: `cached_group_ids`, `cached_block_hashes` (their hashes
    end to end, all of the hasher's length) and `cached_host_block_ids`.
    `pending`: (step id, is an onload, device block id, host block id, the
    hash the host block was pinned under) in step order; each pins its host
    block, so the host blocks' reference counts are derived from them.
    """

    free_host_block_ids: Sequence[int]
    cached_group_ids: Sequence[int]
    cached_block_hashes: bytes
    cached_host_block_ids: Sequence[int]
    pending: tuple[tuple[int, bool, int, int, BlockHash], ...]
    num_offloaded_blocks: int
    num_onloaded_blocks: int
    num_evictions: int
    num_dropped_offloads: int
    num_hit_tokens: int


@dataclass(frozen=True)
class CoreState:
    """A core's state between steps.

    `free_block_ids`: the free queue, head (reused first) to tail.
    `cached`: (group id, block hash, block id) in the order of the group's
    hash map, the blocks of one hash in the order a hit picks them.
    `requests`: oldest first. `pending_copies`: (step id, src, dst) in step order.
    `host_tier`: None without a host tier. Retention (docs/retention.md):
    `block_priorities` (block id, priority) of the cached blocks with a
    priority > 0, in block id order; `pins` oldest first; `num_pins_made`,
    the last pin id made (0: none). Under the frequency eviction policy
    (BlockPool): `frequency_classes`, (block id, class) of the free cached
    blocks whose frequency class is above 0, in block id order, and `seen`,
    the frequency history, least recently seen first (both empty under lru;
    the rest of each free block's key follows from the state). `expected`: (request id, its kept block
    hashes) per expected request, oldest first (core/expectations.py).
    """

    last_step_id: int
    free_block_ids: tuple[int, ...]
    cached: tuple[tuple[int, BlockHash, int], ...]
    requests: tuple[RequestExport, ...]
    pending_copies: tuple[tuple[int, int, int], ...]
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evictions: int
    host_tier: HostTierState | None = None
    kv_losses: tuple[KVLossCount, ...] = ()
    block_priorities: tuple[tuple[int, int], ...] = ()
    pins: tuple[PinExport, ...] = ()
    num_pins_made: int = 0
    num_unpinned_blocks: int = 0
    frequency_classes: tuple[tuple[int, int], ...] = ()
    seen: tuple[tuple[BlockHash, int], ...] = ()
    expected: tuple[tuple[str, tuple[BlockHash, ...]], ...] = ()


def export_state(manager: KVCacheManager) -> CoreState:
    """The manager's state; changes nothing. Its queued events must be drained first: they are the caller's."""
    pool = manager.pool
    assert not pool.events, "drain the core's events (take_events) before exporting its state"
    cached = []
    for group_id, entries in enumerate(pool.cached):
        for block_hash, entry in entries.items():
            if type(entry) is KVCacheBlock:
                cached.append((group_id, block_hash, entry.block_id))
            else:
                cached += [(group_id, block_hash, block_id) for block_id in entry]
    requests = tuple(
        RequestExport(
            r.request_id,
            r.num_tokens,
            r.num_computed_tokens,
            r.num_encoder_tokens,
            r.extras,
            tuple(r.block_hashes),
            tuple(r.tail_token_ids),
            tuple(tuple([b.block_id for b in table]) for table in r.tables),
            tuple(r.num_cached_blocks),
            manager.lost.get(r.request_id),
            r.retention,
        )
        for r in manager.requests.values()
    )
    pins = manager.pins
    return CoreState(
        manager.last_step_id,
        tuple([b.block_id for b in pool.free_queue]),
        tuple(cached),
        requests,
        tuple((step_id, src.block_id, dst.block_id) for step_id, src, dst in manager._pending_copies),
        manager.prefix_cache_queries,
        manager.prefix_cache_hits,
        pool.num_evictions,
        _export_host_tier(manager.host_tier) if manager.host_tier is not None else None,
        manager.kv_losses.counts(),
        tuple(sorted((b.block_id, priority) for b, priority in pool.priorities.items())),
        tuple(
            PinExport(pin.pin_id, pin.request_id, pin.ttl_ms, tuple([b.block_id for b in pin.blocks]))
            for pin in pins.pins.values()
        ),
        pins.next_pin_id - 1,
        pins.num_unpinned_blocks,
        _frequency_classes(pool),
        tuple(pool.seen.items()),
        tuple(manager.expectations.by_request.items()),
    )


def _frequency_classes(pool: BlockPool) -> tuple[tuple[int, int], ...]:
    if not pool.by_frequency:
        return ()
    keys = pool.segment_keys.items()
    return tuple(sorted((b.block_id, key % FREQUENCY_CLASSES) for b, key in keys if key % FREQUENCY_CLASSES))


def _export_host_tier(host_tier: HostTier) -> HostTierState:
    assert not host_tier.offloads and not host_tier.onloads, "a state is exported between steps"
    return HostTierState(
        array("i", host_tier.free_queue),
        *host_tier.index.columns(),
        tuple(
            (step_id, is_onload, copy.device_block_id, copy.host_block_id, block_hash)
            for step_id, _, block_hash, copy, is_onload in host_tier.pending
        ),
        host_tier.num_offloaded_blocks,
        host_tier.num_onloaded_blocks,
        host_tier.num_evictions,
        host_tier.num_dropped_offloads,
        host_tier.num_hit_tokens,
    )


def restore_state(manager: KVCacheManager, state: CoreState) -> None:
    """Make the fresh `manager` (no step taken) hold `state`, then check the core's invariants.

    Reference counts and copy retentions are recomputed from the tables and
    copies, so a state whose parts disagree (a free block that a table holds,
    a block id outside the pool) raises ValueError and is never served.
    """
    if manager.last_step_id or manager.requests:
        raise ValueError("a state is restored into a fresh core")
    if (state.host_tier is None) != (manager.host_tier is None):
        raise ValueError(
            f"the state {'has' if state.host_tier is not None else 'has no'} host tier, but the core's config "
            f"has num_host_blocks {manager.config.num_host_blocks}"
        )
    pool = manager.pool
    block = _block_by_id(pool.blocks, "block", "the pool")
    pool.free_queue = _fresh_free_queue(pool.blocks, state.free_block_ids, block)
    for group_id, block_hash, block_id in state.cached:
        b = block(block_id)
        b.block_hash, b.group_id = block_hash, group_id
        entries = pool.cached[group_id]
        entry = entries.get(block_hash)
        if entry is None:
            entries[block_hash] = b
        elif type(entry) is KVCacheBlock:
            entries[block_hash] = {entry.block_id: entry, block_id: b}
        else:
            entry[block_id] = b
    for r in state.requests:
        tables = [[block(block_id) for block_id in ids] for ids in r.block_ids]
        for table in tables:
            for b in table:
                if not b.is_null:
                    b.ref_cnt += 1
        manager.requests[r.request_id] = RequestState(
            r.request_id,
            r.num_tokens,
            r.num_computed_tokens,
            r.num_encoder_tokens,
            r.extras if not r.extras.is_empty() else NO_EXTRAS,
            list(r.block_hashes),
            list(r.tail_token_ids),
            tables,
            list(r.num_cached_blocks),
            r.retention,
        )
        if r.lost_cause is not None:
            manager.lost[r.request_id] = r.lost_cause
    manager.kv_losses.restore(state.kv_losses)
    retained = manager._retained
    for step_id, src_id, dst_id in state.pending_copies:
        src, dst = block(src_id), block(dst_id)
        for b in (src, dst):
            b.ref_cnt += 1
            retained[b] = retained.get(b, 0) + 1
        manager._pending_copies.append((step_id, src, dst))
    for block_id, priority in state.block_priorities:
        pool.priorities[block(block_id)] = priority
    live_and_expected = [request_id for request_id, _ in state.expected if request_id in manager.requests]
    if live_and_expected:
        raise ValueError(f"the state's requests {live_and_expected[:4]} are both live and expected")
    manager.expectations.restore(state.expected)  # before the segments: their rank keys count `wanted`
    if pool.by_frequency:
        classes = {block(block_id): frequency_class for block_id, frequency_class in state.frequency_classes}
        if any(not 0 < frequency_class < FREQUENCY_CLASSES for frequency_class in classes.values()):
            raise ValueError(f"the state's frequency classes must lie in 1..{FREQUENCY_CLASSES - 1}")
        pool.restore_segments(classes)
        if len(state.seen) > pool.history_size:
            raise ValueError(
                f"the state's frequency history holds {len(state.seen)} hashes; this pool's holds {pool.history_size}"
            )
        pool.seen = OrderedDict(state.seen)
    else:
        pool.restore_segments()
    _restore_pins(manager, state, block)
    manager.last_step_id = state.last_step_id
    manager.prefix_cache_queries = state.prefix_cache_queries
    manager.prefix_cache_hits = state.prefix_cache_hits
    pool.num_evictions = state.num_evictions
    if state.host_tier is not None:
        _restore_host_tier(manager.host_tier, state.host_tier, state.last_step_id)
    try:
        check_invariants(manager)
    except AssertionError as error:
        raise ValueError(f"the state is inconsistent: {error}") from None


def _restore_pins(manager: KVCacheManager, state: CoreState, block: Callable[[int], KVCacheBlock]) -> None:
    """Rebuild the pins and their references; the caller checks the invariants after."""
    pins = manager.pins
    for p in state.pins:
        blocks = [block(block_id) for block_id in p.block_ids]
        for b in blocks:
            b.ref_cnt += 1
            pins.counts[b] = pins.counts.get(b, 0) + 1
        pins.pins[p.pin_id] = Pin(p.pin_id, p.request_id, p.ttl_ms, blocks)
    pins.next_pin_id = state.num_pins_made + 1
    pins.num_unpinned_blocks = state.num_unpinned_blocks


def _restore_host_tier(host_tier: HostTier, state: HostTierState, last_step_id: int) -> None:
    """Make the fresh `host_tier` hold `state`; the caller checks the invariants after."""
    index = host_tier.index
    host_block_id = _check_id(host_tier.num_blocks, "host block", "the host tier")
    host_tier.free_queue = IdQueue.of(host_tier.num_blocks, map(host_block_id, state.free_host_block_ids))
    w = index.hash_num_bytes
    num_cached = len(state.cached_host_block_ids)
    if not (len(state.cached_group_ids) == num_cached and len(state.cached_block_hashes) == num_cached * w):
        raise ValueError(f"the host index's columns disagree: {num_cached} cached blocks of {w}-byte hashes")
    hashes = state.cached_block_hashes
    for i, (group_id, block_id) in enumerate(zip(state.cached_group_ids, state.cached_host_block_ids)):
        if not 0 <= group_id < index.num_groups:
            raise ValueError(f"host index group id {group_id} is outside the {index.num_groups} groups")
        block_hash = BlockHash(hashes[i * w : i * w + w])
        if index.group_id(host_block_id(block_id)) != EMPTY or index.get(group_id, block_hash) != EMPTY:
            raise ValueError(f"host block {block_id} or its hash is twice in the host index")
        index.insert(block_id, group_id, block_hash)
    for step_id, is_onload, device_block_id, block_id, block_hash in state.pending:
        host_tier.ref_cnts[host_block_id(block_id)] += 1
        host_tier.pending.append((step_id, block_id, block_hash, TierCopy(device_block_id, block_id), is_onload))
    host_tier.step_id = last_step_id
    host_tier.num_offloaded_blocks = state.num_offloaded_blocks
    host_tier.num_onloaded_blocks = state.num_onloaded_blocks
    host_tier.num_evictions = state.num_evictions
    host_tier.num_dropped_offloads = state.num_dropped_offloads
    host_tier.num_hit_tokens = state.num_hit_tokens


def _check_id(num_ids: int, noun: str, where: str) -> Callable[[int], int]:
    """`block_id` itself, or ValueError naming the id and the range of `where`."""

    def check(block_id: int) -> int:
        if not 0 <= block_id < num_ids:
            raise ValueError(f"{noun} id {block_id} is outside {where} of {num_ids} blocks")
        return block_id

    return check


def _block_by_id(blocks: Sequence[KVCacheBlock], noun: str, where: str) -> Callable[[int], KVCacheBlock]:
    """`blocks[block_id]`, or ValueError naming the id and the range of `where`."""

    def block(block_id: int) -> KVCacheBlock:
        if not 0 <= block_id < len(blocks):
            raise ValueError(f"{noun} id {block_id} is outside {where} of {len(blocks)} blocks")
        return blocks[block_id]

    return block


def _fresh_free_queue(
    blocks: Sequence[KVCacheBlock], free_ids: Sequence[int], block: Callable[[int], KVCacheBlock]
) -> FreeBlockQueue:
    """A free queue of `free_ids` in that order, every block's old links cleared first."""
    for b in blocks:
        b.prev_free = b.next_free = None
    return FreeBlockQueue([block(block_id) for block_id in free_ids])
