"""A small single-group pool, prompts of whole blocks, and a request run to completion: for the eviction tests."""

from __future__ import annotations

from typing import Any

from kv_manager_service.core import GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_manager_service.shared.ops import Retention

BLOCK = 4


def make_manager(num_blocks: int = 13, policy: str = "lru", **config: Any) -> KVCacheManager:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, BLOCK),)
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, groups=groups, eviction_policy=policy, **config))


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


def run(m: KVCacheManager, request_id: str, tokens: list[int], retention: Retention | None = None) -> None:
    """Admit `tokens` plus one token (so every prompt block is full and cached), then free the request."""
    m.allocate(request_id, tokens + [9], len(tokens) + 1, retention=retention)
    m.free([request_id])
    m.check_invariants()


def cached_blocks(m: KVCacheManager, tokens: list[int]) -> int:
    return len(m.find_cache_hit(tokens + [9]).block_ids[0])
