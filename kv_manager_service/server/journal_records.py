"""The journal's records as the replica's values, and back: the codec between `Replica` and the file.

The replica journals and replays `Entry` values; this module alone knows their
encoding (`kvcache.journal.v1`, see journal.proto). A step's ops are encoded
with the contract's StepRequest (`wire.step_message`); a keyed step carries
the fingerprint of the Step as it was sent, which a re-encoding of its values
need not reproduce.

Formats 2 and 3 journaled a Step as it was sent, and no fingerprint: it is
the journaled request's own. They journaled a single-op call as a Step whose
one-token op may sit in the decode columns, though it may have admitted its
request; so the replica replays an unkeyed step's decode columns from those
formats as allocate ops (the same state either way), and a keyed one
exactly, to remember the same result. Format 4 holds a step's ops and
decode columns as they were applied, and is replayed exactly.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Union

from kv_manager_service import wire
from kv_manager_service.server.idempotency import StepKey, request_fingerprint
from kv_manager_service.shared.ops import DecodeBatch, KVLossCause, MissingKVReport, Op
from kvcache.journal.v1 import journal_pb2 as jpb


class StepApplied(NamedTuple):
    ops: Sequence[Op]
    decode: DecodeBatch | None
    key: StepKey | None


class WorkerRegistered(NamedTuple):
    worker_id: str
    from_step_id: int  # the worker is taken to have done every step up to it
    incarnation: int


class StepsAcked(NamedTuple):
    worker_id: str
    step_id: int


class WorkerUnregistered(NamedTuple):
    worker_id: str


class MissingKVReported(NamedTuple):
    report: MissingKVReport


class PrefixCacheReset(NamedTuple):
    pass


class PinsExpired(NamedTuple):
    """The manager's clock expired these retention pins (see `Replica.expire_pins`)."""

    pin_ids: tuple[int, ...]


class SnapshotTaken(NamedTuple):
    """The replica's whole state (snapshot.py encodes and restores it); only right after the header."""

    snapshot: jpb.JournalSnapshot


Entry = Union[
    StepApplied,
    WorkerRegistered,
    StepsAcked,
    WorkerUnregistered,
    MissingKVReported,
    PrefixCacheReset,
    PinsExpired,
    SnapshotTaken,
]


def encode(entry: Entry) -> jpb.JournalRecord:
    kind = type(entry)
    if kind is StepApplied:
        key = entry.key
        message = wire.step_message(entry.ops, entry.decode, key.key if key is not None else "")
        return jpb.JournalRecord(
            step=jpb.JournalStep(ops=message, request_sha256=key.fingerprint if key is not None else b"")
        )
    if kind is WorkerRegistered:
        return jpb.JournalRecord(register_worker=jpb.WorkerRegistered(**entry._asdict()))
    if kind is StepsAcked:
        return jpb.JournalRecord(ack=jpb.StepsAcked(**entry._asdict()))
    if kind is WorkerUnregistered:
        return jpb.JournalRecord(unregister_worker=jpb.WorkerUnregistered(worker_id=entry.worker_id))
    if kind is MissingKVReported:
        report = entry.report
        return jpb.JournalRecord(
            report_missing_kv=jpb.MissingKVReported(
                worker_id=report.worker_id,
                incarnation=report.incarnation,
                step_id=report.step_id,
                cause=int(report.cause),
                device_block_ids=report.device_block_ids,
                host_block_ids=report.host_block_ids,
                request_ids=report.request_ids,
            )
        )
    if kind is PrefixCacheReset:
        return jpb.JournalRecord(reset_prefix_cache=jpb.PrefixCacheReset())
    if kind is PinsExpired:
        return jpb.JournalRecord(pins_expired=jpb.PinsExpired(pin_ids=entry.pin_ids))
    assert kind is SnapshotTaken, entry
    return jpb.JournalRecord(snapshot=entry.snapshot)


def decode(record: jpb.JournalRecord) -> Entry:
    """The entry of a record (header excluded); ValueError for a record of no known kind."""
    kind = record.WhichOneof("entry")
    if kind == "step":
        message = record.step.ops
        ops, decode_batch = wire.step_ops(message)
        key = None
        if message.idempotency_key:
            fingerprint = record.step.request_sha256 or request_fingerprint(message)  # formats 2 and 3: the latter
            key = StepKey(message.idempotency_key, fingerprint)
        return StepApplied(ops, decode_batch, key)
    if kind == "register_worker":
        m = record.register_worker
        return WorkerRegistered(m.worker_id, m.from_step_id, m.incarnation)
    if kind == "ack":
        return StepsAcked(record.ack.worker_id, record.ack.step_id)
    if kind == "unregister_worker":
        return WorkerUnregistered(record.unregister_worker.worker_id)
    if kind == "report_missing_kv":
        m = record.report_missing_kv
        report = MissingKVReport(
            m.worker_id, m.incarnation, m.step_id, KVLossCause(m.cause),
            tuple(m.device_block_ids), tuple(m.host_block_ids), tuple(m.request_ids),
        )  # fmt: skip
        return MissingKVReported(report)
    if kind == "reset_prefix_cache":
        return PrefixCacheReset()
    if kind == "pins_expired":
        return PinsExpired(tuple(record.pins_expired.pin_ids))
    if kind == "snapshot":
        return SnapshotTaken(record.snapshot)
    raise ValueError(f"unexpected journal record {kind!r}")
