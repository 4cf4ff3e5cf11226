"""Reading the Redis mirror: which live replica holds the longest prefix, and routing.

A lookup reads the replica set, the leases, and the block entries of the
request in growing chunks, and stops as soon as no live replica matches any
more. The first round trip reads the replica set, the leases of the
replicas known so far and the first FIRST_CHUNK_BLOCKS entries; each later
one reads the next chunk (CHUNK_GROWTH times as far as the last), and only
the fields of the replicas that matched every block so far (HMGET; whole
entries with HGETALL while more than HMGET_MAX_FIELDS still match). So a
replica that stopped matching costs nothing further, a prompt that nobody
holds costs one round trip, and one that a replica holds to its end costs a
round trip per chunk (2 for 511 blocks). The first chunk reads the replicas
that were alive at the last lookup only: a dead replica's entries, which
stay until collected, cost nothing, and one that is new, or alive again,
has its lease and first chunk read by one more, small round trip (once).
Commands go out through `mirror.bulk`: packed in bulk, one batch per node
on a Redis Cluster, all nodes in parallel. Each round trip has the whole
budget (below).

Per replica the prefix stops at its first block missing from both its
tiers: it may hold some blocks of it on the device and some only in its
host tier (schema.block_entry_value says which), in any order, as a local
hit may continue from the device into the host tier. An entry counts only
when its value names the incarnation of the replica's live lease.

Malformed data is skipped and counted (schema.MALFORMED_KINDS): a replica
whose lease is malformed is left out of the answer (its own writer replaces
the value at its next heartbeat), a replica-set member that is not UTF-8 is
ignored, and a key of another type reads as absent (a read that meets one
costs two more round trips: one to find which keys, one to read the rest).

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
from binascii import hexlify
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import redis

from kv_manager_service.shared.ops import PrefixLookupKeys
from kv_manager_service.shared.events import Tier
from kv_manager_service.mirror import bulk
from kv_manager_service.mirror.schema import (
    ClusterUnavailableError,
    KeySchema,
    Lease,
    MalformedEntries,
    ReplicaTokens,
    block_entry_value,
    is_wrong_type,
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
        self._known_replicas: tuple[str, ...] = ()  # the replica set at the last lookup
        self._live_replicas: tuple[str, ...] = ()  # those of them with a live lease then
        self._lock = threading.Lock()
        self._skip_until = 0.0  # monotonic; lookups before it do not call Redis
        self._failing = False  # the last lookup that called Redis failed
        self.num_failures = 0  # lookups that could not read Redis
        self.num_skipped = 0  # lookups that did not call Redis after a recent failure
        self.malformed = MalformedEntries()  # malformed data the lookups skipped

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
        known, live_before = self._known_replicas, self._live_replicas
        key_prefix = schema.block_prefix(group_id)
        first_end = min(len(block_hashes), FIRST_CHUNK_BLOCKS)
        first_keys = [key_prefix + hexlify(h) for h in block_hashes[:first_end]]
        keys: list[str | bytes] = [schema.replicas, *(schema.lease(r) for r in known)]
        commands = [bulk.pack_command("SMEMBERS", schema.replicas), *(GET.pack(key) for key in keys[1:])]
        if live_before:
            read_fields = _entry_read(live_before)
            keys += first_keys
            commands += read_fields.pack_each(first_keys)
        replies = self._read(keys, commands)
        members = sorted(self._replica_ids(replies[0]))
        prefixes: dict[str, _Prefix] = {}
        self._add_leases(prefixes, known, replies[1 : 1 + len(known)])
        _extend(prefixes, live_before, replies[1 + len(known) :])
        # Replicas whose first chunk is unread: new in the set (their leases unread too), or alive again.
        new = [r for r in members if r not in known]
        late = [r for r in prefixes if r not in live_before]
        if new or late:
            read_fields = _entry_read(late + new)
            lease_keys = [schema.lease(r) for r in new]
            commands = [GET.pack(k) for k in lease_keys] + read_fields.pack_each(first_keys)
            replies = self._read(lease_keys + first_keys, commands)
            self._add_leases(prefixes, new, replies[: len(new)])
            _extend(prefixes, late + new, replies[len(new) :])
        self._known_replicas = tuple(members)
        self._live_replicas = tuple(prefixes)

        start = first_end
        while start < len(block_hashes):
            # Invariant: a matching replica has matched every block before `start`.
            matching = [r for r, p in prefixes.items() if p.matching]
            if not matching:
                break
            end = min(len(block_hashes), start * CHUNK_GROWTH)
            block_keys = [key_prefix + hexlify(h) for h in block_hashes[start:end]]
            commands = _entry_read(matching).pack_each(block_keys)
            _extend(prefixes, matching, self._read(block_keys, commands))
            start = end
        return [(p.lease, p.is_host) for p in prefixes.values()]

    def _read(self, keys: Sequence[str | bytes], commands: Sequence[bytes]) -> list:
        """`bulk.execute`, where a key of another type than its command reads replies None (absent), counted.

        Raises redis.RedisError for any other error, or when the keys' types keep changing.
        """
        try:
            return bulk.execute(self.client, keys, commands)
        except redis.ResponseError as error:
            if not is_wrong_type(error):
                raise
        # Rare: find the keys of the wrong type (TYPE never fails), then read the others.
        expected = [_READ_TYPES[command.split(b"\r\n", 3)[2]] for command in commands]
        types = bulk.execute(self.client, keys, [TYPE.pack(key) for key in keys])
        readable = [i for i, (kind, wanted) in enumerate(zip(types, expected)) if kind in (wanted, b"none")]
        for i in sorted(set(range(len(keys))) - set(readable)):
            self.malformed.add("key_type", f"{keys[i]!r} holds a {types[i]!r}")
        replies: list = [None] * len(keys)
        for i, reply in zip(readable, bulk.execute(self.client, [keys[i] for i in readable],
                                                   [commands[i] for i in readable])):  # fmt: skip
            replies[i] = reply
        return replies

    def _replica_ids(self, members: list[bytes] | None) -> list[str]:
        """The replica set's members that are replica ids (UTF-8); None: the set was of another type."""
        replica_ids = []
        for member in members or ():
            try:
                replica_ids.append(_text(member))
            except UnicodeDecodeError:
                self.malformed.add("replica_member", f"{self.schema.replicas} holds {member!r}")
        return replica_ids

    def _add_leases(
        self, prefixes: dict[str, _Prefix], replica_ids: Sequence[str], texts: Sequence[bytes | None]
    ) -> None:
        """A prefix for every replica whose lease is alive (the GET found it) and well-formed."""
        for replica_id, text in zip(replica_ids, texts):
            if text is None:
                continue
            lease = Lease.parse(replica_id, text)
            if lease is None:
                self.malformed.add("lease", f"{self.schema.lease(replica_id)} holds {text!r}")
            else:
                prefixes[replica_id] = _Prefix(lease)


