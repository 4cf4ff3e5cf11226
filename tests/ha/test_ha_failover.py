"""A group of managers for one replica: a standby refuses changes and follows; a killed or paused
primary is replaced, and no acknowledged Step is lost or applied twice."""

from __future__ import annotations

import os
import signal
import statistics
import time

import grpc
import pytest
from ha_support import LEASE_MS, THOROUGH, Group, KeyedClients, assert_history_replays, health, is_primary, not_primary_of

from svc_support import alloc, connect, op_alloc, step_request  # noqa: E402 - ha_support puts it on the path

from kvcache.v1 import kv_manager_pb2 as pb  # noqa: E402



def test_a_standby_refuses_every_change_names_the_primary_and_answers_reads(group: Group) -> None:
    first = group.start()
    primary = group.primary()
    assert primary is first
    standby = group.start()
    group.wait_in_sync(standby, primary)
    _, on_primary = connect(primary.address)
    _, on_standby = connect(standby.address)
    for i in range(5):
        on_primary.Step(step_request([op_alloc(f"r{i}", list(range(40)))]))
    assert health(standby.address) == 2 and health(standby.address, "") == 1  # NOT_SERVING, but alive
    # Reads answer what the standby applied: the same tables as the primary's.
    everything = pb.GetBlockTablesRequest()
    assert on_standby.GetBlockTables(everything) == on_primary.GetBlockTables(everything)
    hit = pb.FindCacheHitRequest(token_ids=list(range(40)))
    assert on_standby.FindCacheHit(hit) == on_primary.FindCacheHit(hit)
    assert on_standby.GetConfig(pb.GetConfigRequest()).replica_id == "r"
    assert on_standby.GetStats(pb.GetStatsRequest()).last_step_id == 5
    refused = [
        lambda: on_standby.Step(step_request([op_alloc("x", [1, 2, 3])])),
        lambda: on_standby.Allocate(alloc("x", [1, 2, 3])),
        lambda: on_standby.Free(pb.FreeRequest(request_ids=["r0"])),
        lambda: on_standby.Fork(pb.ForkRequest(parent_request_id="r0", child_request_ids=["c"])),
        lambda: on_standby.ResetPrefixCache(pb.ResetPrefixCacheRequest()),
        lambda: on_standby.AckSteps(pb.AckStepsRequest(worker_id="w", step_id=1)),
        lambda: on_standby.UnregisterWorker(pb.UnregisterWorkerRequest(worker_id="w")),
        lambda: next(on_standby.WatchSteps(pb.WatchStepsRequest(worker_id="w"))),
    ]
    for call in refused:
        with pytest.raises(grpc.RpcError) as raised:
            call()
        assert not_primary_of(raised.value) == primary.address
    assert on_standby.GetBlockTables(everything) == on_primary.GetBlockTables(everything)  # nothing changed


def _kill_during_steps(group: Group, clients: KeyedClients) -> float:
    """SIGKILL the primary once Steps flow; the seconds until its standby reports SERVING."""
    primary = group.primary()
    (standby,) = [m for m in group.running if m is not primary]
    before = len(clients.acked)
    while len(clients.acked) < before + 20:
        time.sleep(0.01)
    primary.kill()
    killed = time.monotonic()
    while not is_primary(standby.address):
        assert time.monotonic() - killed < 10, standby.log()[-3000:]
        time.sleep(0.005)
    return time.monotonic() - killed


def test_killing_the_primary_under_keyed_steps_loses_and_repeats_nothing(group: Group) -> None:
    group.start()
    primary = group.primary()
    group.wait_in_sync(group.start(), primary)
    clients = KeyedClients(group, 3)
    failovers = []
    try:
        for _ in range(20 if THOROUGH else 3):
            failovers.append(_kill_during_steps(group, clients))
            primary = group.primary()
            group.wait_in_sync(group.start(), primary)
    finally:
        clients.stop()
    print(
        f"failover over {len(failovers)} SIGKILLs, lease {LEASE_MS} ms: p50 {statistics.median(failovers):.3f} s, "
        f"max {max(failovers):.3f} s; {len(clients.acked)} keyed Steps acknowledged, {clients.retries} retried"
    )
    assert max(failovers) < 2.0
    assert_history_replays(group, clients)


