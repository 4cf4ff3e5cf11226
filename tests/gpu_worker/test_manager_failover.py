"""Failover without loss: SIGKILL a group's primary in the middle of a generation workload.

A worker started with both members' addresses follows the standby that takes
over, resuming WatchSteps where it left off with its KV tensors kept (the
registry is replicated, so its cache stays valid); the scheduler's client
follows the primary and retries the Step it lost with the same key. The
generated tokens must be exactly those of an uninterrupted run, and those of
the dense pass, and the worker must not restart.
"""

from __future__ import annotations

import random
import sys
import time

from e2e_support import check_unchanged, run_interrupted
from grpc_health.v1 import health_pb2, health_pb2_grpc
import grpc
from kv_manager_service.client import KVManagerClient
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX
from processes import free_port, launch, launch_many, launch_redis, stop_all
from reference_scheduler import ReferenceScheduler, SchedulerConfig, WorkerClient

MODEL = "tiny"
POOL = '{"num_blocks": 128, "groups": [{"kind": "full_attention", "block_size": 16}]}'


def workload(prefix: str, scheduler: ReferenceScheduler) -> list:
    rng = random.Random(5)
    return [scheduler.add(f"{prefix}-{i}", [rng.randrange(256) for _ in range(n)], 24) for i, n in enumerate((9, 30, 47, 21))]


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service="kvcache.v1.KVManagerService")
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=1).status == 1
        except grpc.RpcError:
            return False


def wait_until(done, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_primary_killed_mid_generation_is_replaced_and_the_worker_follows(tmp_path):
    config = tmp_path / "pool.json"
    config.write_text(POOL)
    redis = launch_redis(free_port(), tmp_path / "redis.log")
    ha_url = f"redis://{redis.address}/0"
    members = launch_many(
        [
            [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--replica-id", "ha",
             "--config", str(config), "--ha-url", ha_url]
            for _ in range(2)
        ],
        MANAGER_READY_PREFIX, [tmp_path / "member-0.log", tmp_path / "member-1.log"],
    )  # fmt: skip
    processes = [redis, *members]
    addresses = ",".join(m.address for m in members)
    manager = KVManagerClient(addresses)
    try:
        manager.wait_ready(timeout_s=20)
        primary = next(m for m in members if serving(m.address))
        (standby,) = [m for m in members if m is not primary]
        wait_until(lambda: "is in sync" in primary.log(), "the standby never got in sync")
        processes.append(
            launch(
                [sys.executable, "-m", "gpu_worker.cli", "--manager", addresses, "--model", MODEL, "--worker-id", "w0"],
                WORKER_READY_PREFIX, tmp_path / "worker.log",
            )  # fmt: skip
        )
        worker_process = processes[-1]
        worker = WorkerClient(worker_process.address)
        config_ = SchedulerConfig(token_budget=32)  # chunked prefill: the kill can land inside a prompt

        uninterrupted = ReferenceScheduler(manager, worker, config_)
        reference = workload("calm", uninterrupted)
        uninterrupted.run()

        scheduler = ReferenceScheduler(manager, worker, config_)
        requests = workload("failover", scheduler)
        run_interrupted(scheduler, primary.kill)
        check_unchanged(MODEL, reference, requests)
        assert serving(standby.address)
        assert manager.stats().num_requests == 0
        # The worker did not restart, and the new primary knows it as it was: no cache emptied for it.
        assert worker_process.running
        assert [w.worker_id for w in manager.workers()] == ["w0"]
        assert "registered at step" not in standby.log()
        worker.close()
    finally:
        manager.close()
        failures = stop_all([p for p in processes if not p.killed and p is not redis])
        redis.kill()
        assert not failures, "\n\n".join(failures)
