"""A high-availability group of real `kv-manager serve` processes sharing one real Redis, for tests."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from processes import free_port, launch, launch_redis, stop_all

from kv_manager_service import wire
from kv_manager_service.core import KVCacheConfig, KVCacheManager
from kv_tooling.launch import LaunchedProcess
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kv_manager_service.shared.status import error_info
from kvcache.v1 import kv_manager_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from svc_support import connect, op_alloc, op_free, step_request  # noqa: E402

SERVICE = "kvcache.v1.KVManagerService"
IN_SYNC_KEY = "kvcache:ha:{r}:isr"  # the group's in-sync set in Redis (server/leadership.py), replica id "r"
LEASE_KEY = "kvcache:ha:{r}:lease"
NUM_BLOCKS = 256
LEASE_MS = 1200
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def health(address: str, service: str = SERVICE) -> int:
    """The health service's status of `service` at `address`; -1 when it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=1).status
        except grpc.RpcError:
            return -1


def is_primary(address: str) -> bool:
    return health(address) == health_pb2.HealthCheckResponse.SERVING


def not_primary_of(error: grpc.RpcError) -> str | None:
    """The `primary` a NOT_PRIMARY refusal names ('' when none); fails on any other error."""
    info = error_info(error)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and info is not None, (error.code(), error.details())
    assert info.reason == "NOT_PRIMARY", info
    return info.metadata.get("primary", "")


class Redis:
    """A real redis-server on a free port; `kill` loses its data (no persistence)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: LaunchedProcess | None = None
        self.num_starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.num_starts += 1
        self.process = launch_redis(self.port, self.directory / f"redis-{self.num_starts}.log")

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        if self.process is not None and self.process.running:
            self.process.kill()


class Group:
    """Members of one replica's group; every one still running is SIGTERMed and checked at `close`."""

    def __init__(self, directory: Path, redis_url: str, extra: Sequence[str] = ()) -> None:
        self.directory = directory
        self.redis_url = redis_url
        self.extra = list(extra)
        self.members: list[LaunchedProcess] = []

    def start(self, *args: str) -> LaunchedProcess:
        index = len(self.members)
        argv = [
            sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--replica-id", "r",
            "--ha-url", self.redis_url, "--ha-lease-ms", str(LEASE_MS), "--num-blocks", str(NUM_BLOCKS),
            "--check-invariants", *self.extra, *args,
        ]  # fmt: skip
        member = launch(argv, MANAGER_READY_PREFIX, self.directory / f"member-{index}.log")
        self.members.append(member)
        return member

    @property
    def running(self) -> list[LaunchedProcess]:
        return [m for m in self.members if m.running]

    def primary(self, timeout_s: float = 10.0) -> LaunchedProcess:
        """The one running member whose health says SERVING, waited for."""
        deadline = time.monotonic() + timeout_s
        while True:
            serving = [m for m in self.running if is_primary(m.address)]
            if len(serving) == 1:
                return serving[0]
            assert len(serving) < 2, f"two members serve: {[m.address for m in serving]}"
            assert time.monotonic() < deadline, "no member became primary:\n" + "\n".join(
                m.log()[-3000:] for m in self.members
            )
            time.sleep(0.02)

    def replication_address(self) -> str:
        """Where the lease's holder takes standbys (its value: token, member id, address, replication address)."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=1)
        try:
            return client.get(LEASE_KEY).decode().split(" ")[3]
        finally:
            client.close()

    def wait_in_sync(self, standby: LaunchedProcess, primary: LaunchedProcess, timeout_s: float = 10.0) -> None:
        """Until Redis lists `standby` in the group's in-sync set, as the primary's log names it (its
        latest stream): a log line alone could be of an earlier term, before the set was rewritten."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=1)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                member_id = _member_id(primary, standby)
                try:
                    in_sync = {m.decode() for m in client.smembers(IN_SYNC_KEY)}
                except redis.RedisError:
                    in_sync = set()
                if member_id is not None and member_id in in_sync:
                    return
                assert time.monotonic() < deadline, f"{standby.address} never got in sync:\n{primary.log()[-3000:]}"
                time.sleep(0.02)
        finally:
            client.close()

    def close(self) -> list[str]:
        for member in self.members:
            if member.running:
                os.kill(member.pid, signal.SIGCONT)
        return stop_all([m for m in self.members if not m.killed])


