"""The `KVManagerService` servicer: one core behind a lock, plus the logs workers follow.

Mutating calls are serialized by one lock around the single-threaded core.
Each accepted step appends one `StepDelta` to the step log (step ids are
contiguous) and the core's cache events, numbered from 1, to the event log.
Both logs are bounded; a reader that asks for a dropped entry gets
OUT_OF_RANGE and resyncs (`GetBlockTables` reports the step it reflects).

Copies are released when every registered worker has acknowledged their
step. A worker registers by `WatchSteps` or `AckSteps` and stays registered
(a worker that reconnects resumes where it left off); with no worker
registered, any `AckSteps` caller releases them.

A Step with an idempotency key is applied once: the servicer remembers the
responses of recent keyed Steps (`idempotency.StepKeys`), looked up and
filled under the same lock as the step itself. With `check_invariants`
(`--check-invariants`) every mutating call ends with the core's whole-state
check; a failure is a bug, answered INTERNAL.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

import grpc
from google.protobuf.message import Message

from kv_manager_service.rpc import convert
from kv_manager_service.server.broadcast_log import BroadcastLog, LogTruncatedError
from kv_manager_service.core import (
    AllocateOp,
    ForkOp,
    InvalidArgumentError,
    KVCacheError,
    KVCacheManager,
    OutOfRangeError,
    RequestNotFoundError,
    StepResult,
)
from kv_manager_service.core.block_queue import KVCacheBlock
from kv_manager_service.core.events import KVEvent
from kv_manager_service.core.hashing import HashExtras
from kv_manager_service.mirror.schema import ClusterUnavailableError, Lease
from kv_manager_service.core.ops import Op
from kv_manager_service.server.idempotency import StepKeys, check_key, request_fingerprint
from kv_manager_service.server.journal import Journal
from kv_manager_service.rpc.logs import MAX_LOGGED_IDS
from kv_manager_service.rpc.security import Principal, TokenTable
from kv_manager_service.rpc.errors import PermissionDeniedError
from kv_manager_service.rpc.status import abort, status_code
from kv_manager_service.server.tenancy import Tenancy
from kvcache.v1 import journal_pb2
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the mirror needs the optional redis package
    from kv_manager_service.mirror.lookup import ClusterIndex
    from kv_manager_service.mirror.writer import MirrorWriter

log = logging.getLogger("kv_manager_service.server.servicer")

Response = TypeVar("Response")


@dataclass(frozen=True)
class ServiceLimits:
    """Per-call limits; anything past them is refused with a message naming the limit."""

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


def _unary(method: Callable[..., Response]) -> Callable[..., Response]:
    """Map core errors to their statuses; anything else is a bug: INTERNAL."""

    @functools.wraps(method)
    def wrapper(self: "KVManagerServicer", request, context: grpc.ServicerContext) -> Response:
        try:
            return method(self, request, context)
        except KVCacheError as error:
            log_rejected(method.__name__, request, error)
            abort(context, self._seen_by_caller(error, context))
        except Exception:
            log.exception("bug in %s", method.__name__, extra={"method": method.__name__})
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}; see the server log")

    return wrapper


class KVManagerServicer(pb_grpc.KVManagerServiceServicer):
    def __init__(
        self,
        manager: KVCacheManager,
        replica_id: str,
        incarnation: int,
        limits: ServiceLimits,
        check_invariants: bool = False,
    ) -> None:
        if not manager.config.enable_events:
            raise ValueError("the service needs a core built with enable_events=True")
        self.manager = manager
        self.replica_id = replica_id
        self.incarnation = incarnation
        self.limits = limits
        # Reentrant: a keyed Step holds it across the key lookup and `_apply`.
        self.lock = threading.RLock()
        # A debugging aid: the core's whole-state check after every mutating
        # call, accepted or rejected (O(pool + tables) each; see `mutating`).
        self.check_invariants = check_invariants
        self.step_keys = StepKeys(limits.idempotency_retention)
        # Serialized StepDeltas: a parsed message costs several times its bytes,
        # and the log holds up to step_retention of them.
        self.steps: BroadcastLog[bytes] = BroadcastLog(limits.step_retention)
        # (monotonic ns when logged, event)
        self.events: BroadcastLog[tuple[int, KVEvent]] = BroadcastLog(limits.event_retention)
        self.worker_acks: dict[str, int] = {}
        # Every accepted mutation is written here before its reply (and before
        # workers see its step); None: no journal. Set by the server.
        self.journal: Journal | None = None
        # Set by the server when the Redis mirror is on.
        self.address = ""
        self.mirror: MirrorWriter | None = None
        self.cluster: ClusterIndex | None = None
        # Set by the server with --auth-token-file (who calls) and --multi-tenant.
        self.auth: TokenTable | None = None
        self.tenants: Tenancy | None = None

    def close(self) -> None:
        """End every stream (on shutdown)."""
        self.steps.close()
        self.events.close()

    # -- callers -------------------------------------------------------------------

    def _caller(self, context: grpc.ServicerContext) -> Principal | None:
        """Who made the call (the interceptor accepted its token); None without --auth-token-file."""
        return None if self.auth is None else self.auth.caller(context)

    def _scope(self, request: Message, context: grpc.ServicerContext) -> str | None:
        """In multi-tenant mode, rewrite `request` into its caller's scope (see tenancy.py) and
        return the caller's tenant; None otherwise (one namespace for every caller)."""
        if self.tenants is None:
            return None
        tenant = self._caller(context).tenant
        self.tenants.scope_request(tenant, request)
        return tenant

    def _seen_by_caller(self, error: KVCacheError, context: grpc.ServicerContext) -> KVCacheError:
        """The error as its caller should read it: a tenant's own ids, without the internal prefix."""
        caller = self._caller(context) if self.tenants is not None else None
        return error if caller is None else self.tenants.unscope_error(caller.tenant, error)

    # -- mutations -----------------------------------------------------------------

    @contextmanager
    def mutating(self) -> Iterator[None]:
        """Hold the lock around a mutation. With `check_invariants`, check the core as the
        mutation ends, whether it was accepted or refused: a failure is a bug, which the
        handler logs ("bug in ...") and answers with INTERNAL."""
        with self.lock:
            try:
                yield
            finally:
                if self.check_invariants:
                    self.manager.check_invariants()

    def _apply(
        self, ops: Sequence[Op], num_decode: int = 0, unary: bool = False, request: pb.StepRequest | None = None
    ) -> StepResult:
        """Run one step on the core and publish its delta and events. Holds the lock.

        The last `num_decode` ops come from a Step's decode columns: they must
        continue live requests, and their errors name `decode.*[j]`. A unary
        call's errors name its own fields, without the `ops[0].` prefix.
        `request`: the Step message the ops come from, journaled as it is
        (its idempotency key included).
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
        with self.mutating():
            requests = self.manager.requests
            for j, op in enumerate(ops[num_nested:]):
                if op.request_id not in requests:
                    raise RequestNotFoundError(
                        f"decode entry {j}: unknown request id {op.request_id!r} (decode continues live requests)",
                        f"decode.request_ids[{j}]",
                    )
            admitted = {op.request_id for op in ops if type(op) is AllocateOp and op.request_id not in requests}
            try:
                result = self.manager.step(ops) if self.tenants is None else self.tenants.step(self.manager, ops)
            except KVCacheError as error:
                error.field = _wire_field(error.field, num_nested, unary)
                raise
            children = {
                child_id: self.manager.block_table(child_id)
                for op in ops
                if type(op) is ForkOp
                for child_id in op.child_request_ids
            }
            if self.journal is not None:
                journaled = request if request is not None else convert.step_request(ops)
                self._journal(journal_pb2.JournalRecord(step=journal_pb2.JournalStep(ops=journaled)))
            self.steps.append(convert.step_delta(ops, result, admitted, children).SerializeToString())
            assert self.steps.last_id == result.step_id, (self.steps.last_id, result.step_id)
            self._publish_events()
        return result

    def _ack(self, request: pb.AckStepsRequest) -> None:
        acks = self.worker_acks
        acks[request.worker_id] = max(acks.get(request.worker_id, 0), request.step_id)
        if self.tenants is None:
            self.manager.ack(min(acks.values()))
        else:
            self.tenants.ack(self.manager, min(acks.values()))  # credits each tenant with its copies' blocks

    def _journal(self, record: journal_pb2.JournalRecord) -> None:
        """Write an accepted mutation to the journal. Holds the lock.

        A manager that cannot journal stops at once: it has changed its state
        and must not answer, or let workers see the step, without the record.
        """
        if self.journal is None:
            return
        try:
            self.journal.append(record)
        except OSError:
            log.critical("cannot write the journal %s; stopping", self.journal.path, exc_info=True)
            os._exit(75)

    def restore(self, records: Sequence[journal_pb2.JournalRecord]) -> None:
        """Replay a journal's records (header excluded) into this fresh servicer, in order."""
        assert self.manager.last_step_id == 0 and self.journal is None, "restore into a fresh servicer only"
        for record in records:
            kind = record.WhichOneof("entry")
            if kind == "step" and record.step.ops.idempotency_key:
                # It was applied, so it is applied again (a key forgotten and reused since, under
                # a smaller retention than now, must not be taken for a repeat), and remembered.
                self.step_keys.forget(record.step.ops.idempotency_key)
                self.step_request(record.step.ops)
            elif kind == "step":
                self._apply(convert.step_ops(record.step.ops))
            elif kind == "ack":
                with self.lock:
                    self._ack(record.ack)
            elif kind == "register_worker":
                self.worker_acks.setdefault(record.register_worker.worker_id, record.register_worker.from_step_id)
            elif kind == "reset_prefix_cache":
                with self.lock:
                    assert self.manager.reset_prefix_cache(), "a journaled reset must succeed again"
                    self._publish_events()
            else:
                raise ValueError(f"unexpected journal record {kind!r}")

    def _publish_events(self) -> None:
        # Kept as core events, stamped for the mirror's lag: converted when a
        # watcher sends them, off the lock.
        events = self.manager.take_events()
        if events:
            now = time.monotonic_ns()
            self.events.extend([(now, event) for event in events])

    def cached_snapshot(self) -> tuple[Counter, int]:
        """The pool's cached (group, hash) counts and the last event they include."""
        with self.lock:
            counts: Counter = Counter()
            for group_id, cached in enumerate(self.manager.pool.cached):
                for block_hash, entry in cached.items():
                    counts[(group_id, block_hash)] = 1 if isinstance(entry, KVCacheBlock) else len(entry)
            return counts, self.events.last_id

    def lease(self) -> Lease:
        stats = self.manager.stats()
        return Lease(self.replica_id, self.incarnation, self.address, stats.num_requests, stats.usage, stats.num_free_blocks)

    @_unary
    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        self._scope(request, context)
        return convert.allocate_response(self._apply([convert.allocate_op(request)], unary=True).results[0])

    @_unary
    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        self._scope(request, context)
        result = self._apply([convert.free_op(request)], unary=True).results[0]
        return pb.FreeResponse(num_freed_blocks=result.num_freed_blocks, step_id=result.step_id)

    @_unary
    def Fork(self, request: pb.ForkRequest, context: grpc.ServicerContext) -> pb.ForkResponse:
        self._scope(request, context)
        return pb.ForkResponse(step_id=self._apply([convert.fork_op(request)], unary=True).step_id)

    @_unary
    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        self._scope(request, context)
        return self.step_request(request)

    def step_request(self, request: pb.StepRequest) -> pb.StepResponse:
        """Apply one Step and answer it: the path of every Step, live or replayed from the journal.

        With an `idempotency_key`, looking the key up, applying the step and
        remembering its response happen under the lock at once, so the key
        memory is rebuilt by replaying the accepted Steps in order. A repeat
        of a remembered request gets the stored response and applies
        nothing; the key with another request is IdempotencyKeyReusedError.
        A rejected step is not remembered.
        """
        ops = convert.step_ops(request)
        num_decode = len(ops) - len(request.ops)
        key = request.idempotency_key
        if not key:
            return _step_response(request, self._apply(ops, num_decode, request=request))
        check_key(key)
        fingerprint = request_fingerprint(request)
        with self.lock:
            stored = self.step_keys.get(key, fingerprint)
            if stored is not None:
                return pb.StepResponse.FromString(stored)
            response = _step_response(request, self._apply(ops, num_decode, request=request))
            self.step_keys.put(key, fingerprint, response.SerializeToString())
        return response

    @_unary
    def AckSteps(self, request: pb.AckStepsRequest, context: grpc.ServicerContext) -> pb.AckStepsResponse:
        if not request.worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        with self.mutating():
            if request.step_id > self.manager.last_step_id:
                raise OutOfRangeError(
                    f"step_id {request.step_id} was never issued (last is {self.manager.last_step_id})", "step_id"
                )
            self._ack(request)
            self._journal(journal_pb2.JournalRecord(ack=request))
        return pb.AckStepsResponse()

    @_unary
    def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        with self.mutating():
            ok = self.manager.reset_prefix_cache()
            if ok:
                self._journal(journal_pb2.JournalRecord(reset_prefix_cache=request))
            self._publish_events()
        return pb.ResetPrefixCacheResponse(ok=ok)

    # -- queries -------------------------------------------------------------------

    @_unary
    def GetConfig(self, request: pb.GetConfigRequest, context: grpc.ServicerContext) -> pb.GetConfigResponse:
        return convert.config_response(
            self.manager.config, self.replica_id, self.incarnation, self.limits.max_tokens_per_call
        )

    @_unary
    def FindCacheHit(self, request: pb.FindCacheHitRequest, context: grpc.ServicerContext) -> pb.FindCacheHitResponse:
        self._scope(request, context)  # a tenant's lookup hashes with its own salt
        if len(request.token_ids) > self.limits.max_tokens_per_call:
            raise InvalidArgumentError(
                f"token_ids has {len(request.token_ids)} ids; the limit max_tokens_per_call is "
                f"{self.limits.max_tokens_per_call}",
                "token_ids",
            )
        token_ids = list(request.token_ids)
        lora = convert.lora(request.lora_name, request.lora_path)
        mm_features = convert.mm_features(request.mm_features)
        with self.lock:
            hit = self.manager.find_cache_hit(token_ids, request.cache_salt or None, lora, mm_features)
        response = pb.FindCacheHitResponse(num_cached_tokens=hit.num_cached_tokens)
        for group_id, block_ids in enumerate(hit.block_ids):
            response.groups.add(group_id=group_id, block_ids=block_ids)
        if request.cluster:
            for replica_id, num_cached_tokens in self._cluster_hits(token_ids, lora, request.cache_salt, mm_features, hit):
                response.replicas.add(replica_id=replica_id, num_cached_tokens=num_cached_tokens)
        return response

    def _cluster_hits(self, token_ids, lora, cache_salt, mm_features, local_hit) -> list[tuple[str, int]]:
        """Every live replica's longest cached prefix, from the mirror; without one (or
        while Redis is unreachable), just this replica's. Other replicas are judged
        by the first cacheable group's blocks, aligned like a local hit."""
        local = [(self.replica_id, local_hit.num_cached_tokens)]
        if self.cluster is None or not token_ids:
            return local
        manager = self.manager
        group = next((m for m in manager.managers if m.cacheable), None)
        if group is None:
            return local
        extras = HashExtras(lora, cache_salt or None, mm_features)
        hashes = manager.hasher.hash_blocks(manager.hasher.root_hash, token_ids, 0, extras)
        k = group.hashes_per_block
        # As for a local hit, at least one token is left to compute.
        max_blocks = (len(token_ids) - 1) // group.block_size
        try:
            prefixes = self.cluster.lookup(group.group_id, hashes[k - 1 :: k][:max_blocks])
        except ClusterUnavailableError as error:
            if self.mirror is not None:
                self.mirror.metrics.num_failures += 1
            log.warning("cluster lookup failed (%s); answering for this replica only", error)
            return local
        # This replica answers for itself from its own pool: exact, and present
        # even while its lease is being re-written.
        # Hits end on the lcm of the block sizes, as local hits do.
        alignment = manager.coordinator.alignment
        others = [
            (p.replica_id, p.num_cached_blocks * group.block_size // alignment * alignment)
            for p in prefixes
            if p.replica_id != self.replica_id
        ]
        return sorted(others + local)

    @_unary
    def GetBlockTables(
        self, request: pb.GetBlockTablesRequest, context: grpc.ServicerContext
    ) -> pb.GetBlockTablesResponse:
        caller = self._caller(context)
        tenant = None  # set: a tenant's view, in its own ids
        if caller is not None and not caller.is_operator:
            if self.tenants is not None:
                tenant = self._scope(request, context)
            elif not request.request_ids:
                raise PermissionDeniedError("GetBlockTables of all requests is for the operator role", "request_ids")
        response = pb.GetBlockTablesResponse()
        with self.lock:
            live = self.manager.requests
            request_ids = list(request.request_ids) or (
                list(live) if tenant is None else self.tenants.own_request_ids(tenant, live)
            )
            tables = [self.manager.block_table(request_id) for request_id in request_ids]
            pending = self.manager.pending_copies()
            response.step_id = self.manager.last_step_id
        for table in tables:
            convert.block_table(table, response.tables.add())
        for pending_copy in pending:
            response.pending_copies.add(
                step_id=pending_copy.step_id,
                copy=pb.BlockCopy(src_block_id=pending_copy.copy.src_block_id, dst_block_id=pending_copy.copy.dst_block_id),
            )
        if tenant is not None:
            self.tenants.unscope_response(tenant, response)
        return response

    @_unary
    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        with self.lock:
            stats = self.manager.stats()
            last_step_id = self.manager.last_step_id
        response = convert.stats_response(stats)
        response.last_step_id = last_step_id
        response.last_event_sequence = self.events.last_id
        if self.mirror is not None:
            metrics = self.mirror.metrics
            response.mirror_enabled = True
            response.mirror_failures = metrics.num_failures
            response.mirror_resyncs = metrics.num_resyncs
            response.mirror_queue_depth = metrics.queue_depth
            response.mirror_lag_ms = metrics.lag_ms
        caller = self._caller(context) if self.tenants is not None else None
        if caller is not None and not caller.is_operator:
            self.tenants.tenant_stats(caller.tenant, response)
        return response

    # -- streams -------------------------------------------------------------------

    def WatchSteps(self, request: pb.WatchStepsRequest, context: grpc.ServicerContext) -> Iterator[pb.StepDelta]:
        try:
            if not request.worker_id:
                raise InvalidArgumentError("worker_id must not be empty", "worker_id")
            # 0 means everything still retained.
            first = request.from_step_id or self.steps.first_retained_id
            with self.lock:
                if first > self.steps.last_id + 1:
                    raise OutOfRangeError(
                        f"from_step_id {first} is in the future (last step is {self.steps.last_id})", "from_step_id"
                    )
                self._check_retained(self.steps, first, "from_step_id", "resync with GetBlockTables")
                if request.worker_id not in self.worker_acks:
                    self.worker_acks[request.worker_id] = first - 1
                    registered = pb.WatchStepsRequest(worker_id=request.worker_id, from_step_id=first - 1)
                    self._journal(journal_pb2.JournalRecord(register_worker=registered))
            for _, delta in self._follow(self.steps, first, "from_step_id", context):
                yield pb.StepDelta.FromString(delta)
        except KVCacheError as error:
            log_rejected("WatchSteps", request, error)
            abort(context, error)

    def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.KVEvent]:
        try:
            # 0 means everything still retained.
            first = request.from_sequence or self.events.first_retained_id
            self._check_retained(self.events, first, "from_sequence", "resync with FindCacheHit / GetStats")
            for sequence, (_, event) in self._follow(self.events, first, "from_sequence", context):
                yield convert.kv_event(event, sequence, self.replica_id, self.incarnation)
        except KVCacheError as error:
            log_rejected("WatchEvents", request, error)
            abort(context, error)

    @staticmethod
    def _check_retained(log_: BroadcastLog, first: int, field: str, hint: str) -> None:
        try:
            log_.check_retained(first)
        except LogTruncatedError as e:
            raise OutOfRangeError(f"{field} {first} is no longer retained (oldest is {e.first_retained}); {hint}", field)

    @staticmethod
    def _follow(log_: BroadcastLog, first: int, field: str, context: grpc.ServicerContext) -> Iterator:
        """(id, entry) from `first` on, until the client leaves or the log closes."""
        try:
            for entry in log_.follow(first):
                if entry is None:
                    if not context.is_active():
                        return
                    continue
                yield entry
        except LogTruncatedError as e:
            raise OutOfRangeError(
                f"the reader fell behind: entry {e.first_wanted} was dropped (oldest is {e.first_retained})", field
            )


