"""The Redis key schema of the prefix-index mirror, shared by writers and readers.

Every key starts with a namespace that names the deployment: the model, the
hash algorithm and a fingerprint of the hash seed (never the seed itself),
so two models or two seeds never share an entry. Only block hashes are
stored, never token ids. Every operation touches one key, so the keys shard
across a Redis Cluster; writers batch them in pipelines.

    {ns}:block:{group_id}:{hash hex}   HASH   replica_id -> incarnation, or incarnation + ":host"
        "this replica's incarnation holds a cached block with this hash":
        the bare incarnation when a device block carries it, the ":host"
        form when only the replica's host-memory tier holds it
    {ns}:lease:{replica_id}             STRING JSON, expires after the lease TTL:
        {"incarnation": int, "address": "host:port", "num_requests": int,
         "usage": float, "num_free_blocks": int}
    {ns}:replicas                       SET    every replica id seen and not yet collected
    {ns}:collector                      STRING the collector's lock: who collects, for one interval

A reader trusts a block entry only if the replica's lease is alive and names
the same incarnation: entries of dead replicas, or of a replica's earlier
life, are ignored. A reader that predates the host tier compares the value
with the bare incarnation, so it sees the device tier only, as before.

Stale fields (earlier incarnations', replicas gone for good) are deleted by
collector.py, at most one collection per interval in a deployment.

No key holds a hash tag and every script touches one key, so on a Redis
Cluster the keys spread over every master by their slot, and each command
goes to one node.

One replica id has one holder. A writer claims, renews and drops its lease
with compare-and-set scripts (`CLAIM_LEASE`, `DROP_LEASE`) that act only
when the key is absent or names the writer's own incarnation, so two
managers started with one id never overwrite each other's lease.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections import Counter
from dataclasses import dataclass

from kv_manager_service.shared.events import Tier

BlockKey = tuple[int, bytes]  # (group id, block hash)
# A replica's cached set as the mirror reads it, consistent with itself: its device tier's (group, hash)
# counts, the (group, hash) keys its host tier holds (empty without one), and the last event they include.
CachedSet = tuple[Counter[BlockKey], set[BlockKey], int]


class ClusterUnavailableError(Exception):
    """The mirror could not be read (Redis down or slow), or lookups skip Redis after a recent failure."""


class ReplicaIdInUseError(ValueError):
    """Another live manager holds this replica id's lease: this one must not serve under it."""


# KEYS[1]: the lease; ARGV: our incarnation, the new lease JSON, its TTL in ms.
# Sets the lease if it is absent (returns 0) or ours (returns 1); otherwise
# leaves it and returns it. The incarnation is compared as a string: it
# exceeds the 2**53 that Lua's numbers hold exactly.
CLAIM_LEASE = """
local current = redis.call('GET', KEYS[1])
if current and string.match(current, '"incarnation": *(%d+)') ~= ARGV[1] then
  return current
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if current then return 1 end
return 0
"""

# KEYS[1]: the lease; ARGV[1]: our incarnation. Deletes the lease only if it is ours.
DROP_LEASE = """
local current = redis.call('GET', KEYS[1])
if current and string.match(current, '"incarnation": *(%d+)') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1]: a block entry; ARGV: a replica id, the value it was read with.
# Deletes the field only if it still holds that value: one rewritten since
# (by a newer incarnation) stays.
DELETE_FIELD_IF = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


HOST_ONLY_SUFFIX = ":host"


def block_entry_value(incarnation: str, tier: Tier) -> str:
    """The value of a replica's field in a block entry: its incarnation, marked when the block is host-only."""
    return incarnation if tier is Tier.DEVICE else incarnation + HOST_ONLY_SUFFIX


@dataclass(frozen=True)
class Lease:
    replica_id: str
    incarnation: int
    address: str
    num_requests: int
    usage: float
    num_free_blocks: int

    def to_json(self) -> str:
        return json.dumps(
            {
                "incarnation": self.incarnation,
                "address": self.address,
                "num_requests": self.num_requests,
                "usage": self.usage,
                "num_free_blocks": self.num_free_blocks,
            }
        )

    @classmethod
    def from_json(cls, replica_id: str, text: str | bytes) -> "Lease":
        data = json.loads(text)
        return cls(
            replica_id,
            int(data["incarnation"]),
            str(data.get("address", "")),
            int(data.get("num_requests", 0)),
            float(data.get("usage", 0.0)),
            int(data.get("num_free_blocks", 0)),
        )


@dataclass(frozen=True)
class ReplicaTokens:
    """One replica's cached prefix in tokens: `num_cached_tokens` in both tiers, of which
    `num_host_cached_tokens` only in its host tier (as FindCacheHit's local answer counts them)."""

    replica_id: str
    num_cached_tokens: int
    num_host_cached_tokens: int = 0


@dataclass(frozen=True)
class KeySchema:
    model: str
    hash_algorithm: str
    hash_seed: str | None = None

    @functools.cached_property
    def namespace(self) -> str:
        # The seed may be a secret (xxh3_128's key): its tag comes from a slow
        # key derivation, so reading Redis does not make guessing it cheap.
        seed_tag = (
            hashlib.pbkdf2_hmac("sha256", self.hash_seed.encode(), b"kvcache.v1 namespace", 200_000)[:6].hex()
            if self.hash_seed
            else "noseed"
        )
        return f"kvcache:{self.model}:{self.hash_algorithm}:{seed_tag}"

    def block(self, group_id: int, block_hash: bytes) -> str:
        """The key of a block entry: a prefix per group (`block_prefix`), then the hash in hex."""
        return f"{self.namespace}:block:{group_id}:{block_hash.hex()}"

    def block_prefix(self, group_id: int) -> bytes:
        """`block(group_id, h)` less the hash, encoded: the writer and the lookup append each hash's hex to it."""
        return self.block(group_id, b"").encode()

    def block_pattern(self) -> str:
        """SCAN's MATCH for every block key of the namespace, its glob characters escaped."""
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.namespace)
        return f"{escaped}:block:*"

    def lease(self, replica_id: str) -> str:
        return f"{self.namespace}:lease:{replica_id}"

    @property
    def replicas(self) -> str:
        return f"{self.namespace}:replicas"

    @property
    def collector_lock(self) -> str:
        return f"{self.namespace}:collector"
