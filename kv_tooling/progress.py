"""A one-line progress bar on stderr; plain lines every few seconds when stderr is not a terminal."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total = total
        self.enabled = enabled
        self.width = width
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.last_shown = 0.0

    def update(self, done: int, hit_rate: float, usage: float, num_preemptions: int) -> None:
        now = time.monotonic()
        interval = 0.1 if self.tty and self.enabled else 5.0
        if now - self.last_shown < interval and done < self.total:
            return
        self.last_shown = now
        elapsed = now - self.started
        filled = round(self.width * done / self.total) if self.total else self.width
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} requests | "
            f"hit {hit_rate:5.1%} | usage {usage:5.1%} | preempted {num_preemptions} | "
            f"{done / elapsed if elapsed else 0:.1f} req/s"
        )
        if self.tty and self.enabled:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and self.enabled:
            print(file=sys.stderr)
