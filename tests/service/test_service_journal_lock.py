"""One journal, one writer; a compacted journal without its whole snapshot refuses the start.

A second manager on a journal another one holds exits 2 naming the journal and the holder's pid, also
after the holder's compactions renamed new files over the journal. A compacted journal cut after its
header, or with damage in its snapshot, refuses the start naming the byte offset, the file untouched.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from typing import Iterator

import pytest

from kv_manager_service.server.journal import _FRAME, LOCK_SUFFIX, Journal, JournalError
from kvcache.journal.v1 import journal_pb2
from processes import free_port, stop_all
from svc_support import alloc, connect, snapshot, step_request
from test_service_compaction import COMPACT
from test_service_journal import Manager, ack_record, history, record_offsets, refused_start


@contextmanager
def stopped_at_the_end(manager: Manager) -> Iterator[Manager]:
    """`manager`, whose processes must all have exited cleanly (or been killed) at the end."""
    try:
        yield manager
    finally:
        failures = stop_all(manager.processes)
        assert not failures, "\n\n".join(failures)


def started_elsewhere(manager: Manager) -> subprocess.CompletedProcess:
    """Run `manager`'s command line on another port, expecting it to stop before it serves."""
    argv = list(manager.argv)
    argv[argv.index("--port") + 1] = str(free_port())
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def renamed_over(stub, manager: Manager, first_token: int) -> None:
    """Run decode steps until a compaction renames a new file over the journal."""
    inode = manager.journal.stat().st_ino
    for token in range(first_token, first_token + 500):
        stub.Step(step_request(decode=[("a2", token)]))
        if manager.journal.stat().st_ino != inode:
            return
    raise AssertionError("the journal never compacted")


@pytest.mark.parametrize("compacting", [False, True], ids=["appending", "compacting"])
def test_a_second_manager_on_a_held_journal_is_refused_and_the_first_keeps_serving(tmp_path, compacting):
    with stopped_at_the_end(Manager(tmp_path, *(COMPACT if compacting else ()))) as manager:
        first = manager.start()
        lock = manager.journal.with_name(manager.journal.name + LOCK_SUFFIX)
        channel, stub = connect(first.address)
        with channel:
            history(stub)
            for attempt in range(3 if compacting else 1):
                if compacting:
                    renamed_over(stub, manager, 3000 + 1000 * attempt)
                journaled = manager.journal.read_bytes()
                done = started_elsewhere(manager)
                assert done.returncode == 2, done.stderr
                assert done.stderr == (
                    f"kv-manager: error: journal {manager.journal} is in use: {lock} is locked by pid {first.pid}; "
                    "one manager writes a journal: stop that one first, or use another --journal\n"
                )
                assert manager.journal.read_bytes() == journaled
            last = snapshot(stub)["stats"]["last_step_id"]
            assert stub.Allocate(alloc("after", range(600, 610))).step_id == last + 1  # the first still serves
            before = snapshot(stub)
        assert not stop_all([first])

        channel, stub = connect(manager.start().address)
        with channel:
            assert snapshot(stub) == before


def cut_after_the_header(data: bytes) -> tuple[bytes, int]:
    end = record_offsets(data)[1]
    return data[:end], end


def flip_a_byte_in_the_snapshot(data: bytes) -> tuple[bytes, int]:
    offset = record_offsets(data)[1]
    damaged = bytearray(data)
    damaged[offset + _FRAME.size + 5] ^= 0x01
    return bytes(damaged), offset


@pytest.mark.parametrize("damage", [cut_after_the_header, flip_a_byte_in_the_snapshot])
def test_a_compacted_journal_without_its_whole_snapshot_refuses_the_start_untouched(tmp_path, damage):
    with stopped_at_the_end(Manager(tmp_path, *COMPACT)) as manager:
        channel, stub = connect(manager.start().address)
        with channel:
            history(stub)
            renamed_over(stub, manager, 3000)
            stub.Step(step_request(decode=[("a2", 9)]))  # a record after the snapshot
        assert not stop_all(manager.processes)
        damaged, offset = damage(manager.journal.read_bytes())
        manager.journal.write_bytes(damaged)

        done = refused_start(manager)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"kv-manager: error: journal {manager.journal}: "), done.stderr
        assert f" the record at byte {offset} " in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert manager.journal.read_bytes() == damaged


def test_open_is_refused_while_another_journal_holds_the_lock_and_allowed_after_close(tmp_path):
    path = tmp_path / "j.journal"
    holder = Journal.open(path, "r", "{}")
    assert (tmp_path / "j.journal.lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(JournalError, match=f"journal {path} is in use: .* is locked by pid {os.getpid()}"):
        Journal.open(path, "r", "{}")
    holder.close()
    Journal.open(path, "r", "{}").close()


def compacted_journal(path) -> bytes:
    """A journal of a header, a snapshot and one ack after it: its bytes."""
    journal = Journal.open(path, "r", "{}", compact_bytes=1)
    assert journal.compact(journal_pb2.JournalSnapshot(last_event_sequence=7))
    journal.append(ack_record(1))
    journal.close()
    return path.read_bytes()


def test_open_refuses_a_header_promising_a_snapshot_that_is_not_there(tmp_path):
    path = tmp_path / "j.journal"
    whole = compacted_journal(path)
    header_end, snapshot_end = record_offsets(whole)[1:3]
    for data in (whole[:header_end], whole[:header_end] + whole[snapshot_end:]):  # cut, or an ack in its place
        path.write_bytes(data)
        with pytest.raises(JournalError, match=f"header says a snapshot follows, but the record at byte {header_end}"):
            Journal.open(path, "r", "{}")
        assert path.read_bytes() == data


def test_open_cuts_a_torn_tail_after_a_whole_snapshot(tmp_path):
    path = tmp_path / "j.journal"
    whole = compacted_journal(path)
    path.write_bytes(whole[:-3])
    reopened = Journal.open(path, "r", "{}")
    assert [r.WhichOneof("entry") for r in reopened.records] == ["snapshot"]
    reopened.close()
    assert path.read_bytes() == whole[: record_offsets(whole)[2]]
