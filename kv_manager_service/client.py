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

A high-availability group is given as several addresses
(`KVManagerClient(["a:1", "b:2"])` or `"a:1,b:2"`), and the client follows
its primary. A call that a standby refuses with NOT_PRIMARY changed nothing,
so any call is then sent again: to the primary the refusal names, or else to
the next address, for up to `failover.max_total_s`, after which
`NotPrimaryError` names the addresses tried. A plain UNAVAILABLE (a member
that is down) moves the client to the next address: reads and keyed Steps are
retried there as above, other mutations are not, but the next call goes
there. `address` is the address calls go to now.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
    ExpectOp,
    ExpectResult,
    ForkOp,
    ForkResult,
    FreeOp,
    FreeResult,
    KVLossCause,
    Op,
    PendingCopy,
    Retention,
    Stats,
    StepResult,
)
from kv_manager_service.shared.hash_types import LoraRef, MMFeature
from kv_manager_service import wire
from kv_manager_service.shared import errors as core_errors
from kv_manager_service.shared.errors import IdempotencyKeyReusedError, KVMissingError, NotPrimaryError
from kv_manager_service.shared.security import ClientTLS, client_channel
from kv_manager_service.shared.status import ERROR_DOMAIN, PRIMARY_HEADER, error_info
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
    "ExpectOp",
    "ExpectResult",
    "ForkOp",
    "ForkResult",
    "FreeOp",
    "FreeResult",
    "KVLossCause",
    "KVManagerClient",
    "KVMissingError",
    "LoraRef",
    "MMFeature",
    "NotPrimaryError",
    "Op",
    "PendingCopy",
    "ReplicaHit",
    "RetryPolicy",
    "Stats",
    "StepResult",
    "WorkerStatus",
    "manager_addresses",
]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVManagerService"].full_name  # its health: SERVING on the primary

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
        NotPrimaryError,
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
# How long a call looks for the primary after NOT_PRIMARY: an election takes a lease's length, a few seconds.
FAILOVER_RETRY = RetryPolicy(attempts=100, first_backoff_s=0.05, max_backoff_s=1.0, max_total_s=10.0)
_READ_RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})
# The call may have been applied: only a keyed Step may be sent again. A manager stopping
# (SIGTERM) ends calls it has not answered yet with CANCELLED. The manager
# never answers ABORTED, and gRPC does not produce it for a lost connection.
_KEYED_RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def manager_addresses(addresses: str | Sequence[str]) -> tuple[str, ...]:
    """HOST:PORT addresses, in order, each once: a sequence, or one string with commas between them.

    Raises ValueError when there is none, or one is empty."""
    parts = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    stripped = [part.strip() for part in parts]
    if not stripped or not all(stripped):
        raise ValueError(f"manager addresses must be HOST:PORT[,HOST:PORT...], got {addresses!r}")
    return tuple(dict.fromkeys(stripped))


