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
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import redis

from kv_manager_service.mirror.schema import DELETE_FIELD_IF, KeySchema, Lease

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


@dataclass(frozen=True)
class _Absence:
    since_monotonic: float
    since_wall_ns: int


class StaleFieldCollector:
    """Runs a collection every `options.interval_s` (with jitter) while `may_collect()`, in its own thread.

    `owner` names this process in the lock (replica id and incarnation).
    Failures are logged and retried at the next interval.
    """

    def __init__(
        self,
        client: redis.Redis,
        schema: KeySchema,
        owner: str,
        may_collect: Callable[[], bool],
        options: CollectorOptions = CollectorOptions(),
    ) -> None:
        self.client = client
        self.schema = schema
        self.owner = owner
        self.may_collect = may_collect
        self.options = options
        self.metrics = CollectorMetrics()
        # replica id -> when it was first seen without a lease (cleared when it has one again)
        self._absent: dict[str, _Absence] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mirror-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.options.interval_s * random.uniform(0.5, 1.0)):
            if not self.may_collect():
                continue
            try:
                self.collect_if_due()
            except redis.RedisError as error:
                log.warning("collecting stale mirror fields failed (%s); retrying in about %.0fs",
                            error, self.options.interval_s)  # fmt: skip
            except Exception:
                log.exception("bug in the mirror collector; retrying in about %.0fs", self.options.interval_s)

    def collect_if_due(self) -> bool:
        """Note which replica ids lack a lease; collect if no collection ran in the last interval.

        Returns whether this call collected. Raises redis.RedisError.
        """
        bounds = self._bounds(self._leases())
        lock_ms = int(self.options.interval_s * 1000)
        if not self.client.set(self.schema.collector_lock, self.owner, nx=True, px=lock_ms):
            return False
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
        """Every replica id in the replica set, with its lease (None: none)."""
        members = sorted(m.decode() for m in self.client.smembers(self.schema.replicas))
        pipe = self.client.pipeline(transaction=False)
        for replica_id in members:
            pipe.get(self.schema.lease(replica_id))
        return {
            replica_id: None if text is None else Lease.from_json(replica_id, text)
            for replica_id, text in zip(members, pipe.execute())
        }

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
        """Delete the stale fields of `keys`; add the replica ids met there without a bound to `unknown`."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        stale = []
        for key, fields in zip(keys, pipe.execute()):
            for field, value in fields.items():
                replica_id = field.decode()
                bound = bounds.get(replica_id)
                if bound is None:
                    unknown.add(replica_id)
                elif _incarnation(value) < bound:
                    stale.append((key, field, value))
        if not stale:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for key, field, value in stale:
            pipe.execute_command("EVAL", DELETE_FIELD_IF, 1, key, field, value)  # a cluster pipeline has no eval()
        return sum(pipe.execute())

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
            self.client.srem(self.schema.replicas, *still_gone)
        for replica_id in still_gone:
            del self._absent[replica_id]
        self.metrics.num_collected_replicas += len(still_gone)
        return still_gone


def _incarnation(value: bytes) -> int:
    """The incarnation of a block field's value (`schema.block_entry_value`); -1 when unreadable (stale)."""
    head = value.split(b":", 1)[0]
    return int(head) if head.isdigit() else -1


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
