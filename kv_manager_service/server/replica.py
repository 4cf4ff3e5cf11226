"""A replica: one block pool and everything that must change with it, under one lock.

The replica owns the core (`KVCacheManager`) and the state that must move in
step with it: the step log workers follow, the event log the mirror and
watchers follow, the workers' acknowledgements, the journal, the memory of
keyed Steps and, in multi-tenant mode, the tenants' accounting. Every
mutation runs under `lock`, and publishes, journals and remembers what it did
before the lock is released:

- each accepted step appends one serialized `StepDelta` to `steps` (step ids
  are contiguous) and the core's cache events, numbered from 1, to `events`;
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
- a keyed Step is applied once: the key's lookup, the step and remembering
  its response happen under the lock together, so replaying the journal's
  Steps in order rebuilds the key memory;
- each mutation ends by publishing the pool's figures (`stats`), so readers
  of statistics never wait for the lock behind a long mutation;
- once closed (shutdown), the replica refuses every mutation with
  ShuttingDownError, so nothing is journaled after the journal's owner closes it.

With `check_invariants`, every mutation ends with the core's whole-state
check, accepted or refused; a failure is a bug (AssertionError).

The replica speaks the core's types, plus the two messages it must keep as
sent: a Step's request (journaled, and fingerprinted for its key) and its
response (remembered for the key). Callers, tenants and wire field names are
the servicer's business.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kv_manager_service.core import (
    AllocateOp,
    BlockTable,
    CacheHit,
    HostTierStats,
    KVCacheManager,
    LoraRef,
    MMFeature,
    PendingCopy,
    PrefixLookupKeys,
    Stats,
    StepResult,
)
from kv_manager_service.core.events import KVEvent
from kv_manager_service.core.ops import DecodeBatch, Invalidation, KVLossCause, Op
from kv_manager_service.mirror.schema import CachedSet, Lease
from kv_manager_service.rpc import convert
from kv_manager_service.rpc.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    OutOfRangeError,
    ShuttingDownError,
)
from kv_manager_service.rpc.logs import MAX_LOGGED_IDS
from kv_manager_service.broadcast_log import BroadcastLog, LogTruncatedError
from kv_manager_service.server.idempotency import StepKeys, request_fingerprint
from kv_manager_service.server.journal import Journal
from kv_manager_service.server.snapshot import restore_snapshot, take_snapshot
from kv_manager_service.server.tenancy import Tenancy
from kv_manager_service.server.workers import WorkerLease, WorkerRegistry
from kvcache.v1 import journal_pb2
from kvcache.v1 import kv_manager_pb2 as pb

log = logging.getLogger("kv_manager_service.server.replica")


@dataclass(frozen=True)
class ServiceLimits:
    """Per-call limits and log retention; anything past a limit is refused with a message naming it.

    Each retention is bounded in entries and in bytes, whichever is reached
    first (the defaults in bytes add up to 0.3 GiB; strings and lists of a
    call are bounded by `rpc.bounds`).
    """

    max_tokens_per_call: int = 1 << 20
    max_ops_per_step: int = 1 << 16
    step_retention: int = 100_000  # step deltas kept for WatchSteps
    event_retention: int = 100_000  # events kept for WatchEvents
    idempotency_retention: int = 100_000  # keyed Steps remembered (see idempotency.py)
    step_retention_bytes: int = 128 << 20  # serialized step deltas
    event_retention_bytes: int = 64 << 20  # events, as `logged_event_bytes` estimates them
    idempotency_retention_bytes: int = 128 << 20  # keys and responses of keyed Steps

    def __post_init__(self) -> None:
        for name in (
            "max_tokens_per_call",
            "max_ops_per_step",
            "step_retention",
            "event_retention",
            "idempotency_retention",
            "step_retention_bytes",
            "event_retention_bytes",
            "idempotency_retention_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def logged_delta_bytes(delta: bytes) -> int:
    """A serialized StepDelta's memory in the step log: its bytes, the object's header and the log's slot."""
    return len(delta) + 64


