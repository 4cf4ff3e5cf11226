"""What every KV-cache group manager does; one subclass per attention kind."""

from __future__ import annotations

from typing import ClassVar

from kv_manager_service.core.block_pool import BlockPool
from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.shared.config import GroupSpec
from kv_manager_service.core.hashing import BlockHash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupManager:
    """The policy of one KV-cache group over the shared pool.

    A manager holds no per-request state: the caller owns each request's table
    (a list of blocks, one per `block_size` tokens, append-only) and passes it
    in. A manager decides how many blocks a request needs, what a cache hit
    looks like for its attention kind, and which leading blocks a request will
    never read again. Those are freed and replaced by the null block, so that
    table index i still covers tokens [i * block_size, (i + 1) * block_size).
    """

    # Whether `num_skipped_tokens` can ever be > 0.
    recycles: ClassVar[bool] = False

    def __init__(self, group_id: int, spec: GroupSpec, pool: BlockPool, hash_block_size: int) -> None:
        self.group_id = group_id
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        # Our block i is named by the chained hash at its last hash-block boundary.
        self.hashes_per_block = spec.block_size // hash_block_size
        self.cacheable = spec.cacheable and pool.enable_caching

    # -- cache hits --------------------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int, alignment: int) -> list[KVCacheBlock]:
        """The longest valid hit of at most `max_length` tokens, as a table prefix.

        Null blocks stand for slots the group never reads. The caller aligns
        the hit length to `alignment` and asks again with the shorter length
        when groups disagree. Changes nothing.
        """
        raise NotImplementedError

    def cached_block(self, block_hashes: list[BlockHash], index: int) -> KVCacheBlock | None:
        """The cached block holding this group's block `index` of the chain, if any."""
        entry = self.pool.cached[self.group_id].get(block_hashes[(index + 1) * self.hashes_per_block - 1])
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    # -- sizing and recycling ----------------------------------------------------

    def num_required_blocks(self, num_tokens: int, num_encoder_tokens: int) -> int:
        """Table length needed to hold `num_tokens` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens that no token from `num_computed_tokens` on will read."""
        return 0

    def remove_skipped_blocks(self, table: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Free the blocks wholly inside the skipped tokens and null their slots.

        Freed last-to-first as one batch. Stops at the first null slot: the
        slots before it were nulled by an earlier call.
        """
        num_skipped_blocks = min(self.num_skipped_tokens(num_computed_tokens) // self.block_size, len(table))
        removed = []
        null_block = self.pool.null_block
        for i in range(num_skipped_blocks - 1, -1, -1):
            block = table[i]
            if block is null_block:
                break
            removed.append(block)
            table[i] = null_block
        if removed:
            self.pool.free_blocks(removed)

    # -- caching -----------------------------------------------------------------

    def cache_blocks(
        self, table: list[KVCacheBlock], block_hashes: list[BlockHash], num_cached_blocks: int, num_tokens: int
    ) -> int:
        """Cache the blocks that the first `num_tokens` tokens fill; returns the new cached count."""
        num_full = num_tokens // self.block_size
        if num_full <= num_cached_blocks or not self.cacheable:
            return num_cached_blocks
        k = self.hashes_per_block
        parent = block_hashes[num_cached_blocks * k - 1] if num_cached_blocks else None
        self.pool.cache_full_blocks(
            self.group_id,
            table[num_cached_blocks:num_full],
            block_hashes[(num_cached_blocks + 1) * k - 1 : num_full * k : k],
            parent,
            self.block_size,
        )
        return num_full
