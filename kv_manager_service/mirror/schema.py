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

Everything read from Redis is untrusted. A lease, a replica-set member, a
block field or value, or a key of the wrong Redis type is skipped where it is
met, counted by kind (`MALFORMED_KINDS`, `MalformedEntries`), and never
raised: one bad entry never stops a lookup, a heartbeat or a collection.
What a malformed entry blocks is replaced by the one who may: a writer
replaces a malformed lease at its own id (`CLAIM_LEASE`) and a replica set
of another type (`ADD_REPLICA`); the collector deletes block keys of
another type and fields that name no replica, and replaces a lock that is
not one (`TAKE_COLLECTOR_LOCK`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass

from kv_manager_service.core.host_index import HostKeys
from kv_manager_service.shared.events import Tier

log = logging.getLogger("kv_manager_service.mirror.schema")

BlockKey = tuple[int, bytes]  # (group id, block hash)
# A replica's cached set as the mirror reads it, consistent with itself: its device tier's (group, hash)
# counts, a compact copy of the keys its host tier holds (None without one), and the last event they include.
CachedSet = tuple[Counter[BlockKey], HostKeys | None, int]


class ClusterUnavailableError(Exception):
    """The mirror could not be read (Redis down or slow), or lookups skip Redis after a recent failure."""


class ReplicaIdInUseError(ValueError):
    """Another live manager holds this replica id's lease: this one must not serve under it."""


# KEYS[1]: the lease; ARGV: our incarnation, the new lease JSON, its TTL in ms,
# '=' followed by a malformed value read at the key before, which is
# nobody's lease ('' for none), and '1' when a lower incarnation's lease may
# be taken over (a high-availability group's new primary: its incarnation is
# its fencing token, so an older primary's is lower).
# Sets the lease if the key is absent (returns 0), ours (returns 1), not a
# lease (returns 2: a key of another type, or that malformed value, still
# there), or taken over (returns 3); otherwise leaves it and returns it. The
# incarnation is compared as a string: it exceeds the 2**53 that Lua's
# numbers hold exactly; a takeover compares lengths first, then the digits.
CLAIM_LEASE = """
local kind = redis.call('TYPE', KEYS[1])['ok']
local outcome = 2
if kind == 'none' then
  outcome = 0
elseif kind == 'string' then
  local current = redis.call('GET', KEYS[1])
  local theirs = string.match(current, '"incarnation": *(%d+)')
  if theirs == ARGV[1] then
    outcome = 1
  elseif ARGV[5] == '1' and theirs and (#theirs < #ARGV[1] or (#theirs == #ARGV[1] and theirs < ARGV[1])) then
    outcome = 3
  elseif '=' .. current ~= ARGV[4] then
    return current
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return outcome
"""

# KEYS[1]: the lease; ARGV[1]: our incarnation. Deletes the lease only if it is ours.
DROP_LEASE = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then return 0 end
local current = redis.call('GET', KEYS[1])
if string.match(current, '"incarnation": *(%d+)') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1]: a block entry; ARGV: a replica id, the value it was read with.
# Deletes the field only if it still holds that value: one rewritten since
# (by a newer incarnation) stays, and so does a key that is no hash now.
DELETE_FIELD_IF = """
if redis.call('TYPE', KEYS[1])['ok'] == 'hash' and redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

# KEYS[1]: a block key that did not read as a hash. Deletes it unless it is a
# hash (or absent) now: a key of another type holds no replica's fields, and
# fails every writer's HSET to it. Returns 1 when it deleted the key.
DELETE_UNLESS_HASH = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1]: the replica set; ARGV[1]: a replica id. Adds the id; a key of
# another type is no replica set and is replaced first (every live replica
# adds itself again at its next heartbeat). Returns 1 when it replaced one.
ADD_REPLICA = """
local kind = redis.call('TYPE', KEYS[1])['ok']
local replaced = 0
if kind ~= 'set' and kind ~= 'none' then
  redis.call('DEL', KEYS[1])
  replaced = 1
