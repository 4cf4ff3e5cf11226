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
- each accepted mutation is written to the journal (when there is one)
  before its caller or any worker hears of it; a replica that cannot write
  its journal calls `on_journal_failure` under the lock, which must not return
  to callers as if the step were durable (the server exits);
- copies are released when every registered worker has acknowledged their
  step; a worker registers by following the step log or by acknowledging, and
  stays registered; with no worker registered, any acknowledgement releases;
- a keyed Step is applied once: the key's lookup, the step and remembering
  its response happen under the lock together, so replaying the journal's
  Steps in order rebuilds the key memory.

With `check_invariants`, every mutation ends with the core's whole-state
check, accepted or refused; a failure is a bug (AssertionError).

The replica speaks the core's types, plus the two messages it must keep as
sent: a Step's request (journaled, and fingerprinted for its key) and its
response (remembered for the key). Callers, tenants and wire field names are
the servicer's business.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Counter, Iterator, Sequence

from kv_manager_service.core import (
    AllocateOp,
    BlockTable,
    CacheHit,
    KVCacheManager,
    LoraRef,
    MMFeature,
    PendingCopy,
    PrefixLookupKeys,
    Stats,
    StepResult,
)
from kv_manager_service.core.events import KVEvent
from kv_manager_service.core.ops import Op
from kv_manager_service.mirror.schema import Lease
from kv_manager_service.rpc import convert
from kv_manager_service.rpc.errors import InvalidArgumentError, OutOfRangeError, RequestNotFoundError
from kv_manager_service.server.broadcast_log import BroadcastLog, LogTruncatedError
from kv_manager_service.server.idempotency import StepKeys, check_key, request_fingerprint
from kv_manager_service.server.journal import Journal
from kv_manager_service.server.tenancy import Tenancy
from kvcache.v1 import journal_pb2
from kvcache.v1 import kv_manager_pb2 as pb


