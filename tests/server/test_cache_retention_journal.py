"""Retention on the server side: pin expiries are decided once by the replica's clock and journaled, so
a replay or a standby releases the same pins; and with no retention set, every byte a manager says
(step deltas, responses, events, journal records) is what it said before retention existed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from retention_workload import CONFIGS, run

from kv_manager_service.core import AllocateOp, FailedPreconditionError, FreeOp, KVCacheConfig, KVCacheManager, Retention
from kv_manager_service.server.journal import Journal
from kv_manager_service.server.pin_clock import PinClock
from kv_manager_service.server.replica import Replica
from kv_manager_service.server.tenancy import Tenancy
from kv_manager_service.shared.security import Principal, TokenTable
from kvcache.journal.v1 import journal_pb2 as jpb
from kvcache.v1 import kv_manager_pb2 as pb

# What the seeded workloads of retention_workload.py made a manager say before the retention API
# existed (seeds 1 and 2, 150 steps each).
GOLDEN = {
    ("one group", 1): "c5a2db5b15a71bb92dbee249e38515d39245dc0f15ae6848e8e0abe5c3038706",
    ("one group", 2): "3f98df37c7e241fc4f2fd9d327c5d443a36059b1e6dafaebb00cb1504b7dc3ee",
    ("hybrid", 1): "d20357c59254e0f0742935f90b6666c5df2dbcbe21dcac127566c363f9023512",
    ("hybrid", 2): "1079b4fb59760a54d8cd211a4c5aa192fa4a750008ccda7f2d764bd6cddd37a6",
    ("host tier", 1): "d9937d036fb308c39887c825b60c7a024f63ff442587c753a9de87de39c0c872",
    ("host tier", 2): "a2875984abeb34d86f305b0e5235a57fac5c9136fb0c9f5bef9e9e788b50d15a",
}


@pytest.mark.parametrize(("config_name", "seed"), sorted(GOLDEN))
def test_with_no_retention_every_byte_is_what_it_was_before_retention(tmp_path, config_name, seed):
    assert config_name in CONFIGS
    assert run(config_name, seed, 150, tmp_path / "journal") == GOLDEN[(config_name, seed)]


def test_the_clock_names_due_pins_in_deadline_order_and_forgets_released_ones():
    clock = PinClock()
    clock.start([(1, 300), (2, 100), (3, 200)], now=10.0)
    assert clock.due(10.05, lambda pin_id: True) == []
    assert clock.due(10.25, lambda pin_id: pin_id != 3) == [2]  # 3 was released otherwise
    assert len(clock) == 1 and clock.due(11.0, lambda pin_id: True) == [1]


CONFIG = KVCacheConfig(num_blocks=17, groups=({"kind": "full_attention", "block_size": 4},),
                       enable_events=True, retention_max_pinned_blocks=8)  # fmt: skip


def pinned_history(replica: Replica) -> None:
    """Two pins, of 10 ms and of an hour; the short one expires."""
    replica.step([AllocateOp("sys", list(range(8)), 8, retention=Retention(priority=2, ttl_ms=10))])
    replica.step([AllocateOp("agent", list(range(100, 112)), 12, retention=Retention(ttl_ms=3_600_000))])
    replica.step([FreeOp(["sys", "agent"])])
    time.sleep(0.02)
    assert replica.expire_pins() == [1]
    replica.step([AllocateOp("next", list(range(8)) + [9], 9)])


def test_an_expiry_is_journaled_and_a_restart_replays_it_instead_of_deciding_again(tmp_path: Path):
    path = tmp_path / "journal"
    journal = Journal.open(path, "r", "pool", "never")
    replica = Replica(KVCacheManager(CONFIG), "r", 1, journal=journal, check_invariants=True)
    pinned_history(replica)
    state = replica.manager.export_state()
    journal.close()
    records = Journal.open(path, "r", "pool", "never").records
    assert [r.pins_expired.pin_ids for r in records if r.WhichOneof("entry") == "pins_expired"] == [[1]]

    restarted = Replica(
        KVCacheManager(CONFIG), "r", 2, journal=Journal.open(path, "r", "pool", "never"), check_invariants=True
    )
    assert restarted.manager.export_state() == state
    assert restarted.manager.live_pins() == [(2, 3_600_000)]  # its clock starts again at the restart
    assert restarted.expire_pins() == []


def test_a_standby_applying_the_records_releases_the_same_pins():
    primary = Replica(KVCacheManager(CONFIG), "r", 1, check_invariants=True)
    primary.enable_history(1000, 1 << 20)
    pinned_history(primary)
    payloads = [payload for _, payload in primary.history.read(1, 1000, 0)]
    standby = Replica(KVCacheManager(CONFIG), "r", 1, check_invariants=True)
    standby.apply_records(payloads, [jpb.JournalRecord.FromString(p) for p in payloads])
    assert standby.manager.export_state() == primary.manager.export_state()
    assert standby.manager.live_pins() == [(2, 3_600_000)]


def test_a_snapshot_keeps_pins_and_priorities_and_their_clocks_start_again(tmp_path: Path):
    path = tmp_path / "journal"
    journal = Journal.open(path, "r", "pool", "never", compact_bytes=1)
    replica = Replica(KVCacheManager(CONFIG), "r", 1, journal=journal, check_invariants=True)
    pinned_history(replica)
    replica.step([])  # compacts before it: the journal now starts with a snapshot
    state = replica.manager.export_state()
    journal.close()
    reopened = Journal.open(path, "r", "pool", "never")
    assert reopened.records[0].WhichOneof("entry") == "snapshot"
    restarted = Replica(KVCacheManager(CONFIG), "r", 2, journal=reopened, check_invariants=True)
    assert restarted.manager.export_state() == state
    assert state.pins and state.block_priorities
    assert restarted.manager.live_pins() == [(2, 3_600_000)] and restarted.expire_pins() == []


def test_multi_tenant_mode_refuses_retention():
    tenancy = Tenancy(b"s" * 16, TokenTable({"token-a": Principal("a")}))
    plain = pb.StepRequest(ops=[pb.StepOp(allocate=pb.AllocateRequest(request_id="x", token_ids=[1], num_new_tokens=1))])
    tenancy.scope_request("a", plain)
    retained = pb.AllocateRequest(request_id="x", token_ids=[1], num_new_tokens=1, retention=pb.Retention(priority=1))
    with pytest.raises(FailedPreconditionError) as error:
        tenancy.scope_request("a", pb.StepRequest(ops=[pb.StepOp(allocate=retained)]))
    assert error.value.field == "retention"
