"""Chunked local attention: a token reads only the earlier tokens of its own chunk."""

from __future__ import annotations

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.groups.base import GroupManager
from kv_manager_service.core.hashing import BlockHash


class ChunkedLocalManager(GroupManager):
    recycles = True

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # Tokens of the chunks before the one holding the next token.
        return (num_computed_tokens // self.spec.chunk_size) * self.spec.chunk_size

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int, alignment: int) -> list[KVCacheBlock]:
        """Nulls for the chunks before the current one, then its cached blocks up to a miss.

        The tokens of earlier chunks count as a hit without any block: no token
        from the current chunk on will read them.
        """
        chunk_start_block = (max_length // self.spec.chunk_size) * self.spec.chunk_size // self.block_size
        hits = [self.pool.null_block] * chunk_start_block
        for i in range(chunk_start_block, max_length // self.block_size):
            block = self.cached_block(block_hashes, i)
            if block is None:
                break
            hits.append(block)
        return hits
