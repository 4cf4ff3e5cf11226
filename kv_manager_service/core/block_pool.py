"""The pool of physical blocks: allocation, reference counts and the prefix cache."""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from kv_manager_service.core.block_queue import FreeBlockQueue, KVCacheBlock
from kv_manager_service.shared.config import EvictionPolicy
from kv_manager_service.shared.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kv_manager_service.core.hashing import BlockHash

if TYPE_CHECKING:
    from kv_manager_service.core.host_tier import HostTier


FREQUENCY_CLASSES = 4
"""Under frequency: a free block's hash seen once, twice, three times, or four times or more."""

HISTORY_PER_BLOCK = 4
"""Under frequency: the hashes the history remembers, per block of the pool."""

RANK_SPAN = 1 << 62
"""The rank keys of one band (see BlockPool): more than the expectations a pool will ever number."""


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

    Segments. A freed cached block gets a segment key, and the queue is cut
    into segments by key: head to tail the unhashed blocks and the cached
    blocks of key 0, then the free cached blocks of each key, lowest first,
    each segment in LRU order. So a free block is evicted only after every
    free block of a lower key; a freed block goes to the end of its key's
    segment. The key is its rank key (`rank_key`), times FREQUENCY_CLASSES
    under frequency plus its frequency class:

    - the rank key: its band, twice its retention priority p
      (docs/retention.md), plus one while an expected request's prompt holds
      its hash (`wanted`, core/expectations.py); in band 2p + 1, the earlier
      the first of those requests was expected, the higher the key, as it
      will be admitted sooner. The rank key always follows the state: a
      free block whose hash starts or stops being wanted, or whose first
      expected request changes, moves to the end of its new key's segment
      (`_rekey`). While no block has a priority and nothing is expected, the
      whole queue under lru is the one segment above, vLLM's order.
    - frequency: how often its hash was seen (cached after a computation, or
      hit), less one, capped at FREQUENCY_CLASSES - 1, fixed when the key
      is set. The counts live in `seen`, a history of the last
      `history_size` hashes seen, which outlives eviction (as S3-FIFO's
      ghost queue does): a recomputed block whose hash came back counts as
      frequent. A block seen once is evicted first; the rank key still
      dominates.
    - a `ranker` (`set_ranker`) gives the key instead: offline reference
      orders for the replay (kv_tooling/eviction_oracle.py), never a server's.
    """

    def __init__(
        self,
        num_blocks: int,
        num_groups: int,
        enable_caching: bool,
        enable_events: bool,
        eviction_policy: EvictionPolicy = EvictionPolicy.LRU,
    ) -> None:
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
        # Retention priorities > 0 of cached blocks (any other block has priority 0).
        self.priorities: dict[KVCacheBlock, int] = {}
        # The segment keys > 0 of free cached blocks; the first block of each key's segment, and the
        # keys of the segments in ascending order. All empty under lru while no request sets a
        # priority, and every path then runs as if they did not exist.
        self.segment_keys: dict[KVCacheBlock, int] = {}
        self._segment_heads: dict[int, KVCacheBlock] = {}
        self._segment_order: list[int] = []
        self.eviction_policy = EvictionPolicy(eviction_policy)
        self.by_frequency = self.eviction_policy is EvictionPolicy.FREQUENCY
        self.ranker: Callable[[KVCacheBlock], int] | None = None
        # Whether freed cached blocks always take a key (else only while some block has a priority).
        self.keyed = self.by_frequency
        # frequency: hash -> times seen (at most FREQUENCY_CLASSES), least recently seen first; at most
        # `history_size` hashes. Empty under lru.
        self.seen: OrderedDict[BlockHash, int] = OrderedDict()
        self.history_size = HISTORY_PER_BLOCK * num_blocks
        # hash -> the sequence numbers of the expected requests whose prompts hold it, ascending
        # (core/expectations.py); empty while nothing is expected.
        self.wanted: dict[BlockHash, list[int]] = {}

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
        if self.by_frequency:
            self._see(block_hashes)
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
        """Take a reference on each block, rescuing free (cached) ones from the queue. Under frequency a
        cached block's hash counts as seen once more."""
        if self.by_frequency:
            blocks = list(blocks)
            self._see([block.block_hash for block in blocks if block.block_hash is not None])
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
        if self.priorities or self.keyed or self.wanted:
            self._append_to_segments(to_tail)
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
        self.segment_keys.clear()
        self.seen.clear()
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
        one in a segment leaves it for the head of the queue, in block id
        order, where unhashed blocks go. One BlockRemoved per group.
        """
        removed: dict[int, list[BlockHash]] = {}
        unsegmented = []
        for block in blocks:
            if block.block_hash is not None:
                removed.setdefault(block.group_id, []).append(block.block_hash)
                if block.ref_cnt == 0 and block in self.segment_keys:
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
        if self.segment_keys:
            self.segment_keys.pop(block, None)

    # -- the free queue's segments (see the class docstring) ------------------------------

    def set_ranker(self, ranker: Callable[[KVCacheBlock], int]) -> None:
        """Key freed cached blocks by `ranker` (>= 0; lowest evicted first) instead of the policy's order.
        Only on a pool with no block in use."""
        assert self.free_queue.num_free_blocks == self.num_blocks - 1, "a ranker is set on an unused pool"
        self.ranker = ranker
        self.keyed = True

    def segment_key(self, block: KVCacheBlock) -> int:
        """The key the cached `block` gets when it is freed now."""
        if self.ranker is not None:
            return self.ranker(block)
        if not (self.priorities or self.wanted):
            return self._frequency_class(block.block_hash) if self.by_frequency else 0
        key = self.rank_key(block)
        if not self.by_frequency:
            return key
        return key * FREQUENCY_CLASSES + self._frequency_class(block.block_hash)

    def rank_key(self, block: KVCacheBlock) -> int:
        """A cached block's rank key now (see the class docstring): 2p * RANK_SPAN, or, while its hash is wanted,
        (2p + 2) * RANK_SPAN - 1 - the first expected request's sequence number."""
        priority = self.priorities.get(block, 0) if self.priorities else 0
        holders = self.wanted.get(block.block_hash) if self.wanted else None
        if holders:
            return (2 * priority + 2) * RANK_SPAN - 1 - holders[0]
        return 2 * priority * RANK_SPAN

    def want(self, block_hashes: Sequence[BlockHash], seq: int) -> None:
        """The expected request of sequence number `seq`, higher than any expected now, holds `block_hashes`
        (its prompt's, in order)."""
        wanted = self.wanted
        newly = []
        for block_hash in block_hashes:
            holders = wanted.get(block_hash)
            if holders is None:
                wanted[block_hash] = [seq]
                newly.append(block_hash)
            else:
                holders.append(seq)
        self._rekey(newly)
        if self.host_tier is not None and newly:
            self.host_tier.refresh(newly)

    def unwant(self, block_hashes: Sequence[BlockHash], seq: int) -> None:
        """Undo `want(block_hashes, seq)`."""
        wanted = self.wanted
        changed = []
        for block_hash in block_hashes:
            holders = wanted[block_hash]
            first = holders[0]
            holders.remove(seq)
            if not holders:
                del wanted[block_hash]
                changed.append(block_hash)
            elif first == seq:
                changed.append(block_hash)
        self._rekey(changed)

    def _rekey(self, block_hashes: list[BlockHash]) -> None:
        """The free cached blocks of `block_hashes`, whose rank key just changed, move to the end of their new
        key's segment, a prompt's last blocks first, so they are evicted before the blocks they extend."""
        if self.ranker is not None or not self.enable_caching:
            return
        moved = []
        for block_hash in reversed(block_hashes):
            for cached in self.cached:
                entry = cached.get(block_hash)
                if entry is None:
                    continue
                for block in (entry,) if type(entry) is KVCacheBlock else entry.values():
                    if block.ref_cnt == 0:  # a cached block is in the free queue exactly then
                        moved.append(block)
        if not moved:
            return
        for block in moved:
            self._leave_segment(block)
            self.free_queue.remove(block)
        self._append_to_segments(moved)

    def _frequency_class(self, block_hash: BlockHash) -> int:
        return self.seen.get(block_hash, 1) - 1

    def restore_segments(self, frequency_classes: dict[KVCacheBlock, int] | None = None) -> None:
        """Find the segments in the free queue, as restored (core/state.py) with `priorities`, `wanted` and,
        under frequency, the free blocks' `frequency_classes` (those above 0): the rank keys follow from the
        state (see the class docstring)."""
        segment_keys = {}
        if self.priorities or self.wanted or frequency_classes:
            classes = frequency_classes or {}
            for block in self.free_queue:
                if block.block_hash is not None:
                    key = self.rank_key(block)
                    if self.by_frequency:
                        key = key * FREQUENCY_CLASSES + classes.get(block, 0)
                    if key:
                        segment_keys[block] = key
        self.segment_keys = segment_keys
        self._segment_heads = {}
        for block in self.free_queue:
            key = segment_keys.get(block, 0)
            if key:
                self._segment_heads.setdefault(key, block)
        self._segment_order = sorted(self._segment_heads)

    def _see(self, block_hashes: Iterable[BlockHash]) -> None:
        """Count each hash as seen once more (up to FREQUENCY_CLASSES), now the most recently seen; forget the
        least recently seen beyond the history's size."""
        seen = self.seen  # an OrderedDict: a plain dict slows down as its front is popped
        get, move_to_end = seen.get, seen.move_to_end
        for block_hash in block_hashes:
            count = get(block_hash)
            if count is None:
                seen[block_hash] = 1
            else:
                move_to_end(block_hash)  # half the time of a pop and an insert
                if count < FREQUENCY_CLASSES:
                    seen[block_hash] = count + 1
        for _ in range(len(seen) - self.history_size):
            seen.popitem(last=False)

    def _append_to_segments(self, blocks: list[KVCacheBlock]) -> None:
        """Put the freed cached `blocks`, in order, each at the end of its key's segment."""
        if not blocks:
            return
        keys = self.segment_keys
        by_key: dict[int, list[KVCacheBlock]] = {}
        segment_key = self.segment_key
        for block in blocks:
            key = segment_key(block)
            if key:
                keys[block] = key
            by_key.setdefault(key, []).append(block)
        heads, order = self._segment_heads, self._segment_order
        for key in sorted(by_key):
            batch = by_key[key]
            index = bisect_right(order, key)  # the next higher segment, if any
            if index < len(order):
                self.free_queue.insert_before(heads[order[index]], batch)
            else:
                self.free_queue.append_n(batch)
            if key and key not in heads:
                heads[key] = batch[0]
                order.insert(index, key)

    def _leave_segment(self, block: KVCacheBlock) -> None:
        """`block`, still in the free queue, is about to leave it: drop its key, keep its segment's head right."""
        key = self.segment_keys.pop(block, 0)
        if key and self._segment_heads[key] is block:
            following = block.next_free
            if self.segment_keys.get(following, 0) == key:
                self._segment_heads[key] = following
            else:
                del self._segment_heads[key]
                self._segment_order.remove(key)

    def _after_popleft(self) -> None:
        """Blocks were popped from the head: drop or move the heads of the segments they reached. (The popped
        blocks' keys go when they are evicted: only cached blocks have one.)"""
        heads, order = self._segment_heads, self._segment_order
        while order and heads[order[0]].prev_free is None:  # popped: the segments below went whole
            key = order[0]
            first = self.free_queue.first()
            if first is not None and self.segment_keys.get(first, 0) == key:
                heads[key] = first
                return
            del heads[key]
            order.pop(0)