end
redis.call('SADD', KEYS[1], ARGV[1])
return replaced
"""

# KEYS[1]: the collector's lock; ARGV: the owner, the lock's TTL in ms. Takes
# the lock if it is free (returns 1) or not a lock (returns 2: a key of another
# type, or one without expiry, which would stop every collection for good);
# otherwise returns 0.
TAKE_COLLECTOR_LOCK = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'string' and redis.call('PTTL', KEYS[1]) >= 0 then
  return 0
end
local outcome = 1
if kind ~= 'none' then
  outcome = 2
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return outcome
"""


def is_wrong_type(error: Exception) -> bool:
    """Whether a Redis error reply (redis.ResponseError) says the key holds another type than the command reads."""
    return str(error).startswith("WRONGTYPE")


MALFORMED_KINDS = ("lease", "replica_member", "block_field", "key_type")
"""The kinds of malformed data the mirror skips and counts (`MalformedEntries`):

- `lease`: a lease value that is not a lease (not JSON, a field missing or of
  the wrong type, longer than MAX_LEASE_BYTES);
- `replica_member`: a member of the replica set that is not UTF-8 (no replica id is);
- `block_field`: a block entry's field that is not UTF-8, or a value that names no incarnation;
- `key_type`: a mirror key that holds another Redis type than its pattern's
  (a string at a block key, a hash at a lease...).
"""

MALFORMED_WARNING_INTERVAL_S = 60.0
"""A kind of malformed data is logged (WARNING) at most once per this long; every one is counted."""


class MalformedEntries:
    """How much malformed data from Redis was skipped, by kind (MALFORMED_KINDS). Thread safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(MALFORMED_KINDS, 0)
        self._warned_at: dict[str, float] = {}  # kind -> monotonic time of its last warning

    def add(self, kind: str, what: str) -> None:
        """Count one malformed entry of `kind`; `what` says where (logged, shortened)."""
        now = time.monotonic()
        with self._lock:
            self._counts[kind] += 1
            count = self._counts[kind]
            last = self._warned_at.get(kind)
            if last is not None and now - last < MALFORMED_WARNING_INTERVAL_S:
                return
            self._warned_at[kind] = now
        log.warning("skipped malformed mirror data (%s): %.200s; %d of this kind so far", kind, what, count)

    def by_kind(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


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
        """The lease `text` holds; ValueError when it is malformed (see `parse`)."""
        lease = cls.parse(replica_id, text)
        if lease is None:
            raise ValueError(f"malformed lease of {replica_id!r}: {text[:100]!r}")
        return lease

    @classmethod
    def parse(cls, replica_id: str, raw: object) -> "Lease | None":
        """The lease `raw` (a value read at a lease key) holds, or None when it is malformed. Never raises.

        A lease is a JSON object of at most MAX_LEASE_BYTES with an integer
        incarnation >= 0 and, when present, a string address, integer
        num_requests and num_free_blocks, and a finite number usage.
        """
        if not isinstance(raw, (bytes, str)) or len(raw) > MAX_LEASE_BYTES:
            return None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return None
        if not isinstance(data, dict):
            return None
        incarnation, address = data.get("incarnation"), data.get("address", "")
        num_requests, num_free_blocks = data.get("num_requests", 0), data.get("num_free_blocks", 0)
        usage = data.get("usage", 0.0)
        if not (
            _is_int(incarnation) and incarnation >= 0 and isinstance(address, str) and _is_int(num_requests)
            and _is_int(num_free_blocks) and (_is_int(usage) or isinstance(usage, float)) and math.isfinite(usage)
        ):  # fmt: skip
            return None
        return cls(replica_id, incarnation, address, num_requests, float(usage), num_free_blocks)


MAX_LEASE_BYTES = 4096
"""A longer lease value is malformed: a writer's is about 150 bytes."""


def _is_int(value: object) -> bool:
    return type(value) is int  # not bool


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

    def parse_block(self, key: bytes) -> BlockKey | None:
        """The (group id, block hash) whose `block` key is `key`; None for a key of another namespace or
        another form."""
        head, _, hex_hash = key.rpartition(b":")
        group = head.rpartition(b":")[2]
        if not group.isdigit():
            return None
        group_id = int(group)
        if key != self.block_prefix(group_id) + hex_hash:
            return None
        try:
            return group_id, bytes.fromhex(hex_hash.decode("ascii"))
        except ValueError:  # not hex
            return None

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
