"""Reading the Redis mirror: which live replica holds the longest prefix, and routing.

A lookup is one pipelined round trip: the replica set, the leases of the
replicas known so far, and the entry of every block hash of the request. A
replica discovered by that round trip has its lease read by a second, small
one (once). Per replica the prefix stops at its first missing block.

A lookup is on the RPC path, so it has a budget: its Redis client is its
own (no lookup waits behind the writer's calls) and its socket timeout is
the budget. After a failure the lookups skip Redis for `skip_after_failure_s`,
then one lookup probes it: a Redis that is down or stuck costs one budget
per period, not one per call. The caller answers from its own pool then.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import redis

from kv_manager_service.core.ops import PrefixLookupKeys
from kv_manager_service.mirror.schema import ClusterUnavailableError, KeySchema, Lease

log = logging.getLogger("kv_manager_service.mirror.lookup")


@dataclass(frozen=True)
class ReplicaPrefix:
    replica_id: str
    num_cached_blocks: int
    lease: Lease


class ClusterIndex:
    """Longest cached prefix per live replica, from the mirror. Thread safe for reads.

    `client` is the lookups' own: its socket timeout is their budget.
    """

    def __init__(self, client: redis.Redis, schema: KeySchema, skip_after_failure_s: float = 1.0) -> None:
        self.client = client
        self.schema = schema
        self.skip_after_failure_s = skip_after_failure_s
        self._known_replicas: tuple[str, ...] = ()
        self._lock = threading.Lock()
        self._skip_until = 0.0  # monotonic; lookups before it do not call Redis
        self._failing = False  # the last lookup that called Redis failed
        self.num_failures = 0  # lookups that could not read Redis
        self.num_skipped = 0  # lookups that did not call Redis after a recent failure

    def lookup(self, group_id: int, block_hashes: Sequence[bytes]) -> list[ReplicaPrefix]:
        """Per live replica, how many leading `block_hashes` of `group_id` it holds cached.

        Raises ClusterUnavailableError when Redis cannot be read within the
        budget, or is skipped after a recent failure.
        """
        with self._lock:
            now = time.monotonic()
            if now < self._skip_until:
                self.num_skipped += 1
                raise ClusterUnavailableError("skipped: Redis failed recently")
            if self._failing:  # this lookup probes Redis; the others skip meanwhile
                self._skip_until = now + self.skip_after_failure_s
        try:
            prefixes = self._lookup(group_id, block_hashes)
        except redis.RedisError as error:
            with self._lock:
                self.num_failures += 1
                if not self._failing:
                    log.warning("cluster lookup failed (%s); lookups answer for this replica only, "
                                "probing Redis every %.1fs", error, self.skip_after_failure_s)  # fmt: skip
                self._failing = True
                self._skip_until = time.monotonic() + self.skip_after_failure_s
            raise ClusterUnavailableError(str(error)) from error
        if self._failing:
            with self._lock:
                self._failing = False
                self._skip_until = 0.0
            log.info("cluster lookups read Redis again")
        return prefixes

    def prefix_hits(self, keys: PrefixLookupKeys) -> list[tuple[str, int]]:
        """(replica id, cached tokens) per live replica for a prompt's lookup keys.

        Hits end on the lcm of the block sizes (`keys.alignment`), as local
        hits do. Raises ClusterUnavailableError when Redis cannot be read.
        """
        alignment = keys.alignment
        return [
            (p.replica_id, p.num_cached_blocks * keys.block_size // alignment * alignment)
            for p in self.lookup(keys.group_id, keys.block_hashes)
        ]

    def _lookup(self, group_id: int, block_hashes: Sequence[bytes]) -> list[ReplicaPrefix]:
        schema = self.schema
        known = self._known_replicas
        pipe = self.client.pipeline(transaction=False)
        pipe.smembers(schema.replicas)
        for replica_id in known:
            pipe.get(schema.lease(replica_id))
        for block_hash in block_hashes:
            pipe.hgetall(schema.block(group_id, block_hash))
        replies = pipe.execute()
        members = sorted(_text(m) for m in replies[0])
        leases = {r: Lease.from_json(r, text) for r, text in zip(known, replies[1 : 1 + len(known)]) if text}
        entries = replies[1 + len(known) :]
        new = [r for r in members if r not in known]
        if new:
            pipe = self.client.pipeline(transaction=False)
            for replica_id in new:
                pipe.get(schema.lease(replica_id))
            for replica_id, text in zip(new, pipe.execute()):
                if text:
                    leases[replica_id] = Lease.from_json(replica_id, text)
        self._known_replicas = tuple(members)

        prefixes = []
        for replica_id, lease in leases.items():
            field = replica_id.encode()
            incarnation = str(lease.incarnation).encode()
            num_blocks = 0
            for entry in entries:
                if entry.get(field) != incarnation:
                    break
                num_blocks += 1
            prefixes.append(ReplicaPrefix(replica_id, num_blocks, lease))
        return prefixes


def choose_replica(prefixes: Sequence[ReplicaPrefix]) -> str | None:
    """The replica with the longest cached prefix; ties go to the least loaded (usage, then requests)."""
    if not prefixes:
        return None
    best = min(prefixes, key=lambda p: (-p.num_cached_blocks, p.lease.usage, p.lease.num_requests, p.replica_id))
    return best.replica_id


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