def _member_id(primary: LaunchedProcess, standby: LaunchedProcess) -> str | None:
    """The member id of `standby`'s latest connection, as the primary's log names it."""
    marker = f" at {standby.address} follows"
    ids = [line.split("standby ", 1)[1].split(" ", 1)[0] for line in primary.log().splitlines() if marker in line]
    return ids[-1] if ids else None


class KeyedClients:
    """Clients sending keyed Steps to whichever member serves: each allocates a request, then frees it.
    A call that fails is sent again, with the same key, to the primary, until one answers."""

    def __init__(self, group: Group, count: int) -> None:
        self.group = group
        self.acked: dict[str, pb.StepResponse] = {}  # key -> the first answer
        self.requests: dict[str, pb.StepRequest] = {}
        self.retries = 0
        self._stubs: dict[str, Any] = {}  # address -> stub, one channel each
        self.answered_by: defaultdict[int, set[str]] = defaultdict(set)  # step id -> the members that answered it
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in range(count)]
        for thread in self._threads:
            thread.start()

    def _run(self, client: int) -> None:
        try:
            for i in range(1_000_000):
                if self._stop.is_set():
                    return
                # Every third request lives for 30 more (at most 10 a client), the others end at once.
                ops = [(f"c{client}-{i}-a", op_alloc(f"c{client}-{i}", [client, i % 7, *range(30)]))]
                ended = i if i % 3 else i - 30
                if ended >= 0:
                    ops.append((f"c{client}-{ended}-f", op_free(f"c{client}-{ended}")))
                for key, op in ops:
                    request = step_request([op])
                    request.idempotency_key = key
                    self._send(request)
        except BaseException as error:
            self._errors.append(error)

    def _send(self, request: pb.StepRequest) -> None:
        address = None
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, f"no member answered {request.idempotency_key}"
            if address is None:
                candidates = [m.address for m in self.group.running if is_primary(m.address)]
                if not candidates:
                    time.sleep(0.02)
                    continue
                address = candidates[0]
            try:
                stub = self._stub(address)
                response = stub.Step(request, timeout=5)
            except grpc.FutureTimeoutError:  # it was killed since it served
                address = None
                continue
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                with self._lock:
                    self.retries += 1
                address = None
                continue
            with self._lock:
                self.acked[request.idempotency_key] = response
                self.requests[request.idempotency_key] = request
                self.answered_by[response.step_id].add(address)
            return

    def _stub(self, address: str) -> Any:
        with self._lock:
            stub = self._stubs.get(address)
        if stub is None:
            _, stub = connect(address)
            with self._lock:
                self._stubs[address] = stub
        return stub

    def wait_for(self, count: int, timeout_s: float = 30) -> None:
        """Until `count` more Steps are acknowledged."""
        target = len(self.acked) + count
        deadline = time.monotonic() + timeout_s
        while len(self.acked) < target:
            assert time.monotonic() < deadline, f"{len(self.acked)} of {target} Steps acknowledged"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        assert not self._errors, self._errors


def assert_history_replays(group: Group, clients: KeyedClients) -> None:
    """The acknowledged history is one linear sequence, and the serving primary's state is its replay.

    Each acknowledged Step, sent again with its key, answers what it answered first (it is in the
    history, once); the step ids acknowledged are 1..N, each by one member; and a fresh core fed
    those Steps in step-id order holds what the primary holds.
    """
    _, stub = connect(group.primary().address)
    for key, request in clients.requests.items():
        assert stub.Step(request) == clients.acked[key], key
    by_step = sorted(clients.acked.items(), key=lambda item: item[1].step_id)
    assert [response.step_id for _, response in by_step] == list(range(1, len(by_step) + 1))
    twice = {step_id: members for step_id, members in clients.answered_by.items() if len(members) > 1}
    assert not twice, f"steps acknowledged by two members: {twice}"
    core = KVCacheManager(KVCacheConfig(num_blocks=NUM_BLOCKS))
    for key, _ in by_step:
        ops, decode = wire.step_ops(clients.requests[key])
        core.step(ops, decode=decode)
    served = stub.GetStats(pb.GetStatsRequest())
    replayed = core.stats()
    assert served.last_step_id == core.last_step_id == len(by_step)
    for name in ("num_free_blocks", "num_requests", "prefix_cache_queries", "prefix_cache_hits", "num_evictions"):
        assert getattr(served, name) == getattr(replayed, name), name
    tables = stub.GetBlockTables(pb.GetBlockTablesRequest())
    assert sorted(t.request_id for t in tables.tables) == sorted(core.request_ids())
    for table in tables.tables:
        assert wire.block_table_from(table) == core.block_table(table.request_id), table.request_id
