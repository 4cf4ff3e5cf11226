"""A pool's identity: what must match for a journal to restore it, or for a standby to follow its primary.

Two managers whose descriptions differ would answer the same Steps differently (other block ids, other
evictions), so a journal written by one is refused by the other, and so is a standby of another pool.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from kv_manager_service.shared.config import KVCacheConfig


def pool_description(config: KVCacheConfig) -> str:
    """The pool's configuration as canonical JSON, with the hash seed replaced by a digest of it."""
    values = dataclasses.asdict(config)
    values.pop("enable_events", None)
    if not values.get("num_host_blocks"):  # no host tier: the description journals written before the tier hold
        values.pop("num_host_blocks", None)
    if values.get("retention_max_pinned_blocks") is None:  # the default: as journals written before retention
        values.pop("retention_max_pinned_blocks", None)
    if values.get("max_expected_blocks") is None:  # the default: as journals written before expectations
        values.pop("max_expected_blocks", None)
    if values.get("eviction_policy") == "lru":  # the default: as journals written before the policies
        values.pop("eviction_policy", None)
    seed = values.pop("hash_seed", None)
    values["hash_seed_sha256"] = hashlib.sha256(seed.encode()).hexdigest() if seed else None
    return json.dumps(values, sort_keys=True, default=str)
