"""Real server processes for tests, started as a user starts them (`kv_manager_service.rpc.launch`).

Each must exit 0 within a few seconds of SIGTERM (graceful shutdown), with no
traceback in its log.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Mapping, Sequence

from kv_manager_service.rpc import launch as launcher
from kv_manager_service.rpc.launch import LaunchedProcess
from kv_manager_service.rpc.ready_line import NotReadyError

ROOT = Path(__file__).resolve().parents[1]
SHUTDOWN_TIMEOUT_S = 8.0  # the servers' own grace is 5 s; streams end at once



def launch(argv: Sequence[str], ready_prefix: str, log_path: Path, env: Mapping[str, str] | None = None) -> LaunchedProcess:
    """Start a server from the repository root; a start that fails is a test failure with the log."""
    try:
        return launcher.launch(argv, ready_prefix, log_path, cwd=ROOT, env=env)
    except NotReadyError as error:
        raise AssertionError(str(error)) from None


def check_clean_exit(process: LaunchedProcess) -> None:
    code = process.stop(SHUTDOWN_TIMEOUT_S)
    log = process.log()
    assert code == 0, f"{process.args} exited {code} after SIGTERM (graceful shutdown expected)\n{log}"
    assert "bug in" not in log and "Traceback" not in log, f"{process.args} logged an internal error:\n{log}"


def stop_all(processes: Sequence[LaunchedProcess]) -> list[str]:
    """Stop every process, last started first; the failures of their exit checks."""
    failures = []
    for process in reversed(processes):
        try:
            check_clean_exit(process)
        except AssertionError as error:
            failures.append(str(error))
    return failures


def log_records(process: LaunchedProcess) -> list[dict[str, Any]]:
    """Every stderr line of `process`, each parsed as one JSON object (a line that is not one fails the test)."""
    records = []
    for number, line in enumerate(process.log().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"stderr line {number} is not JSON: {line!r}") from None
    return records


def free_port() -> int:
    """A TCP port free on the loopback now (for a server that must keep its port across restarts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
