"""Launching children: a stop signal never leaves a child nobody knows of."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import pytest

from kv_tooling import launch
from kv_tooling.launch import Interrupted, stopped_on_signals


def _signal_the_parent() -> None:
    os.kill(os.getppid(), signal.SIGTERM)  # runs in the child, after the fork, while Popen waits for the exec


def test_a_stop_signal_during_the_spawn_kills_the_new_child_and_interrupts(tmp_path, monkeypatch):
    spawned: list[subprocess.Popen] = []
    handler_before = signal.getsignal(signal.SIGTERM)

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            spawned.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(launch.subprocess, "Popen", functools.partial(Recorded, preexec_fn=_signal_the_parent))
    with pytest.raises(Interrupted) as raised:
        with stopped_on_signals():
            launch.launch([sys.executable, "-c", "import time; time.sleep(60)"], "never", tmp_path / "child.log")
    assert raised.value.signum == signal.SIGTERM
    assert len(spawned) == 1 and spawned[0].returncode == -signal.SIGKILL, "the child outlived the interruption"
    assert signal.getsignal(signal.SIGTERM) == handler_before
    assert not launch._spawn_guard.spawning and launch._spawn_guard.held is None


def test_without_a_signal_the_spawn_is_untouched(tmp_path):
    with stopped_on_signals():
        process = launch._spawn([sys.executable, "-c", "print('hi')"], tmp_path / "child.log", None, None, None)
    assert process.wait(timeout=30) == 0
    assert (tmp_path / "child.log").read_text().strip() == "hi"
    assert not launch._spawn_guard.spawning and launch._spawn_guard.held is None
