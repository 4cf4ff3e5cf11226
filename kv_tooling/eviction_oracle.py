"""Offline reference orders for the replay's evictions: Belady's next use, and the same order seen from the queue.

Neither is a policy a server can run: each reads the trace ahead. They are
the yardsticks for the online policies (`--eviction-policy lru|frequency`).

- "belady": a freed cached block is keyed by how soon a request not yet
  admitted needs its hash (the first such request in trace order), so the
  block needed last, or never, is evicted first. Every request's prompt is
  hashed up front, as the core hashes it.
- "belady-queued": the same, counting only requests that have arrived on the
  replay's clock and wait: what a manager told about the scheduler's queue
  could do. A block no waiting request needs keeps the LRU order.

Neither is a bound on prefill computed. Preemption reorders accesses, a block
helps only while the blocks before it in its prompt are cached too, and the
key is fixed when a block is freed: a request that arrives later, or that
recomputes the hash because its prefix broke earlier, does not re-key it. The
keys also ignore the host tier, which keeps its own LRU order.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.hashing import BlockHash, BlockHasher
from kv_tooling.workload import TokenExpander, TraceRecord

REFERENCE_ORDERS = {
    "belady": "the offline reference: the block whose hash the trace needs last, or never, first (replay only)",
    "belady-queued": "belady over the requests that have arrived and wait (replay only)",
}


class NextUseOracle:
    """Knows, for every hash of the trace's prompts, which requests need it; `key` ranks a freed block by that.

    The replay reports each request's first admission (`admitted`) and the
    clock after each step (`advance`); keys look past admitted requests and,
    when `released_s` is given, before requests not yet released.
    """

    def __init__(
        self,
        records: Sequence[TraceRecord],
        expander: TokenExpander,
        hasher: BlockHasher,
        released_s: Sequence[float] | None = None,
    ) -> None:
        self.num_requests = len(records)
        self.uses: dict[BlockHash, list[int]] = {}
        for index, record in enumerate(records):
            for block_hash in hasher.hash_blocks(hasher.root_hash, expander.prompt_token_ids(record)):
                self.uses.setdefault(block_hash, []).append(index)
        self._cursor: dict[BlockHash, int] = {}
        self._admitted = bytearray(len(records))
        self._released_s = released_s
        self._num_released = len(records) if released_s is None else 0

    def admitted(self, index: int) -> None:
        self._admitted[index] = 1

    def advance(self, clock_s: float) -> None:
        if self._released_s is not None:
            self._num_released = bisect_right(self._released_s, clock_s)

    def next_use(self, block_hash: BlockHash) -> int | None:
        """The first request in trace order, not yet admitted, whose prompt holds `block_hash`; None if none."""
        uses = self.uses.get(block_hash)
        if uses is None:
            return None
        cursor, admitted = self._cursor.get(block_hash, 0), self._admitted
        while cursor < len(uses) and admitted[uses[cursor]]:
            cursor += 1
        self._cursor[block_hash] = cursor
        return uses[cursor] if cursor < len(uses) else None

    def key(self, block: KVCacheBlock) -> int:
        """0 (evicted first, in LRU order) when no counted request needs the block; else higher the sooner."""
        index = self.next_use(block.block_hash)
        if index is None or index >= self._num_released:
            return 0
        return self.num_requests - index
