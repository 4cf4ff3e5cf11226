"""Fixtures for the service tests: real `kv-manager serve` processes on ephemeral ports.

Every server is started as a user would start it
(`python -m kv_manager_service.cli serve --port 0 ...`), is ready once it has
printed `KV manager listening on HOST:PORT`, and is always stopped with
SIGTERM at teardown; the teardown then checks that it exited 0 within a few
seconds (graceful shutdown) and that its log shows no INTERNAL error (a bug).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from processes import launch, stop_all
from svc_support import pool_config, write_config

from kv_tooling.launch import LaunchedProcess
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX


class ServerFactory:
    """Starts servers in a directory of its own; `close` stops them all and checks each exit."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.servers: list[LaunchedProcess] = []

    def start(self, *args: str, config: dict[str, Any] | None = None) -> LaunchedProcess:
        index = len(self.servers)
        argv = [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", *args]
        if config is not None:
            argv += ["--config", str(write_config(self.directory, config, f"pool-{index}.json"))]
        server = launch(argv, MANAGER_READY_PREFIX, self.directory / f"server-{index}.log")
        self.servers.append(server)
        return server

    def close(self) -> None:
        failures = stop_all(self.servers)
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
def server(module_server_factory: ServerFactory) -> LaunchedProcess:
    """The module's default server: one 16-token full-attention group, 64 blocks. Its tests take turns
    registering one worker, so its lease outlasts the module (worker leases are tested on their own)."""
    return module_server_factory.start(
        "--replica-id", "replica-test", "--worker-timeout-s", "3600", config=pool_config(64)
    )
