"""`StepFollower` follows the primary of a manager's high-availability group (in-process fake members).

A WatchSteps refused NOT_PRIMARY, or ended NOT_PRIMARY when the primary
changes, or broken because the primary died, is sent again to the primary
named or the next address, with the same worker_id and incarnation, from the
first step not yet taken; the worker's other calls follow the same client.
"""

from __future__ import annotations

import time
from typing import Iterator

import pytest
from fake_ha_group import FakeGroup

from gpu_worker.step_follower import StepFollower
from kv_manager_service.client import KVManagerClient

WORKER_ID = "w-failover"
INCARNATION = 77
TIMEOUT_S = 10.0


@pytest.fixture
def group() -> Iterator[FakeGroup]:
    with FakeGroup(3) as group:
        yield group


@pytest.fixture
def follower(group: FakeGroup) -> Iterator[StepFollower]:
    """A follower of the whole group, started at member 0 (a standby), member 1 the primary."""
    group.elect(1)
    client = KVManagerClient(group.addresses, timeout_s=5.0)
    follower = StepFollower(client, WORKER_ID, first_step_id=1, incarnation=INCARNATION)
    follower.start()
    try:
        follower.wait_registered(TIMEOUT_S)
        yield follower
    finally:
        follower.close()
        client.close()


def step_ids(follower: StepFollower, through: int) -> list[int]:
    return [delta.step_id for delta in follower.take_through(through, TIMEOUT_S)]


def received_within(follower: StepFollower, step_id: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while follower.last_received_step_id < step_id:
        assert time.monotonic() < deadline, f"step {step_id} did not arrive"
        time.sleep(0.01)


def watched_from(group: FakeGroup, index: int) -> list[tuple[str, int, int]]:
    return [(w.worker_id, w.incarnation, w.from_step_id) for w in group.members[index].watches]


def test_a_standby_sends_the_follower_to_the_primary(group, follower):
    assert follower.client.address == group.addresses[1]
    assert watched_from(group, 0) == [(WORKER_ID, INCARNATION, 1)]  # refused NOT_PRIMARY
    assert watched_from(group, 1) == [(WORKER_ID, INCARNATION, 1)]
    for _ in range(3):
        group.append_step()
    assert step_ids(follower, 3) == [1, 2, 3]


def test_a_new_primary_is_followed_from_the_first_step_not_taken(group, follower):
    for _ in range(3):
        group.append_step()
    assert step_ids(follower, 2) == [1, 2]
    assert step_ids(follower, 3) == [3]
    for _ in range(2):
        group.append_step()
    received_within(follower, 5)  # held, not taken
    group.elect(2)  # member 1's stream ends NOT_PRIMARY, naming member 2
    group.append_step()
    assert step_ids(follower, 6) == [4, 5, 6]
    assert follower.client.address == group.addresses[2]
    assert watched_from(group, 2)[-1] == (WORKER_ID, INCARNATION, 4)

    follower.client.ack_steps(WORKER_ID, 6)  # the worker's other calls go to the new primary too
    assert [member.calls["AckSteps"] for member in group.members] == [0, 0, 1]


def test_a_primary_that_dies_is_replaced_by_the_next_address(group, follower):
    group.append_step()
    assert step_ids(follower, 1) == [1]
    group.members[1].server.stop(0).wait()
    group.elect(2, named=False)
    group.append_step()
    assert step_ids(follower, 2) == [2]
    assert follower.client.address == group.addresses[2]
    assert watched_from(group, 2)[-1] == (WORKER_ID, INCARNATION, 2)
