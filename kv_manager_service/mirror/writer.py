"""The writer of the Redis mirror: this replica's cached block hashes, in the background.

It follows the service's event log (bounded: that is the pending queue) and
hands each batch of events to its publisher (publisher.py), which writes
the entries they change in one round trip; it is never on the RPC path. A
block hash is published while at least one cached block of this replica
carries it, in either tier; its entry says which (schema.block_entry_value).
The publisher runs in this writer's thread (the default), or in a process
of its own (publisher_process.py), for which the thread here waits without
holding the GIL. When Redis fails (or the publisher's process
dies), or the writer falls behind the log's retention, it sets a resync
flag; on recovery it takes a snapshot of the pool's cached set in both
tiers and has the publisher republish it: what it had published and no
longer holds is deleted, the rest written, and the deltas resume, so the
mirror converges to exactly what the pool holds.

The lease. A heartbeat claims or renews the replica's lease by
compare-and-set (schema.CLAIM_LEASE). The writer writes only while it holds
the lease: from a renewal until three quarters of the TTL after it was sent,
which ends before Redis can expire the key and let another manager claim it.
A lease held by another incarnation is waited on for up to about one TTL (a
crashed predecessor's lease lapses; a live twin renews it); after that, or
at once if this writer held the lease before, the writer is fenced: it stops
for good, logs an ERROR and sets `metrics.fenced`. Entries of one replica id
therefore always come from one manager.

On a Redis Cluster (connect.py) a failed write or renewal, as a master's
failover causes, resyncs as above once the cluster answers again; so does a
grown configuration epoch seen by the heartbeat, for a writer that was idle
during the failover. While it holds the lease, the writer's collector
(collector.py) deletes stale fields of every replica id, its own earlier
incarnations' included.

Malformed data at the keys the heartbeat writes is replaced, counted in
`metrics.malformed`: a lease value at this replica's id that is not a lease
(schema.Lease.parse) is nobody's, so the renewal overwrites it, by
compare-and-set on the value it read; a lease key or replica set of another
Redis type is replaced too (schema.CLAIM_LEASE, schema.ADD_REPLICA).

Threads. The writer's three threads ("mirror-writer", "mirror-heartbeat" and
"mirror-collector") survive any Exception from their work: they log it,
count it (`metrics.num_errors`) and retry, the writer after a backoff and a
resync, the heartbeat at its next beat, the collector at its next interval.
A thread that ends otherwise (a BaseException, or an error in the handling
itself) is dead: `dead_thread` names it, a CRITICAL line says why, and
`on_thread_death(thread_name, error)` is called, for the server to stop
reporting itself healthy.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import redis

from kv_manager_service.broadcast_log import BroadcastLog, LogTruncatedError
from kv_manager_service.shared.events import KVEvent
from kv_manager_service.shared.logs import OutageLog
from kv_manager_service.mirror.collector import CollectorMetrics, CollectorOptions, StaleFieldCollector
from kv_manager_service.mirror.connect import cluster_epoch
from kv_manager_service.mirror.schema import (
    ADD_REPLICA,
    CLAIM_LEASE,
    DROP_LEASE,
    CachedSet,
    KeySchema,
    Lease,
    MalformedEntries,
    ReplicaIdInUseError,
)
from kv_manager_service.mirror.publisher import EntryPublisher
from kv_manager_service.mirror.publisher_process import PublisherProcess

log = logging.getLogger("kv_manager_service.mirror.writer")

Publisher = EntryPublisher | PublisherProcess


class MalformedLeaseError(Exception):
    """Our lease key kept holding malformed values, each replaced by another before the renewal could replace it."""


@dataclass(frozen=True)
class MirrorOptions:
    lease_ttl_s: float = 10.0
    batch_events: int = 4096  # events per pipeline
    coalesce_s: float = 0.002  # wait this long after new events before writing them
    retry_backoff_s: float = 0.2
    max_retry_backoff_s: float = 2.0
    collector: CollectorOptions = CollectorOptions()

    def __post_init__(self) -> None:
        if self.lease_ttl_s < 0.3:
            raise ValueError(f"lease_ttl_s must be >= 0.3, got {self.lease_ttl_s}")


@dataclass
class MirrorMetrics:
    num_failures: int = 0  # Redis calls that failed
    num_resyncs: int = 0  # full re-publications
    num_published: int = 0  # events applied to Redis
    queue_depth: int = 0  # events logged but not yet written
    lag_ms: float = 0.0  # age of the newest event written, when written
    fenced: bool = False  # another manager holds this replica id's lease: nothing is written any more
    collector: CollectorMetrics = field(default_factory=CollectorMetrics)  # stale fields deleted (collector.py)
    malformed: MalformedEntries = field(default_factory=MalformedEntries)  # malformed Redis data met (writer, collector)
    num_errors: int = 0  # unexpected exceptions of the writer and heartbeat threads, logged and survived


class MirrorWriter:
    def __init__(
        self,
        client: redis.Redis,
        schema: KeySchema,
        replica_id: str,
        incarnation: int,
        events: BroadcastLog[tuple[int, KVEvent]],
        snapshot: Callable[[], CachedSet],
        lease: Callable[[], Lease],
        options: MirrorOptions = MirrorOptions(),
        publisher: Publisher | None = None,
        metrics: MirrorMetrics | None = None,
        takeover: bool = False,
    ) -> None:
        """`metrics`: figures to count on (a group's member keeps one set across its terms as primary).
        `takeover`: a lease of a lower incarnation may be taken over (a group's new primary)."""
        self.client = client
        self.schema = schema
        self.replica_id = replica_id
        self.incarnation = str(incarnation)
        self.events = events
        self.snapshot = snapshot
        self.lease = lease
        self.options = options
        self.metrics = metrics or MirrorMetrics()
        self.metrics.fenced = False
        self._takeover = "1" if takeover else ""
        # The per-key work: in this thread, or in a process of its own (publisher_process.py).
        self.publisher = publisher or EntryPublisher(client, schema, replica_id, self.incarnation)
        self._next_sequence = 1
        self._resync = True
        self._claim_lease = client.register_script(CLAIM_LEASE)
        self._drop_lease = client.register_script(DROP_LEASE)
        self._add_replica = client.register_script(ADD_REPLICA)
        self._held_until = 0.0  # monotonic; we may write before it
        self._writing_since_ns: int | None = None  # when the oldest event of the batch being written was logged
        self._ever_held = False
        self._refused_since: float | None = None  # monotonic; first refusal while we never held the lease
        self._cluster_epoch: int | None = None  # the highest configuration epoch of a Redis Cluster seen
        self.collector = StaleFieldCollector(
            client, schema, f"{replica_id}:{incarnation}", self._holds_lease, options.collector, self.metrics.malformed
        )
        self.metrics.collector = self.collector.metrics
        # Called once by a thread that died (see the module docstring), with its name and what ended it.
        self.on_thread_death: Callable[[str, BaseException], None] | None = None
        self.dead_thread: str | None = None  # the name of the first thread that died
        # Redis down: one WARNING, then one a minute, then one line when it answers again.
        self.outage = OutageLog(
            log, f"the mirror's Redis ({schema.namespace})",
            "this replica answers from its own pool, and the mirror is written again once Redis answers",
        )  # fmt: skip
        self._stop = threading.Event()
        self._threads = [
            self._supervised_thread("mirror-writer", self._write_loop),
            self._supervised_thread("mirror-heartbeat", self._heartbeat_loop),
            self._supervised_thread("mirror-collector", self.collector.run),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop writing and drop the lease if it is ours, so readers stop trusting our entries now."""
        self._stop.set()
        self.collector.stop()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5)
        self.publisher.close()
        try:
            self._drop_lease(keys=[self.schema.lease(self.replica_id)], args=[self.incarnation])
        except redis.RedisError:
            pass

    def claim_at_start(self) -> None:
        """Claim the lease before the server serves, waiting up to about one TTL for another's to lapse.

        Raises ReplicaIdInUseError when another incarnation keeps it alive.
        When Redis cannot be reached it returns: the heartbeat claims later,
        and fences the writer instead of refusing the start.
        """
        deadline = time.monotonic() + self._wait_for_other_s
        warned = False
        while True:
            try:
                other = self._renew()
            except redis.RedisError as error:
                self.metrics.num_failures += 1
                self.outage.failed(error)
                return
            except MalformedLeaseError as error:
                log.warning("%s; claiming the lease of %r in the background", error, self.replica_id)
                return
            if other is None:
                return
            if time.monotonic() >= deadline:
                raise ReplicaIdInUseError(self._in_use_message(other))
            if not warned:
                log.warning("replica id %r is leased by incarnation %d at %s; waiting up to %.1fs for it to lapse",
                            self.replica_id, other.incarnation, other.address, self._wait_for_other_s)  # fmt: skip
                warned = True
            self._stop.wait(self.options.lease_ttl_s / 10)

    def _supervised_thread(self, name: str, work: Callable[[], None]) -> threading.Thread:
        """A daemon thread running `work`, which returns only when stopped or fenced: anything else is a death."""

        def run() -> None:
            try:
                work()
            except BaseException as error:  # the work's loops catch every Exception: this is a death
                self._thread_died(name, error)

        return threading.Thread(target=run, name=name, daemon=True)

    def _thread_died(self, name: str, error: BaseException) -> None:
        self.dead_thread = self.dead_thread or name
        log.critical("the mirror's thread %s died (%s: %s): the mirror no longer works; restart this manager",
                     name, type(error).__name__, error, exc_info=error)  # fmt: skip
        if self.on_thread_death is not None:
            self.on_thread_death(name, error)

    # -- writer --------------------------------------------------------------------

    def _write_loop(self) -> None:
        backoff = self.options.retry_backoff_s
        while not self._stop.is_set():
            # Counted on every pass, so that it also grows while a failing resync retries.
            self.metrics.queue_depth = max(0, self.events.last_id - self._next_sequence + 1)
            if time.monotonic() >= self._held_until:
                if self.metrics.fenced:
                    return
                self._stop.wait(0.02)  # not leased (yet, or lapsed): the heartbeat claims it
                continue
            try:
                if self._resync:
                    self._republish()
                self._write_batch()
                backoff = self.options.retry_backoff_s
            except LogTruncatedError:
                log.warning("mirror fell behind the event log's retention; resyncing")
                self._resync = True
            except redis.RedisError as error:
                self.metrics.num_failures += 1
                self._resync = True
                self.outage.failed(error)  # retried after `backoff`, then the writer resyncs
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.options.max_retry_backoff_s)
            except Exception:
                self.metrics.num_errors += 1
                self._resync = True
                log.exception("bug in the mirror writer; retrying in %.1fs, then resyncing", backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.options.max_retry_backoff_s)

    def _republish(self) -> None:
        """Make Redis hold exactly the pool's current cached set, both tiers, for this incarnation."""
        counts, host_keys, sequence = self.snapshot()
        num_hashes, num_host_only = self.publisher.republish(counts, host_keys)
        self._next_sequence = sequence + 1
        self._resync = False
        self.metrics.num_resyncs += 1
        log.info("mirror republished %d block hashes (%d host-only) up to event %d",
                 num_hashes, num_host_only, sequence)  # fmt: skip

    def _write_batch(self) -> None:
        batch = self.events.read(self._next_sequence, self.options.batch_events, timeout_s=0.2)
        if not batch:
            self.metrics.queue_depth = 0
            return
        if len(batch) < self.options.batch_events and self.options.coalesce_s > 0:
            # The RPC that logged these is still sending its reply: let it
            # finish (the writer competes with it for the GIL) and gather
            # what the next steps log.
            self._stop.wait(self.options.coalesce_s)
            batch = self.events.read(self._next_sequence, self.options.batch_events, timeout_s=0)
        self.metrics.queue_depth = self.events.last_id - self._next_sequence + 1
        self._writing_since_ns = batch[0][1][0]
        try:
            self.publisher.apply([event for _, (_, event) in batch])
        finally:
            self._writing_since_ns = None
        last_sequence, (appended_ns, _) = batch[-1]
        self._next_sequence = last_sequence + 1
        self.metrics.num_published += len(batch)
        self.metrics.queue_depth = self.events.last_id - last_sequence
        self.metrics.lag_ms = (time.monotonic_ns() - appended_ns) / 1e6

    # -- lease -----------------------------------------------------------------------

    @property
    def _wait_for_other_s(self) -> float:
        """How long another incarnation's lease is waited on: one TTL, and one heartbeat for slack."""
        return self.options.lease_ttl_s * 4 / 3

    def _refresh_backlog(self) -> None:
        """While a batch is being written, the queue depth and the lag keep growing (from the heartbeat's
        thread): a write that stalls shows in them before its deadline fails it."""
        oldest_ns = self._writing_since_ns
        if oldest_ns is not None:
            self.metrics.queue_depth = max(0, self.events.last_id - self._next_sequence + 1)
            self.metrics.lag_ms = max(self.metrics.lag_ms, (time.monotonic_ns() - oldest_ns) / 1e6)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            self._refresh_backlog()
            try:
                other = self._renew()
                if other is not None and (
                    self._ever_held or time.monotonic() - self._refused_since >= self._wait_for_other_s
                ):
                    self._fence(other)
                    return
                self._notice_failover()
                self.outage.succeeded()
            except redis.RedisError as error:
                self.metrics.num_failures += 1
                self.outage.failed(error)
            except MalformedLeaseError as error:
                log.warning("lease heartbeat: %s; retrying", error)
            except Exception:
                self.metrics.num_errors += 1
                log.exception("bug in the lease heartbeat; retrying")
            self._stop.wait(self.options.lease_ttl_s / 3)

    def _renew(self) -> Lease | None:
        """Claim or renew our lease; None when we hold it now, else the other incarnation's lease.

        A malformed value at our lease key is nobody's lease: it is counted
        and replaced. Raises MalformedLeaseError when it changed before it
        could be (another malformed value was written meanwhile).
        """
        sent = time.monotonic()
        ttl_ms = int(self.options.lease_ttl_s * 1000)
        key = self.schema.lease(self.replica_id)
        lease_json = self.lease().to_json()
        replaceable = b""  # "=" + a malformed value read at the key: nobody's lease, so the claim may replace it
        for _ in range(2):
            outcome = self._claim_lease(keys=[key], args=[self.incarnation, lease_json, ttl_ms, replaceable, self._takeover])
            if isinstance(outcome, int):
                break
            other = Lease.parse(self.replica_id, outcome)
            if other is not None:
                self._held_until = 0.0
                self._refused_since = self._refused_since or sent
                return other
            self.metrics.malformed.add("lease", f"{key} holds {outcome!r}")
            replaceable = b"=" + outcome
        else:
            raise MalformedLeaseError(f"the lease key {key} changed while its malformed value was replaced")
        if outcome == 2 and not replaceable:
            self.metrics.malformed.add("key_type", f"{key} held another type than a lease")
        if outcome != 1:
            # No lease (or none that was one): this is our first claim, or Redis
            # restarted (or lost data) without the writer seeing an error.
            # Either way a republication makes the mirror whole.
            self._resync = True
        self._held_until = sent + self.options.lease_ttl_s * 3 / 4
        self._ever_held = True
        if self._add_replica(keys=[self.schema.replicas], args=[self.replica_id]):
            self.metrics.malformed.add("key_type", f"{self.schema.replicas} held another type than a set")
        return None

    def _holds_lease(self) -> bool:
        return not self.metrics.fenced and time.monotonic() < self._held_until

    def _notice_failover(self) -> None:
        """Resync when a Redis Cluster's configuration epoch grew: a failover (or a resharding) happened.

        A master's writes that its replica had not copied yet die with it,
        acknowledged, and a writer that was idle then saw no error: only a
        republication makes the mirror whole again. A node that lags in
        gossip reports an older epoch, which is ignored.
        """
        epoch = cluster_epoch(self.client)
        if epoch is None:
            return
        if self._cluster_epoch is not None and epoch > self._cluster_epoch:
            log.info("the Redis Cluster's configuration changed (epoch %d -> %d): republishing the mirror",
                     self._cluster_epoch, epoch)  # fmt: skip
            self._resync = True
        self._cluster_epoch = max(epoch, self._cluster_epoch or 0)

    def _fence(self, other: Lease) -> None:
        self.metrics.fenced = True
        self._held_until = 0.0
        log.error("%s; this manager stopped writing to the mirror and serves from its own pool only",
                  self._in_use_message(other))  # fmt: skip

    def _in_use_message(self, other: Lease) -> str:
        return (
            f"replica id {self.replica_id!r} is held by another live manager (incarnation {other.incarnation} "
            f"at {other.address or 'an unknown address'}) in the same Redis: give each manager its own "
            "--replica-id, or stop the other one first"
        )
