"""Open streams cost memory, not threads: unary calls and health checks keep answering under hundreds of them.

The server is a grpc.aio one: a WatchSteps or WatchEvents stream waits on
the event loop, and an unread one holds no more than its flow-control window.
(GetStats during a long Step is measured by bench/starvation_bench.py.)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_support import alloc, connect, op_free, pool_config, step_request

from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

NUM_STREAMS = 300
MAX_WORKERS = 4


def process_threads(pid: int) -> int:
    """The number of threads of process `pid`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_hundreds_of_idle_streams_hold_no_threads(server_factory):
    server = server_factory.start("--max-workers", str(MAX_WORKERS), config=pool_config(256))
    channels = [grpc.insecure_channel(server.address) for _ in range(4)]
    _, stub = connect(server.address)
    health = health_pb2_grpc.HealthStub(channels[0])
    threads_before = process_threads(server.process.pid)
    streams = []
    try:
        for index in range(NUM_STREAMS):
            channel_stub = pb_grpc.KVManagerServiceStub(channels[index % len(channels)])
            if index % 2:
                streams.append(channel_stub.WatchEvents(pb.WatchEventsRequest()))
            else:
                streams.append(channel_stub.WatchSteps(pb.WatchStepsRequest(worker_id=f"idle-{index}")))
        # Every stream is open on the server once GetStats counts its registration.
        deadline = 30
        assert_soon(lambda: len(stub.GetStats(pb.GetStatsRequest(), timeout=deadline).workers) == NUM_STREAMS // 2)
        # Before, with the threaded server, 32 idle streams made both of these time out.
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=deadline).status == health_pb2.HealthCheckResponse.SERVING
        for index in range(20):
            assert stub.Allocate(alloc(f"r{index}", range(40)), timeout=deadline).status == pb.ALLOCATE_STATUS_OK
        stub.Step(step_request([op_free(*(f"r{index}" for index in range(20)))]), timeout=deadline)
        # A stream costs no thread: the server runs at most MAX_WORKERS more than it did before the streams.
        assert process_threads(server.process.pid) <= threads_before + MAX_WORKERS
    finally:
        for stream in streams:
            stream.cancel()
        for channel in channels:
            channel.close()


def assert_soon(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
