"""SIGTERM and SIGINT, as a server's main thread waits for them.

The handler only records the signal. Python runs it on the main thread
between two bytecodes, which may be inside `threading.Event.wait()` while
that thread holds the event's own lock: a handler calling `Event.set()` then
waits for a lock its own thread holds, and the process hangs until SIGKILL.
So the handler takes no lock, and the waiting loop polls.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import NoReturn

TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TerminationSignals:
    """Installed at construction (on the main thread); `wait()` returns the first signal received."""

    def __init__(self) -> None:
        self._received: list[int] = []  # list.append takes no Python-level lock
        self._previous = {sig: signal.signal(sig, self._record) for sig in TERMINATION_SIGNALS}

    def _record(self, number: int, _frame: FrameType | None) -> None:
        self._received.append(number)

    @property
    def received(self) -> signal.Signals | None:
        """The first termination signal received so far, or None."""
        return signal.Signals(self._received[0]) if self._received else None

    def wait(self, poll_s: float = 0.1) -> signal.Signals:
        """Block until SIGTERM or SIGINT arrives (at most `poll_s` late); returns it."""
        while not self._received:
            time.sleep(poll_s)
        return signal.Signals(self._received[0])

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def exit_now(code: int) -> NoReturn:
    """End the process with `code` once its server has shut down, skipping the interpreter's teardown.

    Everything of ours is closed by then; what the teardown adds is the
    libraries' own cleanup: torch's alone takes about 0.6 s of CPU, which a
    busy machine stretches past a supervisor's grace period (the process is
    then killed mid-exit). Logs and stdio are flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