def logged_event_bytes(entry: tuple[int, KVEvent]) -> int:
    """An estimate of a logged event's memory: ~256 bytes of objects, and each hash with its object
    and slot (a BlockStored of 8 sha256 hashes measures ~890 bytes with tracemalloc)."""
    event = entry[1]
    hashes = getattr(event, "block_hashes", ())
    return 256 + (len(hashes) + 1) * (len(hashes[0]) + 40 if hashes else 0)


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
        # Serialized StepDeltas: a parsed message costs several times its bytes,
        # and the log holds up to step_retention of them.
        self.steps: BroadcastLog[bytes] = BroadcastLog(
            limits.step_retention, limits.step_retention_bytes, logged_delta_bytes
        )
        # (monotonic ns when logged, event): stamped for the mirror's lag.
        self.events: BroadcastLog[tuple[int, KVEvent]] = BroadcastLog(
            limits.event_retention, limits.event_retention_bytes, logged_event_bytes
        )
        self.workers = WorkerRegistry(worker_timeout_s)
        self._on_journal_failure = on_journal_failure
        self._closed = False
        self._stats = (manager.stats(), 0, 0, manager.host_tier_stats())
        self.journal: Journal | None = None
        if journal is not None:
            self._replay(journal.records)
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
        """Hold the lock around a mutation; with `check_invariants`, check the core as it ends."""
        with self.lock:
            if self._closed:
                raise ShuttingDownError("the manager is shutting down; retry after its restart, or on another replica")
            self._compact_if_due()
            try:
                yield
            finally:
                if self.check_invariants:
                    self.manager.check_invariants()
                self._publish_stats()

    def step(
        self, ops: Sequence[Op], decode: DecodeBatch | None = None, request: pb.StepRequest | None = None
    ) -> StepResult:
        """Apply one step, then log its delta and events and journal it. Invalid input changes nothing.

        `decode`: a Step's decode columns (they continue live requests).
        `request`: the Step message the ops come from, journaled as sent; None
        for a single-op call, journaled as a Step of its ops.
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
            if self.tenancy is None:
                result = manager.step(ops, decode=decode)
            else:
                result = self.tenancy.step(manager, ops, decode)
            if self.journal is not None:
                journaled = request if request is not None else convert.step_request(ops)
                self._journal(journal_pb2.JournalRecord(step=journal_pb2.JournalStep(ops=journaled)))
            self.steps.append(convert.step_delta(result.delta).SerializeToString())
            assert self.steps.last_id == result.step_id, (self.steps.last_id, result.step_id)
            self._publish_events()
        return result

    def keyed_step(
        self,
        request: pb.StepRequest,
        ops: Sequence[Op],
        decode: DecodeBatch | None,
        respond: Callable[[StepResult], pb.StepResponse],
    ) -> pb.StepResponse:
        """Apply a Step that carries an idempotency key once; a repeat gets the first response.

        Looking the key up, applying the step and remembering `respond`'s
        answer happen under the lock at once. The key with another request is
        IdempotencyKeyReusedError. A rejected step is not remembered.
        """
        key = request.idempotency_key
        fingerprint = request_fingerprint(request)
        with self.lock:
            stored = self.step_keys.get(key, fingerprint)
            if stored is not None:
                return pb.StepResponse.FromString(stored)
            response = respond(self.step(ops, decode, request))
            self.step_keys.put(key, fingerprint, response.SerializeToString())
        return response

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
            registered = pb.WatchStepsRequest(worker_id=worker_id, from_step_id=first - 1, incarnation=incarnation)
            if self._register(registered, replaying=False):
                self._journal(journal_pb2.JournalRecord(register_worker=registered))
            self.workers.open_stream(worker_id, time.monotonic())
        return first

    def _register(self, request: pb.WatchStepsRequest, replaying: bool) -> bool:
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

    def report_missing_kv(self, request: pb.ReportMissingKVRequest) -> Invalidation:
        """A registered worker does not hold these blocks filled, nor these requests' KV: they leave the
        prefix cache and the requests that would read them are lost (see `KVCacheManager.invalidate_blocks`).

        Refused, changing nothing: FailedPreconditionError (worker_id) for a worker that is not
        registered, or registered under another incarnation (it restarted since: everything it held
        was dropped then); OutOfRangeError for a step never issued; InvalidArgumentError for another
        cause or a block id outside the pool.
        """
        if not request.worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        if request.cause not in _REPORTED_CAUSES:
            raise InvalidArgumentError(
                f"cause must be KV_LOSS_CAUSE_STEP_REFUSED or KV_LOSS_CAUSE_KV_MISSING, got {request.cause}", "cause"
            )
        with self.mutating():
            registered = self.workers.incarnation(request.worker_id)
            if request.incarnation and registered and request.incarnation != registered:
                raise FailedPreconditionError(
                    f"worker {request.worker_id!r} reports as incarnation {request.incarnation}, but incarnation "
                    f"{registered} has registered since; everything the older one held was dropped then",
                    "incarnation",
                )
            if request.step_id > self.manager.last_step_id:
                raise OutOfRangeError(
                    f"step_id {request.step_id} was never issued (last is {self.manager.last_step_id})", "step_id"
                )
            invalidation = self._apply_report(request)
            self._journal(journal_pb2.JournalRecord(report_missing_kv=request))
        if invalidation.num_uncached_blocks or invalidation.num_uncached_host_blocks or invalidation.lost_request_ids:
            log.info(
                "worker %s reports KV missing at step %d (%s): %d cached blocks and %d host blocks dropped, "
                "%d requests lost their KV", request.worker_id, request.step_id,
                KVLossCause(request.cause).name, invalidation.num_uncached_blocks,
                invalidation.num_uncached_host_blocks, len(invalidation.lost_request_ids),
                extra={"worker_id": request.worker_id, "step_id": request.step_id,
                       "request_ids": list(invalidation.lost_request_ids[:MAX_LOGGED_IDS])},
            )  # fmt: skip
        return invalidation

    def _apply_report(self, request: pb.ReportMissingKVRequest) -> Invalidation:
        invalidation = self.manager.invalidate_blocks(
            request.device_block_ids, request.host_block_ids, request.request_ids, KVLossCause(request.cause)
        )
        self._publish_events()
        return invalidation

    def close_worker_stream(self, worker_id: str) -> None:
        """A stream `open_worker_stream` opened has ended: the worker's lease runs from now."""
        with self.lock:
            self.workers.close_stream(worker_id, time.monotonic())

    def ack(self, request: pb.AckStepsRequest) -> None:
        """A registered worker finished every step up to `request.step_id`: release what every worker has finished.

        FailedPreconditionError (field worker_id) for a worker that did not register with WatchSteps.
        """
        if not request.worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        with self.mutating():
            if request.step_id > self.manager.last_step_id:
                raise OutOfRangeError(
                    f"step_id {request.step_id} was never issued (last is {self.manager.last_step_id})", "step_id"
                )
            self._ack(request)
            self._journal(journal_pb2.JournalRecord(ack=request))

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
                self._journal(journal_pb2.JournalRecord(reset_prefix_cache=pb.ResetPrefixCacheRequest()))
            self._publish_events()
        return ok

    def _ack(self, request: pb.AckStepsRequest) -> None:
        self.workers.ack(request.worker_id, request.step_id, time.monotonic())
        self._release()

    def _drop_worker(self, worker_id: str, why: str | None) -> None:
        """Drop a registered worker, journal it, release what the others have all done, and log
        why (None: replaying, no line). Holds the lock."""
        self.workers.remove(worker_id)
        self._journal(journal_pb2.JournalRecord(unregister_worker=pb.UnregisterWorkerRequest(worker_id=worker_id)))
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

    def _journal(self, record: journal_pb2.JournalRecord) -> None:
        """Write an accepted mutation to the journal. Holds the lock."""
        if self.journal is None:
            return
        try:
            self.journal.append(record)
        except OSError as error:
            if self._on_journal_failure is None:
                raise
            self._on_journal_failure(self.journal, error)

    def _compact_if_due(self) -> None:
        """Between two mutations (the lock held, the last one complete): restart the journal from a
        snapshot once it has grown enough (journal.py). A snapshot that reached the file but may not
        outlive a power loss is a journal failure."""
        journal = self.journal
        if journal is None or not journal.compaction_due():
            return
        try:
            journal.compact(take_snapshot(self))
        except OSError as error:
            if self._on_journal_failure is None:
                raise
            self._on_journal_failure(journal, error)

    def _replay(self, records: Sequence[journal_pb2.JournalRecord]) -> None:
        """Replay a journal's records (header excluded) into this fresh replica, in order."""
        for record in records:
            kind = record.WhichOneof("entry")
            if kind == "step":
                request = record.step.ops
                ops, decode = convert.step_ops(request)
                if request.idempotency_key:
                    # It was applied, so it is applied again (a key forgotten and reused since, under
                    # a smaller retention than now, must not be taken for a repeat), and remembered.
                    self.step_keys.forget(request.idempotency_key)
                    self.keyed_step(request, ops, decode, convert.step_response)
                else:
                    # A single-op call is journaled as a Step whose decode-shaped op may sit in the
                    # decode columns, though it may have admitted its request: applied as allocate ops.
                    self.step(ops + decode.as_ops() if decode is not None else ops)
            elif kind == "ack":
                # A journal written before registration came only from WatchSteps holds
                # acknowledgements of workers it never registered: they register here.
                self.workers.register(record.ack.worker_id, 0, time.monotonic())
                with self.lock:
                    self._ack(record.ack)
            elif kind == "register_worker":
                with self.lock:
                    self._register(record.register_worker, replaying=True)
            elif kind == "report_missing_kv":
                with self.lock:
                    self._apply_report(record.report_missing_kv)
            elif kind == "unregister_worker":
                with self.lock:
                    self._drop_worker(record.unregister_worker.worker_id, None)
            elif kind == "reset_prefix_cache":
                assert self.reset_prefix_cache(), "a journaled reset must succeed again"
            elif kind == "snapshot":
                restore_snapshot(self, record.snapshot)
            else:
                raise ValueError(f"unexpected journal record {kind!r}")

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
        """The pool's cached (group, hash) counts, its host tier's keys (empty without one) and the
        last event they include (for the mirror)."""
        with self.lock:
            host_tier = self.manager.host_tier
            host_keys = host_tier.cached_block_keys() if host_tier is not None else set()
            return self.manager.cached_block_counts(), host_keys, self.events.last_id

    def lease(self, address: str) -> Lease:
        """What the mirror advertises about this replica, serving at `address`."""
        stats = self.manager.stats()
        return Lease(self.replica_id, self.incarnation, address, stats.num_requests, stats.usage, stats.num_free_blocks)


def check_retained(log: BroadcastLog, first: int, field: str, hint: str) -> None:
    """OutOfRangeError, naming `field`, when entry `first` of `log` is no longer retained."""
    try:
        log.check_retained(first)
    except LogTruncatedError as e:
        raise OutOfRangeError(f"{field} {first} is no longer retained (oldest is {e.first_retained}); {hint}", field)