class KVManagerClient:
    """A client of one manager, or of the members of a high-availability group, following its primary.

    Invariant: `address` is one of `addresses`; it changes only after a call
    to it failed (NOT_PRIMARY, or UNAVAILABLE with several addresses) or in
    `wait_ready`. One channel per address, opened at its first call.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        timeout_s: float = 10.0,
        read_retry: RetryPolicy = RetryPolicy(),
        channel: grpc.Channel | None = None,
        step_retry: RetryPolicy = STEP_RETRY,
        tls: ClientTLS | None = None,
        token: str | None = None,
        failover: RetryPolicy = FAILOVER_RETRY,
    ) -> None:
        """`address`: HOST:PORT, or several (a sequence, or comma-separated) of one group, the first tried first.
        `tls`: reach the server over TLS (None: plaintext); `token`: sent as a bearer token on every call.
        Both are ignored when `channel` is given, which only a single address may be.
        `failover`: how a call refused with NOT_PRIMARY looks for the primary."""
        self._addresses = list(manager_addresses(address))
        if channel is not None and len(self._addresses) > 1:
            raise ValueError(f"a channel is given for one address, not {len(self._addresses)}")
        self.timeout_s = timeout_s
        self.read_retry = read_retry
        self.step_retry = step_retry  # keyed Steps only
        self.failover = failover
        self.tls = tls
        self.token = token
        self._lock = threading.Lock()
        self._current = self._addresses[0]
        self._channels: dict[str, grpc.Channel] = {} if channel is None else {self._current: channel}
        self._stubs: dict[str, pb_grpc.KVManagerServiceStub] = {}
        self.closed = False

    @property
    def address(self) -> str:
        """HOST:PORT that calls go to now."""
        with self._lock:
            return self._current

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every address known: those given, then primaries that refusals named."""
        with self._lock:
            return tuple(self._addresses)

    @property
    def channel(self) -> grpc.Channel:
        """The channel to `address`."""
        return self._channel(self.address)

    @property
    def stub(self) -> pb_grpc.KVManagerServiceStub:
        """The stub of `address`; its calls are neither retried nor followed to the primary."""
        return self._stub(self.address)

    def close(self) -> None:
        """Close every channel: calls in flight end CANCELLED and are not retried."""
        with self._lock:
            self.closed = True
            channels = list(self._channels.values())
        for channel in channels:
            channel.close()

    def __enter__(self) -> "KVManagerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the manager answers; with several addresses, until one of them is the primary (its
        health reports SERVICE_NAME SERVING), which becomes `address`. Raises grpc.FutureTimeoutError."""
        if len(self.addresses) == 1:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while True:
            for address in self.addresses:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise grpc.FutureTimeoutError(f"no primary among {', '.join(self.addresses)} in {timeout_s:g}s")
                if self._is_primary(address, min(remaining_s, 1.0)):
                    with self._lock:
                        self._current = address
                    return
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def fail_over(self, address: str, error: grpc.RpcError) -> bool:
        """After `error` from a call to `address`, point `address` at where the next try should go.

        NOT_PRIMARY: to the primary it names (added to `addresses` if new),
        or else to the next address; UNAVAILABLE with several addresses: to
        the next one. Moves only while `address` is still the current one, so
        callers that saw the same failure move the client once. Returns True
        when `error` is NOT_PRIMARY (the call changed nothing).
        """
        not_primary, primary = _not_primary(error)
        if not not_primary and error.code() is not grpc.StatusCode.UNAVAILABLE:
            return False
        with self._lock:
            if self._current == address:
                if primary and primary not in self._addresses:
                    self._addresses.append(primary)
                index = self._addresses.index(address)
                self._current = primary or self._addresses[(index + 1) % len(self._addresses)]
        return not_primary

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
        retention: Retention | None = None,
    ) -> AllocateResult:
        op = AllocateOp(
            request_id, token_ids, num_new_tokens, num_lookahead_tokens, num_encoder_tokens,
            cache_salt, lora, tuple(mm_features), skip_prefix_cache, retention,
        )
        return wire.allocate_result(self._call("Allocate", wire.allocate_request(op)))

    def free(self, request_ids: Sequence[str]) -> FreeResult:
        response = self._call("Free", pb.FreeRequest(request_ids=request_ids))
        return FreeResult(response.num_freed_blocks, response.step_id)

    def fork(self, parent_request_id: str, child_request_ids: Sequence[str]) -> ForkResult:
        request = pb.ForkRequest(parent_request_id=parent_request_id, child_request_ids=child_request_ids)
        return ForkResult(self._call("Fork", request).step_id)

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
        self._call("AckSteps", pb.AckStepsRequest(worker_id=worker_id, step_id=step_id))

    def unregister_worker(self, worker_id: str) -> None:
        """`worker_id` leaves at once (a clean shutdown): the copies only it held are released."""
        self._call("UnregisterWorker", pb.UnregisterWorkerRequest(worker_id=worker_id))

    def report_missing_kv(self, request: pb.ReportMissingKVRequest) -> pb.ReportMissingKVResponse:
        """A worker's report of KV it does not hold (see ReportMissingKVRequest); applying it twice
        changes nothing more, so a try that ends UNAVAILABLE or DEADLINE_EXCEEDED is repeated."""
        return self._read("ReportMissingKV", request)

    def reset_prefix_cache(self) -> bool:
        return self._call("ResetPrefixCache", pb.ResetPrefixCacheRequest()).ok

    # -- reads: retried ------------------------------------------------------------

    def get_config(self) -> pb.GetConfigResponse:
        return self._read("GetConfig", pb.GetConfigRequest())

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
            mm_features=wire.mm_feature_messages(mm_features),
            cluster=cluster,
        )
        response = self._read("FindCacheHit", request)
        hit = wire.cache_hit_from(response)
        return hit, tuple(
            ReplicaHit(r.replica_id, r.num_cached_tokens, r.num_host_cached_tokens) for r in response.replicas
        )

    def block_tables(self, request_ids: Sequence[str] = ()) -> BlockTables:
        response = self._read("GetBlockTables", pb.GetBlockTablesRequest(request_ids=request_ids))
        return BlockTables(
            tuple(wire.block_table_from(t) for t in response.tables),
            tuple(
                PendingCopy(p.step_id, BlockCopy(p.copy.src_block_id, p.copy.dst_block_id))
                for p in response.pending_copies
            ),
            response.step_id,
        )

    def stats(self) -> Stats:
        return wire.stats_from(self._read("GetStats", pb.GetStatsRequest()))

    def workers(self) -> tuple[WorkerStatus, ...]:
        """The workers registered with the manager, by id (operator only, when tokens are on)."""
        response = self._read("GetStats", pb.GetStatsRequest())
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

    def _call(self, name: str, request: object) -> Any:
        """A mutation: sent again only after NOT_PRIMARY."""
        return self._invoke(name, request, None, frozenset())

    def _read(self, name: str, request: object) -> Any:
        return self._invoke(name, request, self.read_retry, _READ_RETRY_CODES)

    def _step(
        self, request: pb.StepRequest, key: str | None, auto_key: bool, retry: RetryPolicy | None
    ) -> pb.StepResponse:
        if not key and auto_key:
            key = str(uuid.uuid4())
        if not key:
            return self._call("Step", request)
        request.idempotency_key = key
        return self._invoke("Step", request, retry or self.step_retry, _KEYED_RETRY_CODES)

    def _invoke(self, name: str, request: object, retry: RetryPolicy | None, codes: frozenset) -> Any:
        """Call RPC `name` at `address`, following the primary (`fail_over`).

        After NOT_PRIMARY the same request is sent again under `failover`;
        after a failure with one of `codes`, under `retry` (None: never). A
        try goes at once to an address this call has not tried yet, and after
        a backoff to one it has.
        """
        started = time.monotonic()
        failovers, retries = _Tries(self.failover), _Tries(retry) if retry is not None else None
        outcomes: dict[str, str] = {}  # address -> how this call's last try there ended
        while True:
            address = self.address
            try:
                return getattr(self._stub(address), name)(request, timeout=self.timeout_s)
            except grpc.RpcError as error:
                not_primary = self.fail_over(address, error)
                outcomes[address] = error.code().name + (" (NOT_PRIMARY)" if not_primary else "")
                tries = failovers if not_primary else retries if error.code() in codes else None
                untried = self.address not in outcomes
                wait_s = None if tries is None or self.closed else tries.wait_s(time.monotonic() - started, untried)
                if wait_s is None:
                    raise self._final_error(name, error, not_primary, tries is not None, outcomes) from error
            time.sleep(wait_s)

    def _final_error(
        self, name: str, error: grpc.RpcError, not_primary: bool, retried: bool, outcomes: dict[str, str]
    ) -> Exception:
        """What a call that gives up raises: NotPrimaryError naming the addresses tried when no primary
        answered (the last try was refused NOT_PRIMARY, or several addresses were down); `_typed_error` otherwise."""
        unavailable = error.code() is grpc.StatusCode.UNAVAILABLE
        if not (not_primary or (retried and unavailable and len(self.addresses) > 1)):
            return _typed_error(error)
        tried = ", ".join(f"{address}: {outcome}" for address, outcome in outcomes.items())
        return NotPrimaryError(
            f"{name}: no primary answered (tried {tried}; last: {error.details()})", _not_primary(error)[1]
        )

    def _is_primary(self, address: str, timeout_s: float) -> bool:
        """Whether the manager at `address` says it is the primary (its health check of SERVICE_NAME)."""
        health = health_pb2_grpc.HealthStub(self._channel(address))
        try:
            response = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                if self.closed:
                    raise ValueError("the client is closed")
                self._channels[address] = client_channel(
                    address,
                    self.tls,
                    self.token,
                    options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
                )
            return self._channels[address]

    def _stub(self, address: str) -> pb_grpc.KVManagerServiceStub:
        channel = self._channel(address)
        with self._lock:
            if address not in self._stubs:
                self._stubs[address] = pb_grpc.KVManagerServiceStub(channel)
            return self._stubs[address]


class _Tries:
    """The failed tries of one call under `policy`, and the backoff before the next."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.num_failed = 0
        self.backoff_s = policy.first_backoff_s

    def wait_s(self, elapsed_s: float, untried: bool) -> float | None:
        """Count a failed try; the seconds to wait before the next (0 when it goes to an address
        not tried yet), or None when the policy allows no more."""
        self.num_failed += 1
        wait_s = 0.0 if untried else self.backoff_s
        if self.num_failed >= self.policy.attempts or elapsed_s + wait_s > self.policy.max_total_s:
            return None
        if not untried:
            self.backoff_s = min(self.backoff_s * 2, self.policy.max_backoff_s)
        return wait_s