@dataclass(frozen=True)
class ServiceLimits:
    """Per-call limits and log retention; anything past a limit is refused with a message naming it."""

    max_tokens_per_call: int = 1 << 20
    max_ops_per_step: int = 1 << 16
    step_retention: int = 100_000  # step deltas kept for WatchSteps
    event_retention: int = 100_000  # events kept for WatchEvents
    idempotency_retention: int = 100_000  # keyed Steps remembered (see idempotency.py)

    def __post_init__(self) -> None:
        for name in (
            "max_tokens_per_call",
            "max_ops_per_step",
            "step_retention",
            "event_retention",
            "idempotency_retention",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# A consistent view of the pool for the mirror: its cached (group, hash) counts,
# and the sequence of the last event they include.
CachedSnapshot = tuple[Counter, int]


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
    ) -> None:
        """Build the replica; with a journal, first replay what it holds, then journal from here on."""
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
        self.step_keys = StepKeys(limits.idempotency_retention)
        # Serialized StepDeltas: a parsed message costs several times its bytes,
        # and the log holds up to step_retention of them.
        self.steps: BroadcastLog[bytes] = BroadcastLog(limits.step_retention)
        # (monotonic ns when logged, event): stamped for the mirror's lag.
        self.events: BroadcastLog[tuple[int, KVEvent]] = BroadcastLog(limits.event_retention)
        self.worker_acks: dict[str, int] = {}
        self._on_journal_failure = on_journal_failure
        self.journal: Journal | None = None
        if journal is not None:
            self._replay(journal.records)
        self.journal = journal

    def close(self) -> None:
        """End every follower of the logs (on shutdown); the journal is closed by its owner."""
        self.steps.close()
        self.events.close()

    # -- mutations -----------------------------------------------------------------

    @contextmanager
    def mutating(self) -> Iterator[None]:
        """Hold the lock around a mutation; with `check_invariants`, check the core as it ends."""
        with self.lock:
            try:
                yield
            finally:
                if self.check_invariants:
                    self.manager.check_invariants()

    def step(self, ops: Sequence[Op], num_decode: int = 0, request: pb.StepRequest | None = None) -> StepResult:
        """Apply one step, then log its delta and events and journal it. Invalid input changes nothing.

        The last `num_decode` ops come from a Step's decode columns: they must
        continue live requests (a RequestNotFoundError located at that op
        otherwise). `request`: the Step message the ops come from, journaled
        as sent; None for a single-op call, journaled as a Step of its ops.
        """
        num_tokens = sum(len(op.token_ids) for op in ops if type(op) is AllocateOp)
        if num_tokens > self.limits.max_tokens_per_call:
            raise InvalidArgumentError(
                f"the call carries {num_tokens} token ids; the limit max_tokens_per_call is "
                f"{self.limits.max_tokens_per_call}",
                "token_ids",
            )
        if len(ops) > self.limits.max_ops_per_step:
            raise InvalidArgumentError(
                f"the step has {len(ops)} ops; the limit max_ops_per_step is {self.limits.max_ops_per_step}", "ops"
            )
        num_nested = len(ops) - num_decode
        manager = self.manager
        with self.mutating():
            for index in range(num_nested, len(ops)):
                if not manager.has_request(ops[index].request_id):
                    error = RequestNotFoundError(
                        f"decode entry {index - num_nested}: unknown request id {ops[index].request_id!r} "
                        "(decode continues live requests)",
                        "request_id",
                    )
                    error.locate(index)
                    raise error
            result = manager.step(ops) if self.tenancy is None else self.tenancy.step(manager, ops)
            if self.journal is not None:
                journaled = request if request is not None else convert.step_request(ops)
                self._journal(journal_pb2.JournalRecord(step=journal_pb2.JournalStep(ops=journaled)))
            self.steps.append(convert.step_delta(result.delta).SerializeToString())
            assert self.steps.last_id == result.step_id, (self.steps.last_id, result.step_id)
            self._publish_events()
        return result

    def keyed_step(
        self, request: pb.StepRequest, ops: Sequence[Op], num_decode: int, respond: Callable[[StepResult], pb.StepResponse]
    ) -> pb.StepResponse:
        """Apply a Step that carries an idempotency key once; a repeat gets the first response.

        Looking the key up, applying the step and remembering `respond`'s
        answer happen under the lock at once. The key with another request is
        IdempotencyKeyReusedError. A rejected step is not remembered.
        """
        key = request.idempotency_key
        check_key(key)
        fingerprint = request_fingerprint(request)
        with self.lock:
            stored = self.step_keys.get(key, fingerprint)
            if stored is not None:
                return pb.StepResponse.FromString(stored)
            response = respond(self.step(ops, num_decode, request))
            self.step_keys.put(key, fingerprint, response.SerializeToString())
        return response

    def register_worker(self, worker_id: str, from_step_id: int) -> int:
        """A worker follows the step log from `from_step_id` (0: all that is retained); returns the first step id.

        Registering again is a no-op. Raises OutOfRangeError for a step in the
        future or no longer retained.
        """
        if not worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        with self.lock:
            first = from_step_id or self.steps.first_retained_id
            if first > self.steps.last_id + 1:
                raise OutOfRangeError(
                    f"from_step_id {first} is in the future (last step is {self.steps.last_id})", "from_step_id"
                )
            check_retained(self.steps, first, "from_step_id", "resync with GetBlockTables")
            if worker_id not in self.worker_acks:
                self.worker_acks[worker_id] = first - 1
                registered = pb.WatchStepsRequest(worker_id=worker_id, from_step_id=first - 1)
                self._journal(journal_pb2.JournalRecord(register_worker=registered))
        return first

    def ack(self, request: pb.AckStepsRequest) -> None:
        """A worker finished every step up to `request.step_id`: release what every worker has finished."""
        if not request.worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        with self.mutating():
            if request.step_id > self.manager.last_step_id:
                raise OutOfRangeError(
                    f"step_id {request.step_id} was never issued (last is {self.manager.last_step_id})", "step_id"
                )
            self._ack(request)
            self._journal(journal_pb2.JournalRecord(ack=request))

    def reset_prefix_cache(self) -> bool:
        """Forget the whole prefix cache; refused (False) while any block is held."""
        with self.mutating():
            ok = self.manager.reset_prefix_cache()
            if ok:
                self._journal(journal_pb2.JournalRecord(reset_prefix_cache=pb.ResetPrefixCacheRequest()))
            self._publish_events()
        return ok

    def _ack(self, request: pb.AckStepsRequest) -> None:
        acks = self.worker_acks
        acks[request.worker_id] = max(acks.get(request.worker_id, 0), request.step_id)
        if self.tenancy is None:
            self.manager.ack(min(acks.values()))
        else:
            self.tenancy.ack(self.manager, min(acks.values()))  # credits each tenant with its copies' blocks

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

    def _replay(self, records: Sequence[journal_pb2.JournalRecord]) -> None:
        """Replay a journal's records (header excluded) into this fresh replica, in order."""
        for record in records:
            kind = record.WhichOneof("entry")
            if kind == "step":
                request = record.step.ops
                ops = convert.step_ops(request)
                if request.idempotency_key:
                    # It was applied, so it is applied again (a key forgotten and reused since, under
                    # a smaller retention than now, must not be taken for a repeat), and remembered.
                    self.step_keys.forget(request.idempotency_key)
                    num_decode = len(ops) - len(request.ops)
                    self.keyed_step(request, ops, num_decode, lambda result: convert.step_response(request, result))
                else:
                    # A single-op call is journaled as a Step whose decode-shaped op may sit in the
                    # decode columns, though it may have admitted its request: no decode check.
                    self.step(ops)
            elif kind == "ack":
                with self.lock:
                    self._ack(record.ack)
            elif kind == "register_worker":
                self.worker_acks.setdefault(record.register_worker.worker_id, record.register_worker.from_step_id)
            elif kind == "reset_prefix_cache":
                assert self.reset_prefix_cache(), "a journaled reset must succeed again"
            else:
                raise ValueError(f"unexpected journal record {kind!r}")

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
        """
        with self.lock:
            manager = self.manager
            if not request_ids:
                request_ids = [r for r in manager.request_ids() if owned is None or owned(r)]
            tables = [manager.block_table(request_id) for request_id in request_ids]
            return tables, manager.pending_copies(), manager.last_step_id

    def prefix_lookup_keys(
        self, token_ids: Sequence[int], cache_salt: str | None, lora: LoraRef | None, mm_features: Sequence[MMFeature]
    ) -> PrefixLookupKeys | None:
        """What to ask the other replicas about `token_ids` (hashing only: no lock)."""
        return self.manager.prefix_lookup_keys(token_ids, cache_salt, lora, mm_features)

    def stats(self) -> tuple[Stats, int, int]:
        """The pool's figures, the last step id and the last event sequence, read together."""
        with self.lock:
            return self.manager.stats(), self.manager.last_step_id, self.events.last_id

    def cached_snapshot(self) -> CachedSnapshot:
        """The pool's cached (group, hash) counts and the last event they include (for the mirror)."""
        with self.lock:
            return self.manager.cached_block_counts(), self.events.last_id

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
