"""The host tier over flat arrays against a plain reference model of its documented semantics.

The model keeps a list for the LRU free queue and dicts for the index and the
pins, as the tier did with one object per block. Random offloads (hits,
misses, drops), onload pins, acknowledgements, resets and invalidations must
leave both with the same free-queue order, index, pins, pending copies,
counters and events. A last test bounds the tier's bytes per block.
"""

from __future__ import annotations

import hashlib
import sys
from collections import deque

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.host_index import EMPTY
from kv_manager_service.core.host_tier import HostBlock, HostTier
from kv_manager_service.shared.events import BlockRemoved, BlockStored, KVEvent, Tier
from kv_manager_service.shared.ops import PendingTierCopy, TierCopy

HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(16)]
NUM_GROUPS = 2


class ReferenceTier:
    """The host tier's semantics, written plainly: see host_tier.py's docstrings."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))  # head (reused first) to tail
        self.key_of: dict[int, tuple[int, bytes]] = {}
        self.ref_cnts = [0] * num_blocks
        self.pending: deque[tuple[int, int, bytes, TierCopy, bool]] = deque()
        self.offloads: list[TierCopy] = []
        self.onloads: list[TierCopy] = []
        self.counts = {"offloaded": 0, "onloaded": 0, "evictions": 0, "dropped": 0}

    def block_of(self, group_id: int, block_hash: bytes) -> int | None:
        return next((b for b, key in self.key_of.items() if key == (group_id, block_hash)), None)

    def offload(self, step_id: int, device_block_id: int, group_id: int, block_hash: bytes, events: list) -> None:
        block_id = self.block_of(group_id, block_hash)
        if block_id is not None:
            if self.ref_cnts[block_id] == 0:
                self.free.remove(block_id)
                self.free.append(block_id)
            return
        if not self.free:
            self.counts["dropped"] += 1
            return
        block_id = self.free.pop(0)
        if block_id in self.key_of:
            evicted_group, evicted_hash = self.key_of.pop(block_id)
            events.append(BlockRemoved(evicted_group, (evicted_hash,), Tier.HOST))
            self.counts["evictions"] += 1
        self.key_of[block_id] = (group_id, block_hash)
        events.append(BlockStored(group_id, (block_hash,), None, 0, Tier.HOST))
        copy = TierCopy(device_block_id, block_id)
        self.ref_cnts[block_id] += 1
        self.pending.append((step_id, block_id, block_hash, copy, False))
        self.offloads.append(copy)
        self.counts["offloaded"] += 1

    def onload(self, step_id: int, block_id: int, device_block_id: int) -> None:
        if self.ref_cnts[block_id] == 0:
            self.free.remove(block_id)
        self.ref_cnts[block_id] += 1
        copy = TierCopy(device_block_id, block_id)
        self.pending.append((step_id, block_id, self.key_of[block_id][1], copy, True))
        self.onloads.append(copy)
        self.counts["onloaded"] += 1

    def release(self, step_id: int) -> None:
        while self.pending and self.pending[0][0] <= step_id:
            block_id = self.pending.popleft()[1]
            self.ref_cnts[block_id] -= 1
            if self.ref_cnts[block_id] == 0:
                if block_id in self.key_of:
                    self.free.append(block_id)
                else:
                    self.free.insert(0, block_id)

    def uncache(self, block_ids: list[int], events: list) -> int:
        removed: dict[int, list[bytes]] = {}
        for block_id in block_ids:
            if block_id in self.key_of:
                group_id, block_hash = self.key_of.pop(block_id)
                removed.setdefault(group_id, []).append(block_hash)
        events += [BlockRemoved(group_id, tuple(hashes), Tier.HOST) for group_id, hashes in removed.items()]
        return sum(map(len, removed.values()))


class HostTierModelMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 8))
    def start(self, num_blocks: int) -> None:
        self.tier = HostTier(num_blocks, NUM_GROUPS, 32)
        self.model = ReferenceTier(num_blocks)
        self.step_id = 1
        self.tier.step_id = self.step_id
        self.next_device_block_id = 1

    def device_block(self, group_id: int, block_hash: bytes) -> KVCacheBlock:
        block = KVCacheBlock(self.next_device_block_id)
        self.next_device_block_id += 1
        block.block_hash, block.group_id = block_hash, group_id
        return block

    @rule(group_id=st.integers(0, NUM_GROUPS - 1), hash_index=st.integers(0, len(HASHES) - 1), events=st.booleans())
    def offload(self, group_id: int, hash_index: int, events: bool) -> None:
        block = self.device_block(group_id, HASHES[hash_index])
        got: list[KVEvent] = []
        expected: list[KVEvent] = []
        self.tier.offload(block, got if events else None)
        self.model.offload(self.step_id, block.block_id, group_id, HASHES[hash_index], expected)
        assert got == (expected if events else [])

    @rule(data=st.data())
    @precondition(lambda self: self.model.key_of)
    def onload(self, data: st.DataObject) -> None:
        group_id, block_hash = data.draw(st.sampled_from(sorted(self.model.key_of.values())))
        hit = self.tier.find(group_id, block_hash)
        assert hit == HostBlock(self.model.block_of(group_id, block_hash), block_hash)
        device_block = self.device_block(group_id, block_hash)
        self.tier.pin_for_onload(hit)
        self.tier.record_onload(hit, device_block)
        self.model.onload(self.step_id, hit.block_id, device_block.block_id)

    @rule()
    def end_step(self) -> None:
        offloads, onloads = self.tier.take_step_copies()
        assert (list(offloads), list(onloads)) == (self.model.offloads, self.model.onloads)
        self.model.offloads.clear()
        self.model.onloads.clear()
        self.step_id += 1
        self.tier.step_id = self.step_id

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        step_id = data.draw(st.integers(0, self.step_id))
        self.tier.release(step_id)
        self.model.release(step_id)

    @rule()
    def reset(self) -> None:
        self.tier.reset()
        self.model.key_of.clear()

    @rule(data=st.data())
    def uncache(self, data: st.DataObject) -> None:
        block_ids = data.draw(st.lists(st.integers(0, self.tier.num_blocks - 1), max_size=4))
        got: list[KVEvent] = []
        expected: list[KVEvent] = []
        assert self.tier.uncache(block_ids, got) == self.model.uncache(block_ids, expected)
        assert got == expected

    @invariant()
    def agrees_with_the_model(self) -> None:
        tier, model = self.tier, self.model
        assert list(tier.free_queue) == model.free and tier.free_queue.num_free == len(model.free)
        assert tier.ref_cnts.tolist() == model.ref_cnts
        assert [(b, g, h) for g, h, b in tier.index.items()] == sorted((b, *key) for b, key in model.key_of.items())
        for group_id in range(NUM_GROUPS):
            for block_hash in HASHES:
                expected = model.block_of(group_id, block_hash)
                assert tier.index.get(group_id, block_hash) == (EMPTY if expected is None else expected)
        assert list(tier.pending) == list(model.pending)
        assert tier.pending_copies() == [PendingTierCopy(s, onload, c) for s, _, _, c, onload in model.pending]
        counts = (tier.num_offloaded_blocks, tier.num_onloaded_blocks, tier.num_evictions, tier.num_dropped_offloads)
        assert counts == tuple(model.counts.values())
        assert sorted(tier.cached_block_keys()) == sorted(model.key_of.values())
        in_table = sorted(b for b in tier.index.slots() if b != EMPTY)
        assert in_table == sorted(model.key_of) and tier.num_cached_blocks == len(model.key_of)


TestHostTierModelMachine = HostTierModelMachine.TestCase


def test_the_tier_costs_at_most_64_bytes_a_block_full_or_empty() -> None:
    """Counted from the arrays' own sizes (sys.getsizeof: headers and spare capacity included), before
    and after every block holds a hash: nothing grows with use."""
    num_blocks = 4096
    tier = HostTier(num_blocks, 1, 32)

    def num_bytes() -> int:
        index, queue = tier.index, tier.free_queue
        parts = (tier.ref_cnts, queue._next, queue._prev, index._hashes, index._group_ids, index._homes, index._table)
        return sum(map(sys.getsizeof, parts))

    empty = num_bytes()
    assert empty <= 64 * num_blocks and tier.nbytes <= empty
    for i in range(2 * num_blocks):  # every block hashed, half of them twice (evictions)
        block = KVCacheBlock(1)
        block.block_hash, block.group_id = hashlib.sha256(i.to_bytes(4, "little")).digest(), 0
        tier.offload(block)
        tier.release(i)
        tier.step_id = i + 1
    assert tier.num_cached_blocks == num_blocks and tier.num_evictions == num_blocks
    assert num_bytes() == empty, f"{num_bytes() / num_blocks:.1f} bytes per block once full"


def test_the_cached_keys_are_a_copy_that_can_be_read_twice() -> None:
    tier = HostTier(4, NUM_GROUPS, 32)
    for group_id, block_hash in ((1, HASHES[0]), (0, HASHES[1])):
        block = KVCacheBlock(1)
        block.block_hash, block.group_id = block_hash, group_id
        tier.offload(block)
    keys = tier.cached_block_keys()
    tier.reset()
    assert list(keys) == list(keys) == [(1, HASHES[0]), (0, HASHES[1])] and len(keys) == 2
    assert list(tier.cached_block_keys()) == []
