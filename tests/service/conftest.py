"""Fixtures for the service tests: real `kv-manager serve` processes on ephemeral ports.

Every server is started as a user would start it
(`python -m kv_manager_service.cli serve --port 0 ...`), is ready once it has
printed `KV manager listening on HOST:PORT`, and is always stopped with
SIGTERM at teardown; the teardown then checks that it exited 0 within a few
seconds (graceful shutdown) and that its log shows no INTERNAL error (a bug).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from kv_manager_service.ready_line import MANAGER_READY_PREFIX, NotReadyError, wait_for_ready_line
from svc_support import ROOT, pool_config, write_config

START_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 8.0  # the server's own grace is 5 s; streams end at once


class ServerProcess:
    """One running `kv-manager serve` subprocess."""

    def __init__(self, process: subprocess.Popen, address: str, log_path: Path, args: list[str]) -> None:
        self.process = process
        self.address = address
        self.log_path = log_path
        self.args = args
        self.returncode: int | None = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self) -> int:
        """SIGTERM, then wait for the exit; kills and fails if it does not exit in time."""
        if self.returncode is not None:
            return self.returncode
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            self.returncode = -9
            raise AssertionError(
                f"server {self.args} did not exit within {SHUTDOWN_TIMEOUT_S}s of SIGTERM\n{self.log()}"
            ) from None
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()
        return self.returncode

    def check_clean_exit(self) -> None:
        code = self.stop()
        log = self.log()
        assert code == 0, f"server {self.args} exited {code} after SIGTERM (graceful shutdown expected)\n{log}"
        assert "bug in" not in log and "Traceback" not in log, f"the server logged an internal error:\n{log}"


def _read_ready_line(process: subprocess.Popen, log_path: Path, args: list[str]) -> str:
    try:
        return wait_for_ready_line(process, MANAGER_READY_PREFIX, START_TIMEOUT_S)
    except NotReadyError as error:
        raise AssertionError(f"server {args}: {error}\n{log_path.read_text(errors='replace')}") from None


class ServerFactory:
    """Starts servers in a directory of its own; `close` stops them all and checks each exit."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.servers: list[ServerProcess] = []

    def start(self, *args: str, config: dict[str, Any] | None = None) -> ServerProcess:
        index = len(self.servers)
        argv = [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", *args]
        if config is not None:
            argv += ["--config", str(write_config(self.directory, config, f"pool-{index}.json"))]
        log_path = self.directory / f"server-{index}.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL)
        try:
            address = _read_ready_line(process, log_path, argv)
        except BaseException:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
            process.stdout.close()
            raise
        server = ServerProcess(process, address, log_path, argv)
        self.servers.append(server)
        return server

    def close(self) -> None:
        failures = []
        for server in self.servers:
            try:
                server.check_clean_exit()
            except AssertionError as error:
                failures.append(str(error))
        self.servers.clear()
        if failures:
            pytest.fail("\n\n".join(failures), pytrace=False)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[ServerFactory]:
    """Servers for one test; each is SIGTERMed at teardown and must exit 0."""
    factory = ServerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def module_server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """Servers shared by one test module; each is SIGTERMed at teardown and must exit 0."""
    factory = ServerFactory(tmp_path_factory.mktemp("kv-servers"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def server(module_server_factory: ServerFactory) -> ServerProcess:
    """The module's default server: one 16-token full-attention group, 64 blocks."""
    return module_server_factory.start("--replica-id", "replica-test", config=pool_config(64))