def log_rejected(method: str, request: Message, error: KVCacheError) -> None:
    """One INFO line per rejected call: the method, code, reason, field, and the request ids it names."""
    extra = {"method": method, "code": status_code(error).name, "reason": error.reason, "field": error.field}
    request_ids = named_request_ids(request, error.field)
    if request_ids:
        extra["request_ids"] = request_ids
    if "worker_id" in request.DESCRIPTOR.fields_by_name:
        extra["worker_id"] = request.worker_id
    log.info("%s rejected: %s", method, error, extra=extra)


_INDEXED_FIELD = re.compile(r"(ops|decode\.request_ids|decode\.token_ids)\[(\d+)\]")


def named_request_ids(request: Message, field: str | None) -> list[str]:
    """The request ids a rejected call is about (at most MAX_LOGGED_IDS).

    For a Step, those of the op or decode entry the error's field points at
    (none when it points at neither); for the other calls, every id the request carries.
    """
    if isinstance(request, pb.StepRequest):
        match = _INDEXED_FIELD.match(field or "")
        if match is None:
            return []
        index = int(match.group(2))
        if match.group(1) == "ops":
            if index >= len(request.ops):
                return []
            op = request.ops[index]
            kind = op.WhichOneof("op")
            return _carried_request_ids(getattr(op, kind)) if kind else []
        return [request.decode.request_ids[index]] if index < len(request.decode.request_ids) else []
    return _carried_request_ids(request)


