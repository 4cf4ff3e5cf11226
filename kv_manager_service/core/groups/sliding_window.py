"""Sliding-window attention: token p reads tokens [p - window + 1, p]."""

from __future__ import annotations

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.groups.base import GroupManager, cdiv
from kv_manager_service.core.hashing import BlockHash


class SlidingWindowManager(GroupManager):
    recycles = True

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next token, at position num_computed_tokens, reads back to
        # num_computed_tokens - window + 1.
        return max(0, num_computed_tokens - self.spec.sliding_window + 1)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int, alignment: int) -> list[KVCacheBlock]:
        """The rightmost run of cached blocks that covers a window, scanning right to left.

        A hit ending at block e needs blocks e-n+1..e cached, with
        n = cdiv(window - 1, block_size); the blocks before the run are nulls.
        A run that reaches block 0 is a hit even when shorter than n.

            [null, null, b7, b3] <- hit of 4 blocks, n = 2
        """
        block_size = self.block_size
        num_needed = cdiv(self.spec.sliding_window - 1, block_size)
        max_blocks = max_length // block_size
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = self.cached_block(block_hashes, i)
            if block is None:
                run = 0
                continue
            if run == 0 and (i + 1) * block_size % alignment:
                continue  # a hit may only end on an aligned boundary
            run += 1
            if run >= num_needed:
                end = i + run
                return [self.pool.null_block] * i + [self.cached_block(block_hashes, j) for j in range(i, end)]
        return [self.cached_block(block_hashes, j) for j in range(run)]