def _not_primary(error: grpc.RpcError) -> tuple[bool, str | None]:
    """Whether `error` is a standby's NOT_PRIMARY, and the primary it names (None when it names none)."""
    if not isinstance(error, grpc.Call) or error.code() is not grpc.StatusCode.UNAVAILABLE:
        return False, None
    info = error_info(error)
    if info is not None and info.domain == ERROR_DOMAIN:
        return info.reason == NotPrimaryError.reason, info.metadata.get("primary") or None
    trailers = dict(error.trailing_metadata() or ())
    return trailers.get("kvcache-reason") == NotPrimaryError.reason, trailers.get(PRIMARY_HEADER) or None


def _typed_error(error: grpc.RpcError) -> Exception:
    """The core's typed error for a caller mistake; the RpcError itself otherwise."""
    info = error_info(error) if isinstance(error, grpc.Call) else None
    if info is not None and info.domain == ERROR_DOMAIN and info.reason in _ERRORS_BY_REASON:
        field = info.metadata.get("field") or None
        if info.reason == KVMissingError.reason:
            return KVMissingError(error.details(), json.loads(info.metadata.get("request_ids") or "[]"), field)
        if info.reason == NotPrimaryError.reason:
            return NotPrimaryError(error.details(), info.metadata.get("primary") or None)
        return _ERRORS_BY_REASON[info.reason](error.details(), field)
    return error
