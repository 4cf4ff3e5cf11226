"""`KVManagerClient` follows the primary of a high-availability group, against real in-process gRPC servers.

A standby's NOT_PRIMARY changed nothing, so every call is sent again: to the
primary it names, or else to the next address. A plain UNAVAILABLE moves the
client to the next address; reads and keyed Steps are retried there, other
mutations are not. With no primary anywhere a call ends with NotPrimaryError
naming the addresses tried, within the failover policy's time.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import grpc
import pytest
from fake_ha_group import STOPPING, FakeGroup
from processes import free_port

from kv_manager_service.client import KVManagerClient, NotPrimaryError, RetryPolicy, manager_addresses
from kv_manager_service.shared.ops import FreeOp

FAST = RetryPolicy(attempts=4, first_backoff_s=0.01, max_backoff_s=0.05, max_total_s=2.0)
SHORT_FAILOVER = RetryPolicy(attempts=100, first_backoff_s=0.01, max_backoff_s=0.05, max_total_s=0.5)


@pytest.fixture
def group() -> Iterator[FakeGroup]:
    with FakeGroup(3) as group:
        yield group


def client(addresses: str | list[str], **options) -> KVManagerClient:
    options = {"timeout_s": 5.0, "read_retry": FAST, "step_retry": FAST, "failover": SHORT_FAILOVER, **options}
    return KVManagerClient(addresses, **options)


def calls(group: FakeGroup, method: str) -> list[int]:
    return [member.calls[method] for member in group.members]


def test_addresses_are_a_sequence_or_a_comma_separated_string():
    assert manager_addresses("a:1, b:2,a:1") == ("a:1", "b:2")
    assert manager_addresses(["a:1", "b:2"]) == ("a:1", "b:2")
    assert manager_addresses("a:1") == ("a:1",)
    for bad in ("", "a:1,,b:2", []):
        with pytest.raises(ValueError, match="HOST:PORT"):
            manager_addresses(bad)
    with pytest.raises(ValueError, match="channel"):
        KVManagerClient("a:1,b:2", channel=grpc.insecure_channel("a:1"))


def test_not_primary_naming_the_primary_sends_the_call_there_once(group):
    group.elect(2)
    with client(group.addresses) as kv:
        assert kv.step([FreeOp(["x"])]).step_id == 1  # unkeyed: sent again after NOT_PRIMARY all the same
        assert calls(group, "Step") == [1, 0, 1]
        assert kv.address == group.addresses[2]
        assert kv.free(["y"]).step_id == 2  # later calls go straight to the primary
        assert calls(group, "Free") == [0, 0, 1]


def test_a_primary_named_by_a_standby_need_not_be_among_the_addresses(group):
    group.elect(1)
    with client(group.addresses[0]) as kv:
        assert kv.free(["x"]).step_id == 1
        assert kv.address == group.addresses[1]
        assert kv.addresses == tuple(group.addresses[:2])
    assert calls(group, "Free") == [1, 1, 0]


def test_not_primary_without_a_name_moves_to_the_next_address(group):
    group.elect(1, named=False)
    with client(group.addresses) as kv:
        assert kv.free(["x"]).step_id == 1
        assert kv.address == group.addresses[1]
    assert calls(group, "Free") == [1, 1, 0]


def test_a_dead_address_is_passed_over_by_reads_and_keyed_steps(group):
    group.elect(0)
    dead = f"127.0.0.1:{free_port()}"
    with client([dead, group.addresses[0]]) as kv:
        assert kv.get_config().replica_id == "fake-group"
        assert kv.address == group.addresses[0]
    with client([dead, group.addresses[0]]) as kv:
        assert kv.step([FreeOp(["x"])], idempotency_key="k-1").step_id == 1
    assert calls(group, "GetConfig")[0] == calls(group, "Step")[0] == 1


def test_an_unkeyed_mutation_is_not_retried_after_a_plain_unavailable(group):
    group.elect(2)
    group.members[0].set_role(STOPPING)  # answers UNAVAILABLE (SHUTTING_DOWN), without naming a primary
    with client(group.addresses) as kv:
        with pytest.raises(grpc.RpcError) as caught:
            kv.free(["x"])
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert calls(group, "Free") == [1, 0, 0]
        assert kv.address == group.addresses[1]  # but the next call goes to the next address
        assert kv.free(["x"]).step_id == 1
    assert calls(group, "Free") == [1, 1, 1]  # that standby named the primary


def test_an_unkeyed_mutation_to_a_dead_address_is_not_retried(group):
    group.elect(0)
    dead = f"127.0.0.1:{free_port()}"
    with client([dead, group.addresses[0]]) as kv:
        with pytest.raises(grpc.RpcError) as caught:
            kv.free(["x"])
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert calls(group, "Free")[0] == 0
        assert kv.free(["x"]).step_id == 1


def test_no_primary_anywhere_ends_with_not_primary_naming_the_addresses(group):
    group.elect(None)
    with client(group.addresses) as kv:
        started = time.monotonic()
        with pytest.raises(NotPrimaryError) as caught:
            kv.free(["x"])
        assert time.monotonic() - started < SHORT_FAILOVER.max_total_s + 2 * kv.timeout_s
    assert all(address in str(caught.value) for address in group.addresses)
    assert caught.value.primary is None
    assert min(calls(group, "Free")) >= 1  # each was tried, none applied anything
    assert group.last_step_id == 0


def test_members_all_down_end_with_not_primary_naming_them():
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    with client(dead) as kv, pytest.raises(NotPrimaryError) as caught:
        kv.get_config()
    assert all(address in str(caught.value) for address in dead)


def test_a_call_waits_for_the_election(group):
    """A group without a primary for a moment: the call keeps looking, and lands once one is elected."""
    group.elect(None)
    with client(group.addresses, failover=RetryPolicy(100, 0.01, 0.05, 10.0)) as kv:
        timer = threading.Timer(0.3, group.elect, (2,))
        timer.start()
        assert kv.free(["x"]).step_id == 1
        timer.join()
        assert kv.address == group.addresses[2]
    assert group.last_step_id == 1  # applied once, by the primary


def test_wait_ready_finds_the_primary(group):
    group.elect(1)
    with client(group.addresses) as kv:
        kv.wait_ready(5.0)
        assert kv.address == group.addresses[1]
    group.elect(None)
    with client(group.addresses) as kv, pytest.raises(grpc.FutureTimeoutError):
        kv.wait_ready(0.3)


def test_not_primary_from_the_only_address_raises_it_typed(group):
    """One address, a standby naming no primary: NotPrimaryError once the failover policy gives up."""
    group.elect(None)
    with client(group.addresses[0]) as kv, pytest.raises(NotPrimaryError):
        kv.free(["x"])


def test_a_single_address_behaves_as_before(group):
    group.elect(0)
    dead = f"127.0.0.1:{free_port()}"
    with client(dead) as kv:
        with pytest.raises(grpc.RpcError) as caught:  # reads: retried under read_retry, then the RpcError itself
            kv.get_config()
        assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
        assert kv.address == dead and kv.addresses == (dead,)
    with client(group.addresses[0]) as kv:
        assert kv.free(["x"]).step_id == 1
        assert kv.get_config().replica_id == "fake-group"
        assert kv.stub is kv.stub and kv.channel is kv.channel  # one channel, reused
    group.members[0].set_role(STOPPING)
    with client(group.addresses[0]) as kv:
        with pytest.raises(grpc.RpcError):
            kv.free(["y"])
        assert kv.address == group.addresses[0]
    assert calls(group, "Free")[0] == 2

