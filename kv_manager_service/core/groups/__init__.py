"""One manager per attention kind, behind the `GroupManager` interface."""

from __future__ import annotations

from kv_manager_service.core.block_pool import BlockPool
from kv_manager_service.shared.config import GroupKind, GroupSpec
from kv_manager_service.core.groups.base import GroupManager, cdiv
from kv_manager_service.core.groups.chunked_local import ChunkedLocalManager
from kv_manager_service.core.groups.cross_attention import CrossAttentionManager
from kv_manager_service.core.groups.full_attention import FullAttentionManager
from kv_manager_service.core.groups.mamba import MambaManager
from kv_manager_service.core.groups.sliding_window import SlidingWindowManager

_MANAGERS: dict[GroupKind, type[GroupManager]] = {
    GroupKind.FULL_ATTENTION: FullAttentionManager,
    GroupKind.SLIDING_WINDOW: SlidingWindowManager,
    GroupKind.CHUNKED_LOCAL: ChunkedLocalManager,
    GroupKind.MAMBA: MambaManager,
    GroupKind.CROSS_ATTENTION: CrossAttentionManager,
}


def make_group_manager(group_id: int, spec: GroupSpec, pool: BlockPool, hash_block_size: int) -> GroupManager:
    return _MANAGERS[spec.kind](group_id, spec, pool, hash_block_size)


__all__ = ["GroupManager", "cdiv", "make_group_manager"]
