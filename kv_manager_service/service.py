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
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence, TypeVar

import grpc
from google.protobuf.message import Message

from kv_manager_service import convert
from kv_manager_service.broadcast_log import BroadcastLog, LogTruncatedError
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
from kv_manager_service.redis_schema import ClusterUnavailableError, Lease
from kv_manager_service.core.ops import Op
from kv_manager_service.logs import MAX_LOGGED_IDS
from kv_manager_service.status import abort, status_code
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the mirror needs the optional redis package
    from kv_manager_service.cluster import ClusterIndex
    from kv_manager_service.mirror import MirrorWriter

log = logging.getLogger("kv_manager_service.service")

Response = TypeVar("Response")


@dataclass(frozen=True)
class ServiceLimits:
    """Per-call limits; anything past them is refused with a message naming the limit."""

    max_tokens_per_call: int = 1 << 20
    max_ops_per_step: int = 1 << 16
    step_retention: int = 100_000  # step deltas kept for WatchSteps
    event_retention: int = 100_000  # events kept for WatchEvents

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_call", "max_ops_per_step", "step_retention", "event_retention"):
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
            abort(context, error)
        except Exception:
            log.exception("bug in %s", method.__name__, extra={"method": method.__name__})
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}; see the server log")

    return wrapper


class KVManagerServicer(pb_grpc.KVManagerServiceServicer):
    def __init__(self, manager: KVCacheManager, replica_id: str, incarnation: int, limits: ServiceLimits) -> None:
        if not manager.config.enable_events:
            raise ValueError("the service needs a core built with enable_events=True")
        self.manager = manager
        self.replica_id = replica_id
        self.incarnation = incarnation
        self.limits = limits
        self.lock = threading.Lock()
        self.steps: BroadcastLog[pb.StepDelta] = BroadcastLog(limits.step_retention)
        # (monotonic ns when logged, event)
        self.events: BroadcastLog[tuple[int, KVEvent]] = BroadcastLog(limits.event_retention)
        self.worker_acks: dict[str, int] = {}
        # Set by the server when the Redis mirror is on.
        self.address = ""
        self.mirror: MirrorWriter | None = None
        self.cluster: ClusterIndex | None = None

    def close(self) -> None:
        """End every stream (on shutdown)."""
        self.steps.close()
        self.events.close()

    # -- mutations -----------------------------------------------------------------

    def _apply(self, ops: Sequence[Op], num_decode: int = 0, unary: bool = False) -> StepResult:
        """Run one step on the core and publish its delta and events. Holds the lock.

        The last `num_decode` ops come from a Step's decode columns: they must
        continue live requests, and their errors name `decode.*[j]`. A unary
        call's errors name its own fields, without the `ops[0].` prefix.
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
        with self.lock:
            requests = self.manager.requests
            for j, op in enumerate(ops[num_nested:]):
                if op.request_id not in requests:
                    raise RequestNotFoundError(
                        f"decode entry {j}: unknown request id {op.request_id!r} (decode continues live requests)",
                        f"decode.request_ids[{j}]",
                    )
            admitted = {op.request_id for op in ops if type(op) is AllocateOp and op.request_id not in requests}
            try:
                result = self.manager.step(ops)
            except KVCacheError as error:
                error.field = _wire_field(error.field, num_nested, unary)
                raise
            children = {
                child_id: self.manager.block_table(child_id)
                for op in ops
                if type(op) is ForkOp
                for child_id in op.child_request_ids
            }
            self.steps.append(convert.step_delta(ops, result, admitted, children))
            assert self.steps.last_id == result.step_id, (self.steps.last_id, result.step_id)
            self._publish_events()
        return result

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
        return convert.allocate_response(self._apply([convert.allocate_op(request)], unary=True).results[0])

    @_unary
    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        result = self._apply([convert.free_op(request)], unary=True).results[0]
        return pb.FreeResponse(num_freed_blocks=result.num_freed_blocks, step_id=result.step_id)

    @_unary
    def Fork(self, request: pb.ForkRequest, context: grpc.ServicerContext) -> pb.ForkResponse:
        return pb.ForkResponse(step_id=self._apply([convert.fork_op(request)], unary=True).step_id)

    @_unary
    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        ops = convert.step_ops(request)
        num_nested = len(request.ops)
        result = self._apply(ops, num_decode=len(ops) - num_nested)
        response = pb.StepResponse(step_id=result.step_id)
        response.results.extend([convert.step_result(r) for r in result.results[:num_nested]])
        if len(request.decode.request_ids):
            response.decode.CopyFrom(convert.decode_results(result.results[num_nested:]))
        return response

    @_unary
    def AckSteps(self, request: pb.AckStepsRequest, context: grpc.ServicerContext) -> pb.AckStepsResponse:
        if not request.worker_id:
            raise InvalidArgumentError("worker_id must not be empty", "worker_id")
        with self.lock:
            if request.step_id > self.manager.last_step_id:
                raise OutOfRangeError(
                    f"step_id {request.step_id} was never issued (last is {self.manager.last_step_id})", "step_id"
                )
            acks = self.worker_acks
            acks[request.worker_id] = max(acks.get(request.worker_id, 0), request.step_id)
            self.manager.ack(min(acks.values()))
        return pb.AckStepsResponse()

    @_unary
    def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        with self.lock:
            ok = self.manager.reset_prefix_cache()
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
        response = pb.GetBlockTablesResponse()
        with self.lock:
            request_ids = list(request.request_ids) or list(self.manager.requests)
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
                self.worker_acks.setdefault(request.worker_id, first - 1)
            for _, delta in self._follow(self.steps, first, "from_step_id", context):
                yield delta
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
