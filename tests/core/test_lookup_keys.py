"""The local hit and the keys a cluster lookup asks other replicas about, from one hashing of the prompt."""

from __future__ import annotations

from kv_manager_service.core import AllocateOp, GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_manager_service.core.hashing import NO_EXTRAS

BLOCK = 16


def make_manager(**kwargs) -> KVCacheManager:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, BLOCK),)
    return KVCacheManager(KVCacheConfig(num_blocks=16, groups=groups, **kwargs))


def test_the_hit_is_find_cache_hits_and_the_keys_are_the_blocks_a_hit_may_adopt():
    manager = make_manager()
    prompt = list(range(3 * BLOCK))  # three full blocks: a hit may adopt two (one token is left to compute)
    manager.step([AllocateOp("a", prompt, len(prompt))])
    hit, keys = manager.find_cache_hit_and_lookup_keys(prompt)
    assert hit == manager.find_cache_hit(prompt) and hit.num_cached_tokens == 2 * BLOCK
    hashes = manager.hasher.hash_blocks(manager.hasher.root_hash, prompt, 0, NO_EXTRAS)
    assert keys.group_id == 0 and keys.block_size == BLOCK and keys.block_hashes == hashes[:2]
    salted_hit, salted_keys = manager.find_cache_hit_and_lookup_keys(prompt, cache_salt="s")
    assert salted_hit == manager.find_cache_hit(prompt, cache_salt="s") and salted_hit.num_cached_tokens == 0
    assert len(salted_keys.block_hashes) == 2 and not set(salted_keys.block_hashes) & set(hashes)


def test_without_prefix_caching_nothing_is_hit_or_asked():
    manager = make_manager(enable_prefix_caching=False)
    assert manager.find_cache_hit_and_lookup_keys(list(range(2 * BLOCK + 1))) == (manager.find_cache_hit([1]), None)
    assert make_manager().find_cache_hit_and_lookup_keys([]) == (make_manager().find_cache_hit([]), None)

