"""Changes to the prefix cache, queued by the pool in commit order.

They carry hashes only, never token ids: token ids would reveal prompts to
whoever reads the event stream or its Redis mirror.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from kv_manager_service.core.hashing import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Blocks of `group_id` entered the prefix cache; hashes in chain order.

    `parent_block_hash` is the hash of the block before the first one, or
    None when the first one starts the sequence.
    """

    group_id: int
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks of `group_id` left the prefix cache (evicted for reuse)."""

    group_id: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache, all groups, was reset."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
