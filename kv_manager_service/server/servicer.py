"""The `KVManagerService` servicer: translation between `kvcache.v1` and one `Replica`, and caller scoping.

Each handler turns its request into values (`wire`), scopes it to its caller
in multi-tenant mode (`Tenancy.scope_request`), asks the replica, and turns
the answer back into a response: once on the way in, once on the way out. A caller mistake is a
typed error, answered with its status by `_unary` and logged once; the
error's field is said in the terms of the call that was made (`_wire_field`).
State, locking, logs, the journal and quotas are the replica's.

The server is a grpc.aio one (see shared/aio.py), and the event loop never
waits for the replica's lock. A small call runs on the loop when the lock is
free (most calls, on a server that is not saturated); a large one, or any
call while the lock is taken, runs in the thread pool, where it may wait
(`_unary`). The streams follow the replica's logs on the loop, GetStats
reads the figures the last mutation published, and a stream's registration
goes to the thread pool (`_off_loop`).

It runs past 500 lines for its count, not its length: one handler per RPC of
the service (about twenty, each a few lines of conversion and scoping), and
beside the streams the serialization of each delta and event, made once for
all their followers.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

import grpc
from google.protobuf.message import Message

from kv_manager_service.shared.events import KVEvent
from kv_manager_service.server.idempotency import StepKey, request_fingerprint
from kv_manager_service.shared.ops import Op, PrefixLookupKeys, StepDelta
from kv_manager_service.mirror.schema import ClusterUnavailableError, ReplicaTokens
from kv_manager_service import wire
from kv_manager_service.shared.errors import InvalidArgumentError, KVCacheError, OutOfRangeError, PermissionDeniedError
from kv_manager_service.shared.logs import MAX_LOGGED_IDS
from kv_manager_service.shared.ready_line import FIRST_STEP_ID_HEADER
from kv_manager_service.shared.security import Principal, TokenTable
from kv_manager_service.shared.status import end_call, status_code
from kv_manager_service.broadcast_log import BroadcastLog, LogTruncatedError
from kv_manager_service.server.replica import Replica, check_retained
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the mirror and the group need the optional redis package
    from kv_manager_service.server.ha import GroupMember
    from kv_manager_service.mirror.lookup import ClusterIndex
    from kv_manager_service.mirror.writer import MirrorMetrics

log = logging.getLogger("kv_manager_service.server.servicer")

SERVICE = pb.DESCRIPTOR.services_by_name["KVManagerService"]
STREAMS_OF_BYTES = frozenset({"WatchSteps", "WatchEvents", "WatchEventBatches"})  # they yield serialized messages
SERIALIZED_KEPT = 8192  # the last deltas and events sent, serialized, of each log
DEFAULT_EVENTS_PER_MESSAGE = 1024
_EVENTS_FIELD = b"\x0a"  # WatchEventBatchesResponse.events: field 1, wire type 2 (length-delimited)

Response = TypeVar("Response")


# A plain handler whose request is at most this large runs on the event loop when the replica's lock is
# free: it then takes ~1-2 ms at most, and skips the thread pool's round trip (about 0.2 ms a call).
INLINE_MAX_REQUEST_BYTES = 64 << 10


def is_small(request: Message) -> bool:
    return request.ByteSize() <= INLINE_MAX_REQUEST_BYTES


def _unary(
    inline: Callable[[Message], bool] = is_small, mutates: bool = False
) -> Callable[[Callable[..., Response]], Callable[..., Response]]:
    """Make a handler a coroutine that maps caller mistakes to their statuses (anything else is a bug:
    INTERNAL). A plain handler runs on the event loop when `inline(request)` and the replica's lock is
    free at once, and in the thread pool otherwise: the loop never waits for the lock.

    In a high-availability group, a handler that `mutates` answers once what it did is committed
    (held by the in-sync standbys), and only while this member still serves (ha.py)."""

    def decorate(method: Callable[..., Response]) -> Callable[..., Response]:
        if inspect.iscoroutinefunction(method):

            @functools.wraps(method)
            async def wrapper_async(self: "KVManagerServicer", request, context: grpc.aio.ServicerContext) -> Response:
                try:
                    return await method(self, request, context)
                except Exception as error:
                    self._end_failed(method.__name__, request, error, context)

            return wrapper_async

        @functools.wraps(method)
        async def wrapper(self: "KVManagerServicer", request, context: grpc.aio.ServicerContext) -> Response:
            try:
                lock = self.replica.lock
                if inline(request) and lock.acquire(blocking=False):
                    try:
                        response = method(self, request, context)
                    finally:
                        lock.release()
                else:
                    response = await self._off_loop(method, self, request, context)
                if mutates and self.member is not None and response is not None:
                    await self.member.committed()
                return response
            except Exception as error:
                self._end_failed(method.__name__, request, error, context)

        return wrapper

    return decorate


class KVManagerServicer(pb_grpc.KVManagerServiceServicer):
    def __init__(
        self,
        replica: Replica,
        auth: TokenTable | None = None,
        cluster: ClusterIndex | None = None,
        mirror_metrics: MirrorMetrics | None = None,
        pool: Executor | None = None,
        member: GroupMember | None = None,
    ) -> None:
        """`auth`: who may call (None: everyone may call everything). `cluster` answers cluster
        lookups from the Redis mirror, whose writer's figures `mirror_metrics` are (None: no mirror).
        `pool`: the server's thread pool, for the work of coroutine handlers that may wait for the lock.
        `member`: this manager's part in its high-availability group (None: it serves alone)."""
        self.replica = replica
        self.member = member
        self.pool = pool
        self._events_sent: dict[int, bytes] = {}  # sequence -> serialized KVEvent, the newest SERIALIZED_KEPT
        self._deltas_sent: dict[int, bytes] = {}  # step id -> serialized StepDelta, the newest SERIALIZED_KEPT
        self.auth = auth
        self.tenancy = replica.tenancy
        self.cluster = cluster
        self.mirror_metrics = mirror_metrics

    # -- callers -------------------------------------------------------------------

    def _caller(self, context: grpc.ServicerContext) -> Principal | None:
        """Who made the call (the interceptor accepted its token); None without --auth-token-file."""
        return None if self.auth is None else self.auth.caller(context)

    def _scope(self, request: Message, context: grpc.ServicerContext) -> str | None:
        """In multi-tenant mode, rewrite `request` into its caller's scope (see tenancy.py) and
        return the caller's tenant; None otherwise (one namespace for every caller)."""
        if self.tenancy is None:
            return None
        tenant = self._caller(context).tenant
        self.tenancy.scope_request(tenant, request)
        return tenant

    def _end_failed(self, method: str, request: Message, error: Exception, context: grpc.ServicerContext) -> None:
        """End a call whose handler raised: a caller mistake with its status, logged once; anything else
        is a bug, logged with its traceback and answered INTERNAL."""
        if isinstance(error, KVCacheError):
            log_rejected(method, request, error)
            end_call(context, self._seen_by_caller(error, context))
            return
        log.error("bug in %s", method, exc_info=error, extra={"method": method})
        context.set_code(grpc.StatusCode.INTERNAL)
        context.set_details(f"internal error in {method}; see the server log")

    def _seen_by_caller(self, error: KVCacheError, context: grpc.ServicerContext) -> KVCacheError:
        """The error as its caller should read it: a tenant's own ids, without the internal prefix."""
        caller = self._caller(context) if self.tenancy is not None else None
        return error if caller is None else self.tenancy.unscope_error(caller.tenant, error)

    # -- mutations -----------------------------------------------------------------

    def _step(self, ops: list[Op]):
        """A single-op call: its errors name its own fields, without the `ops[0].` prefix."""
        try:
            return self.replica.step(ops).results[0]
        except KVCacheError as error:
            error.field = _wire_field(error, 1, unary=True)
            raise

    @_unary(mutates=True)
    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        self._scope(request, context)
        return wire.allocate_response(self._step([wire.allocate_op(request)]))

    @_unary(mutates=True)
    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        self._scope(request, context)
        result = self._step([wire.free_op(request)])
        return pb.FreeResponse(num_freed_blocks=result.num_freed_blocks, step_id=result.step_id)

    @_unary(mutates=True)
    def Fork(self, request: pb.ForkRequest, context: grpc.ServicerContext) -> pb.ForkResponse:
        self._scope(request, context)
        return pb.ForkResponse(step_id=self._step([wire.fork_op(request)]).step_id)

    @_unary(mutates=True)
    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        tenant = self._scope(request, context)
        ops, decode = wire.step_ops(request)
        try:
            key = StepKey(request.idempotency_key, request_fingerprint(request)) if request.idempotency_key else None
            response = wire.step_response(self.replica.step(ops, decode, key))
        except KVCacheError as error:
            error.field = _wire_field(error, len(ops), unary=False)
            raise
        if tenant is not None and response.lost_requests:
            self.tenancy.unscope_lost_requests(tenant, response)
        return response

    @_unary(mutates=True)
    def AckSteps(self, request: pb.AckStepsRequest, context: grpc.ServicerContext) -> pb.AckStepsResponse:
        self.replica.ack(request.worker_id, request.step_id)
        return pb.AckStepsResponse()

    @_unary(mutates=True)
    def ReportMissingKV(
        self, request: pb.ReportMissingKVRequest, context: grpc.ServicerContext
    ) -> pb.ReportMissingKVResponse:
        invalidation = self.replica.report_missing_kv(wire.missing_kv_report(request))
        return pb.ReportMissingKVResponse(
            num_uncached_blocks=invalidation.num_uncached_blocks + invalidation.num_uncached_host_blocks,
            num_lost_requests=len(invalidation.lost_request_ids),
        )

    @_unary(mutates=True)
    def UnregisterWorker(
        self, request: pb.UnregisterWorkerRequest, context: grpc.ServicerContext
    ) -> pb.UnregisterWorkerResponse:
        self.replica.unregister_worker(request.worker_id)
        return pb.UnregisterWorkerResponse()

    @_unary(mutates=True)
    def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        return pb.ResetPrefixCacheResponse(ok=self.replica.reset_prefix_cache())

    # -- queries -------------------------------------------------------------------

    @_unary()
    def GetConfig(self, request: pb.GetConfigRequest, context: grpc.ServicerContext) -> pb.GetConfigResponse:
        replica = self.replica
        return wire.config_response(
            replica.manager.config, replica.replica_id, replica.incarnation, replica.limits.max_tokens_per_call
        )

    @_unary(inline=lambda request: not request.cluster and is_small(request))
    def FindCacheHit(self, request: pb.FindCacheHitRequest, context: grpc.ServicerContext) -> pb.FindCacheHitResponse:
        self._scope(request, context)  # a tenant's lookup hashes with its own salt
        max_tokens = self.replica.limits.max_tokens_per_call
        if len(request.token_ids) > max_tokens:
            raise InvalidArgumentError(
                f"token_ids has {len(request.token_ids)} ids; the limit max_tokens_per_call is {max_tokens}",
                "token_ids",
            )
        token_ids = list(request.token_ids)
        salt = request.cache_salt or None
        lora = wire.lora(request.lora_name, request.lora_path)
        mm_features = wire.mm_features(request.mm_features)
        if request.cluster and self.cluster is not None:
            hit, keys = self.replica.find_cache_hit_and_lookup_keys(token_ids, salt, lora, mm_features)
        else:
            hit, keys = self.replica.find_cache_hit(token_ids, salt, lora, mm_features), None
        response = wire.cache_hit_response(hit)
        if request.cluster:
            replicas = [ReplicaTokens(self.replica.replica_id, hit.num_cached_tokens, hit.num_host_cached_tokens)]
            if keys is not None:
                replicas += self._other_replicas_hits(keys)
            for replica in sorted(replicas, key=lambda r: r.replica_id):
                response.replicas.add(
                    replica_id=replica.replica_id,
                    num_cached_tokens=replica.num_cached_tokens,
                    num_host_cached_tokens=replica.num_host_cached_tokens,
                )
        return response

    def _other_replicas_hits(self, keys: PrefixLookupKeys) -> list[ReplicaTokens]:
        """Every other live replica's cached prefix, from the mirror; none while Redis is unreachable or slow.

        This replica answers for itself from its own pool: exact, and present
        even while its lease is being re-written. The lookup holds this
        thread for at most its budget (`--cluster-lookup-timeout-ms`); the
        cluster index logs when Redis fails and when it answers again.
        """
        try:
            hits = self.cluster.prefix_hits(keys)
        except ClusterUnavailableError:
            return []
        return [hit for hit in hits if hit.replica_id != self.replica.replica_id]

    @_unary(inline=lambda request: 0 < len(request.request_ids) <= 256)
    def GetBlockTables(
        self, request: pb.GetBlockTablesRequest, context: grpc.ServicerContext
    ) -> pb.GetBlockTablesResponse:
        caller = self._caller(context)
        tenant = None  # set: a tenant's view, in its own ids
        if caller is not None and not caller.is_operator:
            if self.tenancy is not None:
                tenant = self._scope(request, context)
            elif not request.request_ids:
                raise PermissionDeniedError("GetBlockTables of all requests is for the operator role", "request_ids")
        owned = None if tenant is None else self.tenancy.owned_by(tenant)
        tables, pending, step_id = self.replica.block_tables(list(request.request_ids), owned)
        response = pb.GetBlockTablesResponse(step_id=step_id)
        for table in tables:
            wire.block_table(table, response.tables.add())
        for pending_copy in pending:
            response.pending_copies.add(
                step_id=pending_copy.step_id,
                copy=pb.BlockCopy(src_block_id=pending_copy.copy.src_block_id, dst_block_id=pending_copy.copy.dst_block_id),
            )
        if tenant is not None:
            self.tenancy.unscope_response(tenant, response)
        return response

    @_unary()
    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        stats, last_step_id, last_event_sequence, host_tier = self.replica.stats()
        response = wire.stats_response(stats, host_tier)
        response.last_step_id = last_step_id
        response.last_event_sequence = last_event_sequence
        metrics = self.mirror_metrics
        if metrics is not None:
            response.mirror_enabled = True
            response.mirror_failures = metrics.num_failures + (self.cluster.num_failures if self.cluster else 0)
            response.mirror_resyncs = metrics.num_resyncs
            response.mirror_queue_depth = metrics.queue_depth
            response.mirror_lag_ms = metrics.lag_ms
            response.mirror_fenced = metrics.fenced
            response.mirror_lookups_skipped = self.cluster.num_skipped if self.cluster else 0
            response.mirror_malformed = metrics.malformed.total + (self.cluster.malformed.total if self.cluster else 0)
            response.mirror_errors = metrics.num_errors + metrics.collector.num_errors
        caller = self._caller(context) if self.tenancy is not None else None
        if caller is not None and not caller.is_operator:
            self.tenancy.tenant_stats(caller.tenant, response)
        else:
            _worker_statuses(self.replica, response)
        return response

    # -- streams -------------------------------------------------------------------

    # The streams send bytes: a delta or an event is serialized once for every follower (see
    # `add_to_server`). Each watcher of a 256-request decode step is sent ~40 KB.

    async def WatchSteps(self, request: pb.WatchStepsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            first = await self._off_loop(
                self.replica.open_worker_stream, request.worker_id, request.from_step_id, request.incarnation
            )
            try:
                member = self.member
                if member is not None:
                    await member.committed()  # the registration, before the worker hears of it
                # Headers now, before any step: the worker learns it is registered (see WatchSteps).
                await context.send_initial_metadata(((FIRST_STEP_ID_HEADER, str(first)),))
                async for batch in _follow(self.replica.steps, first, "from_step_id"):
                    if member is not None:
                        await member.committed()  # a worker never does a step a new primary may not hold
                    for step_id, delta in batch:
                        yield self._serialized_delta(step_id, delta)
            finally:
                self._close_worker_stream(request.worker_id)
        except KVCacheError as error:
            log_rejected("WatchSteps", request, error)
            end_call(context, error)

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        replica = self.replica
        try:
            # 0 means everything still retained.
            first = request.from_sequence or replica.events.first_retained_id
            check_retained(replica.events, first, "from_sequence", "resync with FindCacheHit / GetStats")
            async for batch in _follow(replica.events, first, "from_sequence"):
                for sequence, (_, event) in batch:
                    yield self._serialized_event(sequence, event)
        except KVCacheError as error:
            log_rejected("WatchEvents", request, error)
            end_call(context, error)

    async def WatchEventBatches(
        self, request: pb.WatchEventBatchesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        replica = self.replica
        try:
            first = request.from_sequence or replica.events.first_retained_id
            check_retained(replica.events, first, "from_sequence", "resync with FindCacheHit / GetStats")
            max_events = request.max_events_per_message or DEFAULT_EVENTS_PER_MESSAGE
            async for batch in _follow(replica.events, first, "from_sequence", max_events):
                # A WatchEventBatchesResponse is its events, each as field 1 (length-delimited).
                yield b"".join(
                    _EVENTS_FIELD + _varint(len(event)) + event
                    for event in (self._serialized_event(sequence, event) for sequence, (_, event) in batch)
                )
        except KVCacheError as error:
            log_rejected("WatchEventBatches", request, error)
            end_call(context, error)

    def _serialized_delta(self, step_id: int, delta: StepDelta) -> bytes:
        """Step `step_id`'s delta as a StepDelta message's bytes, made once for every worker (on the event loop)."""
        serialized = self._deltas_sent.get(step_id)
        if serialized is None:
            serialized = wire.step_delta(delta).SerializeToString()
            if len(self._deltas_sent) >= SERIALIZED_KEPT:
                del self._deltas_sent[next(iter(self._deltas_sent))]  # the oldest
            self._deltas_sent[step_id] = serialized
        return serialized

    def _serialized_event(self, sequence: int, event: KVEvent) -> bytes:
        """Event `sequence` as a KVEvent message's bytes, made once for every watcher (on the event loop)."""
        serialized = self._events_sent.get(sequence)
        if serialized is None:
            replica = self.replica
            serialized = wire.kv_event(event, sequence, replica.replica_id, replica.incarnation).SerializeToString()
            if len(self._events_sent) >= SERIALIZED_KEPT:
                del self._events_sent[next(iter(self._events_sent))]  # the oldest
            self._events_sent[sequence] = serialized
        return serialized

    def _close_worker_stream(self, worker_id: str) -> None:
        """`replica.close_worker_stream` in the thread pool, not awaited: a cancelled stream may await nothing."""
        try:
            asyncio.get_running_loop().run_in_executor(self.pool, self.replica.close_worker_stream, worker_id)
        except RuntimeError:  # the pool is shut down: the server is stopping, and no worker expires any more
            pass

    async def _off_loop(self, function: Callable[..., Response], *args: Any) -> Response:
        """`function(*args)` in the server's thread pool: for work that may wait for the replica's lock."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, function, *args)


def add_to_server(servicer: KVManagerServicer, server: grpc.aio.Server) -> None:
    """Serve `servicer`'s methods on `server`, as the generated `add_KVManagerServiceServicer_to_server`
    does, except that the streams of STREAMS_OF_BYTES yield their messages already serialized."""
    handlers = {}
    for method in SERVICE.methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        serialize = None if method.name in STREAMS_OF_BYTES else response_type.SerializeToString
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name), request_deserializer=request_type.FromString, response_serializer=serialize
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


async def _follow(log_: BroadcastLog, first: int, field: str, max_items: int = 1 << 16) -> AsyncIterator[list]:
    """Lists of (id, entry) from `first` on, until the log closes (BroadcastLog.follow); the call's
    cancellation ends it when the client leaves."""
    try:
        async for batch in log_.follow(first, max_items):
            yield batch
    except LogTruncatedError as e:
        raise OutOfRangeError(
            f"the reader fell behind: entry {e.first_wanted} was dropped (oldest is {e.first_retained})", field
        )


def _worker_statuses(replica: Replica, response: pb.GetStatsResponse) -> None:
    """Fill `response.workers` (without waiting for the replica's lock)."""
    statuses, last_step_id = replica.worker_statuses()
    for status in statuses:
        response.workers.add(
            worker_id=status.worker_id,
            acked_step_id=status.acked_step_id,
            lag_steps=max(0, last_step_id - status.acked_step_id),
            streaming=status.num_streams > 0,
            idle_ms=status.idle_s * 1e3,
        )


def _wire_field(error: KVCacheError, num_nested: int, unary: bool) -> str | None:
    """The field of an error in the terms of the call that was made.

    The core names an op's field `ops[i].x`; a single-op call's is its own
    `x`, and a decode entry's is its column, `decode.request_ids[j]` or
    `decode.token_ids[j]`.
    """
    if error.op_index is None:
        return error.field
    if unary:
        return error.op_field
    if error.op_index >= num_nested:
        column = "token_ids" if error.op_field == "token_ids" else "request_ids"
        return f"decode.{column}[{error.op_index - num_nested}]"
    return error.field


def log_rejected(method: str, request: Message, error: KVCacheError) -> None:
    """One INFO line per rejected call: the method, code, reason, field, and the request ids it names."""
    extra = {"method": method, "code": status_code(error).name, "reason": error.reason, "field": error.field}
    request_ids = named_request_ids(request, error)
    if request_ids:
        extra["request_ids"] = request_ids
    if "worker_id" in request.DESCRIPTOR.fields_by_name:
        extra["worker_id"] = request.worker_id
    log.info("%s rejected: %s", method, error, extra=extra)


def named_request_ids(request: Message, error: KVCacheError) -> list[str]:
    """The request ids a rejected call is about (at most MAX_LOGGED_IDS).

    For a Step, those of the op or decode entry the error is located at
    (none when it is about neither); for the other calls, every id the request carries.
    """
    if not isinstance(request, pb.StepRequest):
        return _carried_request_ids(request)
    index = error.op_index
    if index is None:
        return []
    if index < len(request.ops):
        op = request.ops[index]
        kind = op.WhichOneof("op")
        return _carried_request_ids(getattr(op, kind)) if kind else []
    decode_ids = request.decode.request_ids
    index -= len(request.ops)
    return [decode_ids[index]] if index < len(decode_ids) else []


def _carried_request_ids(message: Message) -> list[str]:
    fields = message.DESCRIPTOR.fields_by_name
    ids = [getattr(message, name) for name in ("request_id", "parent_request_id") if name in fields]
    for name in ("request_ids", "child_request_ids"):
        if name in fields:
            ids.extend(getattr(message, name)[:MAX_LOGGED_IDS])
    return [request_id for request_id in ids if request_id][:MAX_LOGGED_IDS]


def _varint(value: int) -> bytes:
    """`value` (>= 0) as a protobuf varint: 7 bits a byte, least significant first."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
