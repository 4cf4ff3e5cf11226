"""The journal: a manager killed with SIGKILL and restarted under the same replica id resumes its exact state."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kv_manager_service.server.journal import Journal, JournalError
from kv_manager_service.rpc.ready_line import MANAGER_READY_PREFIX
from kvcache.v1 import journal_pb2
from kvcache.v1 import kv_manager_pb2 as pb
from processes import free_port, launch, stop_all
from svc_support import alloc, connect, op_alloc, op_free, pool_config, read_steps, snapshot, step_request, write_config

POOL = pool_config(48, 16)


class Manager:
    """`kv-manager serve --journal` on a fixed port, killable and restartable with the same arguments."""

    def __init__(self, tmp_path, *extra: str) -> None:
        self.tmp_path = tmp_path
        self.journal = tmp_path / "journal" / "replica.journal"
        config = write_config(tmp_path, POOL, "pool.json")
        self.argv = [
            sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", str(free_port()),
            "--replica-id", "journaled", "--config", str(config), "--journal", str(self.journal), *extra,
        ]  # fmt: skip
        self.starts = 0
        self.processes = []

    def start(self):
        process = launch(self.argv, MANAGER_READY_PREFIX, self.tmp_path / f"manager-{self.starts}.log")
        self.starts += 1
        self.processes.append(process)
        return process

    def kill(self) -> None:
        self.processes[-1].kill()  # on purpose: its stop check skips the exit code, not the log


def history(stub) -> None:
    """Admissions, decodes, a prefix hit, a fork with copy-on-write, frees, a registered worker's acks."""
    stub.Allocate(alloc("a", range(40)))
    stub.Allocate(alloc("b", range(100, 137)))
    for i in range(5):
        stub.Step(step_request(decode=[("a", 1000 + i), ("b", 2000 + i)]))
    stub.Fork(pb.ForkRequest(parent_request_id="b", child_request_ids=["b1", "b2"]))
    stub.Step(step_request(decode=[("b1", 7), ("b2", 8)]))  # copy-on-write of b's last block
    stub.Free(pb.FreeRequest(request_ids=["a"]))
    stub.Allocate(alloc("a2", list(range(40)) + [1000, 1001]))  # hits a's cached blocks
    stub.Step(step_request([op_alloc("c", range(300, 330)), op_free("b")]))
    stub.Fork(pb.ForkRequest(parent_request_id="a2", child_request_ids=["a3"]))
    stub.Step(step_request(decode=[("a3", 9)]))  # the last step: its copy stays pending below


def test_a_killed_manager_restarts_with_the_same_state_and_step_log(tmp_path):
    manager = Manager(tmp_path)
    try:
        first = manager.start()
        channel, stub = connect(first.address)
        with channel:
            history(stub)
            last = stub.GetStats(pb.GetStatsRequest()).last_step_id
            deltas = read_steps(stub, "gpu-0", 1, last)  # registers gpu-0
            stub.AckSteps(pb.AckStepsRequest(worker_id="gpu-0", step_id=last - 1))
            before = snapshot(stub)
        assert before["pending_copies"], "the history must leave copies pending (the last step's)"
        manager.kill()

        second = manager.start()
        assert second.address == first.address
        channel, stub = connect(second.address)
        with channel:
            assert snapshot(stub) == before
            assert read_steps(stub, "gpu-0", 1, last) == deltas  # the same step log, from step 1
            # It goes on from there: the worker's ack releases the copies, new steps get new ids.
            stub.AckSteps(pb.AckStepsRequest(worker_id="gpu-0", step_id=last))
            assert stub.GetStats(pb.GetStatsRequest()).num_pending_copies == 0
            assert stub.Allocate(alloc("d", range(500, 510))).step_id == last + 1
            after_more = snapshot(stub)
        # A graceful restart restores the same way.
        assert not stop_all([second])
        third = manager.start()
        channel, stub = connect(third.address)
        with channel:
            assert snapshot(stub) == after_more
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)


def test_a_journal_of_another_replica_or_pool_is_refused(tmp_path):
    path = tmp_path / "j.journal"
    Journal.open(path, "replica-a", '{"num_blocks": 10}').close()
    with pytest.raises(JournalError, match="belongs to replica 'replica-a', not 'replica-b'"):
        Journal.open(path, "replica-b", '{"num_blocks": 10}')
    with pytest.raises(JournalError, match="different pool configuration"):
        Journal.open(path, "replica-a", '{"num_blocks": 11}')


def test_a_torn_last_record_is_cut_and_damage_before_it_is_refused(tmp_path):
    path = tmp_path / "j.journal"
    journal = Journal.open(path, "r", "{}")
    for step_id in (1, 2, 3):
        journal.append(journal_pb2.JournalRecord(ack=pb.AckStepsRequest(worker_id="w", step_id=step_id)))
    journal.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # the process died in the middle of the last write
    reopened = Journal.open(path, "r", "{}")
    assert [r.ack.step_id for r in reopened.records] == [1, 2]
    reopened.append(journal_pb2.JournalRecord(ack=pb.AckStepsRequest(worker_id="w", step_id=4)))
    reopened.close()
    assert [r.ack.step_id for r in Journal.open(path, "r", "{}").records] == [1, 2, 4]

    damaged = bytearray(path.read_bytes())
    damaged[40] ^= 0xFF  # inside the first ack record, not the last one
    path.write_bytes(bytes(damaged))
    with pytest.raises(JournalError, match="fails its checksum"):
        Journal.open(path, "r", "{}")


def test_serve_refuses_a_journal_of_another_replica_with_a_clear_error(tmp_path):
    manager = Manager(tmp_path)
    try:
        manager.start()
    finally:
        assert not stop_all(manager.processes)
    argv = [a if a != "journaled" else "someone-else" for a in manager.argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "belongs to replica 'journaled', not 'someone-else'" in done.stderr, done.stderr
