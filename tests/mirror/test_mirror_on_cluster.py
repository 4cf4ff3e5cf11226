"""The mirror on a real Redis Cluster: keys spread over the masters, evictions, and a master's failover.

Managers are given the URL of one node and find the rest themselves
(`--redis-cluster auto`). Most mirror tests run on both topologies through
the `mirror_redis` fixture; these are the ones about the cluster itself,
plus evictions, run on both.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from kv_manager_service.mirror.connect import RedisEndpoint, connect_now, is_cluster_node
from mirror_support import (
    BLOCK_SIZE,
    CONVERGE_TIMEOUT_S,
    REDIS_CLI,
    REDIS_SERVER,
    ROOT,
    LoadThread,
    RedisClusterServer,
    namespace,
    prompt,
    wait_mirror_converged,
    wait_until,
)


@pytest.fixture
def failover_cluster(tmp_path: Path) -> Iterator[RedisClusterServer]:
    """A cluster of its own, 3 masters with a replica each, that fails a master over after 500 ms."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli are not installed (CI installs them)")
    cluster = RedisClusterServer(tmp_path / "failover-cluster", replicas_per_master=1, node_timeout_ms=500)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_any_node_is_detected_as_a_cluster_and_one_server_is_not(shared_redis_cluster, redis_server):
    for port in shared_redis_cluster.ports:
        assert is_cluster_node(RedisEndpoint(f"redis://127.0.0.1:{port}/0"))
    assert not is_cluster_node(RedisEndpoint(redis_server.url))
    single = connect_now(RedisEndpoint(redis_server.url, cluster="auto"))
    cluster = connect_now(RedisEndpoint(shared_redis_cluster.url, cluster="auto"))
    try:
        assert len(cluster.get_primaries()) == 3
        assert not hasattr(single, "get_primaries")
    finally:
        single.close()
        cluster.close()


