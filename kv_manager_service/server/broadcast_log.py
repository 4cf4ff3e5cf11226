"""A bounded, numbered log that many readers follow, each from its own position."""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, Iterator, TypeVar

Item = TypeVar("Item")


class LogTruncatedError(Exception):
    """The reader asked for entries the log no longer retains."""

    def __init__(self, first_wanted: int, first_retained: int) -> None:
        super().__init__(
            f"entry {first_wanted} is no longer retained; the oldest retained is {first_retained}"
        )
        self.first_wanted = first_wanted
        self.first_retained = first_retained


class BroadcastLog(Generic[Item]):
    """Entries numbered 1, 2, ... in append order; the newest `capacity` are kept.

    Writers append under their own serialization; readers iterate from any
    retained number and block for new entries until the log is closed. Thread
    safe: one condition guards the deque.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"log capacity must be >= 1, got {capacity}")
        self._entries: deque[Item] = deque(maxlen=capacity)
        self._last_id = 0
        self._closed = False
        self._changed = threading.Condition()

    @property
    def last_id(self) -> int:
        return self._last_id

    @property
    def first_retained_id(self) -> int:
        """Number of the oldest retained entry (last_id + 1 when empty)."""
        return self._last_id - len(self._entries) + 1

    def append(self, item: Item) -> int:
        with self._changed:
            self._entries.append(item)
            self._last_id += 1
            self._changed.notify_all()
            return self._last_id

    def extend(self, items: list[Item]) -> None:
        if not items:
            return
        with self._changed:
            self._entries.extend(items)
            self._last_id += len(items)
            self._changed.notify_all()

    def close(self) -> None:
        """Wake every reader; iterators end after draining what is retained."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def check_retained(self, first_id: int) -> None:
        """Raise LogTruncatedError if entry `first_id` (>= 1) was dropped."""
        with self._changed:
            if first_id < self.first_retained_id:
                raise LogTruncatedError(first_id, self.first_retained_id)

    def read(self, first_id: int, max_items: int, timeout_s: float) -> list[tuple[int, Item]]:
        """Up to `max_items` entries from `first_id` on; waits up to `timeout_s` for the first.

        Raises LogTruncatedError if entry `first_id` was dropped.
        """
        with self._changed:
            if first_id > self._last_id and not self._closed:
                self._changed.wait(timeout_s)
            if first_id < self.first_retained_id:
                raise LogTruncatedError(first_id, self.first_retained_id)
            entries = self._entries
            offset = first_id - self.first_retained_id
            end = min(len(entries), offset + max_items)
            return [(first_id + i - offset, entries[i]) for i in range(offset, end)]

    def follow(self, first_id: int, poll_s: float = 0.5) -> Iterator[tuple[int, Item] | None]:
        """Yield (id, item) from `first_id` on, forever, until the log closes.

        Yields None every `poll_s` seconds without news, so the caller can
        check whether its client is still there. Raises LogTruncatedError if
        the reader falls behind the retained window.
        """
        next_id = max(first_id, 1)
        while True:
            with self._changed:
                if next_id < self.first_retained_id:
                    raise LogTruncatedError(next_id, self.first_retained_id)
                if next_id > self._last_id and not self._closed:
                    self._changed.wait(poll_s)
                if next_id < self.first_retained_id:
                    raise LogTruncatedError(next_id, self.first_retained_id)
                offset = next_id - self.first_retained_id
                # deque indexing is cheap near the ends, where new entries are.
                entries = self._entries
                batch = [entries[i] for i in range(offset, len(entries))]
                closed = self._closed
            if not batch:
                if closed:
                    return
                yield None
                continue
            for item in batch:
                yield next_id, item
                next_id += 1