def _carried_request_ids(message: Message) -> list[str]:
    fields = message.DESCRIPTOR.fields_by_name
    ids = [getattr(message, name) for name in ("request_id", "parent_request_id") if name in fields]
    for name in ("request_ids", "child_request_ids"):
        if name in fields:
            ids.extend(getattr(message, name)[:MAX_LOGGED_IDS])
    return [request_id for request_id in ids if request_id][:MAX_LOGGED_IDS]


def _step_response(request: pb.StepRequest, result: StepResult) -> pb.StepResponse:
    """One result per nested op, then the decode batch's results in columns."""
    num_nested = len(request.ops)
    response = pb.StepResponse(step_id=result.step_id)
    response.results.extend([convert.step_result(r) for r in result.results[:num_nested]])
    if len(request.decode.request_ids):
        response.decode.CopyFrom(convert.decode_results(result.results[num_nested:]))
    return response


def _wire_field(field: str | None, num_nested: int, unary: bool) -> str | None:
    """The core names fields `ops[i].x`; say it in the terms of the call that was made."""
    if not field or not field.startswith("ops["):
        return field
    index_text, _, rest = field[len("ops[") :].partition("]")
    index = int(index_text)
    rest = rest.lstrip(".")
    if unary:
        return rest or None
    if index >= num_nested:
        column = "token_ids" if rest == "token_ids" else "request_ids"
        return f"decode.{column}[{index - num_nested}]"
    return field
