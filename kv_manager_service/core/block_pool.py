"""The pool of physical blocks: allocation, reference counts and the prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from kv_manager_service.core.block_queue import FreeBlockQueue, KVCacheBlock
from kv_manager_service.shared.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kv_manager_service.core.hashing import BlockHash

if TYPE_CHECKING:
    from kv_manager_service.core.host_tier import HostTier


class BlockPool:
    """Owns every block, the free queue and the hash -> block map of each group.

    Block 0 is the null block: a placeholder for table slots a group will never
    read. It is never in the free queue, never cached and never freed, and its
    ref count is not maintained.

    The free queue is the eviction policy. Fresh blocks are popped from the
    head. When a batch of blocks is freed, those reaching ref count 0 without a
    hash go to the head together (reused first, they can never produce a hit);
    those with a hash are appended together at the tail (LRU), each group
    keeping the batch order. A cached free block stays findable until it is
    popped for reuse: only then does it lose its hash (lazy eviction).
    """

    def __init__(self, num_blocks: int, num_groups: int, enable_caching: bool, enable_events: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # NOTE: the map does not de-duplicate. Two requests that computed the
        # same block each keep their own copy, because block tables are
        # append-only: a block id handed to a worker never changes. So a hash
        # maps to one block or, rarely, to a dict of blocks keyed by id.
        self.cached: list[dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)
        ]
        self.events: list[KVEvent] = []
        self.num_evictions = 0
        # The host tier behind this pool, if any: an evicted cached block is offered to it.
        self.host_tier: HostTier | None = None

    # -- queries ---------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of allocatable blocks (the null block excluded) in use."""
        return 1.0 - self.free_queue.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, group_id: int, block_hash: BlockHash) -> KVCacheBlock | None:
        entry = self.cached[group_id].get(block_hash)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    # -- mutations -------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, ref count 1 each.

        A popped block that still carries a hash is evicted from the cache now.
        The call's evictions make one BlockRemoved per group, after the host
        tier's events for the same blocks: a frozen event per block cost a
        third of an admission that evicts.
        """
        blocks = self.free_queue.popleft_n(num_blocks)
        removed: dict[int, list[BlockHash]] = {}
        for block in blocks:
            if block.block_hash is not None:
                removed.setdefault(block.group_id, []).append(block.block_hash)
                self._evict(block)
            block.ref_cnt = 1
        if removed and self.enable_events:
            self.events += [BlockRemoved(group_id, tuple(hashes)) for group_id, hashes in removed.items()]
        return blocks

    def cache_full_blocks(
        self,
        group_id: int,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        block_size: int,
    ) -> None:
        """Enter full, uncached, non-null `blocks` into the cache of `group_id`."""
        cached = self.cached[group_id]
        for block, block_hash in zip(blocks, block_hashes):
            assert block.block_hash is None and not block.is_null, block
            block.block_hash = block_hash
            block.group_id = group_id
            entry = cached.get(block_hash)
            if entry is None:
                cached[block_hash] = block
            elif isinstance(entry, KVCacheBlock):
                cached[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block
        if self.enable_events:
            self.events.append(BlockStored(group_id, tuple(block_hashes), parent_block_hash, block_size))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block, rescuing free (cached) ones from the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> int:
        """Drop one reference on each block of one batch; returns how many reached 0.

        Null blocks are skipped. See the class docstring for where freed blocks go.
        """
        to_head: list[KVCacheBlock] = []
        to_tail: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (to_head if block.block_hash is None else to_tail).append(block)
        self.free_queue.prepend_n(to_head)
        self.free_queue.append_n(to_tail)
        return len(to_head) + len(to_tail)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.free_queue.num_free_blocks != self.num_blocks - 1:
            return False
        self.clear_cache()
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True

    def clear_cache(self) -> int:
        """Forget every cached hash, held blocks' included; returns how many there were. No event: the
        caller says why (AllBlocksCleared)."""
        num_cached = 0
        for block in self.blocks:
            if block.block_hash is not None:
                block.block_hash = None
                block.group_id = -1
                num_cached += 1
        for cached in self.cached:
            cached.clear()
        return num_cached

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Take the hashed ones of `blocks` out of the prefix cache, as if never cached; returns how many.

        Unlike an eviction nothing is offered to the host tier (their KV is not
        what the hash names) and no eviction is counted. Each stays where it
        is, held or free: a free one is simply reused sooner or later. One
        BlockRemoved per group.
        """
        removed: dict[int, list[BlockHash]] = {}
        for block in blocks:
            if block.block_hash is not None:
                removed.setdefault(block.group_id, []).append(block.block_hash)
                self._unindex(block)
        if removed and self.enable_events:
            self.events += [BlockRemoved(group_id, tuple(hashes)) for group_id, hashes in removed.items()]
        return sum(len(hashes) for hashes in removed.values())

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _evict(self, block: KVCacheBlock) -> None:
        # When this is the hash's last device block, the hash leaves the device: write it back to the
        # host tier (reads the hash, so first; its HOST events precede the DEVICE BlockRemoved, see
        # shared/events.py).
        if self.host_tier is not None and type(self.cached[block.group_id][block.block_hash]) is KVCacheBlock:
            self.host_tier.offload(block, self.events if self.enable_events else None)
        self._unindex(block)
        self.num_evictions += 1

    def _unindex(self, block: KVCacheBlock) -> None:
        """Take the hashed `block` out of its group's map; it loses its hash."""
        block_hash = block.block_hash
        cached = self.cached[block.group_id]
        entry = cached[block_hash]
        if isinstance(entry, KVCacheBlock):
            del cached[block_hash]
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                cached[block_hash] = next(iter(entry.values()))
        block.block_hash = None
        block.group_id = -1
