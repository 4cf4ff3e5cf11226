"""A typed client of one GPU worker's `WorkerService`.

An Execute the worker refuses because it does not hold KV that requests of
the batch would read raises `KVMissingError` (reason KV_MISSING) naming
them; every other failure raises the `grpc.RpcError` itself.
"""

from __future__ import annotations

import json
from typing import Sequence

import grpc

from kv_manager_service.shared.errors import KVMissingError
from kv_manager_service.shared.security import ClientTLS, client_channel
from kv_manager_service.shared.status import ERROR_DOMAIN, error_info
from kvcache.v1 import worker_pb2 as pb
from kvcache.v1 import worker_pb2_grpc as pb_grpc
from reference_scheduler.interfaces import ExecuteResult, NextToken, Scheduled

__all__ = ["ExecuteResult", "KVMissingError", "NextToken", "Scheduled", "WorkerClient"]


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
        """Raises KVMissingError if the worker computed nothing because it lacks KV the requests it names
        would read (the same step may be executed again without them)."""
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
        try:
            response = self.stub.Execute(request, timeout=self.timeout_s)
        except grpc.RpcError as error:
            missing = _kv_missing(error)
            if missing is None:
                raise
            raise missing from error
        outputs = tuple(NextToken(o.request_id, o.token_id, o.logprob) for o in response.outputs)
        return ExecuteResult(response.step_id, outputs, response.forward_ms)

    def info(self) -> pb.GetWorkerInfoResponse:
        return self.stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=self.timeout_s)


def _kv_missing(error: grpc.RpcError) -> KVMissingError | None:
    """The KVMissingError a failed Execute carries in its ErrorInfo (request ids as a JSON array); None if none."""
    info = error_info(error) if isinstance(error, grpc.Call) else None
    if info is None or info.domain != ERROR_DOMAIN or info.reason != KVMissingError.reason:
        return None
    return KVMissingError(error.details(), json.loads(info.metadata.get("request_ids") or "[]"))
