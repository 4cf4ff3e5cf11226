"""When the core's retention pins expire, by this process's monotonic clock (docs/retention.md).

The core keeps each pin's TTL as data and no clock (core/pins.py). The
replica starts a pin's clock when it learns of the pin: right after the step
that made it, and for every pin a replay or a snapshot brings back, at that
moment (the clock of the process that made it is gone). The replica then asks
`due`, and releases what it names as one journaled record, so a restart or a
standby replays the expiry instead of deciding it again.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable


class PinClock:
    """Deadlines of pins, soonest first; a pin released otherwise (a reset, an invalidation) is
    dropped when its deadline comes, by `is_live`."""

    def __init__(self) -> None:
        self._deadlines: list[tuple[float, int]] = []  # a heap of (deadline, pin id)

    def __len__(self) -> int:
        return len(self._deadlines)

    def start(self, pins: Iterable[tuple[int, int]], now: float) -> None:
        """Start the clocks of `pins`, (pin id, ttl ms) each, at `now` (seconds, monotonic)."""
        for pin_id, ttl_ms in pins:
            heapq.heappush(self._deadlines, (now + ttl_ms / 1e3, pin_id))

    def due(self, now: float, is_live: Callable[[int], bool]) -> list[int]:
        """The live pins whose deadline is `now` or earlier, in deadline order; they leave the clock."""
        deadlines = self._deadlines
        expired = []
        while deadlines and deadlines[0][0] <= now:
            pin_id = heapq.heappop(deadlines)[1]
            if is_live(pin_id):
                expired.append(pin_id)
        return expired

    def clear(self) -> None:
        self._deadlines.clear()
