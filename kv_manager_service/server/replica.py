"""A replica: one block pool and everything that must change with it, under one lock.

The replica owns the core (`KVCacheManager`) and the state that must move in
step with it: the step log workers follow, the event log the mirror and
watchers follow, the workers' acknowledgements, the journal, the memory of
keyed Steps and, in multi-tenant mode, the tenants' accounting. Every
mutation runs under `lock`, and publishes, journals and remembers what it did
before the lock is released:

- each accepted step appends its `StepDelta` to `steps` (step ids are
  contiguous) and the core's cache events, numbered from 1, to `events`;
  both logs are bounded, and a reader asking for a dropped entry resyncs;
- the journal restarts from a snapshot of all of this (snapshot.py) once
  it has grown enough, between two mutations, so a start replays little;
- each accepted mutation is written to the journal (when there is one)
  before its caller or any worker hears of it; a replica that cannot write
  its journal calls `on_journal_failure` under the lock, which must not return
  to callers as if the step were durable (the server exits);
- copies, the host tier's included (their pins on host blocks), are released
  when every registered worker has acknowledged their step (workers.py); a
  worker registers only by following the step log, and stays registered
  while it streams or acknowledges: one silent for the worker timeout is
  expired (`expire_workers`), or it unregisters; dropping the last worker
  releases every pending copy, since no one is left to perform them;
  after a restart, the journal's workers get a fresh lease;
- a worker with empty memory (a new id, or a known one with a new
  incarnation) empties the prefix cache as it registers, and a worker's
  report of missing KV un-caches what it names (core/invalidation.py): both
  are journaled and replayed like Steps, so a restart loses nothing of what
  was lost and why;
- retention pins expire by this process's clock (pin_clock.py): `expire_pins`
  releases the pins that are due and journals their ids, so a replay or a
  standby releases the same pins at the same point of the history; a pin a
  replay or a snapshot brings back counts its TTL again from then;
- a keyed Step is applied once: the key's lookup, the step and remembering
  its result happen under the lock together, so replaying the journal's
  Steps in order rebuilds the key memory;
- each mutation ends by publishing the pool's figures (`stats`), so readers
  of statistics never wait for the lock behind a long mutation;
- once closed (shutdown), the replica refuses every mutation with
  ShuttingDownError, so nothing is journaled after the journal's owner closes it.

With `check_invariants`, every mutation ends with the core's whole-state
check, accepted or refused; a failure is a bug (AssertionError).

It runs past 500 lines because every mutation takes the one lock and ends the
same way (journal, logs, published figures, invariants): split by subject,
each part would need the others' lock, journal and failure path.

The replica takes and returns values only (`kv_manager_service.shared`): the
servicer converts a call's message once on the way in and the answer once on
the way out, and the journal's codec (journal_records.py) encodes what the
replica journals. Callers, tenants and wire field names are the servicer's
business.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from kv_manager_service.broadcast_log import BroadcastLog, LogTruncatedError
from kv_manager_service.core import KVCacheManager
from kv_manager_service.mirror.schema import CachedSet, Lease
from kv_manager_service.server import journal_records
from kv_manager_service.server.idempotency import StepKey, StepKeys
from kv_manager_service.server.pin_clock import PinClock
from kv_manager_service.server.journal import Journal
from kvcache.journal.v1 import journal_pb2 as jpb
from kv_manager_service.server.journal_records import (
    Entry,
    MissingKVReported,
    PinsExpired,
    PrefixCacheReset,
    SnapshotTaken,
    StepApplied,
    StepsAcked,
    WorkerRegistered,
    WorkerUnregistered,
)
from kv_manager_service.server.retention import ServiceLimits, logged_delta_bytes, logged_event_bytes
from kv_manager_service.server.snapshot import restore_snapshot, take_snapshot
from kv_manager_service.server.tenancy import Tenancy
from kv_manager_service.server.workers import WorkerLease, WorkerRegistry
from kv_manager_service.shared.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    OutOfRangeError,
    ShuttingDownError,
)
from kv_manager_service.shared.events import KVEvent
from kv_manager_service.shared.hash_types import LoraRef, MMFeature
from kv_manager_service.shared.logs import MAX_LOGGED_IDS
from kv_manager_service.shared.ops import (
    AllocateOp,
    BlockTable,
    CacheHit,
    DecodeBatch,
    HostTierStats,
    Invalidation,
    KVLossCause,
    MissingKVReport,
    Op,
    PendingCopy,
    PrefixLookupKeys,
    Stats,
    StepDelta,
    StepResult,
)

log = logging.getLogger("kv_manager_service.server.replica")


# The causes a worker may report (the others the manager finds itself, or a scheduler says).
_REPORTED_CAUSES = (KVLossCause.STEP_REFUSED, KVLossCause.KV_MISSING)



class Replica:
    """One pool and its logs, journal, acknowledgements, key memory and quotas (see the module docstring)."""

    def __init__(
        self,
        manager: KVCacheManager,
        replica_id: str,
        incarnation: int,
        limits: ServiceLimits = ServiceLimits(),
        journal: Journal | None = None,
        tenancy: Tenancy | None = None,
        check_invariants: bool = False,
        on_journal_failure: Callable[[Journal, OSError], None] | None = None,
        worker_timeout_s: float = 10.0,
    ) -> None:
        """Build the replica; with a journal, first replay what it holds, then journal from here on.

        `worker_timeout_s`: a registered worker with no open stream that has not
        been heard from for this long is dropped by `expire_workers`.
        """
        if not manager.config.enable_events:
            raise ValueError("a replica needs a core built with enable_events=True")
        if manager.last_step_id != 0:
            raise ValueError("a replica starts from a fresh core")
        self.manager = manager
        self.replica_id = replica_id
        self.incarnation = incarnation
        self.limits = limits
        self.tenancy = tenancy
        self.check_invariants = check_invariants
        # Reentrant: a keyed Step holds it across the key lookup and the step.
        self.lock = threading.RLock()
        self.step_keys = StepKeys(limits.idempotency_retention, limits.idempotency_retention_bytes)
        # The deltas workers follow, serialized when a worker is sent them, off the lock (the servicer).
        self.steps: BroadcastLog[StepDelta] = BroadcastLog(
            limits.step_retention, limits.step_retention_bytes, logged_delta_bytes
        )
        # (monotonic ns when logged, event): stamped for the mirror's lag.
        self.events: BroadcastLog[tuple[int, KVEvent]] = BroadcastLog(
            limits.event_retention, limits.event_retention_bytes, logged_event_bytes
        )
        self.workers = WorkerRegistry(worker_timeout_s)
        self.pin_clock = PinClock()
        self._on_journal_failure = on_journal_failure
        self._closed = False
        self._stats = (manager.stats(), 0, 0, manager.host_tier_stats())
        # In a high-availability group (ha.py): the records numbered and stamped with the fencing
        # token of the primary that accepted them, for the standbys (`enable_history`).
        self.history: BroadcastLog[bytes] | None = None
        self.last_seq = 0  # the last record's number (counted without a group too, from the journal)
        self.last_record_token = 0  # the fencing token of that record
        self.token = 0  # the highest fencing token this replica has seen: records it accepts carry it
        # Set on a member that is not the serving primary: raises NotPrimaryError, so mutations are refused.
        self.primary_check: Callable[[], None] | None = None
        self._applying = False  # replaying or applying another's records: nothing is journaled or refused
        self.journal: Journal | None = None
        if journal is not None:
            with self._applied():
                exact = journal.file_format >= 4
                for record in journal.records:
                    self._apply_record(record, exact)
            self.workers.renew_all(time.monotonic())  # the journal's workers had no chance to call
            self._publish_stats()
        self.journal = journal

    def end_streams(self) -> None:
        """Close the logs, ending every follower's stream (the first step of a shutdown)."""
        self.steps.close()
        self.events.close()

    def close(self) -> None:
        """Refuse every later mutation; after this the journal's owner may close it."""
        with self.lock:
            self._closed = True
        self.end_streams()

    # -- mutations -----------------------------------------------------------------

    @contextmanager
    def mutating(self) -> Iterator[None]:
        """Hold the lock around a mutation; with `check_invariants`, check the core as it ends.
        A member that is not the serving primary refuses it (`primary_check`), changing nothing."""
        with self.lock:
            if self._closed:
                raise ShuttingDownError("the manager is shutting down; retry after its restart, or on another replica")
            if self.primary_check is not None and not self._applying:
                self.primary_check()
            self._compact_if_due()
            try:
                yield
            finally:
                if self.check_invariants:
                    self.manager.check_invariants()
                self._publish_stats()

    def step(self, ops: Sequence[Op], decode: DecodeBatch | None = None, key: StepKey | None = None) -> StepResult:
        """Apply one step, then log its delta and events and journal it. Invalid input changes nothing.

        `decode`: a Step's decode columns (they continue live requests).
        `key`: a keyed Step's idempotency key, applied once: a repeat (the same key and fingerprint)
        gets the first result back and changes nothing. Looking the key up, applying the step and
        remembering its result happen under the lock at once. The key with another request is
        IdempotencyKeyReusedError. A rejected step is not remembered.
        """
        num_tokens = sum(len(op.token_ids) for op in ops if type(op) is AllocateOp)
        num_ops = len(ops)
        if decode is not None:
            num_tokens += len(decode.token_ids)
            num_ops += len(decode.request_ids)
        if num_tokens > self.limits.max_tokens_per_call:
            raise InvalidArgumentError(
                f"the call carries {num_tokens} token ids; the limit max_tokens_per_call is "
                f"{self.limits.max_tokens_per_call}",
                "token_ids",
            )
        if num_ops > self.limits.max_ops_per_step:
            raise InvalidArgumentError(
                f"the step has {num_ops} ops; the limit max_ops_per_step is {self.limits.max_ops_per_step}", "ops"
            )
        manager = self.manager
        with self.mutating():
            if key is not None:
                remembered = self.step_keys.get(key.key, key.fingerprint)
                if remembered is not None:
                    return remembered
            if self.tenancy is None:
                result = manager.step(ops, decode=decode)
            else:
                result = self.tenancy.step(manager, ops, decode)
            if manager.pins.new:
                self.pin_clock.start(manager.take_new_pins(), time.monotonic())
            self._journal(StepApplied(ops, decode, key))
            self.steps.append(result.delta)
            assert self.steps.last_id == result.step_id, (self.steps.last_id, result.step_id)
            self._publish_events()
            if key is not None:
                self.step_keys.put(key.key, key.fingerprint, result)
        return result

    def open_worker_stream(self, worker_id: str, from_step_id: int, incarnation: int = 0) -> int:
        """A worker follows the step log from `from_step_id` (0: all that is retained); returns the first step id.

        The worker is registered (taken to have done every step before the
        first; registering again changes nothing) and cannot expire until
        `close_worker_stream` is called once for each call of this; its lease
        runs from then. A worker with empty memory (a new id, or a known one
        with a new `incarnation`: see `WorkerRegistry.memory_loss`) first
        empties the prefix cache, and every live request with KV is lost: the
        workers of one pool must all hold all of it. Raises OutOfRangeError for
        a step in the future or no longer retained (nothing is registered then).
        """
        if not worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        with self.mutating():
            first = from_step_id or self.steps.first_retained_id
            if first > self.steps.last_id + 1:
                raise OutOfRangeError(
                    f"from_step_id {first} is in the future (last step is {self.steps.last_id})", "from_step_id"
                )
            check_retained(self.steps, first, "from_step_id", "resync with GetBlockTables")
            registered = WorkerRegistered(worker_id, first - 1, incarnation)
            if self._register(registered, replaying=False):
                self._journal(registered)
            self.workers.open_stream(worker_id, time.monotonic())
        return first

    def _register(self, request: WorkerRegistered, replaying: bool) -> bool:
        """Register a worker (see `open_worker_stream`); returns whether anything changed (to journal).
        Holds the lock."""
        worker_id, incarnation = request.worker_id, request.incarnation
        cause = self.workers.memory_loss(worker_id, incarnation)
        self.workers.register(worker_id, request.from_step_id, time.monotonic(), incarnation)
        if cause is None:
            return False
        invalidation = self.manager.invalidate_all(cause)
        self._publish_events()
        if not replaying:
            log.info(
                "worker %s registered at step %d, incarnation %d (%s): %d cached blocks and %d host blocks dropped, "
                "%d requests lost their KV", worker_id, request.from_step_id, incarnation,
                "joined" if cause is KVLossCause.WORKER_JOINED else "restarted", invalidation.num_uncached_blocks,
                invalidation.num_uncached_host_blocks, len(invalidation.lost_request_ids),
                extra={"worker_id": worker_id, "incarnation": incarnation, "cause": cause.name},
            )  # fmt: skip
        return True

    def report_missing_kv(self, report: MissingKVReport) -> Invalidation:
        """A registered worker does not hold these blocks filled, nor these requests' KV: they leave the
        prefix cache and the requests that would read them are lost (see `KVCacheManager.invalidate_blocks`).

        Refused, changing nothing: FailedPreconditionError (worker_id) for a worker that is not
        registered, or registered under another incarnation (it restarted since: everything it held
        was dropped then); OutOfRangeError for a step never issued; InvalidArgumentError for another
        cause or a block id outside the pool.
        """
        if not report.worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        if report.cause not in _REPORTED_CAUSES:
            raise InvalidArgumentError(
                f"cause must be KV_LOSS_CAUSE_STEP_REFUSED or KV_LOSS_CAUSE_KV_MISSING, got {report.cause}", "cause"
            )
        with self.mutating():
            registered = self.workers.incarnation(report.worker_id)
            if report.incarnation and registered and report.incarnation != registered:
                raise FailedPreconditionError(
                    f"worker {report.worker_id!r} reports as incarnation {report.incarnation}, but incarnation "
                    f"{registered} has registered since; everything the older one held was dropped then",
                    "incarnation",
                )
            if report.step_id > self.manager.last_step_id:
                raise OutOfRangeError(
                    f"step_id {report.step_id} was never issued (last is {self.manager.last_step_id})", "step_id"
                )
            invalidation = self._apply_report(report)
            self._journal(MissingKVReported(report))
        if invalidation.num_uncached_blocks or invalidation.num_uncached_host_blocks or invalidation.lost_request_ids:
            log.info(
                "worker %s reports KV missing at step %d (%s): %d cached blocks and %d host blocks dropped, "
                "%d requests lost their KV", report.worker_id, report.step_id,
                KVLossCause(report.cause).name, invalidation.num_uncached_blocks,
                invalidation.num_uncached_host_blocks, len(invalidation.lost_request_ids),
                extra={"worker_id": report.worker_id, "step_id": report.step_id,
                       "request_ids": list(invalidation.lost_request_ids[:MAX_LOGGED_IDS])},
            )  # fmt: skip
        return invalidation

    def _apply_report(self, report: MissingKVReport) -> Invalidation:
        invalidation = self.manager.invalidate_blocks(
            report.device_block_ids, report.host_block_ids, report.request_ids, KVLossCause(report.cause)
        )
        self._publish_events()
        return invalidation

    def close_worker_stream(self, worker_id: str) -> None:
        """A stream `open_worker_stream` opened has ended: the worker's lease runs from now."""
        with self.lock:
            self.workers.close_stream(worker_id, time.monotonic())

    def ack(self, worker_id: str, step_id: int) -> None:
        """A registered worker finished every step up to `step_id`: release what every worker has finished.

        FailedPreconditionError (field worker_id) for a worker that did not register with WatchSteps.
        """
        if not worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        with self.mutating():
            if step_id > self.manager.last_step_id:
                raise OutOfRangeError(
                    f"step_id {step_id} was never issued (last is {self.manager.last_step_id})", "step_id"
                )
            self._ack(worker_id, step_id)
            self._journal(StepsAcked(worker_id, step_id))

    def unregister_worker(self, worker_id: str) -> None:
        """Drop a registered worker at once, releasing the copies only it held.

        FailedPreconditionError (field worker_id) for a worker that is not registered.
        """
        with self.mutating():
            self._drop_worker(worker_id, "unregistered")

    def expire_workers(self) -> list[str]:
        """Drop every worker without an open stream not heard from for the worker timeout; returns their ids."""
        with self.mutating():
            expired = self.workers.expired(time.monotonic())
            for worker_id in expired:
                self._drop_worker(worker_id, f"expired (silent for {self.workers.timeout_s:g}s)")
        return expired

    def expire_pins(self) -> list[int]:
        """Release the retention pins whose TTL has passed by this process's clock, and journal their
        ids (PinsExpired), so a replay or a standby releases exactly these; returns them."""
        if not len(self.pin_clock):
            return []
        with self.mutating():
            manager = self.manager
            expired = self.pin_clock.due(time.monotonic(), manager.has_pin)
            if expired:
                num_freed = manager.expire_pins(expired)
                self._journal(PinsExpired(tuple(expired)))
                log.info(
                    "%d retention pins expired, %d blocks back in the free queue (still cached)", len(expired),
                    num_freed, extra={"pin_ids": expired[:MAX_LOGGED_IDS]},
                )  # fmt: skip
        return expired

    def worker_statuses(self) -> tuple[list[WorkerLease], int]:
        """The registered workers and the last step id the last mutation published.

        Never waits for the lock (as `stats`): a worker's figures may be a moment
        newer than the step id, so a lag is at least 0.
        """
        return self.workers.statuses(time.monotonic()), self._stats[1]

    def reset_prefix_cache(self) -> bool:
        """Forget the whole prefix cache; refused (False) while any block is held."""
        with self.mutating():
            ok = self.manager.reset_prefix_cache()
            if ok:
                self._journal(PrefixCacheReset())
            self._publish_events()
        return ok

    def _ack(self, worker_id: str, step_id: int) -> None:
        self.workers.ack(worker_id, step_id, time.monotonic())
        self._release()

    def _drop_worker(self, worker_id: str, why: str | None) -> None:
        """Drop a registered worker, journal it, release what the others have all done, and log
        why (None: replaying, no line). Holds the lock."""
        self.workers.remove(worker_id)
        self._journal(WorkerUnregistered(worker_id))
        manager = self.manager
        num_pending, num_pending_tier = len(manager.pending_copies()), len(manager.pending_tier_copies())
        self._release()
        if why is not None:
            log.info(
                "worker %s %s: %d pending copies released, and %d pending tier copies, %d workers left",
                worker_id, why, num_pending - len(manager.pending_copies()),
                num_pending_tier - len(manager.pending_tier_copies()), len(self.workers),
                extra={"worker_id": worker_id},
            )  # fmt: skip

    def _release(self) -> None:
        """Release the copies of every step all registered workers have done; every copy when none is registered."""
        step_id = self.workers.min_acked_step_id()
        if step_id is None:
            step_id = self.manager.last_step_id
        if self.tenancy is None:
            self.manager.ack(step_id)
        else:
            self.tenancy.ack(self.manager, step_id)  # credits each tenant with its copies' blocks

    def _journal(self, entry: Entry) -> None:
        """Record an accepted mutation: in the journal, and in a group's history with the next number
        and this replica's token. Holds the lock."""
        if self._applying or (self.journal is None and self.history is None):
            return
        record = journal_records.encode(entry)
        self.last_seq += 1
        if self.history is not None:
            record.seq = self.last_seq
            record.token = self.last_record_token = self.token
        self._record(record.SerializeToString())

    def _record(self, payload: bytes) -> None:
        """Append one serialized record to the journal and the history. Holds the lock."""
        if self.journal is not None:
            try:
                self.journal.append_serialized(payload)
            except OSError as error:
                if self._on_journal_failure is None:
                    raise
                self._on_journal_failure(self.journal, error)
        if self.history is not None:
            self.history.append(payload)

    def _compact_if_due(self) -> None:
        """Between two mutations (the lock held, the last one complete): restart the journal from a
        snapshot once it has grown enough (journal.py). A snapshot that reached the file but may not
        outlive a power loss is a journal failure."""
        journal = self.journal
        if journal is None or not journal.compaction_due():
            return
        try:
            journal.compact(take_snapshot(self), self.last_seq, self.last_record_token)
        except OSError as error:
            if self._on_journal_failure is None:
                raise
            self._on_journal_failure(journal, error)

    # -- a group's records ---------------------------------------------------------

    def enable_history(self, retention: int, retention_bytes: int) -> None:
        """Keep the records from here on, numbered and stamped, for a group's standbys (ha.py)."""
        with self.lock:
            self.history = BroadcastLog(retention, retention_bytes, len)
            self.history.start_after(self.last_seq)

    @contextmanager
    def _applied(self) -> Iterator[None]:
        """Apply records another accepted (or the journal holds): journal nothing, refuse nothing."""
        self._applying = True
        try:
            yield
        finally:
            self._applying = False

    def apply_records(self, payloads: Sequence[bytes], records: Sequence[jpb.JournalRecord]) -> None:
        """A standby applies its primary's records (`payloads`, parsed as `records`), in order, and
        records them as they are.

        Each must follow this replica's last record (`last_seq` + 1, a token no older), or be a
        snapshot, which replaces
        the whole state (a standby that could not follow the primary's history from where it
        stood). ReplicationError, nothing more applied, for a record that does neither.
        """
        with self.lock:
            try:
                for payload, record in zip(payloads, records):
                    if record.WhichOneof("entry") == "snapshot":
                        self._start_over(record)
                        continue
                    if record.seq != self.last_seq + 1 or record.token < self.last_record_token:
                        raise ReplicationError(
                            f"record {record.seq} of token {record.token} does not follow record {self.last_seq} "
                            f"of token {self.last_record_token}"
                        )
                    with self._applied():
                        self._apply_record(record)
                    self._record(payload)
            finally:
                if self.check_invariants:
                    self.manager.check_invariants()
                self._publish_stats()

    def _start_over(self, record: jpb.JournalRecord) -> None:
        """Replace the whole state by a snapshot record's, and the journal by it. Holds the lock."""
        assert self.tenancy is None, "a group's members are not multi-tenant"
        old_steps, old_events = self.steps, self.events
        self.manager = KVCacheManager(self.manager.config)
        self.workers = WorkerRegistry(self.workers.timeout_s)
        self.pin_clock = PinClock()
        self.step_keys = StepKeys(self.limits.idempotency_retention, self.limits.idempotency_retention_bytes)
        self.steps = BroadcastLog(old_steps.capacity, old_steps.max_bytes, logged_delta_bytes)
        self.events = BroadcastLog(old_events.capacity, old_events.max_bytes, logged_event_bytes)
        old_steps.close()
        old_events.close()
        with self._applied():
            self._apply_record(record)
        if self.history is not None:
            self.history.close()
            self.history = BroadcastLog(self.history.capacity, self.history.max_bytes, len)
            self.history.start_after(record.seq)
        if self.journal is not None:
            self.journal.compact(record.snapshot, record.seq, record.token)

    def _apply_record(self, record: jpb.JournalRecord, exact: bool = True) -> None:
        """Apply one journal record (header excluded), with its number and token when it has them.
        `exact`: the record holds a step's ops and decode columns as applied (format 4 and a group's)."""
        self._replay(journal_records.decode(record), exact)
        self.last_seq = record.seq or self.last_seq + 1  # a record of no group: the next
        if record.token:
            self.last_record_token = record.token
            self.token = max(self.token, record.token)

    def _replay(self, entry: Entry, exact: bool) -> None:
        """Replay one journal entry (not the header) into this replica, after those before it."""
        kind = type(entry)
        if kind is StepApplied:
            if entry.key is not None:
                # It was applied, so it is applied again (a key forgotten and reused since, under
                # a smaller retention than now, must not be taken for a repeat), and remembered.
                self.step_keys.forget(entry.key.key)
                self.step(entry.ops, entry.decode, entry.key)
            elif exact or entry.decode is None:
                self.step(entry.ops, entry.decode)
            else:
                # Formats 2 and 3: applied as allocate ops, the same state, since a single-op
                # call's one-token op in the decode columns may have admitted its request.
                self.step(list(entry.ops) + entry.decode.as_ops())
        elif kind is StepsAcked:
            # A journal written before registration came only from WatchSteps holds
            # acknowledgements of workers it never registered: they register here.
            self.workers.register(entry.worker_id, 0, time.monotonic())
            with self.lock:
                self._ack(entry.worker_id, entry.step_id)
        elif kind is WorkerRegistered:
            with self.lock:
                self._register(entry, replaying=True)
        elif kind is MissingKVReported:
            with self.lock:
                self._apply_report(entry.report)
        elif kind is WorkerUnregistered:
            with self.lock:
                self._drop_worker(entry.worker_id, None)
        elif kind is PrefixCacheReset:
            assert self.reset_prefix_cache(), "a journaled reset must succeed again"
        elif kind is PinsExpired:
            with self.lock:
                self.manager.expire_pins(entry.pin_ids)
        else:
            assert kind is SnapshotTaken, entry
            restore_snapshot(self, entry.snapshot)
            self.pin_clock.start(self.manager.live_pins(), time.monotonic())

    def _publish_stats(self) -> None:
        """Publish the figures `stats` returns, in one assignment so a reader sees one mutation's set."""
        manager = self.manager
        self._stats = (manager.stats(), manager.last_step_id, self.events.last_id, manager.host_tier_stats())

    def _publish_events(self) -> None:
        # Kept as core events, converted when a watcher sends them, off the lock.
        events = self.manager.take_events()
        if events:
            now = time.monotonic_ns()
            self.events.extend([(now, event) for event in events])

    # -- queries -------------------------------------------------------------------

    def find_cache_hit(
        self, token_ids: Sequence[int], cache_salt: str | None, lora: LoraRef | None, mm_features: Sequence[MMFeature]
    ) -> CacheHit:
        with self.lock:
            return self.manager.find_cache_hit(token_ids, cache_salt, lora, mm_features)

    def block_tables(
        self, request_ids: Sequence[str], owned: Callable[[str], bool] | None = None
    ) -> tuple[list[BlockTable], list[PendingCopy], int]:
        """The tables of `request_ids`, the pending copies, and the step they reflect, read together.

        No `request_ids`: every live request's table (those `owned` accepts, when given).
        The host tier's pending copies are not listed: a worker that resyncs here has
        neither the device KV an offload would read nor the host KV an onload would read,
        so it could not perform them; they stay pinned until the workers that received
        them in their deltas acknowledge (or are dropped).
        """
        with self.lock:
            manager = self.manager
            if not request_ids:
                request_ids = [r for r in manager.request_ids() if owned is None or owned(r)]
            tables = [manager.block_table(request_id) for request_id in request_ids]
            return tables, manager.pending_copies(), manager.last_step_id

    def find_cache_hit_and_lookup_keys(
        self, token_ids: Sequence[int], cache_salt: str | None, lora: LoraRef | None, mm_features: Sequence[MMFeature]
    ) -> tuple[CacheHit, PrefixLookupKeys | None]:
        """The local hit of `token_ids`, and what to ask the other replicas about it: one hashing of the prompt."""
        with self.lock:
            return self.manager.find_cache_hit_and_lookup_keys(token_ids, cache_salt, lora, mm_features)

    def stats(self) -> tuple[Stats, int, int, HostTierStats | None]:
        """The pool's figures, the last step id, the last event sequence and the host tier's figures
        (None without one), as the last mutation left them.

        Never waits for the lock: a read of statistics does not queue behind a mutation.
        """
        return self._stats

    def cached_set(self) -> CachedSet:
        """The pool's cached (group, hash) counts, its host tier's keys (None without one) and the
        last event they include (for the mirror)."""
        with self.lock:
            host_tier = self.manager.host_tier
            host_keys = host_tier.cached_block_keys() if host_tier is not None else None
            return self.manager.cached_block_counts(), host_keys, self.events.last_id

    def lease(self, address: str) -> Lease:
        """What the mirror advertises about this replica, serving at `address`."""
        stats = self.manager.stats()
        return Lease(self.replica_id, self.incarnation, address, stats.num_requests, stats.usage, stats.num_free_blocks)


class ReplicationError(ValueError):
    """A group's record that cannot be applied here: the standby must start over from a snapshot."""


def check_retained(log: BroadcastLog, first: int, field: str, hint: str) -> None:
    """OutOfRangeError, naming `field`, when entry `first` of `log` is no longer retained."""
    try:
        log.check_retained(first)
    except LogTruncatedError as e:
        raise OutOfRangeError(f"{field} {first} is no longer retained (oldest is {e.first_retained}); {hint}", field)
