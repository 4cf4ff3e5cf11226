"""Agreement between KV-cache groups on one cache hit (hybrid models)."""

from __future__ import annotations

from typing import Sequence

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.groups import GroupManager
from kv_manager_service.core.groups.full_attention import FullAttentionManager
from kv_manager_service.core.hashing import BlockHash


class KVCacheCoordinator:
    """Finds the longest prefix hit on which every cacheable group agrees.

    Groups may have different block sizes over one pool. Hashes are computed
    at `hash_block_size` (the gcd of the block sizes) and a hit is reported on
    a multiple of `alignment` (their lcm), so that it ends on a block boundary
    of every group.
    """

    def __init__(self, managers: Sequence[GroupManager], alignment: int) -> None:
        self.managers = list(managers)
        self.alignment = alignment
        self._cacheable = [m for m in self.managers if m.cacheable]

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int
    ) -> tuple[list[list[KVCacheBlock]], int]:
        """Per group, the table prefix of the hit; and the hit length in tokens.

        A fixed point: propose a length, let each group answer with the longest
        valid hit no longer than it, align the shortest answer down and ask
        again, until every group answers exactly the proposal. The length only
        shrinks, so this ends. Full attention is downward closed, so its answer
        is computed once and then cut. Non-cacheable groups hit nothing and do
        not vote. Changes nothing.
        """
        length = (max_length // self.alignment) * self.alignment
        hits: dict[int, list[KVCacheBlock]] = {}
        full_hits: dict[int, list[KVCacheBlock]] = {}
        while length > 0:
            agreed = length
            for manager in self._cacheable:
                if isinstance(manager, FullAttentionManager):
                    if manager.group_id not in full_hits:
                        full_hits[manager.group_id] = manager.find_longest_cache_hit(block_hashes, length, self.alignment)
                    blocks = full_hits[manager.group_id][: length // manager.block_size]
                else:
                    blocks = manager.find_longest_cache_hit(block_hashes, length, self.alignment)
                hits[manager.group_id] = blocks
                agreed = min(agreed, len(blocks) * manager.block_size)
            agreed = (agreed // self.alignment) * self.alignment
            if agreed == length:
                break
            length = agreed
        if length == 0 or not self._cacheable:
            return [[] for _ in self.managers], 0
        return [hits.get(m.group_id, []) for m in self.managers], length
