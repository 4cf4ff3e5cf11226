"""Journal compaction: a manager whose journal restarted from a snapshot resumes its exact state.

Killed with SIGKILL right after a compaction (the file holds its header and the snapshot, nothing
after) or later (a snapshot and a tail of records), the manager restarts with the same tables,
pending copies, step and event numbers, workers and keyed-Step memory. Damage in the snapshot,
even as the file's last record, refuses the start and leaves the file as it is.
"""

from __future__ import annotations

import subprocess
from typing import Any

import grpc
import pytest

from kv_manager_service.server.journal import _FRAME, _read
from kvcache.v1 import kv_manager_pb2 as pb
from processes import stop_all
from svc_support import alloc, connect, register_worker, snapshot, step_request, workers
from test_service_journal import Manager, history

# Compact whenever the records since the snapshot outweigh it; the worker stays registered without acking.
COMPACT = ("--journal-compact-bytes", "1", "--worker-timeout-s", "600")


def state(stub) -> dict[str, Any]:
    """`snapshot`, and each registered worker's acknowledged step."""
    s = snapshot(stub)
    s["workers"] = sorted((w.worker_id, w.acked_step_id) for w in workers(stub).values())
    return s


def entries(manager: Manager) -> list[str]:
    records, _, _ = _read(manager.journal.read_bytes(), manager.journal)
    return [record.WhichOneof("entry") for record in records]


def compact_now(stub, manager: Manager) -> None:
    """Make the journal end with a fresh snapshot and nothing after it.

    A compaction runs as a mutation starts; a refused one (an unknown decode id) appends nothing.
    Decode steps grow the journal until the records since the snapshot outweigh it.
    """
    for token in range(200):
        try:
            stub.Step(step_request(decode=[("no-such-request", 0)]))
        except Exception:  # NOT_FOUND: the call is refused after the compaction check
            pass
        if entries(manager)[-1] == "snapshot":
            return
        stub.Step(step_request(decode=[("a2", 3000 + token)]))
    raise AssertionError(f"the journal never compacted: {entries(manager)[:3]}...")


def keyed(key: str, request_id: str, token: int) -> pb.StepRequest:
    request = step_request(decode=[(request_id, token)])
    request.idempotency_key = key
    return request


@pytest.mark.parametrize("policy", ["lru", "frequency"])
def test_a_compacted_journal_survives_sigkill_at_once_and_with_a_tail(tmp_path, policy):
    """Under either eviction policy: the frequency order's segment keys and history are in the snapshot."""
    manager = Manager(tmp_path, *COMPACT, "--eviction-policy", policy)
    try:
        channel, stub = connect(manager.start().address)
        with channel:
            history(stub)
            register_worker(stub, "gpu-0")
            keyed_response = stub.Step(keyed("k1", "a2", 77))
            compact_now(stub, manager)
            before = state(stub)
        assert entries(manager)[:2] == ["header", "snapshot"] and len(entries(manager)) == 2
        assert before["pending_copies"] and before["workers"], before
        manager.kill()

        # The snapshot alone.
        channel, stub = connect(manager.start().address)
        with channel:
            assert state(stub) == before
            assert stub.Step(keyed("k1", "a2", 77)) == keyed_response  # the keyed Step is remembered
            assert state(stub) == before
            last = before["stats"]["last_step_id"]
            assert stub.Allocate(alloc("d", range(500, 510))).step_id == last + 1
            stub.AckSteps(pb.AckStepsRequest(worker_id="gpu-0", step_id=last + 1))  # still registered
            stub.Step(step_request(decode=[("d", 1)]))
            with_tail = state(stub)
        assert with_tail["pending_copies"] == [] and with_tail["workers"] == [("gpu-0", last + 1)]
        assert entries(manager)[:2] == ["header", "snapshot"] and len(entries(manager)) > 2
        manager.kill()

        # The snapshot and a tail of records.
        channel, stub = connect(manager.start().address)
        with channel:
            assert state(stub) == with_tail
        manager.kill()

        # The journal's steps evicted by its policy: another one is refused.
        other = "frequency" if policy == "lru" else "lru"
        manager.argv[manager.argv.index(policy)] = other
        done = subprocess.run(manager.argv, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "different pool configuration" in done.stderr, done.stderr[-2000:]
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)


def test_damage_in_the_snapshot_refuses_the_start_and_leaves_the_file_untouched(tmp_path):
    manager = Manager(tmp_path, *COMPACT)
    try:
        channel, stub = connect(manager.start().address)
        with channel:
            history(stub)
            compact_now(stub, manager)
        manager.kill()
        whole = manager.journal.read_bytes()
        offset = _FRAME.size + int.from_bytes(whole[:4], "little")  # the snapshot: the last record, after the header
        damaged = bytearray(whole)
        damaged[offset + _FRAME.size + 5] ^= 0x01
        manager.journal.write_bytes(bytes(damaged))

        done = subprocess.run(manager.argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"the record at byte {offset} fails its checksum (its payload) and is the journal's snapshot" in (
            done.stderr
        ), done.stderr
        assert manager.journal.read_bytes() == bytes(damaged)
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)


def expect(request_id: str, token_ids) -> pb.StepRequest:
    request = step_request([pb.StepOp(expect=pb.ExpectRequest(request_id=request_id, token_ids=token_ids))])
    request.idempotency_key = f"expect-{request_id}"
    return request


def test_expected_requests_survive_sigkill_in_the_snapshot_and_in_the_tail(tmp_path):
    """Expectations made before a compaction (in its snapshot) and after it (in the tail) are there after a
    SIGKILL: the same state, the keyed expect answered from memory, a refused expect changes nothing,
    and the expected prompt is admitted with its cached prefix."""
    manager = Manager(tmp_path, *COMPACT)
    prompt = list(range(600, 648))  # 3 blocks of 16
    try:
        channel, stub = connect(manager.start().address)
        with channel:
            history(stub)
            stub.Allocate(alloc("cached", prompt))
            stub.Free(pb.FreeRequest(request_ids=["cached"]))  # its 3 full blocks stay cached, free
            in_snapshot = stub.Step(expect("w1", prompt))
            compact_now(stub, manager)
            stub.Step(expect("w2", range(700, 732)))
            before = state(stub)
        assert before["stats"]["num_expected_requests"] == 2 and before["stats"]["num_expected_blocks"] == 5
        assert entries(manager)[:2] == ["header", "snapshot"] and len(entries(manager)) > 2
        manager.kill()

        channel, stub = connect(manager.start().address)
        with channel:
            assert state(stub) == before
            assert stub.Step(expect("w1", prompt)) == in_snapshot  # keyed: remembered, not applied again
            refused = step_request([pb.StepOp(expect=pb.ExpectRequest(request_id="a2", token_ids=[1]))])
            with pytest.raises(grpc.RpcError, match="is live"):
                stub.Step(refused)
            assert state(stub) == before
            admitted = stub.Allocate(alloc("w1", prompt))
            assert admitted.num_computed_tokens == 32  # whole blocks short of the prompt's last token: cached
            assert stub.GetStats(pb.GetStatsRequest()).num_expected_requests == 1
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)