def test_a_primary_paused_past_its_lease_acknowledges_nothing_after_it_resumes(group: Group) -> None:
    group.start()
    old = group.primary()
    standby = group.start()
    group.wait_in_sync(standby, old)
    _, on_old = connect(old.address)
    on_old.Step(step_request([op_alloc("before", [1, 2, 3])]))
    os.kill(old.pid, signal.SIGSTOP)
    try:
        # Calls queued while it is stopped, answered (if ever) after it resumes.
        queued = [on_old.Step.future(step_request([op_alloc(f"q{i}", [i])]), timeout=20) for i in range(3)]
        time.sleep(LEASE_MS / 1000 * 2)
        assert is_primary(standby.address)
        _, on_new = connect(standby.address)
        on_new.Step(step_request([op_alloc("after", [4, 5, 6])]))
    finally:
        os.kill(old.pid, signal.SIGCONT)
    for future in queued:
        with pytest.raises(grpc.RpcError) as raised:
            future.result()
        not_primary_of(raised.value)
    with pytest.raises(grpc.RpcError) as raised:
        on_old.Step(step_request([op_alloc("late", [7])]))
    assert not_primary_of(raised.value) in ("", standby.address)
    # It rejoins as a standby of the new primary, and holds what the new primary holds.
    group.wait_in_sync(old, standby)
    everything = pb.GetBlockTablesRequest()
    tables = on_new.GetBlockTables(everything)
    assert sorted(t.request_id for t in tables.tables) == ["after", "before"]
    deadline = time.monotonic() + 5
    while on_old.GetBlockTables(everything) != tables:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_loaded_group_never_fails_over_by_itself(group: Group) -> None:
    """The short lease the failover time needs causes no false failover under the tests' load."""
    group.start()
    primary = group.primary()
    standby = group.start()
    group.wait_in_sync(standby, primary)
    clients = KeyedClients(group, 3)
    try:
        time.sleep(180 if THOROUGH else 15)
    finally:
        clients.stop()
    promotions = [m for m in group.members for line in m.log().splitlines() if "is the primary of replica" in line]
    assert promotions == [primary], f"{len(promotions)} promotions under load; {len(clients.acked)} Steps"
    assert "stepped down" not in primary.log() and "left the in-sync set" not in primary.log()
    print(f"no failover in {180 if THOROUGH else 15} s of load: {len(clients.acked)} keyed Steps acknowledged")


def test_a_group_with_journals_survives_losing_every_member_at_once(group: Group, tmp_path) -> None:
    """Every member SIGKILLed: restarted from their journals, the one Redis lists as in sync takes over
    with every acknowledged Step, and the other rejoins it from where its own journal stands."""
    journals = [tmp_path / "a.journal", tmp_path / "b.journal"]
    group.start("--journal", str(journals[0]))
    primary = group.primary()
    standby = group.start("--journal", str(journals[1]))
    group.wait_in_sync(standby, primary)
    clients = KeyedClients(group, 2)
    try:
        clients.wait_for(60)
    finally:
        clients.stop()
    primary.kill()
    standby.kill()
    restarted = [group.start("--journal", str(journal)) for journal in journals]
    new_primary = group.primary(timeout_s=15)
    (other,) = [m for m in restarted if m is not new_primary]
    group.wait_in_sync(other, new_primary)
    assert "after a snapshot" not in new_primary.log()  # the histories matched: the tail only
    assert_history_replays(group, clients)


def test_a_group_without_journals_stopped_cleanly_starts_over_with_its_next_member(group: Group) -> None:
    """The last member to stop holds the only copy of a state no journal keeps: it dissolves the group's
    in-sync set as it goes, so the next member founds the group again instead of waiting for ever."""
    group.start()
    primary = group.primary()
    standby = group.start()
    group.wait_in_sync(standby, primary)
    assert standby.stop() == 0
    assert primary.stop() == 0
    assert "starts it over" in primary.log()
    successor = group.start()
    assert group.primary(timeout_s=10) is successor
