"""The pool of physical blocks: allocation, reference counts and the prefix cache."""

from __future__ import annotations

from bisect import bisect_right
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

    Retention priorities (docs/retention.md) cut the queue into segments.
    Head to tail it holds the unhashed blocks and the cached blocks of
    priority 0 (the whole queue, exactly as above, while no block has a
    priority), then the free cached blocks of each priority, lowest first,
    each segment in LRU order. So a free block of priority p is evicted only
    after every free block of a lower priority; a freed block goes to the end
    of its priority's segment. Only a cached block has a priority > 0.
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
        # Retention priorities > 0 of cached blocks (any other block has priority 0); the first free
        # block of each priority's segment, and the priorities of the segments in ascending order. All
        # empty while no request sets a priority, and every path then runs as if they did not exist.
        self.priorities: dict[KVCacheBlock, int] = {}
        self._segment_heads: dict[int, KVCacheBlock] = {}
        self._segment_order: list[int] = []

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
        if self._segment_heads:
            self._after_popleft()
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
        segmented = bool(self._segment_heads)
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                if segmented:
                    self._leave_segment(block)
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
        if self.priorities:
            self._append_by_priority(to_tail)
        else:
            self.free_queue.append_n(to_tail)
        return len(to_head) + len(to_tail)

    def raise_priority(self, blocks: Iterable[KVCacheBlock], priority: int) -> None:
        """Give each cached block of `blocks`, all held (none in the free queue), at least `priority`."""
        priorities = self.priorities
        for block in blocks:
            if block.block_hash is not None and priorities.get(block, 0) < priority:
                assert block.ref_cnt > 0, f"{block} is free: its priority would not match its segment"
                priorities[block] = priority

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
        self.priorities.clear()
        self._segment_heads.clear()
        self._segment_order.clear()
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
        is, held or free: a free one is simply reused sooner or later. A free
        one with a retention priority leaves its segment for the head of the
        queue, in block id order, where unhashed blocks go. One BlockRemoved
        per group.
        """
        removed: dict[int, list[BlockHash]] = {}
        unsegmented = []
        for block in blocks:
            if block.block_hash is not None:
                removed.setdefault(block.group_id, []).append(block.block_hash)
                if block.ref_cnt == 0 and block in self.priorities:
                    self._leave_segment(block)
                    self.free_queue.remove(block)
                    unsegmented.append(block)
                self._unindex(block)
        if unsegmented:
            self.free_queue.prepend_n(sorted(unsegmented, key=lambda b: b.block_id))
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
        if self.priorities:
            self.priorities.pop(block, None)

    # -- retention priorities: the free queue's segments (see the class docstring) --------

    def restore_segments(self) -> None:
        """Find the segments in the free queue, as restored with `priorities` (core/state.py)."""
        self._segment_heads = {}
        for block in self.free_queue:
            priority = self.priorities.get(block, 0)
            if priority:
                self._segment_heads.setdefault(priority, block)
        self._segment_order = sorted(self._segment_heads)

    def _append_by_priority(self, blocks: list[KVCacheBlock]) -> None:
        """Put the freed cached `blocks`, in order, each at the end of its priority's segment."""
        if not blocks:
            return
        priorities = self.priorities
        by_priority: dict[int, list[KVCacheBlock]] = {}
        for block in blocks:
            by_priority.setdefault(priorities.get(block, 0), []).append(block)
        heads, order = self._segment_heads, self._segment_order
        for priority in sorted(by_priority):
            batch = by_priority[priority]
            index = bisect_right(order, priority)  # the next higher segment, if any
            if index < len(order):
                self.free_queue.insert_before(heads[order[index]], batch)
            else:
                self.free_queue.append_n(batch)
            if priority and priority not in heads:
                heads[priority] = batch[0]
                order.insert(index, priority)

    def _leave_segment(self, block: KVCacheBlock) -> None:
        """`block`, still in the free queue, is about to leave it: keep its segment's head right."""
        priority = self.priorities.get(block, 0)
        if priority and self._segment_heads[priority] is block:
            following = block.next_free
            if self.priorities.get(following, 0) == priority:
                self._segment_heads[priority] = following
            else:
                del self._segment_heads[priority]
                self._segment_order.remove(priority)

    def _after_popleft(self) -> None:
        """Blocks were popped from the head: drop or move the heads of the segments they reached."""
        heads, order = self._segment_heads, self._segment_order
        while order and heads[order[0]].prev_free is None:  # popped: the segments below went whole
            priority = order[0]
            first = self.free_queue.first()
            if first is not None and self.priorities.get(first, 0) == priority:
                heads[priority] = first
                return
            del heads[priority]
            order.pop(0)
