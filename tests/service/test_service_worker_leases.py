"""Worker leases: a worker that goes away never pins the pool.

A worker registers only by opening WatchSteps; copy-on-write copies wait for
every registered worker's AckSteps. One that neither streams nor acknowledges
for --worker-timeout-s is dropped (journaled), and so is one that calls
UnregisterWorker; the copies only it held are released.
"""

from __future__ import annotations

import time

import grpc
import pytest

from kv_manager_service.client import KVManagerClient, WorkerStatus
from kv_manager_service.shared import errors as core_errors
from kvcache.v1 import kv_manager_pb2 as pb

from processes import log_records, stop_all
from svc_support import (
    NO_SPACE,
    OK,
    STREAM_TIMEOUT_S,
    alloc,
    assert_error,
    connect,
    pool_config,
    rpc_error,
    stats,
    take,
    wait_for,
    workers,
)
from test_service_journal import Manager
from test_service_metrics import metrics_url, scrape

BS = 16
NUM_BLOCKS = 16  # 15 usable
NUM_CHILDREN = 6


def pin_the_pool(stub) -> int:
    """Copy-on-write copies that pin 7 of the 15 usable blocks once every request is freed; returns their last step.

    A parent holds one partial block; each of its forks appends a token, so
    each copies that block to a block of its own (the copy keeps both).
    """
    stub.Allocate(alloc("parent", range(8)))
    children = [f"child-{i}" for i in range(NUM_CHILDREN)]
    stub.Fork(pb.ForkRequest(parent_request_id="parent", child_request_ids=children))
    copies = [stub.Allocate(alloc(child, [100 + i])) for i, child in enumerate(children)]
    assert all(len(c.copies) == 1 for c in copies)
    freed = stub.Free(pb.FreeRequest(request_ids=["parent", *children]))
    assert stats(stub).num_pending_copies == NUM_CHILDREN
    return freed.step_id


def whole_pool(request_id: str) -> pb.AllocateRequest:
    """A request that needs every usable block."""
    return alloc(request_id, range(1000, 1000 + (NUM_BLOCKS - 1) * BS))


def open_stream(stub, worker_id: str, from_step_id: int = 0):
    """A worker's WatchSteps stream, registered once GetStats lists it."""
    stream = stub.WatchSteps(pb.WatchStepsRequest(worker_id=worker_id, from_step_id=from_step_id), timeout=60)
    wait_for(lambda: worker_id in workers(stub) and workers(stub)[worker_id].streaming, f"{worker_id} streaming")
    return stream


def expiry_lines(process, worker_id: str) -> list[str]:
    return [r["msg"] for r in log_records(process) if r.get("worker_id") == worker_id and "expired" in r["msg"]]


