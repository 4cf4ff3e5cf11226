"""Cross-attention: the decoder reads the encoder's KV, sized by encoder tokens."""

from __future__ import annotations

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.groups.base import GroupManager, cdiv
from kv_manager_service.core.hashing import BlockHash


class CrossAttentionManager(GroupManager):
    """Blocks for the encoder output, allocated once and never cached.

    The encoder KV depends on the encoder input, not on the token prefix, so
    a prefix hash cannot name it.
    """

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int, alignment: int) -> list[KVCacheBlock]:
        return []

    def num_required_blocks(self, num_tokens: int, num_encoder_tokens: int) -> int:
        return cdiv(num_encoder_tokens, self.block_size)
