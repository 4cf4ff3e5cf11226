"""Idempotency keys of `Step`: the replica's bounded memory of recent keyed steps.

A scheduler that lost a Step's response (a dropped connection, a deadline, a
restarting manager) cannot tell whether the step was applied. Sent again with
the same `idempotency_key`, the Step is not applied twice: the servicer finds
the key here and answers with the response it gave the first time.

An entry is `key -> (fingerprint of the request, serialized response)`. The
fingerprint is SHA-256 over the request's deterministic serialization, so
the same message encoded differently by another client (packed or not,
fields in another order) matches, and a different request under the same
key is refused (`IdempotencyKeyReusedError`). Only accepted steps are
remembered; a rejected call changed nothing and may simply be sent again.

The memory holds the last `retention` keyed steps, and no more than
`max_bytes` of them (key, fingerprint, response and ENTRY_OVERHEAD_BYTES
each), oldest forgotten first; a key repeated after that is applied as a
new step. The newest entry is always kept, whatever its size. Entries are
kept serialized (a 256-request decode response is a few KiB) and parsed
only when a retry asks for one. A key has at most `rpc.bounds.MAX_ID_CHARS`
characters as sent (checked before the handler; a tenant's prefix comes on top).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from google.protobuf.message import Message

from kv_manager_service.rpc.errors import IdempotencyKeyReusedError

# What an entry costs beside its key, fingerprint and response: the dict's slot and links, the
# tuple and the objects' headers (tracemalloc: ~270 bytes with a UUID key's fingerprint).
ENTRY_OVERHEAD_BYTES = 256


def request_fingerprint(request: Message) -> bytes:
    """SHA-256 of the request's deterministic serialization (its key included)."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).digest()


class StepKeys:
    """The last `retention` keyed steps, within `max_bytes`: key -> (request fingerprint, serialized response).

    Not thread-safe: the servicer reads and writes it under its lock, in the
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
        self._entries: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str, fingerprint: bytes) -> bytes | None:
        """The stored response of `key`, or None if the key is unknown (or forgotten).

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

    def items(self) -> list[tuple[str, bytes, bytes]]:
        """(key, fingerprint, response) of every entry, oldest first: what `put` in order restores."""
        return [(key, fingerprint, response) for key, (fingerprint, response) in self._entries.items()]

    def forget(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= _entry_bytes(key, entry)

    def put(self, key: str, fingerprint: bytes, response: bytes) -> None:
        """Remember an applied step's response; forgets the oldest entries past the retention or max_bytes."""
        assert key not in self._entries, f"idempotency key {key!r} is already remembered"
        entries = self._entries
        entry = (fingerprint, response)
        entries[key] = entry
        self.num_bytes += _entry_bytes(key, entry)
        while len(entries) > self.retention or (
            self.max_bytes is not None and self.num_bytes > self.max_bytes and len(entries) > 1
        ):
            self.num_bytes -= _entry_bytes(*entries.popitem(last=False))


def _entry_bytes(key: str, entry: tuple[bytes, bytes]) -> int:
    return len(key) + len(entry[0]) + len(entry[1]) + ENTRY_OVERHEAD_BYTES
