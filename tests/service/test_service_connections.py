"""Idle sockets cannot lock real clients out: 1,100 TCP connections that never send a byte, against a
manager whose process may open 1,024 files. The connections past the cap are closed at accept, those
under it once their handshake times out, and a real call is served then."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import grpc
import pytest

from kv_manager_service.shared.connections import FDS_KEPT_FREE, connection_limit
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc
from processes import idle_connections, launch, open_files, served_within, stop_all, with_open_file_limit

NOFILE = 1024
NUM_IDLE = 1100
HANDSHAKE_TIMEOUT_S = 2.0


def test_idle_connections_do_not_lock_out_a_real_client(tmp_path: Path):
    argv = with_open_file_limit(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "64",
         "--handshake-timeout-s", str(HANDSHAKE_TIMEOUT_S)],
        NOFILE,
    )  # fmt: skip
    server = launch(argv, MANAGER_READY_PREFIX, tmp_path / "server.log")
    try:
        with idle_connections(server.address, NUM_IDLE):
            assert open_files(server.process.pid) <= NOFILE - 100  # the connections left files for the rest
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.KVManagerServiceStub(channel)
                served_within(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=2), HANDSHAKE_TIMEOUT_S + 20, f"GetStats with {NUM_IDLE} idle sockets")
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
