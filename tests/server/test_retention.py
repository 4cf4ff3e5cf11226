"""The step log, the event log and the key memory are bounded in bytes as well as in entries."""

from __future__ import annotations

import pytest

from kv_manager_service.core.events import BlockRemoved, BlockStored
from kv_manager_service.broadcast_log import BroadcastLog, LogTruncatedError
from kv_manager_service.server.idempotency import ENTRY_OVERHEAD_BYTES, StepKeys
from kv_manager_service.server.replica import ServiceLimits, logged_event_bytes


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
    keys = StepKeys(retention=1000, max_bytes=3 * (ENTRY_OVERHEAD_BYTES + 1 + 32 + 100))
    for name in "abcde":
        keys.put(name, bytes(32), b"r" * 100)
    assert [name for name in "abcde" if name in keys] == ["c", "d", "e"]
    keys.forget("d")
    assert keys.num_bytes == 2 * (ENTRY_OVERHEAD_BYTES + 1 + 32 + 100)
    keys.put("big", bytes(32), b"r" * 100_000)  # kept alone: the newest entry always is
    assert len(keys) == 1 and "big" in keys


def test_the_default_retentions_add_up_to_about_a_third_of_a_gib():
    limits = ServiceLimits()
    total = limits.step_retention_bytes + limits.event_retention_bytes + limits.idempotency_retention_bytes
    assert 0.25 * 2**30 <= total <= 0.35 * 2**30
    with pytest.raises(ValueError):
        ServiceLimits(step_retention_bytes=0)
