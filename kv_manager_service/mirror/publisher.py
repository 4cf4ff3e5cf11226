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
from itertools import chain
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import redis

from kv_manager_service.core.host_index import HostKeys
from kv_manager_service.shared.events import AllBlocksCleared, BlockStored, KVEvent, Tier
from kv_manager_service.mirror.bulk import CommandTemplate, HashWrites, execute
from kv_manager_service.mirror.collector import pages
from kv_manager_service.mirror.key_set import HostKeySet
from kv_manager_service.mirror.schema import BlockKey, KeySchema, block_entry_value

SWEEP_PAGE_KEYS = 1000
"""Block keys a sweep reads per round trip."""
WRITE_PAGE_KEYS = 10_000
"""Keys a republication (or a clear) writes per round trip: it holds one page of commands, not the pool's."""


class EntryPublisher:
    """This incarnation's block entries in Redis: `republish` a snapshot, then `apply` each batch of events.

    Every method raises redis.RedisError when a write fails. Then some of its
    writes may have landed: the keys it changed are remembered (or, for a
    republication or a clear, which change every key, the next republication
    sweeps), and the next `republish`, which must come before any further
    `apply`, makes them right too.

    What it remembers of the host tier is a HostKeySet, the size of the tier:
    flat arrays, about 50 bytes a host block, never a Python object per key.
    A republication streams: it holds one page of writes at a time.
    """

    def __init__(self, client: redis.Redis, schema: KeySchema, replica_id: str, incarnation: str) -> None:
        self.client = client
        self.schema = schema
        self.replica_id = replica_id
        self.incarnation = incarnation
        # What Redis holds for us: a key is published as a device entry while
        # it has a device count (positive: a key whose count falls to zero is
        # removed), else as a host-only entry while the host tier holds it
        # (at most once: the host index names a key at most once).
        self._published: dict[BlockKey, int] = {}
        self._published_host: HostKeySet | None = None  # None: the last snapshot had no host tier
        self._unsure: set[BlockKey] = set()  # keys a failed batch may have changed
        # Invariant: True from a failure that may have changed any key until a republication sweeps.
        self._needs_sweep = False
        self._key_prefixes: dict[int, bytes] = {}  # group id -> the Redis key of its blocks, less the hash

    def republish(
        self, counts: Mapping[BlockKey, int], host_keys: HostKeys | None, sweep: bool = False
    ) -> tuple[int, int]:
        """Make Redis hold exactly these cached sets for this incarnation: how many hashes it holds, and host-only.

        `counts`: the device tier's cached blocks per key, `host_keys`: what
        the host tier holds (None without one). Entries published before and
        not held any more are deleted. With `sweep`, so is every other entry
        of this replica found in Redis: for a publisher that does not know
        what an earlier one published (a writer process that replaced one
        that died).
        """
        device = {key: count for key, count in counts.items() if count > 0}
        sweep = sweep or self._needs_sweep
        self._needs_sweep = True  # until the last page lands, Redis holds some of before and some of after
        old_device, unsure = self._published, self._unsure
        self._published, self._unsure = device, set()
        host, dropped = self._host_set_for(host_keys)
        writes = HashWrites(self.client, WRITE_PAGE_KEYS)

        def held(key: BlockKey) -> bool:
            return key in device or (host is not None and key in host)

        # `dropped` is consumed first: the host set holds exactly `host_keys` from then on.
        for page in pages((key for key in dropped if key not in device), WRITE_PAGE_KEYS):
            writes.hdel_each(self._redis_keys(page), self.replica_id)
        gone = [key for key in old_device.keys() | unsure if not held(key)]
        writes.hdel_each(self._redis_keys(gone), self.replica_id)
        for page in pages(device, WRITE_PAGE_KEYS):
            writes.hset_each(self._redis_keys(page), self.replica_id, block_entry_value(self.incarnation, Tier.DEVICE))
        num_host_only = 0
        host_entry = block_entry_value(self.incarnation, Tier.HOST)
        for page in pages((key for key in host_keys or () if key not in device), WRITE_PAGE_KEYS):
            writes.hset_each(self._redis_keys(page), self.replica_id, host_entry)
            num_host_only += len(page)
        if sweep:
            self._sweep(writes, held)
        writes.execute()
        self._needs_sweep = False
        return len(device) + num_host_only, num_host_only

    def apply(self, events: Sequence[KVEvent]) -> None:
        """Write the entries that these events, in log order, change."""
        writes = HashWrites(self.client)
        changed: list[BlockKey] = []
        try:
            start = 0
            for position, event in enumerate(events):
                if type(event) is AllBlocksCleared:
                    self._write_changes(events[start:position], writes, changed)
                    self._write_clear(writes)
                    start = position + 1
            self._write_changes(events[start:], writes, changed)
            writes.execute()
        except redis.RedisError:
            self._unsure.update(changed)  # part of the batch may have landed: the resync must clean these too
            raise
        except Exception:
            self._needs_sweep = True  # the counts moved past writes never made: only a sweep finds those keys
            raise

    def _write_changes(self, events: Sequence[KVEvent], writes: HashWrites, changed: list[BlockKey]) -> None:
        """Add to `writes` the entries that `events` (no clear among them) change, and name them in `changed`."""
        # This loop runs once per block event of the pool: plain dict operations. The host set's look-ups
        # (a Python loop each) are left to the keys of host events and, after it, to the keys that end up
        # on no device block: a store on the device needs none.
        device, host = self._published, self._published_host
        was_on_device: dict[BlockKey, bool] = {}  # every key the events name -> it had a device entry before
        was_on_host: dict[BlockKey, bool] = {}  # the keys of host events -> the host held them before
        for event in events:
            delta = 1 if type(event) is BlockStored else -1
            group_id = event.group_id
            if event.tier is Tier.DEVICE:
                for block_hash in event.block_hashes:
                    key = (group_id, block_hash)
                    if key not in was_on_device:
                        was_on_device[key] = key in device
                    count = device.get(key, 0) + delta
                    if count > 0:
                        device[key] = count
                    else:
                        device.pop(key, None)
                continue
            if host is None:
                raise ValueError("a host-tier event from a replica whose snapshot had no host tier")
            for block_hash in event.block_hashes:
                key = (group_id, block_hash)
                if key not in was_on_device:
                    was_on_device[key] = key in device
                if key not in was_on_host:
                    was_on_host[key] = key in host
                if delta > 0:
                    host.add(key)
                else:
                    host.discard(key)
        # The keys whose entry changed, by the tier it names after these events. Lists, not a dict by tier:
        # hashing an enum member is a Python call, once per key. A key the host events did not name was on
        # the host before exactly when it is now.
        now_device: list[BlockKey] = []
        now_host: list[BlockKey] = []
        deleted: list[BlockKey] = []
        for key, had_device_entry in was_on_device.items():
            if key in device:
                if not had_device_entry:
                    now_device.append(key)
                continue
            on_host = host is not None and key in host
            had_host_entry = not had_device_entry and was_on_host.get(key, on_host)
            if on_host:
                if not had_host_entry:
                    now_host.append(key)
            elif had_device_entry or had_host_entry:
                deleted.append(key)
        writes.hdel_each(self._redis_keys(deleted), self.replica_id)
        for keys, tier in ((now_device, Tier.DEVICE), (now_host, Tier.HOST)):
            writes.hset_each(self._redis_keys(keys), self.replica_id, block_entry_value(self.incarnation, tier))
        changed += now_device
        changed += now_host
        changed += deleted

    def _write_clear(self, writes: HashWrites) -> None:
        """Add to `writes` the deletion of every entry: both tiers were cleared. It may change any key:
        should a write fail, the next republication sweeps."""
        self._needs_sweep = True
        device, host = self._published, self._published_host
        keys: Iterable[BlockKey] = device if host is None else chain(device, (key for key in host if key not in device))
        for page in pages(keys, WRITE_PAGE_KEYS):
            writes.hdel_each(self._redis_keys(page), self.replica_id)
        writes.execute()
        device.clear()
        if host is not None:
            host.clear()
        self._needs_sweep = False

    def _host_set_for(self, host_keys: HostKeys | None) -> tuple[HostKeySet | None, Iterator[BlockKey]]:
        """The host set to hold `host_keys`, and the keys that were in it and are not in `host_keys`:
        dropped as they are read, which must be to the end before the set is used."""
        old = self._published_host
        if old is not None and host_keys is not None and old.fits(host_keys):
            return old, old.reconcile(host_keys)
        # A first snapshot, or a tier that appeared, went or changed size: a new set; the old one's keys are dropped.
        new = self._published_host = HostKeySet.of(host_keys) if host_keys is not None else None
        return new, (key for key in old or () if new is None or key not in new)

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

    def _sweep(self, writes: HashWrites, held: Callable[[BlockKey], bool]) -> None:
        """Add to `writes` the deletion of this replica's field from every block key in Redis whose
        (group, hash) is not `held`: a scan of the namespace, a page at a time."""
        holds_field = CommandTemplate(b"HEXISTS", (self.replica_id.encode(),))
        keys = self.client.scan_iter(match=self.schema.block_pattern(), count=SWEEP_PAGE_KEYS)
        for page in pages(keys, SWEEP_PAGE_KEYS):
            replies = execute(self.client, page, holds_field.pack_each(page))
            stale = []
            for key, has_field in zip(page, replies):
                if has_field:
                    block_key = self.schema.parse_block(key)
                    if block_key is None or not held(block_key):
                        stale.append(key)
            writes.hdel_each(stale, self.replica_id)

