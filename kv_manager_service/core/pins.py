"""Retention pins: a freed request's cached blocks kept out of the free queue until the pin expires.

A request admitted with `Retention.ttl_ms` > 0 is pinned when it is freed:
its cached blocks, in token order, each take one more reference, held by the
pin, so they stay cached and cannot be evicted. The core keeps no clock: the
pin carries its TTL as data, and the server, which owns the clock, releases
it (`KVCacheManager.expire_pins`, journaled) once the TTL has passed. Pin ids
count up from 1 in the order pins are made, so a replay of the same
operations makes the same ids.

The quota (`KVCacheConfig.max_pinned_blocks`) bounds the distinct blocks all
pins hold together; a block several pins hold counts once. A pin takes the
request's blocks in token order while the quota has room (blocks already
pinned cost none) and stops at the first one it has no room for: a later
block is no use without the ones before it. The blocks it could not take are
counted (`num_unpinned_blocks`).

Invariants (checked by `invariants.check_retention_invariants`): each pinned
block is cached and holds one reference per pin naming it; `counts` holds
exactly those references; len(counts) <= max_pinned_blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.shared.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kv_manager_service.core.block_pool import BlockPool
    from kv_manager_service.core.groups.base import GroupManager
    from kv_manager_service.core.request import RequestState


class Pin:
    """One request's pinned blocks, in token order, and how long it was asked to hold them."""

    __slots__ = ("pin_id", "request_id", "ttl_ms", "blocks")

    def __init__(self, pin_id: int, request_id: str, ttl_ms: int, blocks: list[KVCacheBlock]) -> None:
        self.pin_id = pin_id
        self.request_id = request_id
        self.ttl_ms = ttl_ms
        self.blocks = blocks


class Pins:
    """The live pins of one pool, their quota, and the pins made since the server last took them."""

    def __init__(self, pool: BlockPool, max_pinned_blocks: int) -> None:
        self.pool = pool
        self.max_pinned_blocks = max_pinned_blocks
        self.pins: dict[int, Pin] = {}  # by id, oldest first
        self.counts: dict[KVCacheBlock, int] = {}  # pinned block -> the pins holding it
        self.next_pin_id = 1
        self.num_unpinned_blocks = 0
        self.new: list[Pin] = []  # made since `take_new`

    def pin(self, request: RequestState, managers: Sequence[GroupManager]) -> Pin | None:
        """Pin the cached blocks of `request`, about to be freed, as its retention asks, within the quota.

        Returns the pin, or None when it takes no block (nothing cached, or no room).
        """
        candidates = sorted(
            ((index + 1) * manager.block_size, manager.group_id, block)
            for manager, table in zip(managers, request.tables)
            for index, block in enumerate(table[: request.num_cached_blocks[manager.group_id]])
            if not block.is_null
        )
        counts = self.counts
        room = self.max_pinned_blocks - len(counts)
        taken: list[KVCacheBlock] = []
        for _, _, block in candidates:
            if block not in counts:
                if not room:
                    self.num_unpinned_blocks += sum(1 for _, _, b in candidates[len(taken) :] if b not in counts)
                    break
                room -= 1
            taken.append(block)
            counts[block] = counts.get(block, 0) + 1
            block.ref_cnt += 1
        if not taken:
            return None
        pin = Pin(self.next_pin_id, request.request_id, request.retention.ttl_ms, taken)
        self.next_pin_id += 1
        self.pins[pin.pin_id] = pin
        self.new.append(pin)
        return pin

    def expire(self, pin_ids: Sequence[int]) -> int:
        """Release the pins `pin_ids`, in order; returns how many blocks went back to the free queue.

        Validated whole first: InvalidArgumentError (field pin_ids), nothing
        changed, for an id that names no live pin or appears twice.
        """
        seen = set()
        for pin_id in pin_ids:
            if pin_id not in self.pins or pin_id in seen:
                raise InvalidArgumentError(f"pin id {pin_id!r} names no live pin (or appears twice)", "pin_ids")
            seen.add(pin_id)
        return sum(self._release(self.pins.pop(pin_id)) for pin_id in pin_ids)

    def release_all(self) -> None:
        """Release every pin, oldest first (the cache is being emptied)."""
        pins, self.pins = self.pins, {}
        for pin in pins.values():
            self._release(pin)

    def drop_uncached(self) -> None:
        """Blocks left the prefix cache (an invalidation): each pin lets go of those it held; a pin left
        with no block is gone."""
        for pin_id, pin in list(self.pins.items()):
            uncached = [block for block in pin.blocks if block.block_hash is None]
            if uncached:
                pin.blocks = [block for block in pin.blocks if block.block_hash is not None]
                self._release_blocks(uncached)
                if not pin.blocks:
                    del self.pins[pin_id]

    def take_new(self) -> list[tuple[int, int]]:
        """(pin id, ttl ms) of each pin made since the last call that is still live, oldest first."""
        new, self.new = self.new, []
        return [(pin.pin_id, pin.ttl_ms) for pin in new if pin.pin_id in self.pins]

    def _release(self, pin: Pin) -> int:
        return self._release_blocks(pin.blocks)

    def _release_blocks(self, blocks: list[KVCacheBlock]) -> int:
        """Drop one pin reference on each of `blocks` (token order): the last is evicted first, as when
        a request frees its table."""
        counts = self.counts
        for block in blocks:
            count = counts[block] - 1
            if count:
                counts[block] = count
            else:
                del counts[block]
        return self.pool.free_blocks(reversed(blocks))
