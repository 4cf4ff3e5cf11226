"""The journal: a manager killed with SIGKILL and restarted under the same replica id resumes its exact state.

A torn tail (an interrupted append, zero bytes after a power loss) is cut at start; any other damage refuses
the start with the byte offset and leaves the file as it is.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib

import pytest

from kv_manager_service.server.journal import _FRAME, Journal, JournalError
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kvcache.journal.v1 import journal_pb2
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
        journal.append(journal_pb2.JournalRecord(ack=journal_pb2.StepsAcked(worker_id="w", step_id=step_id)))
    journal.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # the process died in the middle of the last write
    reopened = Journal.open(path, "r", "{}")
    assert [r.ack.step_id for r in reopened.records] == [1, 2]
    reopened.append(journal_pb2.JournalRecord(ack=journal_pb2.StepsAcked(worker_id="w", step_id=4)))
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


def refused_start(manager: Manager) -> subprocess.CompletedProcess:
    """Run `manager`'s command line once more, expecting it to stop before it serves."""
    return subprocess.run(manager.argv, capture_output=True, text=True, timeout=60)


def record_offsets(data: bytes) -> list[int]:
    """Where each record of an intact journal starts (a frame begins with its payload length)."""
    offsets, offset = [], 0
    while offset < len(data):
        offsets.append(offset)
        offset += _FRAME.size + struct.unpack_from("<I", data, offset)[0]
    return offsets


def killed_after_history(manager: Manager) -> tuple[dict, bytes]:
    """Start `manager`, run the history, SIGKILL it: (its snapshot, the journal's bytes)."""
    channel, stub = connect(manager.start().address)
    with channel:
        history(stub)
        before = snapshot(stub)
    manager.kill()
    return before, manager.journal.read_bytes()


def flip_length(data: bytearray, offset: int) -> None:
    data[offset + 2] ^= 0x01  # the record claims 64 KiB more than it holds: past the file's end


def flip_payload(data: bytearray, offset: int) -> None:
    data[offset + _FRAME.size + 1] ^= 0x01


def zero_block(data: bytearray, offset: int) -> None:
    data[offset : offset + 32] = bytes(32)  # a block that never reached the disk, mid-file


@pytest.mark.parametrize("damage", [flip_length, flip_payload, zero_block])
def test_damage_before_the_end_refuses_the_start_and_leaves_the_file_untouched(tmp_path, damage):
    manager = Manager(tmp_path)
    try:
        _, whole = killed_after_history(manager)
        offset = record_offsets(whole)[len(record_offsets(whole)) // 2]
        damaged = bytearray(whole)
        damage(damaged, offset)
        manager.journal.write_bytes(bytes(damaged))

        done = refused_start(manager)
        assert done.returncode == 2, done.stderr
        assert f"journal {manager.journal}: the record at byte {offset} " in done.stderr, done.stderr
        assert "move the file aside to start empty, or restore a backup" in done.stderr, done.stderr
        assert manager.journal.read_bytes() == bytes(damaged)
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)


def zeros(last_frame: bytes) -> bytes:
    return bytes(4096)  # the file grew, its data never reached the disk


def torn_record_then_zeros(last_frame: bytes) -> bytes:
    return last_frame[: len(last_frame) // 2] + bytes(4096)


def torn_header(last_frame: bytes) -> bytes:
    return last_frame[: _FRAME.size - 3]


@pytest.mark.parametrize("tail", [zeros, torn_record_then_zeros, torn_header])
def test_a_torn_tail_is_cut_and_the_manager_starts_with_everything_before_it(tmp_path, tail):
    manager = Manager(tmp_path)
    try:
        before, whole = killed_after_history(manager)
        last_frame = whole[record_offsets(whole)[-1] :]
        manager.journal.write_bytes(whole + tail(last_frame))

        channel, stub = connect(manager.start().address)
        with channel:
            assert snapshot(stub) == before
            assert stub.Allocate(alloc("after", range(600, 610))).step_id == before["stats"]["last_step_id"] + 1
        assert manager.journal.read_bytes().startswith(whole)
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)


