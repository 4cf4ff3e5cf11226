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

from array import array
from collections import deque
from typing import Iterable, NamedTuple, Sequence

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.host_index import EMPTY, HostIndex, HostKeys
from kv_manager_service.core.id_queue import IdQueue
from kv_manager_service.shared.events import BlockRemoved, BlockStored, KVEvent, Tier
from kv_manager_service.core.hashing import BlockHash
from kv_manager_service.shared.ops import PendingTierCopy, TierCopy


class HostBlock(NamedTuple):
    """A cache hit on the host: the host block holding `block_hash` when the hit was found.

    A value, not the block (the tier keeps no object per block): a distinct
    type so that a hit, which may mix tiers, says where each block lives.
    """

    block_id: int
    block_hash: BlockHash


class HostTier:
    """The host pool: its pins, LRU free queue and hash index, in flat arrays.

    Host blocks have ids 0..num_blocks-1 (no null block). Per block the tier
    holds a pin count (`ref_cnts`, int32: the pending tier copies that pin
    it), two free-queue links (`IdQueue`) and its hash and group
    (`HostIndex`): with sha256 hashes 4 + 8 + 46 = 58 bytes per block, and
    no per-block Python object, so a tier of 10^7 blocks starts at memory
    speed (bench/host_tier_memory.py). The semantics are the device pool's: the same LRU free queue
    order and lazy eviction (a free host block stays findable until it is
    popped for reuse). Unlike the device map, the host index de-duplicates:
    a hash names at most one host block, because an offload is skipped when
    the hash is already on the host.

    Invariant: a host block is in the free queue iff its ref_cnt is 0.

    The manager sets `step_id` when a step starts and drains the step's copies
    with `take_step_copies` when it ends; the device pool calls `offload`
    from its eviction path.
    """

    def __init__(self, num_blocks: int, num_groups: int, hash_num_bytes: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_host_blocks must be >= 1 for a host tier, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnts = array("i", bytes(4 * num_blocks))
        self.free_queue = IdQueue(num_blocks)
        self.index = HostIndex(num_blocks, num_groups, hash_num_bytes)
        self.step_id = 0
        # The copies of the running step, in op order.
        self.offloads: list[TierCopy] = []
        self.onloads: list[TierCopy] = []
        # Copies not yet acknowledged, in step order, each pinning its host block:
        # (step id, host block id, the hash it was pinned under, the copy, is an onload).
        self.pending: deque[tuple[int, int, BlockHash, TierCopy, bool]] = deque()
        self.num_offloaded_blocks = 0
        self.num_onloaded_blocks = 0
        self.num_evictions = 0
        self.num_dropped_offloads = 0
        self.num_hit_tokens = 0

    # -- queries ----------------------------------------------------------------------

    def find(self, group_id: int, block_hash: BlockHash) -> HostBlock | None:
        """The host block holding `block_hash` in group `group_id`, if any; changes nothing."""
        block_id = self.index.get(group_id, block_hash)
        return HostBlock(block_id, block_hash) if block_id != EMPTY else None

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self.index.block_hash(block_id)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.index)

    def cached_block_keys(self) -> HostKeys:
        """Every (group id, block hash) the host index holds, free cached blocks included: a compact copy."""
        group_ids, hashes, _ = self.index.columns()
        return HostKeys(group_ids, hashes, self.index.hash_num_bytes, self.index.num_blocks)

    def pending_copies(self) -> list[PendingTierCopy]:
        return [PendingTierCopy(step_id, is_onload, copy) for step_id, _, _, copy, is_onload in self.pending]

    @property
    def nbytes(self) -> int:
        """Bytes held by the tier's arrays (the pending copies of steps in flight aside)."""
        return len(self.ref_cnts) * self.ref_cnts.itemsize + self.free_queue.nbytes + self.index.nbytes

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
        index, free_queue = self.index, self.free_queue
        block_id = index.get(group_id, block_hash)
        if block_id != EMPTY:
            if self.ref_cnts[block_id] == 0:
                free_queue.remove(block_id)
                free_queue.append(block_id)
            return
        if free_queue.num_free == 0:
            self.num_dropped_offloads += 1
            return
        block_id = free_queue.popleft()
        evicted_group_id = index.group_id(block_id)
        if evicted_group_id != EMPTY:  # lazy eviction: the LRU block loses its hash only now
            if events is not None:
                events.append(BlockRemoved(evicted_group_id, (index.block_hash(block_id),), Tier.HOST))
            index.remove(block_id)
            self.num_evictions += 1
        index.insert(block_id, group_id, block_hash)
        if events is not None:
            events.append(BlockStored(group_id, (block_hash,), None, 0, Tier.HOST))
        copy = TierCopy(device_block.block_id, block_id)
        self.ref_cnts[block_id] += 1
        self.pending.append((self.step_id, block_id, block_hash, copy, False))
        self.offloads.append(copy)
        self.num_offloaded_blocks += 1

    def refresh(self, block_hashes: Sequence[BlockHash]) -> None:
        """Newly expected prompts hold `block_hashes` (in prompt order): their free host blocks become the most
        recently used, a prompt's first blocks last, so the host keeps what the queue will ask for."""
        index, free_queue, ref_cnts = self.index, self.free_queue, self.ref_cnts
        for block_hash in reversed(block_hashes):
            for group_id in range(index.num_groups):
                block_id = index.get(group_id, block_hash)
                if block_id != EMPTY and ref_cnts[block_id] == 0:
                    free_queue.remove(block_id)
                    free_queue.append(block_id)

    # -- the manager's calls --------------------------------------------------------

    def pin_for_onload(self, host_block: HostBlock) -> None:
        """Take a reference on a hit host block before any device block is popped.

        Popping device blocks may offload and so evict host blocks; a pinned
        one is out of the free queue and safe. `record_onload` names the copy.
        """
        block_id = host_block.block_id
        if self.ref_cnts[block_id] == 0:
            self.free_queue.remove(block_id)
        self.ref_cnts[block_id] += 1

    def record_onload(self, host_block: HostBlock, device_block: KVCacheBlock) -> None:
        """Queue host -> device for the running step; the pin taken by `pin_for_onload` is now the copy's."""
        copy = TierCopy(device_block.block_id, host_block.block_id)
        self.pending.append((self.step_id, host_block.block_id, host_block.block_hash, copy, True))
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
        pending, ref_cnts, index, free_queue = self.pending, self.ref_cnts, self.index, self.free_queue
        num_released = 0
        while pending and pending[0][0] <= step_id:
            block_id = pending.popleft()[1]
            ref_cnts[block_id] -= 1
            if ref_cnts[block_id] == 0:
                if index.group_id(block_id) == EMPTY:
                    free_queue.prepend(block_id)
                else:
                    free_queue.append(block_id)
            num_released += 1
        return num_released

    def reset(self) -> None:
        """Forget every host hash. Pinned blocks stay pinned until their copies are acknowledged."""
        self.index.clear()

    def uncache(self, host_block_ids: Iterable[int], events: list[KVEvent] | None = None) -> int:
        """Take the hashed ones of `host_block_ids` out of the host index (their KV is not what the hash
        names); returns how many. Pinned ones stay pinned until acknowledged. With `events`, one HOST
        BlockRemoved per group is appended to it."""
        index = self.index
        removed: dict[int, list[BlockHash]] = {}
        for block_id in host_block_ids:
            group_id = index.group_id(block_id)
            if group_id != EMPTY:
                removed.setdefault(group_id, []).append(index.block_hash(block_id))
                index.remove(block_id)
        if events is not None:
            events += [BlockRemoved(group_id, tuple(hashes), Tier.HOST) for group_id, hashes in removed.items()]
        return sum(len(hashes) for hashes in removed.values())
