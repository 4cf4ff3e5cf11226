"""Restart without loss: SIGKILL the manager in the middle of a generation workload, restart it, finish.

The worker keeps its KV tensors and its block tables; the restarted manager
resumes from its journal (tables, computed tokens, prefix cache, pending
copies, the step log the worker follows); the scheduler retries the Step it
lost with the same idempotency key. The generated tokens must be exactly
those of an uninterrupted run, and those of the dense pass.
"""

from __future__ import annotations

import random
import sys
import time

from e2e_support import check_unchanged, run_interrupted
from kv_manager_service.client import KVManagerClient
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX
from processes import free_port, launch, stop_all
from reference_scheduler import ReferenceScheduler, SchedulerConfig, WorkerClient

MODEL = "tiny"
POOL = '{"num_blocks": 128, "groups": [{"kind": "full_attention", "block_size": 16}]}'


def workload(prefix: str, scheduler: ReferenceScheduler) -> list:
    rng = random.Random(3)
    return [scheduler.add(f"{prefix}-{i}", [rng.randrange(256) for _ in range(n)], 24) for i, n in enumerate((9, 30, 47, 21))]


def test_a_manager_killed_mid_generation_resumes_from_its_journal(tmp_path):
    config = tmp_path / "pool.json"
    config.write_text(POOL)
    manager_argv = [
        sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", str(free_port()), "--replica-id", "restart",
        "--config", str(config), "--journal", str(tmp_path / "restart.journal"), "--journal-fsync", "never",
    ]  # fmt: skip
    processes = [launch(manager_argv, MANAGER_READY_PREFIX, tmp_path / "manager-0.log")]
    address = processes[0].address
    processes.append(
        launch(
            [sys.executable, "-m", "gpu_worker.cli", "--manager", address, "--model", MODEL, "--worker-id", "w0"],
            WORKER_READY_PREFIX, tmp_path / "worker.log",
        )  # fmt: skip
    )
    manager = KVManagerClient(address)
    worker = WorkerClient(processes[1].address)
    config_ = SchedulerConfig(token_budget=32)  # chunked prefill: the kill can land inside a prompt
    try:
        uninterrupted = ReferenceScheduler(manager, worker, config_)
        reference = workload("calm", uninterrupted)
        uninterrupted.run()

        scheduler = ReferenceScheduler(manager, worker, config_)
        requests = workload("killed", scheduler)

        def kill_and_restart() -> None:
            victim = processes[0]
            victim.kill()
            time.sleep(0.3)  # the scheduler's calls fail meanwhile, and are retried
            processes[0:1] = [victim, launch(manager_argv, MANAGER_READY_PREFIX, tmp_path / "manager-1.log")]

        run_interrupted(scheduler, kill_and_restart)
        check_unchanged(MODEL, reference, requests)
        stats = manager.stats()
        assert stats.num_requests == 0
        restarted_log = (tmp_path / "manager-1.log").read_text()
        assert "restored" in restarted_log
    finally:
        manager.close()
        worker.close()
        failures = stop_all(processes)
        assert not failures, "\n\n".join(failures)
