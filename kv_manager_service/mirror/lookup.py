"""Reading the Redis mirror: which live replica holds the longest prefix, and routing.

A lookup is one pipelined round trip: the replica set, the leases of the
replicas known so far, and the entry of every block hash of the request. A
replica discovered by that round trip has its lease read by a second, small
one (once). Per replica the prefix stops at its first block missing from
both its tiers: it may hold some blocks of it on the device and some only in
its host tier (schema.block_entry_value says which), in any order, as a
local hit may continue from the device into the host tier.

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
from fractions import Fraction
from typing import Sequence

import redis

from kv_manager_service.core.ops import PrefixLookupKeys
from kv_manager_service.core.events import Tier
from kv_manager_service.mirror.schema import (
    ClusterUnavailableError,
    KeySchema,
    Lease,
    ReplicaTokens,
    block_entry_value,
)

log = logging.getLogger("kv_manager_service.mirror.lookup")

HOST_HIT_WEIGHT = Fraction(4, 5)
"""What a cached block only in a replica's host tier is worth to routing, against a device block (1).

A host block saves its recomputation but costs a host -> device copy (an
onload) before the forward pass. An estimate, not a measurement of this
project: for Llama-3-8B a 16-token block holds 2 MiB of KV (32 layers x K and
V x 8 KV heads x 128 x 2 bytes x 16 tokens), about 85 us over a 25 GB/s
PCIe 4 link, against about 0.5 ms to recompute its 16 tokens (2 x 8e9 x 16
FLOP at ~500 TFLOP/s achieved). So a host block saves about 85% of what a
device block saves: 0.8, rounded down because the copy also shares the link
with the step's other transfers and takes a device block. A Fraction, so
that equal scores compare equal and ties fall through to the load as before.
"""


@dataclass(frozen=True)
class ReplicaPrefix:
    """One replica's cached prefix of a lookup: `num_cached_blocks` in both tiers, chain order.

    `num_host_blocks` of them are held only in its host tier (0 without one).
    """

    replica_id: str
    num_cached_blocks: int
    lease: Lease
    num_host_blocks: int = 0


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
        """Per live replica, how many leading `block_hashes` of `group_id` it holds cached, in either tier.

        Raises ClusterUnavailableError when Redis cannot be read within the
        budget, or is skipped after a recent failure.
        """
        return [
            ReplicaPrefix(lease.replica_id, len(is_host), lease, sum(is_host))
            for lease, is_host in self._guarded_lookup(group_id, block_hashes)
        ]

    def prefix_hits(self, keys: PrefixLookupKeys) -> list[ReplicaTokens]:
        """Cached tokens per live replica, both tiers and host-only, for a prompt's lookup keys.

        Hits end on the lcm of the block sizes (`keys.alignment`), as local
        hits do; the host-only tokens are those of the blocks kept. Raises
        ClusterUnavailableError when Redis cannot be read.
        """
        alignment = keys.alignment
        hits = []
        for lease, is_host in self._guarded_lookup(keys.group_id, keys.block_hashes):
            num_tokens = len(is_host) * keys.block_size // alignment * alignment
            num_host_blocks = sum(is_host[: num_tokens // keys.block_size])
            hits.append(ReplicaTokens(lease.replica_id, num_tokens, num_host_blocks * keys.block_size))
        return hits

    def _guarded_lookup(self, group_id: int, block_hashes: Sequence[bytes]) -> list[tuple[Lease, list[bool]]]:
        """`_lookup` within the failure policy of the module docstring."""
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

    def _lookup(self, group_id: int, block_hashes: Sequence[bytes]) -> list[tuple[Lease, list[bool]]]:
        """Per live replica, its lease and, per block of its cached prefix, whether only its host holds it."""
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
            incarnation = str(lease.incarnation)
            on_device = block_entry_value(incarnation, Tier.DEVICE).encode()
            host_only = block_entry_value(incarnation, Tier.HOST).encode()
            is_host: list[bool] = []
            for entry in entries:
                value = entry.get(field)
                if value == on_device:
                    is_host.append(False)
                elif value == host_only:
                    is_host.append(True)
                else:
                    break
            prefixes.append((lease, is_host))
        return prefixes


def choose_replica(prefixes: Sequence[ReplicaPrefix]) -> str | None:
    """The replica whose cached prefix saves the most: device blocks + HOST_HIT_WEIGHT x host-only blocks.

    Without host tiers that is the longest prefix. Ties go to the least
    loaded (usage, then requests), then the smallest replica id.
    """
    if not prefixes:
        return None

    def rank(p: ReplicaPrefix) -> tuple:
        score = p.num_cached_blocks - p.num_host_blocks + HOST_HIT_WEIGHT * p.num_host_blocks
        return (-score, p.lease.usage, p.lease.num_requests, p.replica_id)

    return min(prefixes, key=rank).replica_id


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
