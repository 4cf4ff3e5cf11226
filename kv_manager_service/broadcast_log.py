"""A bounded, numbered log that many readers follow, each from its own position."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import AsyncIterator, Callable, Generic, TypeVar

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
    """Entries numbered 1, 2, ... in append order; the newest `capacity` are kept, and with `max_bytes`,
    only as many of the newest as fit in `max_bytes` by `size_of` (the newest entry is always kept).

    Writers append under their own serialization, from any thread; readers
    `read` from any retained number, or `follow` it on an event loop, waiting
    for new entries without a thread until the log is closed. One condition
    guards the deque and the waiters; each append wakes every waiting reader.
    """

    def __init__(
        self, capacity: int, max_bytes: int | None = None, size_of: Callable[[Item], int] | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError(f"log capacity must be >= 1, got {capacity}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"log max_bytes must be >= 1, got {max_bytes}")
        if (max_bytes is None) != (size_of is None):
            raise ValueError("a log bounded in bytes needs both max_bytes and size_of")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self._size_of = size_of
        self.num_bytes = 0  # of the retained entries, by size_of (0 without max_bytes)
        self._entries: deque[Item] = deque()
        self._last_id = 0
        self._closed = False
        self._generation = 0  # `end_followers` ends the follows started before it
        self._changed = threading.Condition()
        # Futures of readers waiting for news on an event loop, by loop: one wake-up call per loop.
        self._waiters: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}

    @property
    def last_id(self) -> int:
        return self._last_id

    def start_after(self, last_id: int) -> None:
        """Number the next entry `last_id + 1`: a log restored from a snapshot, before any append."""
        with self._changed:
            assert self._last_id == 0 and not self._entries, "only an empty, new log starts elsewhere"
            self._last_id = last_id

    @property
    def first_retained_id(self) -> int:
        """Number of the oldest retained entry (last_id + 1 when empty)."""
        return self._last_id - len(self._entries) + 1

    def append(self, item: Item) -> int:
        with self._changed:
            self._entries.append(item)
            if self._size_of is not None:
                self.num_bytes += self._size_of(item)
            self._last_id += 1
            self._trim()
            self._notify()
            return self._last_id

    def extend(self, items: list[Item]) -> None:
        if not items:
            return
        with self._changed:
            self._entries.extend(items)
            if self._size_of is not None:
                self.num_bytes += sum(map(self._size_of, items))
            self._last_id += len(items)
            self._trim()
            self._notify()

    def close(self) -> None:
        """Wake every reader; iterators end after draining what is retained."""
        with self._changed:
            self._closed = True
            self._notify()

    def end_followers(self) -> None:
        """End every `follow` under way (after what it has been given), keeping the entries for later ones."""
        with self._changed:
            self._generation += 1
            self._notify()

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

    async def follow(self, first_id: int, max_items: int = 1 << 16) -> AsyncIterator[list[tuple[int, Item]]]:
        """Yield every new (id, item) from `first_id` on, in lists of at most `max_items`, until the log
        closes or `end_followers` is called; on an event loop.

        Waiting costs a future, not a thread. Raises LogTruncatedError if the
        reader falls behind the retained window. A cancelled reader (its
        client left) leaves a done future behind until the next append.
        """
        loop = asyncio.get_running_loop()
        next_id = max(first_id, 1)
        generation = self._generation
        while True:
            with self._changed:
                if self._generation != generation:
                    return
                if next_id < self.first_retained_id:
                    raise LogTruncatedError(next_id, self.first_retained_id)
                offset = next_id - self.first_retained_id
                # deque indexing is cheap near the ends, where new entries are.
                entries = self._entries
                end = min(len(entries), offset + max_items)
                batch = [(next_id + i - offset, entries[i]) for i in range(offset, end)]
                closed = self._closed
                if not batch and not closed:
                    waiter = loop.create_future()
                    self._waiters.setdefault(loop, []).append(waiter)
            if batch:
                yield batch
                next_id += len(batch)
            elif closed:
                return
            else:
                await waiter

    def _trim(self) -> None:
        """Drop the oldest entries past `capacity` or `max_bytes`, keeping the newest. Holds `_changed`."""
        entries = self._entries
        while len(entries) > self.capacity:
            self._drop_oldest()
        while self.max_bytes is not None and self.num_bytes > self.max_bytes and len(entries) > 1:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        item = self._entries.popleft()
        if self._size_of is not None:
            self.num_bytes -= self._size_of(item)

    def _notify(self) -> None:
        """Wake every reader, blocked or on a loop. Holds `_changed`."""
        self._changed.notify_all()
        if self._waiters:
            for loop, waiters in self._waiters.items():
                if not loop.is_closed():  # a closed loop's readers are gone
                    loop.call_soon_threadsafe(_resolve, waiters)
            self._waiters = {}


def _resolve(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
