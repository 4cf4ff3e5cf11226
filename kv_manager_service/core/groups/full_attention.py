"""Full attention: every token reads every earlier token, so nothing is recycled."""

from __future__ import annotations

from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.groups.base import GroupManager
from kv_manager_service.core.hashing import BlockHash
from kv_manager_service.core.host_tier import HostBlock


class FullAttentionManager(GroupManager):
    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_length: int, alignment: int
    ) -> list[KVCacheBlock | HostBlock]:
        """Cached blocks from the start, up to the first miss.

        A full-attention hit is downward closed: any prefix of a hit is a hit.
        With a host tier, the chain is followed across both tiers block by
        block: a block hits on the device, else on the host (a `HostBlock` at
        that position), and the chain stops at the first block in neither.
        """
        cached = self.pool.cached[self.group_id]
        host_tier = self.pool.host_tier
        k = self.hashes_per_block
        hits: list[KVCacheBlock | HostBlock] = []
        for i in range(k - 1, (max_length // self.block_size) * k, k):
            entry = cached.get(block_hashes[i])
            if entry is None:
                if host_tier is None:
                    break
                entry = host_tier.find(self.group_id, block_hashes[i])
                if entry is None:
                    break
            hits.append(entry if not isinstance(entry, dict) else next(iter(entry.values())))
        blocks_per_alignment = max(alignment // self.block_size, 1)
        del hits[len(hits) - len(hits) % blocks_per_alignment :]
        return hits
