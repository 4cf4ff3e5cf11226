"""The worker registry (kv_manager_service/server/workers.py): leases, streams, the acknowledged minimum.

Pure logic with the time passed in: no server, no clock.
"""

from __future__ import annotations

import pytest

from kv_manager_service.shared.errors import FailedPreconditionError
from kv_manager_service.server.workers import WorkerLease, WorkerRegistry


def test_only_a_registered_worker_may_acknowledge_or_leave():
    registry = WorkerRegistry(timeout_s=5)
    for call in (lambda: registry.ack("ghost", 3, 0.0), lambda: registry.remove("ghost")):
        with pytest.raises(FailedPreconditionError, match="register with WatchSteps first") as caught:
            call()
        assert caught.value.field == "worker_id"
    assert len(registry) == 0 and registry.min_acked_step_id() is None


def test_copies_wait_for_the_slowest_registered_worker():
    registry = WorkerRegistry(timeout_s=5)
    assert registry.register("a", 4, 0.0) and registry.register("b", 2, 0.0)
    assert not registry.register("a", 0, 1.0)  # again: the acknowledged step stays
    assert registry.min_acked_step_id() == 2
    registry.ack("b", 7, 1.0)
    registry.ack("b", 5, 1.0)  # an older step changes nothing
    assert registry.acked_step_ids() == {"a": 4, "b": 7} and registry.min_acked_step_id() == 4
    registry.remove("a")
    assert registry.min_acked_step_id() == 7


def test_a_silent_worker_expires_after_the_timeout_and_a_streaming_one_never():
    registry = WorkerRegistry(timeout_s=5)
    registry.register("silent", 0, 0.0)
    registry.register("acking", 0, 0.0)
    registry.register("streaming", 0, 0.0)
    registry.open_stream("streaming", 0.0)
    registry.ack("acking", 1, 4.0)
    assert registry.expired(4.9) == []
    assert registry.expired(5.0) == ["silent"]
    assert registry.expired(1000.0) == ["silent", "acking"]  # the open stream keeps its worker


def test_the_lease_runs_from_when_the_last_stream_closes():
    registry = WorkerRegistry(timeout_s=5)
    registry.register("w", 0, 0.0)
    registry.open_stream("w", 0.0)
    registry.open_stream("w", 1.0)  # a reconnect before the old stream was seen to close
    registry.close_stream("w", 10.0)
    assert registry.expired(100.0) == []
    registry.close_stream("w", 20.0)
    assert registry.expired(24.0) == [] and registry.expired(25.0) == ["w"]
    registry.remove("w")
    registry.close_stream("w", 30.0)  # a stream of a dropped worker ends: nothing to do


def test_renewing_gives_every_worker_a_fresh_lease():
    registry = WorkerRegistry(timeout_s=5)
    registry.register("w", 3, 0.0)
    registry.renew_all(100.0)
    assert registry.expired(104.0) == [] and registry.expired(105.0) == ["w"]


def test_statuses_show_each_worker_idle_time_and_streams():
    registry = WorkerRegistry(timeout_s=5)
    registry.register("b", 2, 0.0)
    registry.register("a", 1, 0.0)
    registry.open_stream("a", 1.0)
    assert registry.statuses(3.0) == [WorkerLease("a", 1, 1, 0.0), WorkerLease("b", 2, 0, 3.0)]


@pytest.mark.parametrize("timeout_s", [0, -1.0])
def test_the_timeout_must_be_positive(timeout_s):
    with pytest.raises(ValueError, match="worker timeout"):
        WorkerRegistry(timeout_s)
