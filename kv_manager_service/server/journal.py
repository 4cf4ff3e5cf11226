"""The manager's journal: an append-only local file of every accepted mutation.

Record framing (formats 2 to 4, little-endian):

    | u32 payload length | u32 CRC-32 of the payload | u32 CRC-32 of the 8 bytes before | payload |

The frame header has its own checksum, so damage to any byte is detected,
and a damaged length is never followed: the reader only trusts a length
whose header checks. The first record is a header naming the format, the
replica and its pool; a journal only restores the same pool. A file of
format 1 (one CRC over the payload only) is refused with a message saying to
move it aside: reading it and appending to it would keep the framing whose
damaged lengths passed for a torn tail. Format 3 adds the snapshot record;
format 4 moves the records to their own package (`kvcache.journal.v1`, the
same bytes) and adds a keyed step's fingerprint (journal_records.py).
Files of formats 2 and 3 are read, then rewritten in format 4 (a compaction,
even with compaction off) before anything is appended to them, so a file
never mixes formats. A newer format is refused. In a high-availability
group (ha.py) each record also carries its number in the group's history
and its fencing token, and the header names the member the journal makes
(`member_id`); a format 4 file without one is rewritten with one before
its next append.

Compaction. The records since the last snapshot are replayed at every start,
so once they pass `compact_bytes` and the size of the file's snapshot (so
that compacting costs at most as much as was appended since), the replica
writes a snapshot of its whole state between two mutations (`compact`): the
header and the snapshot go to `<journal>.compacting`, which is fsynced and
renamed over the journal, then the directory is fsynced, and appends go on
in the new file. A crash at any point leaves the old journal or the new one
whole: a `.compacting` file found at open is an unfinished compaction and is
deleted. A compaction that cannot write its file (disk full) leaves the
journal as it was and is tried again after as many bytes more.

A record is written (one `write`) before the call's reply is sent and before
workers can see its step, so a crash of the process, SIGKILL included, loses
no acknowledged step. With `fsync="always"` each record is also forced to
disk before the reply (surviving power loss too); with `fsync="never"` the
operating system decides when. A write that fails (disk full), the header
of a new journal's included, stops the manager (`on_write_failure`).

At open, the journal is read up to its first bad record. What follows is cut
off only when it is a torn tail, what an interrupted append leaves: the start
of one frame (a header too short to check, or a header that checks with its
payload short or failing its checksum), then nothing but zero bytes (a power
loss can leave the file longer than what reached the disk). Its call was
never answered. Any other damage refuses the start, naming the byte offset,
and leaves the file as it is. A bad last record whose header checks cannot
be told from a torn write, so it is cut too, unless it is a compacted
journal's snapshot (its header says one follows). A compacted journal whose
header says a snapshot follows but whose next record is not one (the file
was cut after its header) is refused the same way.

One journal, one writer. `open` takes an exclusive lock (`flock`) on
`<journal>.lock` before it reads or changes anything, and the journal holds
it until `close` or the process's death; the holder writes its pid there. A
second manager on the same journal is refused at open (JournalError naming
the journal and the holder's pid) rather than append to the same file, or,
after the holder's compaction renamed a new file over it, to an unlinked
one. The lock file is never renamed or deleted, so compaction keeps the lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
import uuid
import zlib
from pathlib import Path
from typing import Callable

from google.protobuf.message import DecodeError

from kvcache.journal.v1 import journal_pb2 as pb

log = logging.getLogger("kv_manager_service.server.journal")

FORMAT_VERSION = 4  # written by this manager
READ_FORMAT_VERSIONS = (2, 3, 4)
DEFAULT_COMPACT_BYTES = 16 << 20
COMPACTING_SUFFIX = ".compacting"
LOCK_SUFFIX = ".lock"
FSYNC_POLICIES = ("always", "never")
_FRAME = struct.Struct("<III")  # payload length, payload CRC-32, CRC-32 of the first 8 bytes
_FORMAT_1_FRAME = struct.Struct("<II")  # payload length, payload CRC-32
_WHAT_TO_DO = "move the file aside to start empty, or restore a backup"


class JournalError(ValueError):
    """The journal cannot be used: it belongs to another replica or pool, or it is corrupt before its end."""


class Journal:
    """An open journal: the records it held when opened, and appends from then on."""

    def __init__(
        self, path: Path, fd: int, lock_fd: int, fsync: str, records: list[pb.JournalRecord],
        header: pb.JournalHeader, compact_bytes: int, num_bytes: int, snapshot_end: int, file_format: int,
    ) -> None:  # fmt: skip
        self.path = path
        self.fd = fd
        self.lock_fd = lock_fd  # holds the exclusive lock on <journal>.lock until closed
        self.fsync = fsync == "always"
        self.records = records  # as read at open, header excluded
        self.num_appended = 0
        self.header = header  # of a compacted file
        self.compact_bytes = compact_bytes  # 0: never compact
        self.num_bytes = num_bytes  # the file's size
        self.snapshot_end = snapshot_end  # where the file's snapshot (or header) ends: what a start does not replay
        self._compact_after = max(compact_bytes, snapshot_end)  # bytes past snapshot_end
        self.file_format = file_format  # older than FORMAT_VERSION: rewritten before the first append

    @classmethod
    def open(
        cls,
        path: Path,
        replica_id: str,
        pool: str,
        fsync: str = "always",
        on_write_failure: Callable[["Journal", OSError], None] | None = None,
        compact_bytes: int = DEFAULT_COMPACT_BYTES,
    ) -> "Journal":
        """Open (or create) the journal at `path` for this replica and pool, reading what it holds.

        Cuts a torn tail off the file; raises JournalError, the file untouched, on any other damage,
        and when another process holds the journal's lock.
        A new journal's header that cannot be written goes to `on_write_failure` (None: raises),
        as every later append's failure goes to the replica's. `compact_bytes`: see the module
        docstring; 0 never compacts.
        """
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"journal fsync policy must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        if compact_bytes < 0:
            raise ValueError(f"journal compact_bytes must be >= 0, got {compact_bytes}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise JournalError(f"cannot open the journal {path}: {error.strerror}") from error
        lock_fd = _lock(path)
        try:
            unfinished = path.with_name(path.name + COMPACTING_SUFFIX)
            if unfinished.exists():
                log.warning(
                    "journal %s: deleting %s, left by a compaction that did not finish (the journal is whole)",
                    path, unfinished, extra={"journal": str(path)},
                )  # fmt: skip
                unfinished.unlink()
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as error:
            os.close(lock_fd)
            raise JournalError(f"cannot open the journal {path}: {error.strerror}") from error
        journal = None
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
            records, ends, valid_bytes = _read(data, path)
            if records:
                _check_header(records[0], path, replica_id, pool)  # before the file is changed
            if valid_bytes < size:
                log.warning(
                    "journal %s: cutting a torn tail (%d bytes from byte %d): an append that was never answered",
                    path, size - valid_bytes, valid_bytes, extra={"journal": str(path)},
                )  # fmt: skip
                os.ftruncate(fd, valid_bytes)
            # Kept from the file: a member of a high-availability group is who its journal says.
            member_id = records[0].header.member_id if records else ""
            header = pb.JournalHeader(
                format_version=FORMAT_VERSION, replica_id=replica_id, pool=pool, member_id=member_id or _new_member_id()
            )
            snapshot_end = ends[1] if len(records) > 1 and records[1].WhichOneof("entry") == "snapshot" else 0
            file_format = records[0].header.format_version if records else FORMAT_VERSION
            if records and not member_id:
                file_format = min(file_format, FORMAT_VERSION - 1)  # rewritten with its member id before an append
            journal = cls(
                path, fd, lock_fd, fsync, records[1:], header, compact_bytes, valid_bytes, snapshot_end, file_format
            )  # fmt: skip
            if records:
                return journal
            try:
                journal.append(pb.JournalRecord(header=header))
            except OSError as error:
                if on_write_failure is not None:
                    on_write_failure(journal, error)  # does not return
                raise
            return journal
        except BaseException:
            if journal is not None:
                journal.close()
            else:
                os.close(fd)
                os.close(lock_fd)
            raise

    @property
    def member_id(self) -> str:
        """Who this journal's manager is in a high-availability group: made when the journal was, and
        kept by compaction, so a restart from the journal is the same member and an empty start is not."""
        return self.header.member_id

    def append(self, record: pb.JournalRecord) -> None:
        """Write one record; with fsync="always", force it to disk before returning."""
        self.append_serialized(record.SerializeToString())

    def append_serialized(self, payload: bytes) -> None:
        """`append` of a record already serialized (a high-availability group's, sent as they are)."""
        frame = _frame_payload(payload)
        _write(self.fd, frame, self.path)
        if self.fsync:
            os.fsync(self.fd)
        self.num_appended += 1
        self.num_bytes += len(frame)

    def compaction_due(self) -> bool:
        """Whether the records since the file's snapshot are worth replacing by a new one, or the file
        is of an older format (module docstring)."""
        if self.file_format < FORMAT_VERSION:
            return True
        return self.compact_bytes > 0 and self.num_bytes - self.snapshot_end >= self._compact_after

    def compact(self, snapshot: pb.JournalSnapshot, seq: int = 0, token: int = 0) -> bool:
        """Replace the file by its header and `snapshot`, atomically (see the module docstring); appends
        go on in the new file. The caller holds the state still: `snapshot` is all it has journaled.

        Returns False, the journal unchanged, when the new file cannot be written; raises OSError
        when the directory cannot be synced after the rename (the new file may not outlive a power loss).
        `seq` and `token`: those of the last record the snapshot includes, in a high-availability group.
        """
        started = time.perf_counter()
        temp = self.path.with_name(self.path.name + COMPACTING_SUFFIX)
        header = pb.JournalHeader(snapshot_follows=True)
        header.MergeFrom(self.header)
        frames = _frame(pb.JournalRecord(header=header)) + _frame(pb.JournalRecord(snapshot=snapshot, seq=seq, token=token))
        fd = -1
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            _write(fd, frames, temp)
            os.fsync(fd)
        except OSError as error:
            if fd >= 0:
                os.close(fd)
                temp.unlink(missing_ok=True)
            self._compact_after = self.num_bytes - self.snapshot_end + max(self.compact_bytes, self.snapshot_end)
            log.error(
                "journal %s: cannot compact (%s); appending to the journal as it is, trying again later",
                self.path, error, extra={"journal": str(self.path)},
            )  # fmt: skip
            return False
        os.rename(temp, self.path)
        old_fd, self.fd = self.fd, fd
        os.close(old_fd)
        num_bytes_before, self.num_bytes = self.num_bytes, len(frames)
        self.snapshot_end = len(frames)
        self.file_format = FORMAT_VERSION
        self._compact_after = max(self.compact_bytes, self.snapshot_end)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        log.info(
            "journal %s: compacted %d bytes into a %d-byte snapshot in %.3fs",
            self.path, num_bytes_before, len(frames), time.perf_counter() - started,
            extra={"journal": str(self.path), "snapshot_bytes": len(frames)},
        )  # fmt: skip
        return True

    def close(self) -> None:
        """Close the file and release the lock; closing again does nothing."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = -1

    def __del__(self) -> None:  # a journal dropped unclosed releases its lock, as a dropped file closes
        self.close()


def _new_member_id() -> str:
    return uuid.uuid4().hex


def _lock(path: Path) -> int:
    """The descriptor of `<path>.lock`, locked exclusively and holding this process's pid.

    Raises JournalError when another process holds the lock, naming its pid when the file gives it.
    """
    lock_path = path.with_name(path.name + LOCK_SUFFIX)
    try:
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        raise JournalError(f"cannot open the journal's lock file {lock_path}: {error.strerror}") from error
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(lock_fd, 32, 0).decode("ascii", "replace").strip()
        os.close(lock_fd)
        who = f"pid {holder}" if holder.isdigit() else "another process (its pid is not in the file)"
        raise JournalError(
            f"journal {path} is in use: {lock_path} is locked by {who}; "
            "one manager writes a journal: stop that one first, or use another --journal"
        ) from None
    except OSError as error:
        os.close(lock_fd)
        raise JournalError(f"cannot lock the journal's lock file {lock_path}: {error.strerror}") from error
    try:
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as error:  # the lock holds all the same; a refused manager cannot name this one's pid
        log.warning("journal %s: cannot write this process's pid to %s (%s)", path, lock_path, error.strerror)
    return lock_fd


def _frame(record: pb.JournalRecord) -> bytes:
    return _frame_payload(record.SerializeToString())


def _frame_payload(payload: bytes) -> bytes:
    length_and_crc = struct.pack("<II", len(payload), zlib.crc32(payload))
    return length_and_crc + struct.pack("<I", zlib.crc32(length_and_crc)) + payload


def _write(fd: int, data: bytes, path: Path) -> None:
    written = os.write(fd, data)
    if written != len(data):
        raise OSError(f"journal {path}: wrote {written} of {len(data)} bytes")


def _read(data: bytes, path: Path) -> tuple[list[pb.JournalRecord], list[int], int]:
    """(records, where each ends, bytes they span). Stops at a torn tail; raises JournalError on damage before it."""
    records = []
    ends = []
    offset = 0
    while offset < len(data):
        end, damage = _frame_end(data, offset)
        if damage is not None:
            if offset == 0 and _is_format_1(data):
                raise JournalError(
                    f"journal {path} is in format 1, written by an earlier version; this manager reads format "
                    f"{FORMAT_VERSION}: move the file aside to start empty"
                )
            follows_header = len(records) == 1 and records[0].header.snapshot_follows
            if _is_torn_tail(data, offset) and not follows_header:  # a snapshot was synced before it was used
                break
            what = "is the journal's snapshot" if follows_header else "is not the file's last write"
            raise JournalError(
                f"journal {path}: the record at byte {offset} {damage} and {what} (the file is damaged): {_WHAT_TO_DO}"
            )
        record = pb.JournalRecord()
        try:
            record.ParseFromString(data[offset + _FRAME.size : end])
        except DecodeError as error:
            raise JournalError(
                f"journal {path}: the record at byte {offset} does not parse ({error}): {_WHAT_TO_DO}"
            ) from error
        records.append(record)
        ends.append(end)
        offset = end
    if records and records[0].header.snapshot_follows:
        if len(records) < 2 or records[1].WhichOneof("entry") != "snapshot":
            raise JournalError(
                f"journal {path}: the header says a snapshot follows, but the record at byte {ends[0]} "
                f"{'is missing (the file ends there)' if len(records) < 2 else 'is not one'} "
                f"(the file is damaged): {_WHAT_TO_DO}"
            )
    return records, ends, offset


def _frame_end(data: bytes, offset: int) -> tuple[int, str | None]:
    """(end of the frame at `offset`, what is wrong with it or None)."""
    if offset + _FRAME.size > len(data):
        return len(data), "has an incomplete frame header"
    length, payload_crc, header_crc = _FRAME.unpack_from(data, offset)
    if zlib.crc32(data[offset : offset + 8]) != header_crc:
        return len(data), "fails its checksum (its frame header: length or payload checksum)"
    end = offset + _FRAME.size + length
    if end > len(data):
        return len(data), "has an incomplete payload"
    if zlib.crc32(data[offset + _FRAME.size : end]) != payload_crc:
        return end, "fails its checksum (its payload)"
    return end, None


def _is_torn_tail(data: bytes, offset: int) -> bool:
    """Whether the bytes from `offset` on are what an interrupted append leaves: the start of one
    frame, then only zero bytes. The nonzero bytes must fit in a header (too short to check) or in
    the one frame a checking header spans."""
    rest = data[offset:].rstrip(b"\0")
    if len(rest) < _FRAME.size:
        return True
    length, _, header_crc = _FRAME.unpack_from(rest, 0)
    return zlib.crc32(rest[:8]) == header_crc and len(rest) <= _FRAME.size + length


def _is_format_1(data: bytes) -> bool:
    """Whether `data` starts with a format 1 header record."""
    if len(data) < _FORMAT_1_FRAME.size:
        return False
    length, crc = _FORMAT_1_FRAME.unpack_from(data, 0)
    payload = data[_FORMAT_1_FRAME.size : _FORMAT_1_FRAME.size + length]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return False
    record = pb.JournalRecord()
    try:
        record.ParseFromString(payload)
    except DecodeError:
        return False
    return record.WhichOneof("entry") == "header" and record.header.format_version == 1


def _check_header(record: pb.JournalRecord, path: Path, replica_id: str, pool: str) -> None:
    if record.WhichOneof("entry") != "header":
        raise JournalError(f"journal {path}: the first record is not a header: {_WHAT_TO_DO}")
    header = record.header
    if header.format_version not in READ_FORMAT_VERSIONS:
        raise JournalError(
            f"journal {path}: format version {header.format_version}, this manager reads "
            f"{', '.join(map(str, READ_FORMAT_VERSIONS[:-1]))} and {READ_FORMAT_VERSIONS[-1]}: a newer manager "
            "wrote it; run that version, "
            "or move the file aside to start empty"
        )
    if header.replica_id != replica_id:
        raise JournalError(
            f"journal {path} belongs to replica {header.replica_id!r}, not {replica_id!r}; "
            "restart under the same --replica-id or use another --journal"
        )
    if header.pool != pool:
        raise JournalError(
            f"journal {path} was written by a different pool configuration:\n  journal: {header.pool}\n  now:     {pool}"
        )
