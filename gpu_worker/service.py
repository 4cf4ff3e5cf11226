"""`WorkerService` over gRPC: translates between proto and the runner, and keeps step order."""

from __future__ import annotations

import logging
import re
import threading
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpu_worker.runner import ModelRunner, ScheduledRequest
from gpu_worker.sampling import SamplingParams
from gpu_worker.step_follower import FollowerError, StepFollower
from kv_manager_service.client import KVManagerClient
from kv_manager_service.rpc.errors import FailedPreconditionError, InvalidArgumentError, KVCacheError
from kv_manager_service.rpc.logs import MAX_LOGGED_IDS
from kv_manager_service.rpc.status import end_call, status_code
from kvcache.v1 import kv_manager_pb2 as manager_pb
from kvcache.v1 import worker_pb2 as pb
from kvcache.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("gpu_worker.service")

# 0.5 ms .. 10 s: a decode step of a small model on a GPU, up to a long prefill on a CPU.
EXECUTE_DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REQUEST_FIELD = re.compile(r"requests\[(\d+)\]")


class WorkerMetrics:
    """The worker's `gpu_worker_*` metrics in `registry`: what Execute records, and what is read at scrape time.

    The RPC durations and error codes (`gpu_worker_rpc_*`) come from the server's interceptor.
    """

    def __init__(self, registry: CollectorRegistry, runner: ModelRunner) -> None:
        self.forward_seconds = Histogram(
            "gpu_worker_execute_forward_seconds",
            "Execute's forward_ms, of the calls that succeeded: applying the manager's steps (tables, "
            "block copies) and the model over the scheduled tokens.",
            registry=registry,
            buckets=EXECUTE_DURATION_BUCKETS_S,
        )
        self.tokens_computed = Counter(
            "gpu_worker_tokens_computed", "Tokens whose K/V were computed and stored.", registry=registry
        )
        self.requests_executed = Counter(
            "gpu_worker_requests_executed", "Scheduled requests executed, one per request per Execute.", registry=registry
        )
        last_applied = Gauge(
            "gpu_worker_last_applied_step_id", "The last manager step applied to the block tables.", registry=registry
        )
        last_applied.set_function(lambda: runner.last_applied_step_id)
        kv_cache = Gauge("gpu_worker_kv_cache_bytes", "Bytes of the KV cache tensors.", registry=registry)
        kv_cache.set(runner.kv_cache_bytes)

    def executed(self, forward_s: float, num_requests: int, num_tokens: int) -> None:
        self.forward_seconds.observe(forward_s)
        self.requests_executed.inc(num_requests)
        self.tokens_computed.inc(num_tokens)


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """One Execute at a time, each after every delta up to its step has been applied.

    Steps are acknowledged to the manager once applied (their copies done),
    without holding up the reply.
    """

    def __init__(
        self,
        runner: ModelRunner,
        follower: StepFollower,
        manager: KVManagerClient,
        info: pb.GetWorkerInfoResponse,
        step_timeout_s: float,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.runner = runner
        self.follower = follower
        self.manager = manager
        self.info = info
        self.step_timeout_s = step_timeout_s
        self.metrics = metrics
        self.lock = threading.Lock()

    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> pb.ExecuteResponse:
        try:
            if request.step_id == 0:
                raise InvalidArgumentError("step_id must be the manager's step id (>= 1)", "step_id")
            scheduled = [
                ScheduledRequest(r.request_id, r.token_ids, r.start_position, SamplingParams(r.sampling.temperature, r.sampling.seed))
                for r in request.requests
            ]
            with self.lock:
                deltas = self._deltas_through(request.step_id)
                started = time.perf_counter()
                self._apply(deltas, request.step_id)
                outputs = self.runner.execute(scheduled)
                forward_ms = (time.perf_counter() - started) * 1e3
        except KVCacheError as error:
            self._log_failed(request, status_code(error), error, error.field)
            end_call(context, error)
        except TimeoutError as error:
            self._log_failed(request, grpc.StatusCode.UNAVAILABLE, error)
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except FollowerError as error:
            self._log_failed(request, grpc.StatusCode.FAILED_PRECONDITION, error)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        self._record_executed(request, forward_ms)
        return pb.ExecuteResponse(
            step_id=request.step_id,
            outputs=[pb.RequestOutput(request_id=o.request_id, token_id=o.token_id, logprob=o.logprob) for o in outputs],
            forward_ms=forward_ms,
        )

    def _record_executed(self, request: pb.ExecuteRequest, forward_ms: float) -> None:
        """Count a successful Execute in the metrics; log it at DEBUG."""
        num_requests = len(request.requests)
        num_tokens = sum(len(r.token_ids) for r in request.requests)
        if self.metrics is not None:
            self.metrics.executed(forward_ms / 1e3, num_requests, num_tokens)
        log.debug(
            "executed step %d: %d requests, %d tokens, %.2f ms", request.step_id, num_requests, num_tokens, forward_ms,
            extra={"step_id": request.step_id, "num_requests": num_requests, "num_tokens": num_tokens,
                   "forward_ms": round(forward_ms, 3)},
        )  # fmt: skip

    def _log_failed(
        self, request: pb.ExecuteRequest, code: grpc.StatusCode, error: Exception, field: str | None = None
    ) -> None:
        """One WARNING line per failed Execute: its step, code, field, and the requests it names (or all of them)."""
        match = _REQUEST_FIELD.match(field or "")
        if match is not None and int(match.group(1)) < len(request.requests):
            request_ids = [request.requests[int(match.group(1))].request_id]
        else:
            request_ids = [r.request_id for r in request.requests[:MAX_LOGGED_IDS]]
        log.warning(
            "Execute of step %d failed: %s", request.step_id, error,
            extra={"step_id": request.step_id, "worker_id": self.follower.worker_id, "code": code.name, "field": field,
                   "request_ids": request_ids, "num_requests": len(request.requests)},
        )  # fmt: skip

    def GetWorkerInfo(self, request: pb.GetWorkerInfoRequest, context: grpc.ServicerContext) -> pb.GetWorkerInfoResponse:
        info = pb.GetWorkerInfoResponse()
        info.CopyFrom(self.info)
        info.last_applied_step_id = self.runner.last_applied_step_id
        return info

    def _deltas_through(self, step_id: int) -> list[manager_pb.StepDelta]:
        """The deltas not yet applied up to `step_id`; waits for them to arrive from the manager."""
        applied = self.runner.last_applied_step_id
        if step_id < applied:
            raise FailedPreconditionError(
                f"step {step_id} is older than the block tables here (applied up to step {applied}); "
                "execute steps in order",
                "step_id",
            )
        return self.follower.take_through(step_id, self.step_timeout_s)

    def _apply(self, deltas: list[manager_pb.StepDelta], step_id: int) -> None:
        """Apply the deltas (copies included), then acknowledge them without waiting for the reply."""
        for delta in deltas:
            self.runner.apply_step(delta)
        if deltas:
            ack = self.manager.stub.AckSteps.future(
                manager_pb.AckStepsRequest(worker_id=self.follower.worker_id, step_id=step_id),
                timeout=self.manager.timeout_s,
            )
            ack.add_done_callback(_log_failed_ack)


def _log_failed_ack(future: grpc.Future) -> None:
    if future.exception() is not None:
        log.warning("AckSteps failed: %s (the next one covers it)", future.exception())
