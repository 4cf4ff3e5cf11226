"""A doubly linked queue of integer ids held in two flat arrays: the host tier's LRU free queue."""

from __future__ import annotations

from array import array
from typing import Iterable, Iterator

UNLINKED = -(2**31)
"""The link value of an id that is not in the queue."""


class IdQueue:
    """The ids 0..num_ids-1, some of them queued: FreeBlockQueue's operations and order, no object per id.

    The head is popped first. Every operation is O(1) and allocates nothing:
    the links live in two int32 arrays (8 bytes per id), and node `num_ids`
    is a sentinel whose next is the head and whose previous is the tail. An
    id is in the queue iff its links are set (not UNLINKED).

    A link is stored as an offset from the neighbour in id order:
    `_next[i] == next(i) - (i + 1)` and `_prev[i] == prev(i) - (i - 1)`. So
    the queue 0, 1, ..., n-1 that a tier starts with is two arrays of zeros
    (and the sentinel's two links), allocated at memory speed instead of one
    Python int per id.
    """

    def __init__(self, num_ids: int, queued: bool = True) -> None:
        """All `num_ids` ids queued in id order, or (`queued` False) none."""
        if not 0 < num_ids < 2**31 - 1:
            raise ValueError(f"an IdQueue holds 1 to 2**31 - 2 ids, got {num_ids}")
        self.num_ids = num_ids
        self._sentinel = num_ids
        if queued:
            self._next = array("i", bytes(4 * (num_ids + 1)))
            self._prev = array("i", bytes(4 * (num_ids + 1)))
            self._link(num_ids, 0)
            self._link(num_ids - 1, num_ids)
            self.num_free = num_ids
        else:
            self._next = array("i", [UNLINKED]) * (num_ids + 1)
            self._prev = array("i", [UNLINKED]) * (num_ids + 1)
            self._link(num_ids, num_ids)
            self.num_free = 0

    @classmethod
    def of(cls, num_ids: int, ids: Iterable[int]) -> IdQueue:
        """A queue holding `ids` in that order, head first. ValueError for an id out of range or twice."""
        queue = cls(num_ids, queued=False)
        for i in ids:
            if not 0 <= i < num_ids:
                raise ValueError(f"id {i} is outside 0..{num_ids - 1}")
            if i in queue:
                raise ValueError(f"id {i} is twice in the queue")
            queue.append(i)
        return queue

    def __contains__(self, i: int) -> bool:
        return self._prev[i] != UNLINKED

    def popleft(self) -> int:
        nxt, prv, s = self._next, self._prev, self._sentinel
        i = s + 1 + nxt[s]
        if i == s:
            raise ValueError("no free ids left")
        following = i + 1 + nxt[i]
        nxt[s] = following - s - 1
        prv[following] = s - following + 1
        nxt[i] = prv[i] = UNLINKED
        self.num_free -= 1
        return i

    def remove(self, i: int) -> None:
        """Take `i` out of the middle of the queue."""
        nxt, prv = self._next, self._prev
        if prv[i] == UNLINKED:
            raise ValueError(f"id {i} is not in the queue")
        previous, following = i - 1 + prv[i], i + 1 + nxt[i]
        nxt[previous] = following - previous - 1
        prv[following] = previous - following + 1
        nxt[i] = prv[i] = UNLINKED
        self.num_free -= 1

    def append(self, i: int) -> None:
        """Put `i`, not queued, at the tail (popped last)."""
        nxt, prv, s = self._next, self._prev, self._sentinel
        tail = s - 1 + prv[s]
        nxt[tail] = i - tail - 1
        prv[i] = tail - i + 1
        nxt[i] = s - i - 1
        prv[s] = i - s + 1
        self.num_free += 1

    def prepend(self, i: int) -> None:
        """Put `i`, not queued, at the head (popped first)."""
        nxt, prv, s = self._next, self._prev, self._sentinel
        head = s + 1 + nxt[s]
        nxt[s] = i - s - 1
        prv[i] = s - i + 1
        nxt[i] = head - i - 1
        prv[head] = i - head + 1
        self.num_free += 1

    def __iter__(self) -> Iterator[int]:
        """Head to tail; at most `num_ids` ids, so a corrupt (cyclic) queue cannot loop forever."""
        nxt, s = self._next, self._sentinel
        i = s + 1 + nxt[s]
        for _ in range(self.num_ids):
            if i == s:
                return
            yield i
            i = i + 1 + nxt[i]

    def next_of(self, i: int) -> int:
        """The id after queued `i` (`num_ids` for the tail): for integrity checks."""
        return i + 1 + self._next[i]

    def prev_of(self, i: int) -> int:
        """The id before queued `i` (`num_ids` for the head): for integrity checks."""
        return i - 1 + self._prev[i]

    @property
    def nbytes(self) -> int:
        """Bytes held by the links."""
        return (len(self._next) + len(self._prev)) * self._next.itemsize

    def _link(self, a: int, b: int) -> None:
        """next(a) = b and prev(b) = a (the operations above spell this out, for speed)."""
        self._next[a] = b - a - 1
        self._prev[b] = a - b + 1