def test_acknowledging_or_unregistering_an_unregistered_worker_is_refused(server_factory):
    process = server_factory.start("--replica-id", "ghosts", config=pool_config(NUM_BLOCKS, BS))
    channel, stub = connect(process.address)
    with channel:
        stub.Allocate(alloc("r", range(20)))
        for call, request in (
            (stub.AckSteps, pb.AckStepsRequest(worker_id="ghost", step_id=1)),
            (stub.UnregisterWorker, pb.UnregisterWorkerRequest(worker_id="ghost")),
        ):
            error = rpc_error(call, request)
            assert_error(error, grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION", "worker_id")
            assert "register with WatchSteps first" in error.details()
        assert workers(stub) == {}
    with KVManagerClient(process.address) as client:
        with pytest.raises(core_errors.FailedPreconditionError, match="register with WatchSteps first"):
            client.ack_steps("ghost", 1)
        with pytest.raises(core_errors.FailedPreconditionError, match="register with WatchSteps first"):
            client.unregister_worker("ghost")


def test_a_worker_that_vanished_is_expired_and_its_copies_released(server_factory):
    process = server_factory.start(
        "--replica-id", "leases", "--worker-timeout-s", "1", config=pool_config(NUM_BLOCKS, BS)
    )  # fmt: skip
    worker_channel, worker_stub = connect(process.address)
    stream = open_stream(worker_stub, "gone", 1)
    channel, stub = connect(process.address)
    with channel:
        last = pin_the_pool(stub)
        assert take(stream, 1)[0].step_id == 1  # it did follow
        status = workers(stub)["gone"]
        assert status.streaming and status.acked_step_id == 0 and status.lag_steps == last
        assert stub.Allocate(whole_pool("big")).status == NO_SPACE  # pinned while the worker streams
        worker_channel.close()  # the worker vanishes: no unregister, no more acks

        wait_for(lambda: "gone" not in workers(stub), "the silent worker expired")
        assert stats(stub).num_pending_copies == 0
        assert stub.Allocate(whole_pool("big")).status == OK
        (line,) = expiry_lines(process, "gone")
        assert f"{NUM_CHILDREN} pending copies released" in line


def test_a_streaming_worker_never_expires(server_factory):
    process = server_factory.start(
        "--replica-id", "alive", "--worker-timeout-s", "1", config=pool_config(NUM_BLOCKS, BS)
    )  # fmt: skip
    channel, stub = connect(process.address)
    with channel:
        stream = open_stream(stub, "streaming")
        pin_the_pool(stub)
        time.sleep(3)  # three timeouts without an acknowledgement
        assert workers(stub)["streaming"].streaming and stats(stub).num_pending_copies == NUM_CHILDREN
        stream.cancel()
        wait_for(lambda: not workers(stub), "the worker expired once its stream closed")
        assert stats(stub).num_pending_copies == 0


def test_unregister_drops_the_worker_at_once(server_factory):
    process = server_factory.start("--replica-id", "leaving", config=pool_config(NUM_BLOCKS, BS))  # default timeout
    with KVManagerClient(process.address) as client:
        stream = client.watch_steps("leaving", 1)
        stay = open_stream(client.stub, "staying")
        wait_for(lambda: "leaving" in workers(client.stub), "leaving registered")
        last = pin_the_pool(client.stub)
        client.ack_steps("staying", last)
        assert client.stats().num_pending_copies == NUM_CHILDREN  # "leaving" holds them alone

        client.unregister_worker("leaving")  # while its stream is still open
        assert [w.worker_id for w in client.workers()] == ["staying"]
        assert client.stats().num_pending_copies == 0
        assert client.stub.Allocate(whole_pool("big")).status == OK
        with pytest.raises(core_errors.FailedPreconditionError):
            client.ack_steps("leaving", last)
        stream.cancel()
        stay.cancel()
    assert any("unregistered" in r["msg"] for r in log_records(process) if r.get("worker_id") == "leaving")


def test_get_stats_lists_the_workers_and_their_lag(server_factory):
    process = server_factory.start(
        "--replica-id", "lag", "--metrics-port", "0", config=pool_config(NUM_BLOCKS, BS)
    )  # fmt: skip
    with KVManagerClient(process.address) as client:
        ahead, behind = open_stream(client.stub, "ahead", 1), open_stream(client.stub, "behind", 1)
        for i in range(3):
            client.stub.Allocate(alloc(f"r{i}", range(i * 100, i * 100 + 5)))
        take(ahead, 3)
        client.ack_steps("ahead", 3)
        listed = client.workers()
        assert [(w.worker_id, w.acked_step_id, w.lag_steps, w.streaming) for w in listed] == [
            ("ahead", 3, 0, True),
            ("behind", 0, 3, True),
        ]
        assert all(isinstance(w, WorkerStatus) and w.idle_ms == 0 for w in listed)
        samples = scrape(metrics_url(process))
        assert samples.get("kvcache_workers_registered") == 2
        assert samples.get("kvcache_worker_lag_steps", worker_id="behind") == 3
        assert samples.get("kvcache_worker_lag_steps", worker_id="ahead") == 0
        assert samples.get("kvcache_worker_streaming", worker_id="ahead") == 1
        behind.cancel()
        wait_for(lambda: not client.workers()[1].streaming, "behind's stream seen closed")
        assert client.workers()[1].idle_ms >= 0
        ahead.cancel()


def test_registrations_and_expiries_survive_a_restart(tmp_path):
    manager = Manager(tmp_path, "--worker-timeout-s", "2")
    try:
        first = manager.start()
        channel, stub = connect(first.address)
        with channel:
            stream = open_stream(stub, "journaled-worker", 1)
            stub.Allocate(alloc("a", range(40)))
            stub.Fork(pb.ForkRequest(parent_request_id="a", child_request_ids=["a1"]))
            stub.Allocate(alloc("a1", [7]))  # a copy, pending for the worker
            assert stats(stub).num_pending_copies == 1
            stream.cancel()
        manager.kill()

        # Restarted: the journal's worker is registered again, with a fresh lease.
        second = manager.start()
        channel, stub = connect(second.address)
        with channel:
            restored = workers(stub)
            assert list(restored) == ["journaled-worker"] and not restored["journaled-worker"].streaming
            assert stats(stub).num_pending_copies == 1
            wait_for(lambda: not workers(stub), "the journal's worker expired")
            assert stats(stub).num_pending_copies == 0
        assert not stop_all([second])

        # The expiry was journaled: a replay reaches the same state.
        third = manager.start()
        channel, stub = connect(third.address)
        with channel:
            assert workers(stub) == {} and stats(stub).num_pending_copies == 0
            with pytest.raises(grpc.RpcError) as caught:
                stub.AckSteps(pb.AckStepsRequest(worker_id="journaled-worker", step_id=1), timeout=STREAM_TIMEOUT_S)
            assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)
