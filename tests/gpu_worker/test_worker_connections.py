"""The worker's server bounds its connections as the manager's does (shared/connections.py): 1,100 TCP
connections that never send a byte, against a worker whose process may open 1,024 files, do not keep the
scheduler out past the handshake timeout."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

from gpu_worker.server import HANDSHAKE_TIMEOUT_S
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX
from kvcache.v1 import worker_pb2 as pb
from kvcache.v1 import worker_pb2_grpc as pb_grpc
from processes import idle_connections, launch, open_files, served_within, stop_all, with_open_file_limit

NOFILE = 1024
NUM_IDLE = 1100


def test_idle_connections_do_not_lock_the_scheduler_out_of_a_worker(tmp_path: Path):
    processes = [
        launch([sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "64"],
               MANAGER_READY_PREFIX, tmp_path / "manager.log")  # fmt: skip
    ]
    try:
        argv = with_open_file_limit(
            [sys.executable, "-m", "gpu_worker.cli", "--manager", processes[0].address, "--port", "0", "--device",
             "cpu", "--dtype", "float32", "--backend", "torch", "--model", "tiny", "--worker-id", "w"],
            NOFILE,
        )  # fmt: skip
        worker = launch(argv, WORKER_READY_PREFIX, tmp_path / "worker.log")
        processes.append(worker)
        with idle_connections(worker.address, NUM_IDLE):
            assert open_files(worker.process.pid) <= NOFILE - 100
            with grpc.insecure_channel(worker.address) as channel:
                stub = pb_grpc.WorkerServiceStub(channel)
                info = served_within(
                    lambda: stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=2),
                    HANDSHAKE_TIMEOUT_S + 20, f"GetWorkerInfo with {NUM_IDLE} idle sockets",
                )  # fmt: skip
                assert info.worker_id == "w"
            assert worker.process.poll() is None
    finally:
        failures = stop_all(processes)
    assert not failures, failures