def test_cluster_yes_against_one_server_stops_the_start_with_one_line(redis_server, replicas):
    argv = replicas.argv("replica-a", redis_server.url, 64, None, ["--redis-cluster", "yes"])
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--redis-cluster yes, but the Redis at" in result.stderr and "cluster mode off" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_database_other_than_0_on_a_cluster_stops_the_start_with_one_line(shared_redis_cluster, replicas):
    url = f"redis://127.0.0.1:{shared_redis_cluster.ports[0]}/1"
    assert is_cluster_node(RedisEndpoint(url))  # asked on database 0: a cluster node refuses SELECT 1
    result = subprocess.run(replicas.argv("replica-a", url, 64, None, []), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "names database 1 of a Redis Cluster node" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.fixture
def unstarted_cluster(tmp_path: Path) -> Iterator[RedisClusterServer]:
    """A cluster whose ports are chosen but which the test starts (stopped after the test's replicas)."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli are not installed (CI installs them)")
    cluster = RedisClusterServer(tmp_path / "late-cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_manager_started_before_the_cluster_finds_it_when_it_comes_up(unstarted_cluster, replicas):
    cluster = unstarted_cluster
    a, b = replicas.start_many(
        [dict(replica_id="replica-a", redis_url=cluster.url), dict(replica_id="replica-b", redis_url=cluster.url)]
    )
    tokens = prompt(75, 3 * BLOCK_SIZE + 1)
    a.cache("early", tokens)
    assert b.cluster(tokens) == {"replica-b": 0}  # no Redis yet: each answers for itself
    cluster.start()
    wait_until(lambda: b.cluster(tokens), lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 0},
               CONVERGE_TIMEOUT_S, "the prefix cached before the cluster came up")  # fmt: skip
    wait_mirror_converged([a, b], cluster, namespace())
    assert "is reachable now: cluster" in a.log() and not a.stats().mirror_fenced


def test_two_replicas_see_each_others_prefixes_and_the_keys_spread_over_every_master(shared_redis_cluster, replicas):
    cluster = shared_redis_cluster
    cluster.flush()
    # Each manager is told a different node: both find the whole cluster.
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=f"redis://127.0.0.1:{cluster.ports[1]}/0"),
            dict(replica_id="replica-b", redis_url=f"redis://127.0.0.1:{cluster.ports[2]}"),
        ]
    )
    tokens_a, tokens_b = prompt(70, 24 * BLOCK_SIZE + 1), prompt(71, 9 * BLOCK_SIZE + 1)
    a.cache("a", tokens_a)
    b.cache("b", tokens_b)
    expected_a = {"replica-a": 24 * BLOCK_SIZE, "replica-b": 0}
    expected_b = {"replica-a": 0, "replica-b": 9 * BLOCK_SIZE}
    for asking in (a, b):
        wait_until(lambda: asking.cluster(tokens_a), lambda got: got == expected_a, CONVERGE_TIMEOUT_S,
                   f"replica-a's prefix seen from {asking.replica_id}")  # fmt: skip
        wait_until(lambda: asking.cluster(tokens_b), lambda got: got == expected_b, CONVERGE_TIMEOUT_S,
                   f"replica-b's prefix seen from {asking.replica_id}")  # fmt: skip
    # 33 block keys, a lease each and the replica set: every master holds some of them.
    sizes = cluster.num_keys_per_node()
    assert sum(sizes.values()) == 33 + 2 + 1, sizes
    assert all(sizes[port] > 0 for port in cluster.ports[:3]), sizes


def test_evictions_reach_the_index(mirror_redis, replicas):
    """A pool of 12 blocks caches far more: what it evicts leaves Redis, exactly."""
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url, num_blocks=12),
            dict(replica_id="replica-b", redis_url=mirror_redis.url),
        ]
    )
    prompts = [prompt(80 + i, 5 * BLOCK_SIZE + 1) for i in range(6)]
    for i, tokens in enumerate(prompts):
        a.cache(f"p{i}", tokens)
    assert a.stats().num_evictions > 0
    wait_mirror_converged([a], mirror_redis, namespace())
    # The first prompt was evicted (LRU): gone from the cluster answer; the last is whole.
    assert a.client.find_cache_hit(prompts[0])[0].num_cached_tokens == 0
    assert b.cluster(prompts[0]) == {"replica-a": 0, "replica-b": 0}
    assert b.cluster(prompts[-1]) == {"replica-a": 5 * BLOCK_SIZE, "replica-b": 0}


def test_a_master_sigkilled_under_load_fails_over_and_the_mirror_converges_exactly(failover_cluster, replicas):
    cluster = failover_cluster
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=cluster.url, num_blocks=64),
            dict(replica_id="replica-b", redis_url=cluster.url, num_blocks=64),
        ]
    )
    ns = namespace()
    loads = [LoadThread(a, seed=11), LoadThread(b, seed=12)]
    for load in loads:
        load.start()
    try:
        wait_until(lambda: min(load.num_iterations for load in loads), lambda n: n >= 30, CONVERGE_TIMEOUT_S,
                   "load before the failover")  # fmt: skip
        # The node the managers were pointed at: they must not depend on it.
        killed_port = cluster.kill_master(0)
        cluster.wait_failed_over(killed_port)
        done = [load.num_iterations for load in loads]
        wait_until(lambda: [load.num_iterations - n for load, n in zip(loads, done)], lambda got: min(got) >= 30,
                   CONVERGE_TIMEOUT_S, "load after the failover")  # fmt: skip
    finally:
        for load in loads:
            load.stop()
    assert [load.errors for load in loads] == [[], []], "RPCs failed during the failover"

    wait_mirror_converged([a, b], cluster, ns)
    for replica in (a, b):
        stats = replica.stats()
        assert stats.mirror_failures > 0 and stats.mirror_resyncs >= 2, stats
        assert not stats.mirror_fenced
        # Every writer noticed the failover itself, errors or not.
        assert "the Redis Cluster's configuration changed" in replica.log(), replica.log()

    # The cluster lookups found the new master: a new prefix is seen from the other replica.
    probe = prompt(90, 3 * BLOCK_SIZE + 1)
    a.cache("after-failover", probe)
    b_tokens = b.client.find_cache_hit(probe)[0].num_cached_tokens
    wait_until(lambda: b.cluster(probe), lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": b_tokens},
               CONVERGE_TIMEOUT_S, "a new prefix to be published and read after the failover")  # fmt: skip
