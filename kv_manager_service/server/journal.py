"""The manager's journal: an append-only local file of every accepted mutation.

Record framing (little-endian):

    | u32 payload length | u32 CRC-32 of the payload | payload: a JournalRecord |

The first record is a header naming the replica and its pool; a journal only
restores the same pool. A record is written (one `write`) before the call's
reply is sent and before workers can see its step, so a crash of the process,
SIGKILL included, loses no acknowledged step. With `fsync="always"` each
record is also forced to disk before the reply (surviving power loss too);
with `fsync="never"` the operating system decides when. A torn record at the
end (the process died mid-write) is cut off when the journal is opened: its
call was never answered.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

from kvcache.v1 import journal_pb2 as pb

log = logging.getLogger("kv_manager_service.server.journal")

FORMAT_VERSION = 1
FSYNC_POLICIES = ("always", "never")
_FRAME = struct.Struct("<II")


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
    def open(cls, path: Path, replica_id: str, pool: str, fsync: str = "always") -> "Journal":
        """Open (or create) the journal at `path` for this replica and pool, reading what it holds."""
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"journal fsync policy must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            records, valid_bytes, size = _read(fd, path)
            if valid_bytes < size:
                log.warning(
                    "journal %s: cutting a torn record at its end (%d bytes)", path, size - valid_bytes,
                    extra={"journal": str(path)},
                )  # fmt: skip
                os.ftruncate(fd, valid_bytes)
            journal = cls(path, fd, fsync, records[1:])
            if records:
                _check_header(records[0], path, replica_id, pool)
            else:
                header = pb.JournalHeader(format_version=FORMAT_VERSION, replica_id=replica_id, pool=pool)
                journal.append(pb.JournalRecord(header=header))
            return journal
        except BaseException:
            os.close(fd)
            raise

    def append(self, record: pb.JournalRecord) -> None:
        """Write one record; with fsync="always", force it to disk before returning."""
        payload = record.SerializeToString()
        frame = _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
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


def _read(fd: int, path: Path) -> tuple[list[pb.JournalRecord], int, int]:
    """(records, bytes they span, file size). Stops at a torn last record; raises on damage before it."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0) if size else b""
    records = []
    offset = 0
    while offset < size:
        if offset + _FRAME.size > size:
            break  # a torn frame header at the end
        length, crc = _FRAME.unpack_from(data, offset)
        end = offset + _FRAME.size + length
        if end > size:
            break  # a torn payload at the end
        payload = data[offset + _FRAME.size : end]
        if zlib.crc32(payload) != crc:
            if end == size:
                break  # the last record, torn
            raise JournalError(f"journal {path}: record at byte {offset} fails its checksum (the file is damaged)")
        record = pb.JournalRecord()
        record.ParseFromString(payload)
        records.append(record)
        offset = end
    return records, offset, size


def _check_header(record: pb.JournalRecord, path: Path, replica_id: str, pool: str) -> None:
    if record.WhichOneof("entry") != "header":
        raise JournalError(f"journal {path}: the first record is not a header")
    header = record.header
    if header.format_version != FORMAT_VERSION:
        raise JournalError(f"journal {path}: format version {header.format_version}, this manager reads {FORMAT_VERSION}")
    if header.replica_id != replica_id:
        raise JournalError(
            f"journal {path} belongs to replica {header.replica_id!r}, not {replica_id!r}; "
            "restart under the same --replica-id or use another --journal"
        )
    if header.pool != pool:
        raise JournalError(
            f"journal {path} was written by a different pool configuration:\n  journal: {header.pool}\n  now:     {pool}"
        )
