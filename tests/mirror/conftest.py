"""Fixtures of the Redis-mirror tests: a real redis-server per test, real replica processes.

`redis_server` runs `redis-server --port P --save "" --appendonly no --bind
127.0.0.1` on a free port; the test may SIGKILL it (`.kill()`) and start it
again on the same port (`.restart()`). `replicas` starts `python -m
kv_manager_service.cli serve ...` processes; every one is terminated at
teardown: those the test did not kill must exit 0, and none may log a
traceback.

The only reason to skip is a missing `redis-server` binary (CI installs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from mirror_support import REDIS_SERVER, RedisServer, ReplicaFactory


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """The only skip of this folder: no redis-server binary.

    Unstarted Redis servers, each on a free port: append `RedisServer(tmp_path)` and start it when wanted."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (CI installs it)")
    servers: list[RedisServer] = []
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path, redis_factory: list[RedisServer]) -> RedisServer:
    server = RedisServer(tmp_path)
    redis_factory.append(server)
    server.start()
    return server


@pytest.fixture
def replicas(tmp_path: Path, redis_factory: list[RedisServer]) -> Iterator[ReplicaFactory]:
    # Depends on redis_factory so replicas stop (and drop their leases) before Redis goes.
    factory = ReplicaFactory(tmp_path)
    try:
        yield factory
    finally:
        failures = factory.close()
        if failures:
            pytest.fail("\n\n".join(failures), pytrace=False)
