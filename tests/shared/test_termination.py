"""A server's main thread wakes on SIGTERM or SIGINT, whatever it holds when the signal lands."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from processes import ROOT

# The child signals itself while its main thread holds a plain lock, as
# `threading.Event.wait()` holds its own between polls: the handler must not
# need that lock (an `Event.set()` handler hung here until SIGKILL).
CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading
    from kv_manager_service.shared.termination import TerminationSignals

    signals = TerminationSignals()
    held = threading.Lock()
    with held:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        for _ in range(1000):  # bytecodes, between which the handler runs
            pass
    print(signals.wait().name, flush=True)
    """
)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_the_wait_returns_the_signal_received_while_a_lock_is_held(name):
    child = subprocess.run(
        [sys.executable, "-c", CHILD, name], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == name


def test_the_previous_handlers_come_back():
    from kv_manager_service.shared.termination import TerminationSignals

    before = signal.getsignal(signal.SIGTERM)
    signals = TerminationSignals()
    assert signal.getsignal(signal.SIGTERM) != before and signals.received is None
    signals.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_exit_now_ends_the_process_with_its_code_after_flushing_logs_and_stdout():
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(
            """
            import logging, sys
            from kv_manager_service.shared.termination import exit_now
            logging.basicConfig(stream=sys.stderr)
            logging.getLogger("t").warning("last words")
            print("buffered", end="")
            exit_now(3)
            print("never")
            """
        )],
        cwd=ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert child.returncode == 3
    assert child.stdout == "buffered" and "last words" in child.stderr
