"""In-process stand-ins for the members of a manager's high-availability group, for client-side tests.

Each member is a real gRPC server on an ephemeral port, with the health
service. The members share one step log, as a group replicates it. The
primary answers; a standby refuses every mutation NOT_PRIMARY through
`kv_manager_service.shared.status` (naming the primary, or not), answers
reads, and reports `kvcache.v1.KVManagerService` NOT_SERVING; a stopping
member refuses mutations SHUTTING_DOWN, a plain UNAVAILABLE. Only the RPCs
the tests call are implemented: Step, Free, AckSteps, GetConfig and
WatchSteps.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent import futures
from typing import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kv_manager_service.client import SERVICE_NAME
from kv_manager_service.shared.errors import NotPrimaryError, ShuttingDownError
from kv_manager_service.shared.ready_line import FIRST_STEP_ID_HEADER
from kv_manager_service.shared.status import end_call
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

PRIMARY, STANDBY, STOPPING = "primary", "standby", "stopping"


class FakeGroup:
    """Members sharing one step log; at most one is the primary.

    Invariant: `last_step_id` counts the steps applied by any primary, each once.
    """

    def __init__(self, num_members: int) -> None:
        self.changed = threading.Condition()
        self.last_step_id = 0
        self.members = [Member(self, f"member-{i}") for i in range(num_members)]
        self.addresses = [member.address for member in self.members]

    def elect(self, index: int | None, named: bool = True) -> None:
        """Member `index` becomes the primary (None: none is), the others standbys that name it when `named`.

        Streams open on a former primary end NOT_PRIMARY."""
        primary = self.members[index].address if index is not None and named else None
        with self.changed:
            for i, member in enumerate(self.members):
                member.set_role(PRIMARY if i == index else STANDBY, primary)
            self.changed.notify_all()

    def append_step(self) -> int:
        """A step applied by the primary (or the test): its id."""
        with self.changed:
            self.last_step_id += 1
            self.changed.notify_all()
            return self.last_step_id

    def close(self) -> None:
        for member in self.members:
            member.server.stop(0).wait()

    def __enter__(self) -> "FakeGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Member(pb_grpc.KVManagerServiceServicer):
    """One member; `calls` counts the RPCs it received, by method name; `watches` keeps its WatchSteps requests."""

    def __init__(self, group: FakeGroup, name: str) -> None:
        self.group = group
        self.name = name
        self.role = STANDBY
        self.primary: str | None = None  # what a standby's NOT_PRIMARY names
        self.calls: Counter[str] = Counter()
        self.watches: list[pb.WatchStepsRequest] = []
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_KVManagerServiceServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        self.set_role(STANDBY, None)

    def set_role(self, role: str, primary: str | None = None) -> None:
        self.role, self.primary = role, primary
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        status = health_pb2.HealthCheckResponse
        self.health.set(SERVICE_NAME, status.SERVING if role == PRIMARY else status.NOT_SERVING)

    def _refuse_unless_primary(self, context: grpc.ServicerContext) -> None:
        """End the call as a standby or a stopping member would; return when this member is the primary."""
        if self.role == STANDBY:
            end_call(context, NotPrimaryError(f"{self.name} is a standby", self.primary))
        if self.role == STOPPING:
            end_call(context, ShuttingDownError(f"{self.name} is stopping"))

    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        self.calls["Step"] += 1
        self._refuse_unless_primary(context)
        return pb.StepResponse(step_id=self.group.append_step())

    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        self.calls["Free"] += 1
        self._refuse_unless_primary(context)
        return pb.FreeResponse(step_id=self.group.append_step())

    def AckSteps(self, request: pb.AckStepsRequest, context: grpc.ServicerContext) -> pb.AckStepsResponse:
        self.calls["AckSteps"] += 1
        self._refuse_unless_primary(context)
        return pb.AckStepsResponse()

    def GetConfig(self, request: pb.GetConfigRequest, context: grpc.ServicerContext) -> pb.GetConfigResponse:
        self.calls["GetConfig"] += 1
        return pb.GetConfigResponse(replica_id="fake-group", num_blocks=64)

    def WatchSteps(self, request: pb.WatchStepsRequest, context: grpc.ServicerContext) -> Iterator[pb.StepDelta]:
        """The shared log's deltas from `from_step_id` on, while this member stays the primary; then NOT_PRIMARY."""
        self.calls["WatchSteps"] += 1
        self.watches.append(request)
        self._refuse_unless_primary(context)
        context.send_initial_metadata(((FIRST_STEP_ID_HEADER, str(request.from_step_id)),))
        next_step_id = request.from_step_id
        while context.is_active():
            with self.group.changed:
                self.group.changed.wait_for(
                    lambda: self.role != PRIMARY or self.group.last_step_id >= next_step_id, timeout=0.05
                )
                last_step_id, role = self.group.last_step_id, self.role
            if role != PRIMARY:
                self._refuse_unless_primary(context)
            for step_id in range(next_step_id, last_step_id + 1):
                yield pb.StepDelta(step_id=step_id)
            next_step_id = max(next_step_id, last_step_id + 1)
