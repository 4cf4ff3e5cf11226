"""Changes to the prefix cache, queued by the pool in commit order.

They carry hashes only, never token ids: token ids would reveal prompts to
whoever reads the event stream or its Redis mirror.

Each BlockStored / BlockRemoved names its tier. The device tier's events are
those of a pool without a host tier, unchanged: a device eviction removes the
hash from the device tier even when the block moves to the host. The host
tier's events follow its hash index: a HOST BlockStored when an offload
indexes a hash on the host, a HOST BlockRemoved when the host evicts it. An
onload enters the hash into the device tier (a DEVICE BlockStored) and keeps
it on the host. So per tier, stores minus removals give exactly that tier's
cached set, and a consumer that ignores the tier still counts every hash the
replica holds in either tier (an offload is queued, and its HOST BlockStored
logged, before the device's BlockRemoved of the same hash).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from kv_manager_service.shared.hash_types import BlockHash


class Tier(enum.Enum):
    """Where a cached block lives: device memory (the pool) or the host-memory tier behind it."""

    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True)
class BlockStored:
    """Blocks of `group_id` entered the prefix cache of `tier`; hashes in chain order.

    `parent_block_hash` is the hash of the block before the first one, or
    None when the first one starts the sequence. The host tier stores one
    block at a time, in eviction order rather than chain order, and knows
    neither its parent nor its group's block size: its events carry None and
    0 there.
    """

    group_id: int
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_size: int
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks of `group_id` left the prefix cache of `tier` (evicted for reuse)."""

    group_id: int
    block_hashes: tuple[BlockHash, ...]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache, all groups and both tiers, was reset."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