FIRST_CHUNK_BLOCKS = 64
"""Block entries the first round trip reads: a prompt that no replica holds past them costs one round trip."""
CHUNK_GROWTH = 8
"""Each later chunk ends this many times as far as the last one: 64, 512, 4096 blocks.

A round trip costs far more than reading one more field of a block entry
(an HMGET is one command whatever its fields), so the chunks grow fast: an
8k-token prompt (511 blocks) takes 2 round trips, a 32k one 3, while a
replica that stopped matching at block k is read at most to the end of k's
chunk (< 8k + 64 entries), never to the prompt's end.
"""
HMGET_MAX_FIELDS = 8
"""Up to this many replicas a chunk reads their fields (HMGET); past it, whole entries (HGETALL): `_entry_read`."""
GET = bulk.CommandTemplate(b"GET")
HGETALL = bulk.CommandTemplate(b"HGETALL")
TYPE = bulk.CommandTemplate(b"TYPE")
_READ_TYPES = {b"SMEMBERS": b"set", b"GET": b"string", b"HMGET": b"hash", b"HGETALL": b"hash"}
"""The Redis type each read of a lookup reads: a key of another type reads as absent (`ClusterIndex._read`)."""


class _Prefix:
    """One live replica's prefix while a lookup reads it: per block read, whether only its host tier holds it."""

    __slots__ = ("lease", "is_host", "matching", "on_device", "host_only")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.is_host: list[bool] = []
        self.matching = True  # every block read so far is in one of its tiers
        incarnation = str(lease.incarnation)
        self.on_device = block_entry_value(incarnation, Tier.DEVICE).encode()
        self.host_only = block_entry_value(incarnation, Tier.HOST).encode()


def _entry_read(replica_ids: Sequence[str]) -> bulk.CommandTemplate:
    """The command that reads these replicas' fields of a block entry: HMGET of them, or HGETALL for many.

    Redis keeps a small hash as a listpack and finds each HMGET field by a
    linear scan: F fields of an H-field entry cost F x H, against H for
    HGETALL. Past HMGET_MAX_FIELDS the whole entry is cheaper to read.
    """
    if len(replica_ids) > HMGET_MAX_FIELDS:
        return HGETALL
    return bulk.CommandTemplate(b"HMGET", tuple(r.encode() for r in replica_ids))


def _extend(prefixes: dict[str, _Prefix], fields: Sequence[str], entries: Sequence) -> None:
    """Extend the matching prefixes of `fields` by the next `entries`, consecutive blocks read by `_entry_read(fields)`:
    HMGET replies (one value per field) or HGETALL ones (a map; a flat list of fields and values in RESP2);
    None for an entry that was of another type (read as absent)."""
    whole = len(fields) > HMGET_MAX_FIELDS
    if None in entries:
        absent = {} if whole else [None] * len(fields)
        entries = [absent if e is None else e for e in entries]
    if whole:
        entries = [e if isinstance(e, dict) else dict(zip(e[::2], e[1::2])) for e in entries]
    for position, replica_id in enumerate(fields):
        prefix = prefixes.get(replica_id)
        if prefix is None or not prefix.matching:
            continue  # no live lease, or it stopped matching earlier
        on_device, host_only, is_host = prefix.on_device, prefix.host_only, prefix.is_host
        field = replica_id.encode()
        for entry in entries:
            value = entry.get(field) if whole else entry[position]
            if value == on_device:
                is_host.append(False)
            elif value == host_only:
                is_host.append(True)
            else:
                prefix.matching = False
                break


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
