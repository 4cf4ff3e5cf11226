"""Fixtures of the Redis-mirror tests: a real redis-server per test, real replica processes.

`redis_server` runs `redis-server --port P --save "" --appendonly no --bind
127.0.0.1` on a free port; the test may SIGKILL it (`.kill()`) and start it
again on the same port (`.restart()`). `replicas` starts `python -m
kv_manager_service.cli serve ...` processes; every one is terminated at
teardown: those the test did not kill must exit 0, and none may log a
traceback.

`mirror_redis` is either topology, one test id each: `[single]` a
redis-server of its own, `[cluster]` a Redis Cluster of 3 masters that the
tests of a session share (`shared_redis_cluster`, emptied before each test;
tests that kill a node start their own). A test that means the mirror to
work the same on both asks for it instead of `redis_server`.

The only reason to skip is a missing `redis-server` binary (CI installs it,
with `redis-cli`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from mirror_support import REDIS_CLI, REDIS_SERVER, RedisClusterServer, RedisServer, ReplicaFactory


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


@pytest.fixture(scope="session")
def shared_redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServer]:
    """One Redis Cluster of 3 masters (no replicas) for the session's tests that only read and write it."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli are not installed (CI installs them)")
    cluster = RedisClusterServer(tmp_path_factory.mktemp("redis-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["single", "cluster"])
def mirror_redis(
    request: pytest.FixtureRequest, tmp_path: Path, redis_factory: list[RedisServer]
) -> RedisServer | RedisClusterServer:
    """A running Redis of either topology, empty: a redis-server of its own, or the shared cluster flushed."""
    if request.param == "single":
        server = RedisServer(tmp_path)
        redis_factory.append(server)
        server.start()
        return server
    cluster = request.getfixturevalue("shared_redis_cluster")
    cluster.flush()
    return cluster


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
