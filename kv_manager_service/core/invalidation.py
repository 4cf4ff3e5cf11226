"""Rollback of optimistic caching: KV the manager counted as computed that the workers do not hold.

A block enters the prefix cache when its tokens are scheduled, before any
worker computes them, exactly as in vLLM: a request admitted in the next step
(or later in the same one) may hit it. That is right only if the step that
fills it runs, on memory that still exists. When a worker or a scheduler says
otherwise, this module takes the blocks out of the cache on both tiers and
marks lost every live request that holds one of them where it has counted
tokens as computed: such a request would read KV that is not there.

Invariant kept here (and checked by `invariants.check_invariants`): a lost
request is live, and stays lost until it is freed; every op on it answers
`KV_LOST` and changes nothing. Its blocks stay in its tables, so reference
counts are untouched; `num_cached_blocks` is cut to the first block that is no
longer cached, so the cached prefix of every table is still cached. A
retention pin lets go of the blocks that left the cache (pins.py), so a pin
holds cached blocks only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.shared.events import AllBlocksCleared
from kv_manager_service.shared.ops import Invalidation, KVLossCause, KVLossCount
from kv_manager_service.core.request import RequestState
from kv_manager_service.shared.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kv_manager_service.core.manager import KVCacheManager


class KVLosses:
    """Per cause, what invalidations have done since the start: the figures GetStats shows."""

    def __init__(self) -> None:
        self._counts: dict[KVLossCause, list[int]] = {}

    def add(self, cause: KVLossCause, num_blocks: int, num_host_blocks: int, num_requests: int) -> None:
        if not (num_blocks or num_host_blocks or num_requests):
            return
        counts = self._counts.setdefault(cause, [0, 0, 0])
        counts[0] += num_blocks
        counts[1] += num_host_blocks
        counts[2] += num_requests

    def counts(self) -> tuple[KVLossCount, ...]:
        """One entry per cause that has invalidated anything, in cause order."""
        return tuple(KVLossCount(cause, *self._counts[cause]) for cause in sorted(self._counts))

    def restore(self, counts: Iterable[KVLossCount]) -> None:
        self._counts = {
            KVLossCause(c.cause): [c.num_uncached_blocks, c.num_uncached_host_blocks, c.num_lost_requests]
            for c in counts
        }


def invalidate_blocks(
    manager: KVCacheManager,
    device_block_ids: Sequence[int],
    host_block_ids: Sequence[int],
    request_ids: Sequence[str],
    cause: KVLossCause,
) -> Invalidation:
    """A worker does not hold these blocks filled, nor the KV of these requests.

    The blocks leave the prefix cache (device and host); the named requests
    that are live, and every live request holding a named device block where
    it counts tokens as computed, become lost. Ids of freed requests are
    ignored (their free came first). Validated whole first:
    InvalidArgumentError naming the field, nothing changed, for a block id
    outside the pool or the host tier.
    """
    pool = manager.pool
    _check_ids(device_block_ids, pool.num_blocks, "device_block_ids")
    host_tier = manager.host_tier
    _check_ids(host_block_ids, host_tier.num_blocks if host_tier is not None else 0, "host_block_ids")
    blocks = {pool.blocks[block_id] for block_id in device_block_ids if block_id}
    num_blocks = pool.uncache(blocks)
    if num_blocks and manager.pins.pins:
        manager.pins.drop_uncached()
    num_host_blocks = 0
    if host_tier is not None and host_block_ids:
        events = pool.events if pool.enable_events else None
        num_host_blocks = host_tier.uncache(host_block_ids, events)
    lost = [manager.requests[r] for r in dict.fromkeys(request_ids) if r in manager.requests]
    if blocks:
        lost += [r for r in manager.requests.values() if _reads_any(r, blocks, manager)]
    return _finish(manager, cause, num_blocks, num_host_blocks, lost)


def invalidate_all(manager: KVCacheManager, cause: KVLossCause) -> Invalidation:
    """No worker memory holds anything: empty the prefix cache on both tiers, and every live request
    with computed tokens becomes lost. Pinned host blocks stay pinned until acknowledged."""
    pool = manager.pool
    num_blocks = pool.clear_cache()
    manager.pins.release_all()
    num_host_blocks = 0
    host_tier = manager.host_tier
    if host_tier is not None:
        num_host_blocks = host_tier.num_cached_blocks
        host_tier.reset()
    if (num_blocks or num_host_blocks) and pool.enable_events:
        pool.events.append(AllBlocksCleared())
    lost = [r for r in manager.requests.values() if r.num_computed_tokens]
    return _finish(manager, cause, num_blocks, num_host_blocks, lost)


def uncache_past(manager: KVCacheManager, request: RequestState, num_computed_tokens: int) -> Invalidation:
    """A scheduler computed only the first `num_computed_tokens` of `request` (freed next, in the same
    step): its blocks that reach past them leave the cache, and the other live requests that hold one
    where they count tokens as computed become lost."""
    blocks = set()
    for group, table in zip(manager.managers, request.tables):
        blocks.update(block for block in table[num_computed_tokens // group.block_size :] if not block.is_null)
    num_blocks = manager.pool.uncache(blocks)
    if num_blocks and manager.pins.pins:
        manager.pins.drop_uncached()
    lost = [r for r in manager.requests.values() if r is not request and _reads_any(r, blocks, manager)]
    return _finish(manager, KVLossCause.NOT_COMPUTED, num_blocks, 0, lost)


def _reads_any(request: RequestState, blocks: set[KVCacheBlock], manager: KVCacheManager) -> bool:
    """Whether `request` counts as computed a token that lives in one of `blocks`."""
    num_computed = request.num_computed_tokens
    for group, table in zip(manager.managers, request.tables):
        last = min(len(table), -(-num_computed // group.block_size))
        for index in range(last):
            if table[index] in blocks:
                return True
    return False


def _finish(
    manager: KVCacheManager, cause: KVLossCause, num_blocks: int, num_host_blocks: int, lost: list[RequestState]
) -> Invalidation:
    """Mark `lost` lost (those not yet), cut every table's cached count to what is still cached, and count."""
    newly_lost = []
    for request in lost:
        if request.request_id not in manager.lost:
            manager.lost[request.request_id] = cause
            newly_lost.append(request.request_id)
    if num_blocks:
        for request in manager.requests.values():
            _cut_cached_count(request)
    manager.kv_losses.add(cause, num_blocks, num_host_blocks, len(newly_lost))
    return Invalidation(num_blocks, num_host_blocks, tuple(newly_lost))


def _cut_cached_count(request: RequestState) -> None:
    for group_id, table in enumerate(request.tables):
        num_cached = request.num_cached_blocks[group_id]
        for index in range(num_cached):
            block = table[index]
            if block.block_hash is None and not block.is_null:
                request.num_cached_blocks[group_id] = index
                break


def _check_ids(ids: Sequence[int], limit: int, field: str) -> None:
    for index, block_id in enumerate(ids):
        if not isinstance(block_id, int) or not 0 <= block_id < limit:
            raise InvalidArgumentError(f"{field}[{index}] is {block_id!r}; the pool's ids are 0..{limit - 1}", field)