def test_a_new_journal_on_a_full_disk_stops_the_manager_with_the_journal_failure(tmp_path):
    manager = Manager(tmp_path)
    manager.journal.parent.mkdir()
    manager.journal.symlink_to("/dev/full")  # every write fails with ENOSPC, as on a full disk
    done = refused_start(manager)
    assert done.returncode == 75, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    failure = [line for line in lines if line["level"] == "CRITICAL"]
    assert [line["msg"] for line in failure] == [
        f"cannot write the journal {manager.journal} ([Errno 28] No space left on device); stopping"
    ]


def test_a_journal_in_the_earlier_format_is_refused(tmp_path):
    path = tmp_path / "j.journal"
    header = journal_pb2.JournalRecord(header=journal_pb2.JournalHeader(format_version=1, replica_id="r", pool="{}"))
    payload = header.SerializeToString()
    path.write_bytes(struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(JournalError, match="is in format 1, written by an earlier version.*move the file aside"):
        Journal.open(path, "r", "{}")
    assert path.read_bytes() == struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def test_a_journal_that_cannot_be_opened_refuses_the_start_in_one_line(tmp_path):
    manager = Manager(tmp_path)
    manager.journal.mkdir(parents=True)  # a directory where the file should be
    done = refused_start(manager)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"kv-manager: error: cannot open the journal {manager.journal}: Is a directory\n"


def test_a_journal_of_another_replica_is_refused_before_its_torn_tail_is_cut(tmp_path):
    path = tmp_path / "j.journal"
    Journal.open(path, "replica-a", "{}").close()
    path.write_bytes(path.read_bytes() + bytes(100))
    with pytest.raises(JournalError, match="belongs to replica 'replica-a'"):
        Journal.open(path, "replica-b", "{}")
    assert path.read_bytes().endswith(bytes(100))


def ack_record(step_id: int) -> journal_pb2.JournalRecord:
    return journal_pb2.JournalRecord(ack=journal_pb2.StepsAcked(worker_id="w", step_id=step_id))


def test_a_compaction_that_cannot_write_its_file_leaves_the_journal_as_it_was(tmp_path):
    path = tmp_path / "j.journal"
    journal = Journal.open(path, "r", "{}", compact_bytes=1)
    journal.append(ack_record(1))
    assert journal.compaction_due()
    unfinished = tmp_path / "j.journal.compacting"
    unfinished.mkdir()  # the new file cannot be created
    whole = path.read_bytes()
    assert not journal.compact(journal_pb2.JournalSnapshot())
    assert path.read_bytes() == whole and not journal.compaction_due()  # tried again after as many bytes more
    journal.append(ack_record(2))
    assert journal.compaction_due()
    unfinished.rmdir()
    assert journal.compact(journal_pb2.JournalSnapshot(last_event_sequence=7))
    journal.append(ack_record(3))
    journal.close()

    unfinished.write_bytes(b"a compaction killed before its rename")
    reopened = Journal.open(path, "r", "{}")
    assert not unfinished.exists()
    assert [r.WhichOneof("entry") for r in reopened.records] == ["snapshot", "ack"]
    assert reopened.records[0].snapshot.last_event_sequence == 7 and reopened.records[1].ack.step_id == 3


def test_journals_in_formats_2_and_3_are_read_and_a_newer_format_is_refused(tmp_path):
    path = tmp_path / "j.journal"
    journal = Journal.open(path, "r", "{}")
    journal.append(ack_record(1))
    journal.close()
    for version, readable in ((2, True), (3, True), (5, False)):
        data = bytearray(path.read_bytes())
        header = journal_pb2.JournalRecord(
            header=journal_pb2.JournalHeader(format_version=version, replica_id="r", pool="{}")
        ).SerializeToString()
        length_and_crc = struct.pack("<II", len(header), zlib.crc32(header))
        end = _FRAME.size + struct.unpack_from("<I", data, 0)[0]
        data[:end] = length_and_crc + struct.pack("<I", zlib.crc32(length_and_crc)) + header
        path.write_bytes(bytes(data))
        if readable:
            assert [r.ack.step_id for r in Journal.open(path, "r", "{}").records] == [1]
        else:
            with pytest.raises(JournalError, match="format version 5, this manager reads 2, 3 and 4: a newer manager"):
                Journal.open(path, "r", "{}")
