"""Idempotency keys of `Step`: the replica's bounded memory of recent keyed steps.

A scheduler that lost a Step's response (a dropped connection, a deadline, a
restarting manager) cannot tell whether the step was applied. Sent again with
the same `idempotency_key`, the Step is not applied twice: the servicer finds
the key here and answers with the response it gave the first time.

An entry is `key -> (fingerprint of the request, the step's result)`. The
fingerprint is SHA-256 over the request's deterministic serialization (the
servicer takes it from the Step as sent), so the same message encoded
differently by another client (packed or not, fields in another order)
matches, and a different request under the same key is refused
(`IdempotencyKeyReusedError`). Only accepted steps are remembered; a
rejected call changed nothing and may simply be sent again. The result is
kept without its delta (the step log's business), and the servicer answers
a repeat with the same response it made of it the first time.

The memory holds the last `retention` keyed steps, and no more than
`max_bytes` of them (as `result_bytes` estimates an entry), oldest forgotten
first; a key repeated after that is applied as a new step. The newest entry
is always kept, whatever its size. A key has at most
`shared.bounds.MAX_ID_CHARS` characters as sent (checked before the handler;
a tenant's prefix comes on top).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from typing import NamedTuple

from google.protobuf.message import Message

from kv_manager_service.shared.errors import IdempotencyKeyReusedError
from kv_manager_service.shared.ops import AllocateResult, StepResult

# What an entry costs beside its key and result: the dict's slot and links, the tuple, the
# fingerprint and the objects' headers.
ENTRY_OVERHEAD_BYTES = 320


class StepKey(NamedTuple):
    """A Step's idempotency key, and the fingerprint of the request it came with."""

    key: str
    fingerprint: bytes


def request_fingerprint(request: Message) -> bytes:
    """SHA-256 of the request's deterministic serialization (its key included)."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).digest()


def result_bytes(result: StepResult) -> int:
    """An estimate, on the high side, of a remembered result's memory: a tuple or list costs 64 bytes
    and 8 a slot, a result object 120, an int 32. `sys.getsizeof` summed over every object reachable
    from a result, shared ones included, stays below it: 4.6 KiB against 12.6 KiB for a 256-request
    decode step, 65 KiB against 85 KiB when each of the 256 gets a block, 17 KiB against 23 KiB for 32
    prompts of 100 tokens (tests/server/test_retention.py)."""
    size = 120 + 64 + 8 * len(result.results) + 64 + 72 * len(result.lost_requests)
    for op_result in result.results:
        size += 120
        if type(op_result) is AllocateResult:
            size += 64 + 8 * len(op_result.copies) + 56 * len(op_result.copies)
            for group in op_result.groups:
                size += 120 + 128 + 40 * (len(group.hit_block_ids) + len(group.new_block_ids))
    decode = result.decode
    if decode is not None:
        size += 120 + 4 * 64 + 8 * len(decode.statuses) + 40 * len(decode.num_computed_tokens)
        size += sum(64 + 120 + 64 + 40 * len(group.new_block_ids) for _, group in decode.changes)
        size += 64 * len(decode.copies)
    return size


class StepKeys:
    """The last `retention` keyed steps, within `max_bytes`: key -> (request fingerprint, step result).

    Not thread-safe: the replica reads and writes it under its lock, in the
    same critical section that applies the step, so two copies of one keyed
    request sent at once still apply it once.
    """

    def __init__(self, retention: int, max_bytes: int | None = None) -> None:
        """`max_bytes`: None, no bound in bytes."""
        if retention < 1:
            raise ValueError(f"retention must be >= 1, got {retention}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.retention = retention
        self.max_bytes = max_bytes
        self.num_bytes = 0  # of the entries held, as `_entry_bytes` counts them
        self._entries: OrderedDict[str, tuple[bytes, StepResult]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str, fingerprint: bytes) -> StepResult | None:
        """The remembered result of `key`, or None if the key is unknown (or forgotten).

        Raises IdempotencyKeyReusedError when the key belongs to another request.
        """
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] != fingerprint:
            raise IdempotencyKeyReusedError(
                f"idempotency_key {key!r} was used by a different Step request; a retry must resend the same "
                "request, and a new step needs a new key",
                "idempotency_key",
            )
        return entry[1]

    def items(self) -> list[tuple[str, bytes, StepResult]]:
        """(key, fingerprint, result) of every entry, oldest first: what `put` in order restores."""
        return [(key, fingerprint, result) for key, (fingerprint, result) in self._entries.items()]

    def forget(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= _entry_bytes(key, entry)

    def put(self, key: str, fingerprint: bytes, result: StepResult) -> None:
        """Remember an applied step's result (its delta dropped); forgets the oldest entries past the
        retention or max_bytes."""
        assert key not in self._entries, f"idempotency key {key!r} is already remembered"
        entries = self._entries
        entry = (fingerprint, result._replace(delta=None))
        entries[key] = entry
        self.num_bytes += _entry_bytes(key, entry)
        while len(entries) > self.retention or (
            self.max_bytes is not None and self.num_bytes > self.max_bytes and len(entries) > 1
        ):
            self.num_bytes -= _entry_bytes(*entries.popitem(last=False))


def _entry_bytes(key: str, entry: tuple[bytes, StepResult]) -> int:
    return len(key) + result_bytes(entry[1]) + ENTRY_OVERHEAD_BYTES
