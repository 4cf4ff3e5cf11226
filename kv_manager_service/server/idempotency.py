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

The memory holds the last `retention` keyed steps, oldest forgotten first; a
key repeated after that is applied as a new step. Entries are kept
serialized (a 256-request decode response is a few KiB) and parsed only when
a retry asks for one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from google.protobuf.message import Message

from kv_manager_service.rpc.errors import IdempotencyKeyReusedError, InvalidArgumentError

MAX_KEY_LENGTH = 256  # characters; a UUID has 36



def request_fingerprint(request: Message) -> bytes:
    """SHA-256 of the request's deterministic serialization (its key included)."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).digest()


def check_key(key: str) -> None:
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidArgumentError(
            f"idempotency_key has {len(key)} characters; at most {MAX_KEY_LENGTH} are allowed", "idempotency_key"
        )


class StepKeys:
    """The last `retention` keyed steps: key -> (request fingerprint, serialized response).

    Not thread-safe: the servicer reads and writes it under its lock, in the
    same critical section that applies the step, so two copies of one keyed
    request sent at once still apply it once.
    """

    def __init__(self, retention: int) -> None:
        if retention < 1:
            raise ValueError(f"retention must be >= 1, got {retention}")
        self.retention = retention
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

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)

    def put(self, key: str, fingerprint: bytes, response: bytes) -> None:
        """Remember an applied step's response; forgets the oldest entry past the retention."""
        assert key not in self._entries, f"idempotency key {key!r} is already remembered"
        entries = self._entries
        entries[key] = (fingerprint, response)
        if len(entries) > self.retention:
            entries.popitem(last=False)
