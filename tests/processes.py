"""Real server processes for tests, started as a user starts them (`kv_tooling.launch`).

A server that does not start fails the test with its log. Each must exit 0
within a few seconds of SIGTERM (graceful shutdown), with no traceback in
its log; one the test killed on purpose (`LaunchedProcess.kill`) is exempt
from the exit code only.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from kv_tooling import launch as launcher
from kv_tooling.launch import LaunchedProcess
from kv_tooling.launch import free_port  # noqa: F401 - the tests take it from here, with the rest
from kv_manager_service.shared.ready_line import NotReadyError

if TYPE_CHECKING:
    import redis

ROOT = Path(__file__).resolve().parents[1]
SHUTDOWN_TIMEOUT_S = 8.0  # the servers' own grace is 5 s; streams end at once


@contextmanager
def _start_failure_fails_the_test() -> Iterator[None]:
    try:
        yield
    except NotReadyError as error:
        raise AssertionError(str(error)) from None


def launch(argv: Sequence[str], ready_prefix: str, log_path: Path, env: Mapping[str, str] | None = None) -> LaunchedProcess:
    """Start a server from the repository root and wait for its ready line."""
    return launch_many([argv], ready_prefix, [log_path], env)[0]


def launch_many(
    argvs: Sequence[Sequence[str]], ready_prefix: str, log_paths: Sequence[Path], env: Mapping[str, str] | None = None
) -> list[LaunchedProcess]:
    """Start several servers from the repository root at once, then wait for each ready line."""
    with _start_failure_fails_the_test():
        return launcher.launch_many(argvs, ready_prefix, log_paths, cwd=ROOT, env=env)


def launch_until_ready(
    argv: Sequence[str], is_ready: Callable[[], bool], address: str, log_path: Path, cwd: Path, timeout_s: float
) -> LaunchedProcess:
    """Start a server that prints no ready line of ours; it is ready once `is_ready()` is true."""
    with _start_failure_fails_the_test():
        return launcher.launch_until_ready(argv, is_ready, address, log_path, cwd=cwd, timeout_s=timeout_s)


def launch_redis(
    port: int, log_path: Path, extra_args: Sequence[str] = (), tls: bool = False, ping_client: redis.Redis | None = None
) -> LaunchedProcess:
    """A redis-server without persistence on 127.0.0.1:`port` (see `launcher.launch_redis`)."""
    with _start_failure_fails_the_test():
        return launcher.launch_redis(port, log_path, extra_args, tls=tls, ping_client=ping_client)


def check_clean_exit(process: LaunchedProcess, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    code = process.stop(timeout_s)
    log = process.log()
    if not process.killed:
        assert code == 0, f"{process.args} exited {code} after SIGTERM (graceful shutdown expected)\n{log}"
    assert "bug in" not in log and "Traceback" not in log, f"{process.args} logged an internal error:\n{log}"


def stop_all(processes: Sequence[LaunchedProcess], timeout_s: float = SHUTDOWN_TIMEOUT_S) -> list[str]:
    """Stop every process, last started first; the failures of their exit checks."""
    failures = []
    for process in reversed(processes):
        try:
            check_clean_exit(process, timeout_s)
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


# A process started under `ulimit -n N`, as an operator's unit file would start it.
_LIMITED = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({0}, {0})); os.execv(sys.argv[1], sys.argv[1:])"


def with_open_file_limit(argv: Sequence[str], limit: int) -> list[str]:
    """`argv` (a Python module run as `sys.executable -m ...`, or any program) run with `limit` open files."""
    return [sys.executable, "-c", _LIMITED.format(limit), *argv]


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextmanager
def idle_connections(address: str, count: int) -> Iterator[list[socket.socket]]:
    """`count` TCP connections to `address` that never send a byte (those refused or reset at once left
    out), closed at the end; this process's open-file limit is raised for them first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 1024), hard))
    host, port = address.rsplit(":", 1)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            try:
                sockets.append(socket.create_connection((host, int(port)), timeout=5))
            except OSError:  # refused or reset past the server's cap: it is not out of files
                pass
        yield sockets
    finally:
        for s in sockets:
            s.close()


def exited(pid: int) -> bool:
    """Whether process `pid` is gone (or a zombie no one waited for yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def served_within(call: Callable[[], Any], deadline_s: float, what: str) -> Any:
    """Repeat `call` until it returns without a gRPC error, and return its answer; fail naming `what` past
    `deadline_s`."""
    import grpc

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            assert time.monotonic() < deadline, f"{what} not served within {deadline_s:g}s: {error}"
            time.sleep(0.2)
