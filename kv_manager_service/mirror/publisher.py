"""What Redis holds for one replica's incarnation, and the writes that keep it so.

The writer (writer.py) decides when to write: it follows the event log,
holds the lease and resyncs after a failure. The publisher does the per-key
work: it counts the cached blocks per (group, hash) and tier, turns a batch
of events into the entries whose value changed, and writes those in one
bulk round trip (mirror.bulk). A block hash is published while at least one
cached block carries it, in either tier (the device cache does not
de-duplicate): as a device entry while a device block carries it, else as a
host-only entry while the host tier holds it (schema.block_entry_value).

It runs in the writer's thread, or in a process of its own
(publisher_process.py), where that per-key work and the round trip do not
share the server's GIL with its RPCs.
"""

from __future__ import annotations

from binascii import hexlify
from typing import Iterable, Mapping, Sequence

import redis

from kv_manager_service.shared.events import AllBlocksCleared, BlockStored, KVEvent, Tier
from kv_manager_service.mirror.bulk import CommandTemplate, HashWrites, execute
from kv_manager_service.mirror.collector import pages
from kv_manager_service.mirror.schema import BlockKey, KeySchema, block_entry_value

SWEEP_PAGE_KEYS = 1000
"""Block keys a sweep reads per round trip."""


class EntryPublisher:
    """This incarnation's block entries in Redis: `republish` a snapshot, then `apply` each batch of events.

    Every method raises redis.RedisError when a write fails. Then some of its
    writes may have landed: the keys it changed are remembered, and the next
    `republish`, which must come before any further `apply`, makes them
    right too.
    """

    def __init__(self, client: redis.Redis, schema: KeySchema, replica_id: str, incarnation: str) -> None:
        self.client = client
        self.schema = schema
        self.replica_id = replica_id
        self.incarnation = incarnation
        # Counts per tier of what Redis holds for us: a key is published as a
        # device entry while it has a device count, else as a host-only entry
        # while it has a host count. Counts are positive: a key whose count
        # falls to zero is removed.
        self._published: dict[BlockKey, int] = {}
        self._published_host: dict[BlockKey, int] = {}
        self._unsure: set[BlockKey] = set()  # keys a failed write may have changed
        self._key_prefixes: dict[int, bytes] = {}  # group id -> the Redis key of its blocks, less the hash

    def republish(
        self, counts: Mapping[BlockKey, int], host_keys: Iterable[BlockKey], sweep: bool = False
    ) -> tuple[int, int]:
        """Make Redis hold exactly these cached sets for this incarnation: how many hashes it holds, and host-only.

        `counts`: the device tier's cached blocks per key, `host_keys`: what
        the host tier holds. Entries published before and not held any more
        are deleted. With `sweep`, so is every other entry of this replica
        found in Redis: for a publisher that does not know what an earlier
        one published (a writer process that replaced one that died).
        """
        device = {key: count for key, count in counts.items() if count > 0}
        host_only = set(host_keys) - device.keys()
        published = self._published.keys() | self._published_host.keys()
        gone = self._redis_keys((published | self._unsure) - device.keys() - host_only)
        device_keys = self._redis_keys(device)
        host_only_keys = self._redis_keys(host_only)
        if sweep:
            gone.extend(self._entries_in_redis() - set(device_keys) - set(host_only_keys) - set(gone))
        writes = HashWrites(self.client)
        writes.hdel_each(gone, self.replica_id)
        writes.hset_each(device_keys, self.replica_id, block_entry_value(self.incarnation, Tier.DEVICE))
        writes.hset_each(host_only_keys, self.replica_id, block_entry_value(self.incarnation, Tier.HOST))
        try:
            writes.execute()
        except redis.RedisError:
            # These may have landed; the retry deletes what the pool no longer holds.
            self._unsure.update(device)
            self._unsure.update(host_only)
            raise
        self._published = device
        self._published_host = dict.fromkeys(host_keys, 1)
        self._unsure.clear()
        return len(device) + len(host_only), len(host_only)

    def apply(self, events: Sequence[KVEvent]) -> None:
        """Write the entries that these events, in log order, change."""
        # This loop runs once per block event of the pool: plain dict operations.
        device, host = self._published, self._published_host
        before: dict[BlockKey, Tier | None] = {}  # key -> its entry's tier before this batch
        for event in events:
            if type(event) is AllBlocksCleared:
                for key in device.keys() | host.keys():
                    if key not in before:
                        before[key] = Tier.DEVICE if key in device else Tier.HOST
                device.clear()
                host.clear()
                continue
            counts = device if event.tier is Tier.DEVICE else host
            delta = 1 if type(event) is BlockStored else -1
            group_id = event.group_id
            for block_hash in event.block_hashes:
                key = (group_id, block_hash)
                if key not in before:
                    before[key] = Tier.DEVICE if key in device else Tier.HOST if key in host else None
                count = counts.get(key, 0) + delta
                if count > 0:
                    counts[key] = count
                else:
                    counts.pop(key, None)
        # The keys whose entry changed, by the tier it names after this batch. Lists, not a dict by tier:
        # hashing an enum member is a Python call, once per key.
        now_device: list[BlockKey] = []
        now_host: list[BlockKey] = []
        deleted: list[BlockKey] = []
        for key, tier in before.items():
            if key in device:
                if tier is not Tier.DEVICE:
                    now_device.append(key)
            elif key in host:
                if tier is not Tier.HOST:
                    now_host.append(key)
            elif tier is not None:
                deleted.append(key)
        writes = HashWrites(self.client)
        writes.hdel_each(self._redis_keys(deleted), self.replica_id)
        for keys, tier in ((now_device, Tier.DEVICE), (now_host, Tier.HOST)):
            writes.hset_each(self._redis_keys(keys), self.replica_id, block_entry_value(self.incarnation, tier))
        try:
            writes.execute()
        except redis.RedisError:
            # Part of the batch may have landed: the resync must clean these too.
            self._unsure.update(now_device, now_host, deleted)
            raise

    def close(self) -> None:
        """Nothing to release: the client is the caller's."""

    def _redis_keys(self, keys: Iterable[BlockKey]) -> list[bytes]:
        """The Redis keys of block entries, as KeySchema.block spells them, encoded: one format per group."""
        prefixes = self._key_prefixes
        return [
            (prefixes.get(group_id) or self._key_prefix(group_id)) + hexlify(block_hash)
            for group_id, block_hash in keys
        ]

    def _key_prefix(self, group_id: int) -> bytes:
        prefix = self._key_prefixes[group_id] = self.schema.block_prefix(group_id)
        return prefix

    def _entries_in_redis(self) -> set[bytes]:
        """The block keys in Redis that hold a field of this replica, whatever its value: a scan of the namespace."""
        holds_field = CommandTemplate(b"HEXISTS", (self.replica_id.encode(),))
        found: set[bytes] = set()
        keys = self.client.scan_iter(match=self.schema.block_pattern(), count=SWEEP_PAGE_KEYS)
        for page in pages(keys, SWEEP_PAGE_KEYS):
            replies = execute(self.client, page, holds_field.pack_each(page))
            found.update(key for key, held in zip(page, replies) if held)
        return found
