"""A typed client of one GPU worker's `WorkerService`."""

from __future__ import annotations

from typing import Sequence

import grpc

from kv_manager_service.rpc.security import ClientTLS, client_channel
from kvcache.v1 import worker_pb2 as pb
from kvcache.v1 import worker_pb2_grpc as pb_grpc
from reference_scheduler.interfaces import ExecuteResult, NextToken, Scheduled

__all__ = ["ExecuteResult", "NextToken", "Scheduled", "WorkerClient"]


class WorkerClient:
    def __init__(
        self, address: str, timeout_s: float = 120.0, tls: ClientTLS | None = None, token: str | None = None
    ) -> None:
        """`tls`: reach the worker over TLS (None: plaintext); `token`: sent as a bearer token on every call."""
        self.address = address
        self.timeout_s = timeout_s
        self.channel = client_channel(address, tls, token)
        self.stub = pb_grpc.WorkerServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def execute(self, step_id: int, requests: Sequence[Scheduled]) -> ExecuteResult:
        request = pb.ExecuteRequest(
            step_id=step_id,
            requests=[
                pb.ScheduledRequest(
                    request_id=r.request_id,
                    token_ids=r.token_ids,
                    start_position=r.start_position,
                    sampling=pb.Sampling(temperature=r.temperature, seed=r.seed),
                )
                for r in requests
            ],
        )
        response = self.stub.Execute(request, timeout=self.timeout_s)
        outputs = tuple(NextToken(o.request_id, o.token_id, o.logprob) for o in response.outputs)
        return ExecuteResult(response.step_id, outputs, response.forward_ms)

    def info(self) -> pb.GetWorkerInfoResponse:
        return self.stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=self.timeout_s)
