"""The journal's codec (journal_records.py): every entry survives its record, and a format 3 journal,
whose records reused the contract's messages and kept a keyed Step as it was sent, is replayed to the
same state and key memory, then rewritten in format 4 before anything is appended."""

from __future__ import annotations

from pathlib import Path

from kv_manager_service import wire
from kv_manager_service.core import KVCacheConfig, KVCacheManager
from kv_manager_service.server import journal_records
from kv_manager_service.server.idempotency import StepKey, request_fingerprint
from kv_manager_service.server.journal import FORMAT_VERSION, Journal, _frame
from kv_manager_service.server.journal_records import (
    MissingKVReported,
    PrefixCacheReset,
    StepApplied,
    StepsAcked,
    WorkerRegistered,
    WorkerUnregistered,
)
from kv_manager_service.server.replica import Replica
from kv_manager_service.shared.hash_types import LoraRef, MMFeature
from kv_manager_service.shared.ops import (
    AllocateOp,
    DecodeBatch,
    ExpectOp,
    ForkOp,
    FreeOp,
    KVLossCause,
    MissingKVReport,
)
from kvcache.journal.v1 import journal_pb2 as jpb
from kvcache.v1 import kv_manager_pb2 as pb

CONFIG = KVCacheConfig.from_dict({"num_blocks": 64, "enable_events": True})


def test_every_entry_survives_its_record():
    allocate = AllocateOp(
        "a", [1, 2, 3], 3, num_lookahead_tokens=2, cache_salt="s", lora=LoraRef("l", "/l"),
        mm_features=(MMFeature("img", 0, 2),),
    )  # fmt: skip
    entries = [
        StepApplied([allocate, FreeOp(["b"], num_computed_tokens=[5]), ForkOp("c", ["c1", "c2"])], None, None),
        StepApplied([ExpectOp("w", [4, 5, 6], "s", LoraRef("l", "/l"), (MMFeature("img", 1, 2),))], None, None),
        StepApplied([], DecodeBatch(["x", "y"], [7, 8]), StepKey("k", bytes(range(32)))),
        WorkerRegistered("w", 4, 99),
        StepsAcked("w", 5),
        WorkerUnregistered("w"),
        MissingKVReported(MissingKVReport("w", 99, 6, KVLossCause.KV_MISSING, (3, 4), (1,), ("x",))),
        PrefixCacheReset(),
    ]
    for entry in entries:
        record = jpb.JournalRecord.FromString(journal_records.encode(entry).SerializeToString())
        decoded = journal_records.decode(record)
        assert type(decoded) is type(entry)
        if type(entry) is StepApplied:
            assert (list(decoded.ops), decoded.decode, decoded.key) == (list(entry.ops), entry.decode, entry.key)
        else:
            assert decoded == entry


def write_format_3_journal(path: Path, records: list[jpb.JournalRecord]) -> None:
    """A journal as a format 3 manager wrote it: the bytes of its records are those of format 4."""
    header = jpb.JournalRecord(header=jpb.JournalHeader(format_version=3, replica_id="r", pool="{}"))
    path.write_bytes(b"".join(_frame(record) for record in [header, *records]))


def test_a_format_3_journal_replays_its_keys_and_is_rewritten_in_format_4(tmp_path):
    path = tmp_path / "r.journal"
    # As a format 3 manager journaled them: the keyed Step as it was sent (its fields in an order a
    # re-encoding would not keep), the worker's registration and acknowledgement as the RPC messages.
    sent = pb.StepRequest(
        ops=[pb.StepOp(allocate=pb.AllocateRequest(request_id="a", token_ids=range(40), num_new_tokens=40))],
        idempotency_key="key-1",
    )
    sent_bytes = b"\x1a\x05key-1" + sent.SerializeToString().replace(b"\x1a\x05key-1", b"")
    assert pb.StepRequest.FromString(sent_bytes) == sent
    registered = pb.WatchStepsRequest(worker_id="w", from_step_id=0, incarnation=7)
    acked = pb.AckStepsRequest(worker_id="w", step_id=1)
    records = [
        jpb.JournalRecord(register_worker=jpb.WorkerRegistered.FromString(registered.SerializeToString())),
        jpb.JournalRecord(step=jpb.JournalStep(ops=pb.StepRequest.FromString(sent_bytes))),
        jpb.JournalRecord(ack=jpb.StepsAcked.FromString(acked.SerializeToString())),
    ]
    write_format_3_journal(path, records)

    journal = Journal.open(path, "r", "{}")
    assert journal.file_format == 3
    replica = Replica(KVCacheManager(CONFIG), "r", 1, journal=journal)
    assert replica.manager.last_step_id == 1 and replica.manager.request_ids() == ["a"]
    assert replica.workers.incarnation("w") == 7
    # The Step sent again gets its first result: the key and the fingerprint of the Step as sent held.
    again = replica.step(*wire.step_ops(sent), key=StepKey("key-1", request_fingerprint(sent)))
    assert again.step_id == 1 and replica.manager.last_step_id == 1
    # That call was a mutation: the file was rewritten in format 4 before it could append anything.
    assert journal.file_format == FORMAT_VERSION
    replica.step([FreeOp(("a",))])
    replica.close()
    journal.close()

    reopened = Journal.open(path, "r", "{}")
    assert reopened.file_format == FORMAT_VERSION
    assert [r.WhichOneof("entry") for r in reopened.records] == ["snapshot", "step"]
    restarted = Replica(KVCacheManager(CONFIG), "r", 1, journal=reopened)
    assert restarted.manager.last_step_id == 2 and restarted.manager.request_ids() == []
    assert restarted.step(*wire.step_ops(sent), key=StepKey("key-1", request_fingerprint(sent))).step_id == 1
    reopened.close()
