"""The step log, the event log and the key memory are bounded in bytes as well as in entries."""

from __future__ import annotations

import enum
import sys

import pytest

from kv_manager_service.shared.events import BlockRemoved, BlockStored
from kv_manager_service.broadcast_log import BroadcastLog, LogTruncatedError
from kv_manager_service.core import KVCacheConfig, KVCacheManager
from kv_manager_service.server.idempotency import ENTRY_OVERHEAD_BYTES, StepKeys, result_bytes
from kv_manager_service.server.retention import ServiceLimits, logged_delta_bytes, logged_event_bytes
from kv_manager_service.shared.ops import AllocateOp, AllocateStatus, DecodeBatch, DecodeResults, StepResult


def test_a_log_keeps_only_the_newest_entries_that_fit_in_its_bytes():
    log: BroadcastLog[bytes] = BroadcastLog(capacity=1000, max_bytes=100, size_of=len)
    for _ in range(10):
        log.append(b"x" * 30)
    assert (log.first_retained_id, log.last_id, log.num_bytes) == (8, 10, 90)
    log.extend([b"y" * 40, b"z" * 40])
    assert (log.first_retained_id, log.last_id, log.num_bytes) == (11, 12, 80)
    with pytest.raises(LogTruncatedError):
        log.check_retained(log.first_retained_id - 1)
    assert [item for _, item in log.read(log.first_retained_id, 10, 0)] == [b"y" * 40, b"z" * 40]


def test_the_newest_entry_is_kept_whatever_its_size_and_the_entry_bound_still_holds():
    log: BroadcastLog[bytes] = BroadcastLog(capacity=3, max_bytes=10, size_of=len)
    log.append(b"x" * 1000)
    assert (log.first_retained_id, log.last_id) == (1, 1)
    for _ in range(5):
        log.append(b"")
    assert (log.first_retained_id, log.last_id, log.num_bytes) == (4, 6, 0)
    with pytest.raises(ValueError):
        BroadcastLog(capacity=3, max_bytes=10)  # without size_of


def test_an_event_is_counted_by_its_hashes():
    stored = (0, BlockStored(0, tuple(bytes(32) for _ in range(8)), bytes(32), 16))
    removed = (0, BlockRemoved(0, (bytes(32),)))
    assert 800 <= logged_event_bytes(stored) <= 1000  # ~890 bytes measured with tracemalloc
    assert logged_event_bytes(removed) < logged_event_bytes(stored)


def test_the_key_memory_forgets_the_oldest_keys_past_its_bytes():
    result = StepResult(1, ())
    entry = ENTRY_OVERHEAD_BYTES + 1 + result_bytes(result)
    keys = StepKeys(retention=1000, max_bytes=3 * entry)
    for name in "abcde":
        keys.put(name, bytes(32), result)
    assert [name for name in "abcde" if name in keys] == ["c", "d", "e"]
    keys.forget("d")
    assert keys.num_bytes == 2 * entry
    big = StepResult(2, (), decode=DecodeResults([AllocateStatus.OK] * 4096, list(range(4096)), [], []))
    keys.put("big", bytes(32), big)  # kept alone: the newest entry always is
    assert len(keys) == 1 and "big" in keys


def reachable_bytes(value: object, seen: set[int] | None = None) -> int:
    """`sys.getsizeof` of `value` and of every tuple, list, int and str it reaches (enum members are
    shared singletons): more than a result or delta costs, since the core shares many of its ids."""
    seen = set() if seen is None else seen
    if id(value) in seen or value is None or isinstance(value, enum.Enum):
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, (tuple, list)):
        size += sum(reachable_bytes(item, seen) for item in value)
    return size


def test_the_estimates_of_results_and_deltas_are_on_the_high_side():
    """A 256-request batch as it prefills, as it decodes, and as each request gets a block."""
    manager = KVCacheManager(KVCacheConfig.from_dict({"num_blocks": 4096, "enable_events": True}))
    request_ids = [f"request-{index:04d}" for index in range(256)]
    prefill = manager.step([AllocateOp(r, range(1000 * i, 1000 * i + 100), 100) for i, r in enumerate(request_ids)])
    results = [prefill]
    for token in range(12):  # tokens 101..112: the last fills each request's 7th block, the next needs an 8th
        results.append(manager.step([], decode=DecodeBatch(request_ids, [token] * 256)))
    results.append(manager.step([], decode=DecodeBatch(request_ids, [99] * 256)))
    assert not results[1].decode.changes and len(results[-1].decode.changes) == 256
    for result in results:
        assert result_bytes(result) >= reachable_bytes(result._replace(delta=None)), result.step_id
        assert logged_delta_bytes(result.delta) >= reachable_bytes(result.delta), result.step_id


def test_the_default_retentions_add_up_to_about_a_third_of_a_gib():
    limits = ServiceLimits()
    total = limits.step_retention_bytes + limits.event_retention_bytes + limits.idempotency_retention_bytes
    assert 0.25 * 2**30 <= total <= 0.35 * 2**30
    with pytest.raises(ValueError):
        ServiceLimits(step_retention_bytes=0)
