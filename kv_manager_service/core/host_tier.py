"""The host-memory tier: a second prefix cache behind the device pool.

Policy: write-back on eviction. A cached block travels to the host only when
the device pool evicts it (its hash leaves the device index so the block can
be reused), and only if the host does not hold that hash already. The
alternative, write-through (vLLM's offloading connector), copies every newly
cached full block to the host at once. Write-back moves only the blocks that
actually fall out of the device pool: a block still on the device when it is
hit again, or never evicted, costs no copy. How much that saves depends on
the device pool's share of the working set: on the Mooncake trace (3,993
requests) with a 100,000-block device pool nearly every block is evicted
sooner or later, and write-back copies 1.54 M blocks against write-through's
1.57 M (bench/tier_replay.py, which counts write-through's copies from the
same run's stores). Write-through's
advantage is timing: its copies can overlap the forward pass of the step
that computed the block, while a write-back copy must finish before its
device block is overwritten, in the step that evicts it (see the order
below). A host copy is kept when its block is onloaded back, so the device
evicting that block again needs no new copy.

The order in which a worker applies one step's copies, then runs it:

1. offloads, device -> host;
2. onloads, host -> device;
3. copy-on-write copies, device -> device;
4. the forward pass.

Why this is safe: a device block evicted in a step is reused in that same
step (that is why it was evicted), possibly as an onload or copy-on-write
destination, or written by the forward pass. Offloads go first, so they read
its old content before anything overwrites it. An offload's source was
computed in an earlier step (a block cached in a step is held by its request
for the whole step, so it cannot be evicted in it), and workers apply steps
in order, so that content exists. Onloads read host blocks that no offload of
the same step writes, except a host block that an earlier op of the step
filled by offload, which step 1 has already written. Copy-on-write copies
and the forward pass come after both, so whatever they write into a reused
block is written after the offloads have read it and the onloads have filled
their (fresh, distinct) destinations.

Pins: the host block an offload writes and the host block an onload reads
keep one reference (`ref_cnt`) per pending copy until the step that carried
the copy is acknowledged, like copy-on-write retentions on the device; a
pinned host block is never in the free queue, so it is never evicted or
rewritten under a copy in flight. The device end of a tier copy is not
retained: an offload's source is already the evicting request's block, and
an onload's destination is the admitted request's block.

Events: the host index changes only inside `offload` (a hash indexed, and
the hash of the host block it reuses evicted), so that is where the host
tier's BlockStored / BlockRemoved (tier HOST) are queued, into the device
pool's event list so that both tiers' events keep one commit order. A reset
is the pool's AllBlocksCleared, which covers both tiers.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from kv_manager_service.core.block_queue import FreeBlockQueue, KVCacheBlock
from kv_manager_service.shared.events import BlockRemoved, BlockStored, KVEvent, Tier
from kv_manager_service.core.hashing import BlockHash
from kv_manager_service.shared.ops import PendingTierCopy, TierCopy


class HostBlock(KVCacheBlock):
    """One block of host memory, id 0..num_host_blocks-1 (the host tier has no null block).

    A distinct type so that a cache hit, which may mix tiers, says where each
    block lives. `ref_cnt` counts the pending tier copies that pin it.
    """

    __slots__ = ()


class HostTier:
    """The host pool: its blocks, pins, LRU free queue and hash index of each group.

    It reuses the device pool's pieces: `KVCacheBlock` (as `HostBlock`) and
    `FreeBlockQueue`, with the same lazy eviction (a free host block stays
    findable until it is popped for reuse). Unlike the device map, the host
    index de-duplicates: a hash names at most one host block, because an
    offload is skipped when the hash is already on the host.

    The manager sets `step_id` when a step starts and drains the step's copies
    with `take_step_copies` when it ends; the device pool calls `offload`
    from its eviction path.
    """

    def __init__(self, num_blocks: int, num_groups: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1 for a host tier, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [HostBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: list[dict[BlockHash, HostBlock]] = [{} for _ in range(num_groups)]
        self.step_id = 0
        # The copies of the running step, in op order.
        self.offloads: list[TierCopy] = []
        self.onloads: list[TierCopy] = []
        # Copies not yet acknowledged, in step order, each pinning its host block:
        # (step id, host block, the hash it was pinned under, the copy, is an onload).
        self.pending: deque[tuple[int, HostBlock, BlockHash, TierCopy, bool]] = deque()
        self.num_offloaded_blocks = 0
        self.num_onloaded_blocks = 0
        self.num_evictions = 0
        self.num_dropped_offloads = 0
        self.num_hit_tokens = 0

    # -- the device pool's eviction path ------------------------------------------

    def offload(self, device_block: KVCacheBlock, events: list[KVEvent] | None = None) -> None:
        """Keep the cached `device_block`, about to lose its hash, on the host.

        If the host holds its hash already, that copy becomes the host's most
        recently used block and nothing is copied. Otherwise the host's least
        recently used free block is taken (evicting its hash), indexed under
        the hash, pinned, and an offload copy is queued for the running step.
        With every host block pinned, the block is dropped (counted).

        With `events`, the host index's changes are appended to it: the
        evicted hash's HOST BlockRemoved, then the new hash's HOST BlockStored.
        """
        block_hash, group_id = device_block.block_hash, device_block.group_id
        cached = self.cached[group_id]
        host_block = cached.get(block_hash)
        if host_block is not None:
            if host_block.ref_cnt == 0:
                self.free_queue.remove(host_block)
                self.free_queue.append_n([host_block])
            return
        if self.free_queue.num_free_blocks == 0:
            self.num_dropped_offloads += 1
            return
        host_block = self.free_queue.popleft()
        if host_block.block_hash is not None:
            if events is not None:
                events.append(BlockRemoved(host_block.group_id, (host_block.block_hash,), Tier.HOST))
            self._evict(host_block)
        host_block.block_hash = block_hash
        host_block.group_id = group_id
        cached[block_hash] = host_block
        if events is not None:
            events.append(BlockStored(group_id, (block_hash,), None, 0, Tier.HOST))
        copy = TierCopy(device_block.block_id, host_block.block_id)
        self._pin(host_block, block_hash, copy, is_onload=False)
        self.offloads.append(copy)
        self.num_offloaded_blocks += 1

    # -- the manager's calls --------------------------------------------------------

    def pin_for_onload(self, host_block: HostBlock) -> None:
        """Take a reference on a hit host block before any device block is popped.

        Popping device blocks may offload and so evict host blocks; a pinned
        one is out of the free queue and safe. `record_onload` names the copy.
        """
        if host_block.ref_cnt == 0:
            self.free_queue.remove(host_block)
        host_block.ref_cnt += 1

    def record_onload(self, host_block: HostBlock, device_block: KVCacheBlock) -> None:
        """Queue host -> device for the running step; the pin taken by `pin_for_onload` is now the copy's."""
        copy = TierCopy(device_block.block_id, host_block.block_id)
        self.pending.append((self.step_id, host_block, host_block.block_hash, copy, True))
        self.onloads.append(copy)
        self.num_onloaded_blocks += 1

    def take_step_copies(self) -> tuple[tuple[TierCopy, ...], tuple[TierCopy, ...]]:
        """The running step's offloads and onloads, in op order; clears them."""
        offloads, onloads = tuple(self.offloads), tuple(self.onloads)
        self.offloads.clear()
        self.onloads.clear()
        return offloads, onloads

    def release(self, step_id: int) -> int:
        """Unpin the host blocks of every copy of steps up to `step_id`; returns how many copies.

        A block left with no pin goes back to the free queue: at the tail
        (most recently used) if it is still cached, at the head if a reset
        took its hash.
        """
        pending = self.pending
        num_released = 0
        while pending and pending[0][0] <= step_id:
            host_block = pending.popleft()[1]
            host_block.ref_cnt -= 1
            if host_block.ref_cnt == 0:
                if host_block.block_hash is None:
                    self.free_queue.prepend_n([host_block])
                else:
                    self.free_queue.append_n([host_block])
            num_released += 1
        return num_released

    def cached_block_keys(self) -> set[tuple[int, BlockHash]]:
        """Every (group id, block hash) the host index holds; free cached blocks included."""
        return {(group_id, block_hash) for group_id, cached in enumerate(self.cached) for block_hash in cached}

    def pending_copies(self) -> list[PendingTierCopy]:
        return [PendingTierCopy(step_id, is_onload, copy) for step_id, _, _, copy, is_onload in self.pending]

    def reset(self) -> None:
        """Forget every host hash. Pinned blocks stay pinned until their copies are acknowledged."""
        for block in self.blocks:
            block.block_hash = None
            block.group_id = -1
        for cached in self.cached:
            cached.clear()

    def uncache(self, host_blocks: Iterable[HostBlock], events: list[KVEvent] | None = None) -> int:
        """Take the hashed ones of `host_blocks` out of the host index (their KV is not what the hash
        names); returns how many. Pinned ones stay pinned until acknowledged. With `events`, one HOST
        BlockRemoved per group is appended to it."""
        removed: dict[int, list[BlockHash]] = {}
        for host_block in host_blocks:
            if host_block.block_hash is not None:
                removed.setdefault(host_block.group_id, []).append(host_block.block_hash)
                self._unindex(host_block)
        if events is not None:
            events += [BlockRemoved(group_id, tuple(hashes), Tier.HOST) for group_id, hashes in removed.items()]
        return sum(len(hashes) for hashes in removed.values())

    # -- internals --------------------------------------------------------------------

    def _pin(self, host_block: HostBlock, block_hash: BlockHash, copy: TierCopy, is_onload: bool) -> None:
        host_block.ref_cnt += 1
        self.pending.append((self.step_id, host_block, block_hash, copy, is_onload))

    def _evict(self, host_block: HostBlock) -> None:
        self._unindex(host_block)
        self.num_evictions += 1

    def _unindex(self, host_block: HostBlock) -> None:
        """Take the hashed `host_block` out of its group's index; it loses its hash."""
        del self.cached[host_block.group_id][host_block.block_hash]
        host_block.block_hash = None
        host_block.group_id = -1
