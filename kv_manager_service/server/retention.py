"""What a replica keeps, and how much: the per-call limits, and the retention of its step log, event
log and key memory, each bounded in entries and in bytes; the bytes are estimates of the values kept
(`logged_delta_bytes`, `logged_event_bytes`, and `idempotency.result_bytes`), on the high side."""

from __future__ import annotations

from dataclasses import dataclass

from kv_manager_service.shared.events import KVEvent
from kv_manager_service.shared.ops import StepDelta


@dataclass(frozen=True)
class ServiceLimits:
    """Per-call limits and log retention; anything past a limit is refused with a message naming it.

    Each retention is bounded in entries and in bytes, whichever is reached
    first (the defaults in bytes add up to 0.3 GiB; strings and lists of a
    call are bounded by `shared.bounds`).
    """

    max_tokens_per_call: int = 1 << 20
    max_ops_per_step: int = 1 << 16
    step_retention: int = 100_000  # step deltas kept for WatchSteps
    event_retention: int = 100_000  # events kept for WatchEvents
    idempotency_retention: int = 100_000  # keyed Steps remembered (see idempotency.py)
    step_retention_bytes: int = 128 << 20  # step deltas, as `logged_delta_bytes` estimates them
    event_retention_bytes: int = 64 << 20  # events, as `logged_event_bytes` estimates them
    idempotency_retention_bytes: int = 128 << 20  # keys and results of keyed Steps (see idempotency.py)

    def __post_init__(self) -> None:
        for name in (
            "max_tokens_per_call",
            "max_ops_per_step",
            "step_retention",
            "event_retention",
            "idempotency_retention",
            "step_retention_bytes",
            "event_retention_bytes",
            "idempotency_retention_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def logged_delta_bytes(delta: StepDelta) -> int:
    """An estimate, on the high side, of a logged delta's memory: ~400 bytes of objects and slot, and
    each part's tuples and ints. `sys.getsizeof` summed over every object reachable from a delta, the
    core's own request ids and block ids included, stays below it: 59 KiB against 60 KiB when each of
    256 decoding requests gets a block, 15 KiB against 17 KiB for 32 prompts of 100 tokens."""
    size = 400 + 72 * len(delta.requests_freed) + 120 * (len(delta.copies) + len(delta.offloads) + len(delta.onloads))
    for table in delta.rows_added:
        size += 200 + sum(64 + 40 * len(block_ids) for block_ids in table.block_ids)
    for append in delta.blocks_appended:
        size += 200 + 40 * len(append.block_ids)
    return size


def logged_event_bytes(entry: tuple[int, KVEvent]) -> int:
    """An estimate of a logged event's memory: ~256 bytes of objects, and each hash with its object
    and slot (a BlockStored of 8 sha256 hashes measures ~890 bytes with tracemalloc)."""
    event = entry[1]
    hashes = getattr(event, "block_hashes", ())
    return 256 + (len(hashes) + 1) * (len(hashes[0]) + 40 if hashes else 0)
