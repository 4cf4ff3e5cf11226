"""The manager's journal: an append-only local file of every accepted mutation.

Record framing (format 2, little-endian):

    | u32 payload length | u32 CRC-32 of the payload | u32 CRC-32 of the 8 bytes before | payload |

The frame header has its own checksum, so damage to any byte is detected,
and a damaged length is never followed: the reader only trusts a length
whose header checks. The first record is a header naming the format, the
replica and its pool; a journal only restores the same pool. A file of
format 1 (one CRC over the payload only) is refused with a message saying to
move it aside: reading it and appending to it would keep the framing whose
damaged lengths passed for a torn tail.

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
be told from a torn write, so it is cut too.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Callable

from google.protobuf.message import DecodeError

from kvcache.v1 import journal_pb2 as pb

log = logging.getLogger("kv_manager_service.server.journal")

FORMAT_VERSION = 2
FSYNC_POLICIES = ("always", "never")
_FRAME = struct.Struct("<III")  # payload length, payload CRC-32, CRC-32 of the first 8 bytes
_FORMAT_1_FRAME = struct.Struct("<II")  # payload length, payload CRC-32
_WHAT_TO_DO = "move the file aside to start empty, or restore a backup"


class JournalError(ValueError):
    """The journal cannot be used: it belongs to another replica or pool, or it is corrupt before its end."""


class Journal:
    """An open journal: the records it held when opened, and appends from then on."""

    def __init__(self, path: Path, fd: int, fsync: str, records: list[pb.JournalRecord]) -> None:
        self.path = path
        self.fd = fd
        self.fsync = fsync == "always"
        self.records = records  # as read at open, header excluded
        self.num_appended = 0

    @classmethod
    def open(
        cls,
        path: Path,
        replica_id: str,
        pool: str,
        fsync: str = "always",
        on_write_failure: Callable[["Journal", OSError], None] | None = None,
    ) -> "Journal":
        """Open (or create) the journal at `path` for this replica and pool, reading what it holds.

        Cuts a torn tail off the file; raises JournalError, the file untouched, on any other damage.
        A new journal's header that cannot be written goes to `on_write_failure` (None: raises),
        as every later append's failure goes to the replica's.
        """
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"journal fsync policy must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as error:
            raise JournalError(f"cannot open the journal {path}: {error.strerror}") from error
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
            records, valid_bytes = _read(data, path)
            if records:
                _check_header(records[0], path, replica_id, pool)  # before the file is changed
            if valid_bytes < size:
                log.warning(
                    "journal %s: cutting a torn tail (%d bytes from byte %d): an append that was never answered",
                    path, size - valid_bytes, valid_bytes, extra={"journal": str(path)},
                )  # fmt: skip
                os.ftruncate(fd, valid_bytes)
            journal = cls(path, fd, fsync, records[1:])
            if records:
                return journal
            header = pb.JournalHeader(format_version=FORMAT_VERSION, replica_id=replica_id, pool=pool)
            try:
                journal.append(pb.JournalRecord(header=header))
            except OSError as error:
                if on_write_failure is not None:
                    on_write_failure(journal, error)  # does not return
                raise
            return journal
        except BaseException:
            os.close(fd)
            raise

    def append(self, record: pb.JournalRecord) -> None:
        """Write one record; with fsync="always", force it to disk before returning."""
        payload = record.SerializeToString()
        length_and_crc = struct.pack("<II", len(payload), zlib.crc32(payload))
        frame = length_and_crc + struct.pack("<I", zlib.crc32(length_and_crc)) + payload
        written = os.write(self.fd, frame)
        if written != len(frame):
            raise OSError(f"journal {self.path}: wrote {written} of {len(frame)} bytes")
        if self.fsync:
            os.fsync(self.fd)
        self.num_appended += 1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read(data: bytes, path: Path) -> tuple[list[pb.JournalRecord], int]:
    """(records, bytes they span). Stops at a torn tail; raises JournalError on damage before it."""
    records = []
    offset = 0
    while offset < len(data):
        end, damage = _frame_end(data, offset)
        if damage is not None:
            if offset == 0 and _is_format_1(data):
                raise JournalError(
                    f"journal {path} is in format 1, written by an earlier version; this manager reads format "
                    f"{FORMAT_VERSION}: move the file aside to start empty"
                )
            if _is_torn_tail(data, offset):
                break
            raise JournalError(
                f"journal {path}: the record at byte {offset} {damage} and is not the file's last write "
                f"(the file is damaged): {_WHAT_TO_DO}"
            )
        record = pb.JournalRecord()
        try:
            record.ParseFromString(data[offset + _FRAME.size : end])
        except DecodeError as error:
            raise JournalError(
                f"journal {path}: the record at byte {offset} does not parse ({error}): {_WHAT_TO_DO}"
            ) from error
        records.append(record)
        offset = end
    return records, offset


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
    if header.format_version != FORMAT_VERSION:
        raise JournalError(
            f"journal {path}: format version {header.format_version}, this manager reads {FORMAT_VERSION}: "
            "move the file aside to start empty"
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
