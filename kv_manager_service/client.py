"""`KVManagerClient`: the Python client of `KVManagerService`, with typed results.

Every call has a deadline. Reads (GetConfig, FindCacheHit, GetBlockTables,
GetStats) are retried on UNAVAILABLE with backoff. A mutation is retried
only as a Step with an idempotency key (`step` and `decode` with
`idempotency_key=` or `auto_key=True`): on UNAVAILABLE, DEADLINE_EXCEEDED or
CANCELLED (what a manager's restart leaves its callers with) it is sent again
with the same key, and the manager applies it once. Other mutations never
are, since a lost response does not tell whether the step was applied. A caller
mistake raises the core's typed error (`RequestNotFoundError`, ...), decoded
from the status' ErrorInfo, so code written against the in-process core and
against the service handles errors the same way.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple, Sequence, TypeVar

import grpc

# The core's value types are the client's too: code written against the
# in-process core runs against the service unchanged. Schedulers and workers
# import them from here, never from the core.
from kv_manager_service.shared.ops import (
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    BlockCopy,
    BlockTable,
    CacheHit,
    ForkOp,
    ForkResult,
    FreeOp,
    FreeResult,
    KVLossCause,
    Op,
    PendingCopy,
    Stats,
    StepResult,
)
from kv_manager_service.shared.hash_types import LoraRef, MMFeature
from kv_manager_service import wire
from kv_manager_service.shared import errors as core_errors
from kv_manager_service.shared.errors import IdempotencyKeyReusedError, KVMissingError
from kv_manager_service.shared.security import ClientTLS, client_channel
from kv_manager_service.shared.status import ERROR_DOMAIN, error_info
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

__all__ = [
    "AllocateOp",
    "AllocateResult",
    "AllocateStatus",
    "BlockCopy",
    "BlockTable",
    "BlockTables",
    "CacheHit",
    "DecodeStepResult",
    "DecodeTableChange",
    "ForkOp",
    "ForkResult",
    "FreeOp",
    "FreeResult",
    "KVLossCause",
    "KVManagerClient",
    "KVMissingError",
    "LoraRef",
    "MMFeature",
    "Op",
    "PendingCopy",
    "ReplicaHit",
    "RetryPolicy",
    "Stats",
    "StepResult",
    "WorkerStatus",
]

Response = TypeVar("Response")

_ERRORS_BY_REASON = {
    cls.reason: cls
    for cls in (
        core_errors.InvalidArgumentError,
        core_errors.RequestNotFoundError,
        core_errors.RequestExistsError,
        core_errors.FailedPreconditionError,
        core_errors.ResourceExhaustedError,
        core_errors.OutOfRangeError,
        IdempotencyKeyReusedError,
        KVMissingError,
    )
}


_STATUSES = {int(status): status for status in AllocateStatus}


class DecodeTableChange(NamedTuple):
    op_index: int
    group_id: int
    new_block_index: int
    new_block_ids: tuple[int, ...]


class DecodeStepResult(NamedTuple):
    """A columnar decode step: index i belongs to request_ids[i]."""

    step_id: int
    statuses: tuple[AllocateStatus, ...]
    num_computed_tokens: tuple[int, ...]
    changes: tuple[DecodeTableChange, ...]
    copies: tuple[BlockCopy, ...]
    # Live requests whose KV is lost, until freed (see StepResult.lost_requests).
    lost_requests: tuple[tuple[str, KVLossCause], ...] = ()


class BlockTables(NamedTuple):
    tables: tuple[BlockTable, ...]
    pending_copies: tuple[PendingCopy, ...]
    step_id: int  # the last step these tables reflect


class ReplicaHit(NamedTuple):
    replica_id: str
    num_cached_tokens: int  # both tiers
    num_host_cached_tokens: int = 0  # of those, only in the replica's host tier


class WorkerStatus(NamedTuple):
    """A worker registered with the manager (see GetStatsResponse.workers)."""

    worker_id: str
    acked_step_id: int
    lag_steps: int
    streaming: bool
    idle_ms: float


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries, the backoff doubling from `first_backoff_s` up to
    `max_backoff_s` between them; no new try starts once `max_total_s` have passed."""

    attempts: int = 4
    first_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    max_total_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if min(self.first_backoff_s, self.max_backoff_s, self.max_total_s) < 0:
            raise ValueError(f"backoffs and max_total_s must be >= 0, got {self}")


# Keyed Steps outlast a manager restart (a new process replaying its journal):
# about 9 s of backoff in all.
STEP_RETRY = RetryPolicy(attempts=10, first_backoff_s=0.05, max_backoff_s=2.0, max_total_s=30.0)
_READ_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
# The call may have been applied: only a keyed Step may be sent again. A manager stopping
# (SIGTERM) ends calls it has not answered yet with CANCELLED. The manager
# never answers ABORTED, and gRPC does not produce it for a lost connection.
_KEYED_RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


class KVManagerClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = 10.0,
        read_retry: RetryPolicy = RetryPolicy(),
        channel: grpc.Channel | None = None,
        step_retry: RetryPolicy = STEP_RETRY,
        tls: ClientTLS | None = None,
        token: str | None = None,
    ) -> None:
        """`tls`: reach the server over TLS (None: plaintext); `token`: sent as a bearer token on every call.
        Both are ignored when `channel` is given."""
        self.address = address
        self.timeout_s = timeout_s
        self.read_retry = read_retry
        self.step_retry = step_retry  # keyed Steps only
        self.channel = channel or client_channel(
            address,
            tls,
            token,
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
        )
        self.stub = pb_grpc.KVManagerServiceStub(self.channel)
        self.closed = False

    def close(self) -> None:
        """Close the channel: calls in flight end CANCELLED and are not retried."""
        self.closed = True
        self.channel.close()

    def __enter__(self) -> "KVManagerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    # -- mutations: only keyed Steps are retried ------------------------------------

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_encoder_tokens: int = 0,
        cache_salt: str | None = None,
        lora: LoraRef | None = None,
        mm_features: Sequence[MMFeature] = (),
        skip_prefix_cache: bool = False,
    ) -> AllocateResult:
        op = AllocateOp(
            request_id, token_ids, num_new_tokens, num_lookahead_tokens, num_encoder_tokens,
            cache_salt, lora, tuple(mm_features), skip_prefix_cache,
        )
        return wire.allocate_result(self._call(self.stub.Allocate, wire.allocate_request(op)))

    def free(self, request_ids: Sequence[str]) -> FreeResult:
        response = self._call(self.stub.Free, pb.FreeRequest(request_ids=request_ids))
        return FreeResult(response.num_freed_blocks, response.step_id)

    def fork(self, parent_request_id: str, child_request_ids: Sequence[str]) -> ForkResult:
        request = pb.ForkRequest(parent_request_id=parent_request_id, child_request_ids=child_request_ids)
        return ForkResult(self._call(self.stub.Fork, request).step_id)

    def step(
        self,
        ops: Sequence[Op],
        idempotency_key: str | None = None,
        *,
        auto_key: bool = False,
        retry: RetryPolicy | None = None,
    ) -> StepResult:
        """Apply `ops` as one atomic step.

        With an `idempotency_key` (or `auto_key=True`: a new UUID), a try that
        ends UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED is repeated with the same key,
        under `retry` (default: the client's `step_retry`); the manager applies
        the step once and answers every repeat with the first response.
        Without a key the call is never repeated.
        """
        request = pb.StepRequest(ops=[wire.step_op(op) for op in ops])
        response = self._step(request, idempotency_key, auto_key, retry)
        return StepResult(
            response.step_id,
            tuple(wire.op_result(r) for r in response.results),
            lost_requests=wire.lost_requests_from(response),
        )

    def decode(
        self,
        request_ids: Sequence[str],
        token_ids: Sequence[int],
        idempotency_key: str | None = None,
        *,
        auto_key: bool = False,
        retry: RetryPolicy | None = None,
    ) -> DecodeStepResult:
        """One step in which request_ids[i] appends token_ids[i] and computes it (the columnar fast path).

        Keys and retries as for `step`.
        """
        request = pb.StepRequest(decode=pb.DecodeBatch(request_ids=request_ids, token_ids=token_ids))
        response = self._step(request, idempotency_key, auto_key, retry)
        decode = response.decode
        return DecodeStepResult(
            response.step_id,
            tuple(map(_STATUSES.__getitem__, decode.statuses)),
            tuple(decode.num_computed_tokens),
            tuple(
                DecodeTableChange(c.op_index, c.group_id, c.new_block_index, tuple(c.new_block_ids))
                for c in decode.changes
            ),
            tuple(BlockCopy(c.src_block_id, c.dst_block_id) for c in decode.copies),
            wire.lost_requests_from(response),
        )

    def ack_steps(self, worker_id: str, step_id: int) -> None:
        """`worker_id`, registered by `watch_steps`, did every step up to `step_id`."""
        self._call(self.stub.AckSteps, pb.AckStepsRequest(worker_id=worker_id, step_id=step_id))

    def unregister_worker(self, worker_id: str) -> None:
        """`worker_id` leaves at once (a clean shutdown): the copies only it held are released."""
        self._call(self.stub.UnregisterWorker, pb.UnregisterWorkerRequest(worker_id=worker_id))

    def report_missing_kv(self, request: pb.ReportMissingKVRequest) -> pb.ReportMissingKVResponse:
        """A worker's report of KV it does not hold (see ReportMissingKVRequest); applying it twice
        changes nothing more, so a try that ends UNAVAILABLE or DEADLINE_EXCEEDED is repeated."""
        return self._read(self.stub.ReportMissingKV, request)

    def reset_prefix_cache(self) -> bool:
        return self._call(self.stub.ResetPrefixCache, pb.ResetPrefixCacheRequest()).ok

    # -- reads: retried ------------------------------------------------------------

    def get_config(self) -> pb.GetConfigResponse:
        return self._read(self.stub.GetConfig, pb.GetConfigRequest())

    def find_cache_hit(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: LoraRef | None = None,
        mm_features: Sequence[MMFeature] = (),
        cluster: bool = False,
    ) -> tuple[CacheHit, tuple[ReplicaHit, ...]]:
        request = pb.FindCacheHitRequest(
            token_ids=token_ids,
            cache_salt=cache_salt or "",
            lora_name=lora.name if lora else "",
            lora_path=lora.path if lora else "",
            mm_features=[pb.MMFeature(identifier=m.identifier, offset=m.offset, length=m.length) for m in mm_features],
            cluster=cluster,
        )
        response = self._read(self.stub.FindCacheHit, request)
        hit = wire.cache_hit_from(response)
        return hit, tuple(
            ReplicaHit(r.replica_id, r.num_cached_tokens, r.num_host_cached_tokens) for r in response.replicas
        )

    def block_tables(self, request_ids: Sequence[str] = ()) -> BlockTables:
        response = self._read(self.stub.GetBlockTables, pb.GetBlockTablesRequest(request_ids=request_ids))
        return BlockTables(
            tuple(wire.block_table_from(t) for t in response.tables),
            tuple(
                PendingCopy(p.step_id, BlockCopy(p.copy.src_block_id, p.copy.dst_block_id))
                for p in response.pending_copies
            ),
            response.step_id,
        )

    def stats(self) -> Stats:
        return wire.stats_from(self._read(self.stub.GetStats, pb.GetStatsRequest()))

    def workers(self) -> tuple[WorkerStatus, ...]:
        """The workers registered with the manager, by id (operator only, when tokens are on)."""
        response = self._read(self.stub.GetStats, pb.GetStatsRequest())
        return tuple(
            WorkerStatus(w.worker_id, w.acked_step_id, w.lag_steps, w.streaming, w.idle_ms) for w in response.workers
        )

    # -- streams -------------------------------------------------------------------

    def watch_steps(self, worker_id: str, from_step_id: int = 0, incarnation: int = 0) -> Iterator[pb.StepDelta]:
        """Step deltas from `from_step_id` on; cancel with `.cancel()` on the returned iterator.

        `incarnation`: new at every start of the worker process (see WatchStepsRequest).
        """
        request = pb.WatchStepsRequest(worker_id=worker_id, from_step_id=from_step_id, incarnation=incarnation)
        return self.stub.WatchSteps(request)

    def watch_events(self, from_sequence: int = 0) -> Iterator[pb.KVEvent]:
        """Events one per message: WatchEvents is deprecated (each event costs the server a message per
        watcher); prefer `watch_event_batches`."""
        return self.stub.WatchEvents(pb.WatchEventsRequest(from_sequence=from_sequence))

    def watch_event_batches(self, from_sequence: int = 0, max_events_per_message: int = 0) -> Iterator[list[pb.KVEvent]]:
        """The events of `watch_events`, received several per message (0: the server's default)."""
        request = pb.WatchEventBatchesRequest(from_sequence=from_sequence, max_events_per_message=max_events_per_message)
        for response in self.stub.WatchEventBatches(request):
            yield list(response.events)

    # -- plumbing ------------------------------------------------------------------

    def _call(self, method: Callable[..., Response], request: object) -> Response:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as error:
            raise _typed_error(error) from error

    def _read(self, method: Callable[..., Response], request: object) -> Response:
        return self._retried(method, request, self.read_retry, _READ_RETRY_CODES)

    def _step(
        self, request: pb.StepRequest, key: str | None, auto_key: bool, retry: RetryPolicy | None
    ) -> pb.StepResponse:
        if not key and auto_key:
            key = str(uuid.uuid4())
        if not key:
            return self._call(self.stub.Step, request)
        request.idempotency_key = key
        return self._retried(self.stub.Step, request, retry or self.step_retry, _KEYED_RETRY_CODES)

    def _retried(
        self, method: Callable[..., Response], request: object, policy: RetryPolicy, codes: frozenset
    ) -> Response:
        """Call `method`, repeating the same request after a failure with one of `codes`, under `policy`."""
        started = time.monotonic()
        backoff = policy.first_backoff_s
        for attempt in range(1, policy.attempts + 1):
            try:
                return method(request, timeout=self.timeout_s)
            except grpc.RpcError as error:
                if (
                    error.code() not in codes
                    or self.closed
                    or attempt == policy.attempts
                    or time.monotonic() - started + backoff > policy.max_total_s
                ):
                    raise _typed_error(error) from error
            time.sleep(backoff)
            backoff = min(backoff * 2, policy.max_backoff_s)
        raise AssertionError("unreachable")


def _typed_error(error: grpc.RpcError) -> Exception:
    """The core's typed error for a caller mistake; the RpcError itself otherwise."""
    info = error_info(error) if isinstance(error, grpc.Call) else None
    if info is not None and info.domain == ERROR_DOMAIN and info.reason in _ERRORS_BY_REASON:
        field = info.metadata.get("field") or None
        if info.reason == KVMissingError.reason:
            return KVMissingError(error.details(), json.loads(info.metadata.get("request_ids") or "[]"), field)
        return _ERRORS_BY_REASON[info.reason](error.details(), field)
    return error
