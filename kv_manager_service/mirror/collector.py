"""Collecting the mirror's stale block fields: earlier incarnations' and replicas gone for good.

Readers fence stale fields out (schema.py: a field counts only while its
replica's lease names its incarnation), but nothing else deletes them: a
restarted replica leaves the fields of the blocks its earlier life held and
its new one does not, and a replica that is scaled down leaves all of its
own. So without collection the index grows with every restart.

Every live writer runs a collector; at most one collection runs per
`interval_s` in the whole deployment: a collection starts only by taking
the lock key `{ns}:collector`, which nobody releases, and which expires
after `interval_s`. A collection

1. reads the replica set and its leases. A field is stale when its
   incarnation is older than its replica's bound: the lease's incarnation
   while the lease is alive; for a replica id without a lease (or one met
   only in a block entry) that has been seen so for `collect_after_s`, the
   wall-clock time it was first seen so (a restart after that gets a larger
   incarnation, a start time; hosts whose clocks disagree by more than
   `collect_after_s` could lose a new incarnation's fields, which its next
   resync writes back);
2. scans the namespace's block keys on every node (SCAN MATCH, per master on
   a cluster), reads their fields a page at a time (`page_size` keys) and
   deletes each stale one with schema.DELETE_FIELD_IF, which deletes only
   the value that was read: a field rewritten meanwhile stays. Pages are
   paced to at most `max_keys_per_s`, so a collection is a trickle of load;
3. drops the gone replica ids that were collected from the replica set (a
   replica that comes back adds itself again at its next heartbeat).

Malformed data never stops a collection: it is counted (schema.MALFORMED_KINDS)
and, where it can only be junk, removed. A malformed lease counts as no lease;
a replica-set member that is not UTF-8 is removed from the set; a block key
of another type than a hash is deleted (it holds nobody's fields, and fails
the writers' HSETs to it); a block field that is not UTF-8 is deleted (no
replica id is), and so is a value that names no incarnation, as stale, where
its replica has a bound. A lock key that is not a lock (another type, or no
expiry) is replaced.

The collector's loop (`run`, the writer's "mirror-collector" thread) survives
any exception from a collection: it logs it, counts it, and tries again at
the next interval.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import redis

from kv_manager_service.mirror.schema import (
    DELETE_FIELD_IF,
    DELETE_UNLESS_HASH,
    HOST_ONLY_SUFFIX,
    TAKE_COLLECTOR_LOCK,
    KeySchema,
    Lease,
    MalformedEntries,
    is_wrong_type,
)

log = logging.getLogger("kv_manager_service.mirror.collector")


@dataclass(frozen=True)
class CollectorOptions:
    interval_s: float = 300.0  # at most one collection per this long, deployment-wide
    collect_after_s: float = 600.0  # a replica id without a lease this long is gone: all its fields go
    page_size: int = 500  # block keys read per round trip
    max_keys_per_s: float = 20_000.0  # pacing of a collection's reads

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"--redis-collect-interval-s must be > 0, got {self.interval_s}")
        if not self.collect_after_s > 0:
            raise ValueError(f"--redis-collect-after-s must be > 0, got {self.collect_after_s}")
        if self.page_size < 1 or not self.max_keys_per_s > 0:
            raise ValueError(
                f"page_size and max_keys_per_s must be positive, got {self.page_size} and {self.max_keys_per_s}"
            )


@dataclass
class CollectorMetrics:
    num_collections: int = 0  # collections this process ran (it held the lock)
    num_collected_fields: int = 0  # stale block fields it deleted
    num_collected_replicas: int = 0  # gone replica ids it dropped from the replica set
    num_errors: int = 0  # collections that ended with an exception other than a Redis failure (logged)


@dataclass(frozen=True)
class _Absence:
    since_monotonic: float
    since_wall_ns: int


class StaleFieldCollector:
    """Runs a collection every `options.interval_s` (with jitter) while `may_collect()`, in `run`.

    `owner` names this process in the lock (replica id and incarnation);
    `malformed` counts the malformed data it meets. Failures are logged and
    retried at the next interval.
    """

    def __init__(
        self,
        client: redis.Redis,
        schema: KeySchema,
        owner: str,
        may_collect: Callable[[], bool],
        options: CollectorOptions = CollectorOptions(),
        malformed: MalformedEntries | None = None,
    ) -> None:
        self.client = client
        self.schema = schema
        self.owner = owner
        self.may_collect = may_collect
        self.options = options
        self.metrics = CollectorMetrics()
        self.malformed = malformed or MalformedEntries()
        # replica id -> when it was first seen without a lease (cleared when it has one again)
        self._absent: dict[str, _Absence] = {}
        self._stop = threading.Event()
        self._take_lock = client.register_script(TAKE_COLLECTOR_LOCK)

    def stop(self) -> None:
        """Make `run` return (at once, or after the page it is collecting)."""
        self._stop.set()

    def run(self) -> None:
        """Collect every interval until `stop`; nothing a collection raises (an Exception) ends it."""
        while not self._stop.wait(self.options.interval_s * random.uniform(0.5, 1.0)):
            if not self.may_collect():
                continue
            try:
                self.collect_if_due()
            except redis.RedisError as error:
                log.warning("collecting stale mirror fields failed (%s); retrying in about %.0fs",
                            error, self.options.interval_s)  # fmt: skip
            except Exception:
                self.metrics.num_errors += 1
                log.exception("bug in the mirror collector; retrying in about %.0fs", self.options.interval_s)

    def collect_if_due(self) -> bool:
        """Note which replica ids lack a lease; collect if no collection ran in the last interval.

        Returns whether this call collected. Raises redis.RedisError.
        """
        bounds = self._bounds(self._leases())
        lock_ms = int(self.options.interval_s * 1000)
        taken = self._take_lock(keys=[self.schema.collector_lock], args=[self.owner, lock_ms])
        if taken == 0:
            return False
        if taken == 2:
            self.malformed.add("key_type", f"{self.schema.collector_lock} was no lock (another type, or no expiry)")
        self.collect(bounds)
        return True

    def collect(self, bounds: dict[str, int]) -> None:
        """Delete every block field older than its replica's bound (`bounds`: replica id -> incarnation)."""
        started = time.monotonic()
        num_keys = num_fields = 0
        unknown: set[str] = set()
        for page in pages(self.client.scan_iter(match=self.schema.block_pattern(), count=1000), self.options.page_size):
            num_keys += len(page)
            num_fields += self._collect_page(page, bounds, unknown)
            if self._stop.is_set():
                return
            pace_s = num_keys / self.options.max_keys_per_s - (time.monotonic() - started)
            if pace_s > 0:
                self._stop.wait(pace_s)
        now_monotonic, now_wall_ns = time.monotonic(), time.time_ns()
        for replica_id in unknown - self._absent.keys():
            self._absent[replica_id] = _Absence(now_monotonic, now_wall_ns)
        gone = self._drop_gone(bounds)
        self.metrics.num_collections += 1
        self.metrics.num_collected_fields += num_fields
        log.info("collected %d stale mirror fields in %d block keys and %d gone replica ids in %.1fs",
                 num_fields, num_keys, len(gone), time.monotonic() - started)  # fmt: skip

    def _leases(self) -> dict[str, Lease | None]:
        """Every replica id in the replica set, with its lease (None: none, or a malformed one).

        Members that are not UTF-8 are removed from the set; a replica set of
        another type reads as empty (the writers replace it at their next heartbeat).
        """
        try:
            raw_members = self.client.smembers(self.schema.replicas)
        except redis.ResponseError as error:
            if not is_wrong_type(error):
                raise
            self.malformed.add("key_type", f"{self.schema.replicas} is no set")
            return {}
        members, junk = [], []
        for member in raw_members:
            try:
                members.append(member.decode())
            except UnicodeDecodeError:
                self.malformed.add("replica_member", f"{self.schema.replicas} holds {member!r}")
                junk.append(member)
        if junk:
            self.client.srem(self.schema.replicas, *junk)
        members.sort()
        pipe = self.client.pipeline(transaction=False)
        for replica_id in members:
            pipe.get(self.schema.lease(replica_id))
        leases: dict[str, Lease | None] = {}
        for replica_id, text in zip(members, pipe.execute(raise_on_error=False)):
            key = self.schema.lease(replica_id)
            leases[replica_id] = None
            if isinstance(text, Exception):
                if not is_wrong_type(text):
                    raise text
                self.malformed.add("key_type", f"{key} is no string")
            elif text is not None:
                leases[replica_id] = Lease.parse(replica_id, text)
                if leases[replica_id] is None:
                    self.malformed.add("lease", f"{key} holds {text!r}")
        return leases

    def _bounds(self, leases: dict[str, Lease | None]) -> dict[str, int]:
        """Replica id -> the incarnation below which its fields are stale; notes which ids lack a lease."""
        now_monotonic, now_wall_ns = time.monotonic(), time.time_ns()
        bounds = {}
        for replica_id, lease in leases.items():
            if lease is not None:
                self._absent.pop(replica_id, None)
                bounds[replica_id] = lease.incarnation
            elif replica_id not in self._absent:
                self._absent[replica_id] = _Absence(now_monotonic, now_wall_ns)
        for replica_id, absence in list(self._absent.items()):
            if replica_id not in bounds and now_monotonic - absence.since_monotonic >= self.options.collect_after_s:
                bounds[replica_id] = absence.since_wall_ns
        return bounds

    def _collect_page(self, keys: list[bytes], bounds: dict[str, int], unknown: set[str]) -> int:
        """Delete the stale fields of `keys`; add the replica ids met there without a bound to `unknown`.

        Deletes junk too: keys of another type than a hash, fields that are not
        UTF-8. Returns how many fields it deleted.
        """
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        stale, not_hashes = [], []
        for key, fields in zip(keys, pipe.execute(raise_on_error=False)):
            if isinstance(fields, Exception):
                if not is_wrong_type(fields):
                    raise fields
                self.malformed.add("key_type", f"{key!r} is no hash")
                not_hashes.append(key)
                continue
            for field, value in fields.items():
                try:
                    replica_id = field.decode()
                except UnicodeDecodeError:
                    self.malformed.add("block_field", f"{key!r} holds the field {field!r}")
                    stale.append((key, field, value))
                    continue
                incarnation = _incarnation(value)
                if incarnation < 0:
                    self.malformed.add("block_field", f"{key!r} holds {value!r} for {replica_id!r}")
                bound = bounds.get(replica_id)
                if bound is None:
                    unknown.add(replica_id)
                elif incarnation < bound:
                    stale.append((key, field, value))
        if not stale and not not_hashes:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key in not_hashes:
            pipe.execute_command("EVAL", DELETE_UNLESS_HASH, 1, key)
        for key, field, value in stale:
            pipe.execute_command("EVAL", DELETE_FIELD_IF, 1, key, field, value)  # a cluster pipeline has no eval()
        return sum(pipe.execute()[len(not_hashes) :])

    def _drop_gone(self, bounds: dict[str, int]) -> list[str]:
        """Remove the collected gone replica ids from the replica set, unless one has a lease again."""
        gone = [replica_id for replica_id in bounds if replica_id in self._absent]
        if not gone:
            return []
        pipe = self.client.pipeline(transaction=False)
        for replica_id in gone:
            pipe.exists(self.schema.lease(replica_id))
        still_gone = [replica_id for replica_id, alive in zip(gone, pipe.execute()) if not alive]
        if still_gone:
            try:
                self.client.srem(self.schema.replicas, *still_gone)
            except redis.ResponseError as error:
                if not is_wrong_type(error):
                    raise
                self.malformed.add("key_type", f"{self.schema.replicas} is no set")
        for replica_id in still_gone:
            del self._absent[replica_id]
        self.metrics.num_collected_replicas += len(still_gone)
        return still_gone


def _incarnation(value: bytes) -> int:
    """The incarnation of a block field's value (`schema.block_entry_value`); -1 when malformed (stale)."""
    digits = value.removesuffix(HOST_ONLY_SUFFIX.encode())
    return int(digits) if digits.isdigit() and len(digits) <= MAX_INCARNATION_DIGITS else -1


MAX_INCARNATION_DIGITS = 20
"""An incarnation is a start time in ns (19 digits): a value with more digits names none."""


def pages(keys: Iterable[bytes], page_size: int) -> Iterator[list[bytes]]:
    """`keys` in lists of `page_size` (the last one shorter), as a scan yields them."""
    page: list[bytes] = []
    for key in keys:
        page.append(key)
        if len(page) == page_size:
            yield page
            page = []
    if page:
        yield page
