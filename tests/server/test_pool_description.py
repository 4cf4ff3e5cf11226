"""The pool description a journal is checked against at start: unchanged for a pool without a host tier."""

from __future__ import annotations

import json

from kv_manager_service.core import KVCacheConfig
from kv_manager_service.server.pool_identity import pool_description


def test_a_pool_without_host_tier_is_described_as_before_the_tier_existed():
    """Journals written before `num_host_blocks` existed must still match the same pool."""
    described = json.loads(pool_description(KVCacheConfig(num_blocks=64)))
    assert "num_host_blocks" not in described
    assert described["num_blocks"] == 64


def test_a_host_tier_is_part_of_the_description():
    described = json.loads(pool_description(KVCacheConfig(num_blocks=64, num_host_blocks=32)))
    assert described["num_host_blocks"] == 32


def test_the_eviction_policy_is_described_unless_it_is_the_default_lru():
    """A journal written under one eviction order is refused under another: its steps would evict differently."""
    assert "eviction_policy" not in json.loads(pool_description(KVCacheConfig(num_blocks=64)))
    described = json.loads(pool_description(KVCacheConfig(num_blocks=64, eviction_policy="frequency")))
    assert described["eviction_policy"] == "frequency"
