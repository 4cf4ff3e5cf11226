"""Idle sockets cannot lock real clients out: 1,100 TCP connections that never send a byte, against a
manager whose process may open 1,024 files. The connections past the cap are closed at accept, those
under it once their handshake times out, and a real call is served then."""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc
from kv_manager_service.shared.connections import FDS_KEPT_FREE, connection_limit
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from processes import launch, stop_all

NOFILE = 1024
NUM_IDLE = 1100
HANDSHAKE_TIMEOUT_S = 2.0
# The manager under `ulimit -n NOFILE`, as an operator's unit file would start it.
LIMITED = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({0}, {0})); os.execv(sys.argv[1], sys.argv[1:])"


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def idle_sockets():
    """Room in this process for NUM_IDLE sockets, and the sockets opened, closed at the end."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < NUM_IDLE + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, NUM_IDLE + 1024), hard))
    sockets: list[socket.socket] = []
    yield sockets
    for s in sockets:
        s.close()


def test_idle_connections_do_not_lock_out_a_real_client(tmp_path: Path, idle_sockets):
    argv = [
        sys.executable, "-c", LIMITED.format(NOFILE), sys.executable, "-m", "kv_manager_service.cli", "serve",
        "--port", "0", "--num-blocks", "64", "--handshake-timeout-s", str(HANDSHAKE_TIMEOUT_S),
    ]  # fmt: skip
    server = launch(argv, MANAGER_READY_PREFIX, tmp_path / "server.log")
    try:
        host, port = server.address.rsplit(":", 1)
        for _ in range(NUM_IDLE):
            try:
                idle_sockets.append(socket.create_connection((host, int(port)), timeout=5))
            except OSError:  # refused or reset once past the cap: the server is not out of files
                pass
        assert open_files(server.process.pid) <= NOFILE - 100  # the connections left files for the rest
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S + 20
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.KVManagerServiceStub(channel)
            while True:
                try:
                    stub.GetStats(pb.GetStatsRequest(), timeout=2)
                    break
                except grpc.RpcError as error:
                    assert time.monotonic() < deadline, f"no real call served with {NUM_IDLE} idle sockets: {error}"
                    time.sleep(0.2)
        assert server.process.poll() is None
        assert open_files(server.process.pid) < 100  # the idle sockets were closed by their handshake timeout
    finally:
        failures = stop_all([server])
    assert not failures, failures


def test_a_connection_cap_that_leaves_too_few_files_is_refused():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_limit(None) == max(16, soft - FDS_KEPT_FREE)
    assert connection_limit(16) == 16
    with pytest.raises(ValueError, match=r"--max-connections \d+ would leave fewer than 128 .* raise ulimit -n"):
        connection_limit(soft - FDS_KEPT_FREE + 1)
