"""`WorkerService` over gRPC: translates between proto and the runner, and keeps step order."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from gpu_worker.runner import ModelRunner, ScheduledRequest
from gpu_worker.sampling import SamplingParams
from gpu_worker.step_follower import FollowerError, StepFollower
from kv_manager_service.client import KVManagerClient
from kv_manager_service.core.errors import FailedPreconditionError, InvalidArgumentError, KVCacheError
from kv_manager_service.status import abort
from kvcache.v1 import kv_manager_pb2 as manager_pb
from kvcache.v1 import worker_pb2 as pb
from kvcache.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("gpu_worker.service")


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
    ) -> None:
        self.runner = runner
        self.follower = follower
        self.manager = manager
        self.info = info
        self.step_timeout_s = step_timeout_s
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
                started = time.perf_counter()
                self._catch_up(request.step_id)
                outputs = self.runner.execute(scheduled)
                forward_ms = (time.perf_counter() - started) * 1e3
        except KVCacheError as error:
            abort(context, error)
        except TimeoutError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except FollowerError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return pb.ExecuteResponse(
            step_id=request.step_id,
            outputs=[pb.RequestOutput(request_id=o.request_id, token_id=o.token_id, logprob=o.logprob) for o in outputs],
            forward_ms=forward_ms,
        )

    def GetWorkerInfo(self, request: pb.GetWorkerInfoRequest, context: grpc.ServicerContext) -> pb.GetWorkerInfoResponse:
        info = pb.GetWorkerInfoResponse()
        info.CopyFrom(self.info)
        info.last_applied_step_id = self.runner.last_applied_step_id
        return info

    def _catch_up(self, step_id: int) -> None:
        """Apply every delta up to `step_id` (copies included), then acknowledge them."""
        applied = self.runner.last_applied_step_id
        if step_id < applied:
            raise FailedPreconditionError(
                f"step {step_id} is older than the block tables here (applied up to step {applied}); "
                "execute steps in order",
                "step_id",
            )
        deltas = self.follower.take_through(step_id, self.step_timeout_s)
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
