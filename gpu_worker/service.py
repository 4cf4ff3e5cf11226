"""`WorkerService` over gRPC: translates between proto and the runner, keeps step order, and tells
the manager what this worker's memory does not hold.

An Execute that the worker refuses once its steps' deltas are applied is
reported to the manager (`ReportMissingKV`) before the reply: KV_MISSING
when the guard found requests that would read unfilled blocks
(`gpu_worker.kv_presence`), STEP_REFUSED for any other refusal, since the
tokens it carried were not computed.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Sequence

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpu_worker.kv_presence import UnfilledKVError
from gpu_worker.kv_reports import MissingKVReporter
from gpu_worker.runner import ModelRunner, ScheduledRequest
from gpu_worker.sampling import SamplingParams
from gpu_worker.step_follower import FollowerError, StepFollower
from kv_manager_service.client import KVManagerClient
from kv_manager_service.shared.errors import FailedPreconditionError, InvalidArgumentError, KVCacheError, KVMissingError
from kv_manager_service.shared.logs import MAX_LOGGED_IDS
from kv_manager_service.shared.status import end_call, status_code
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
        self.kv_missing_refusals = Counter(
            "gpu_worker_kv_missing_refusals",
            "Executes refused because a request would have read KV this worker does not hold (KV_MISSING).",
            registry=registry,
        )
        self.kv_reports_failed = Counter(
            "gpu_worker_kv_reports_failed",
            "ReportMissingKV tries that failed; a report the manager did not answer is tried again.",
            registry=registry,
        )

    def executed(self, forward_s: float, num_requests: int, num_tokens: int) -> None:
        self.forward_seconds.observe(forward_s)
        self.requests_executed.inc(num_requests)
        self.tokens_computed.inc(num_tokens)


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """One Execute at a time, each after every delta up to its step has been applied.

    Steps are acknowledged to the manager once applied (their copies done),
    without holding up the reply. An Execute refused after its deltas were
    applied is reported to the manager before the reply (`MissingKVReporter`).
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
        self.reports = MissingKVReporter(manager, metrics)
        self.lock = threading.Lock()

    def close(self) -> None:
        """Stop retrying undelivered reports."""
        self.reports.close()

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
                try:
                    self._apply(deltas, request.step_id)
                    outputs = self.runner.execute(scheduled)
                except Exception as error:
                    self._report_refused(error, scheduled)
                    raise
                forward_ms = (time.perf_counter() - started) * 1e3
        except KVCacheError as error:
            if isinstance(error, KVMissingError) and self.metrics is not None:
                self.metrics.kv_missing_refusals.inc()
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
        if isinstance(error, KVMissingError):
            request_ids = error.request_ids[:MAX_LOGGED_IDS]
        elif match is not None and int(match.group(1)) < len(request.requests):
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
        """The deltas not yet applied up to `step_id`; waits for them to arrive from the manager.

        `step_id` may be the last step applied: an Execute of it again (the
        requests a KV_MISSING refusal did not name) applies nothing more.
        """
        applied = self.runner.last_applied_step_id
        if step_id < applied:
            raise FailedPreconditionError(
                f"step {step_id} is older than the block tables here (applied up to step {applied}); "
                "execute steps in order",
                "step_id",
            )
        return self.follower.take_through(step_id, self.step_timeout_s)

    def _report_refused(self, error: Exception, scheduled: Sequence[ScheduledRequest]) -> None:
        """Tell the manager, before the reply, what a refused Execute leaves missing here.

        KV_MISSING (the guard refused): the requests it names and the blocks
        they lack. STEP_REFUSED (any other refusal, once the deltas are
        applied): every request of the call that has a table here, and its
        blocks that are not full, from the one holding its start position on. Either report
        carries the host blocks onloaded while they held nothing here.
        Nothing is sent when there is nothing to say.
        """
        presence = self.runner.presence
        if isinstance(error, UnfilledKVError):
            cause = manager_pb.KV_LOSS_CAUSE_KV_MISSING
            request_ids, device_block_ids = list(error.missing.request_ids), list(error.missing.device_block_ids)
        else:
            cause = manager_pb.KV_LOSS_CAUSE_STEP_REFUSED
            request_ids = list(dict.fromkeys(r.request_id for r in scheduled if r.request_id in presence))
            starts = {r.request_id: r.start_position for r in reversed(scheduled)}  # the first start of each
            blocks = (presence.unfilled_blocks_from(rid, starts[rid]) for rid in request_ids)
            device_block_ids = sorted({block_id for some in blocks for block_id in some})
        host_block_ids = presence.take_missing_host_block_ids()
        if not (request_ids or device_block_ids or host_block_ids):
            return
        self.reports.report(
            manager_pb.ReportMissingKVRequest(
                worker_id=self.follower.worker_id, incarnation=self.follower.incarnation,
                step_id=self.runner.last_applied_step_id, device_block_ids=device_block_ids,
                host_block_ids=host_block_ids, request_ids=request_ids, cause=cause,
            )
        )  # fmt: skip

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
