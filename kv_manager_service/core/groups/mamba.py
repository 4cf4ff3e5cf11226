"""Mamba (state-space) layers: one state block per request is all that is read."""

from __future__ import annotations

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.groups.base import GroupManager
from kv_manager_service.core.hashing import BlockHash


class MambaManager(GroupManager):
    """Block i holds the recurrent state after the tokens of [0, (i + 1) * block_size).

    Only the block holding the latest state is kept; the previous one is
    recycled once the state has moved on. A full block is cacheable: its state
    summarises its whole prefix.
    """

    recycles = True

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next token continues from the state after token num_computed - 1.
        return max(0, num_computed_tokens - 1)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int, alignment: int) -> list[KVCacheBlock]:
        """The latest cached state at an aligned boundary, behind nulls."""
        block_size = self.block_size
        for i in range(max_length // block_size - 1, -1, -1):
            if (i + 1) * block_size % alignment:
                continue
            block = self.cached_block(block_hashes, i)
            if block is not None:
                return [self.pool.null_block] * i + [block]
        return []
