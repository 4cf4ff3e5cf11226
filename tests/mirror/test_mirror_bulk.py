"""mirror.bulk against a real redis-server and a real 3-master Redis Cluster: replies, errors, redirections.

The replies must be what redis-py's own pipeline reads (before its
response callbacks turn them into dicts and sets); errors must raise the
redis errors the mirror's callers handle, and leave the connections usable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from kv_manager_service.mirror import bulk
from kv_manager_service.mirror.connect import DeferredRedis, RedisEndpoint, connect
from kv_tooling.launch import free_cluster_port, free_port, launch_redis, launch_redis_cluster
from mirror_support import REDIS_SERVER


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (CI installs it)")
    directory = tmp_path_factory.mktemp("bulk-single")
    server = launch_redis(free_port(), directory / "redis.log")
    client = redis.Redis(host="127.0.0.1", port=int(server.address.rsplit(":", 1)[1]), socket_timeout=5.0)
    yield client
    client.close()
    server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (CI installs it)")
    directory = tmp_path_factory.mktemp("bulk-cluster")
    ports: list[int] = []
    while len(ports) < 3:
        port = free_cluster_port()
        if port not in ports:
            ports.append(port)
    nodes = launch_redis_cluster(ports, directory)
    client = RedisCluster(host="127.0.0.1", port=ports[0], socket_timeout=5.0)
    yield client
    client.close()
    for node in nodes:
        node.stop()


@pytest.fixture(params=["single", "cluster"])
def client(request: pytest.FixtureRequest) -> redis.Redis | RedisCluster:
    target = request.getfixturevalue(request.param)
    target.flushall() if isinstance(target, redis.Redis) else target.flushall(target_nodes=RedisCluster.PRIMARIES)
    return target


def hset(key: str, field: str, value: str) -> bytes:
    return bulk.CommandTemplate(b"HSET", (field.encode(), value.encode())).pack(key)


def as_dict(reply: dict | list) -> dict:
    """A hash as RESP3 sends it (a map), or as RESP2 does (a flat array of fields and values)."""
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2]))


def test_pack_command_is_what_redis_py_sends():
    assert bulk.pack_command("HSET", "k", b"f", "v") == b"*4\r\n$4\r\nHSET\r\n$1\r\nk\r\n$1\r\nf\r\n$1\r\nv\r\n"
    assert bulk.CommandTemplate(b"HMGET", (b"a", b"bb")).pack("key:1") == bulk.pack_command("HMGET", "key:1", "a", "bb")
    assert bulk.CommandTemplate(b"GET").pack(b"\xff\x00") == bulk.pack_command(b"GET", b"\xff\x00")
    template = bulk.CommandTemplate(b"HMGET", (b"a", b"bb"))
    for keys in ([b"k:1", b"k:2", b"k:3"], [b"k:1", b"key:22", b""], []):  # one length, mixed lengths, none
        assert template.pack_each(keys) == [bulk.pack_command("HMGET", key, "a", "bb") for key in keys]
    writes = bulk.HashWrites(redis.Redis())
    writes.hset("k:1", "replica-a", "7")
    writes.hdel("k:2", "replica-a")
    writes.hset("k:3", "replica-a", "7:host")
    assert len(writes) == 3
    assert writes._commands == [bulk.pack_command("HSET", "k:1", "replica-a", "7"),
                                bulk.pack_command("HDEL", "k:2", "replica-a"),
                                bulk.pack_command("HSET", "k:3", "replica-a", "7:host")]  # fmt: skip


def test_replies_equal_redis_py_pipeline(client):
    keys = [f"block:{i}" for i in range(300)]
    commands, command_keys = [], []
    for i, key in enumerate(keys):
        commands.append(hset(key, "replica-a", str(i)))
        command_keys.append(key)
        if i % 3 == 0:
            commands.append(hset(key, "replica-b", f"{i}:host"))
            command_keys.append(key)
    commands.append(bulk.pack_command("SADD", "replicas", "replica-a", "replica-b"))
    command_keys.append("replicas")
    commands.append(bulk.pack_command("SET", "lease:a", '{"incarnation": 7}'))
    command_keys.append("lease:a")
    replies = bulk.execute(client, command_keys, commands)
    assert replies == [1] * (len(commands) - 2) + [2, b"OK"]

    reads = [bulk.pack_command("HGETALL", k) for k in keys]
    reads += [bulk.pack_command("HMGET", k, "replica-b", "replica-a", "x") for k in keys]
    reads += [bulk.pack_command("SMEMBERS", "replicas"), bulk.pack_command("GET", "lease:a"),
              bulk.pack_command("GET", "lease:missing"), bulk.pack_command("HGETALL", "missing")]  # fmt: skip
    read_keys = keys + keys + ["replicas", "lease:a", "lease:missing", "missing"]
    got = bulk.execute(client, read_keys, reads)

    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    for key in keys:
        pipe.hmget(key, "replica-b", "replica-a", "x")
    pipe.smembers("replicas").get("lease:a").get("lease:missing").hgetall("missing")
    expected = pipe.execute()
    n = len(keys)
    assert [as_dict(reply) for reply in got[:n]] == expected[:n]
    assert got[n : 2 * n] == expected[n : 2 * n]
    assert set(got[2 * n]) == expected[2 * n] == {b"replica-a", b"replica-b"}
    assert got[2 * n + 1 : 2 * n + 3] == [b'{"incarnation": 7}', None]
    assert as_dict(got[2 * n + 3]) == expected[2 * n + 3] == {}

    deletes = [bulk.pack_command("HDEL", k, "replica-a") for k in keys]
    assert bulk.execute(client, keys, deletes) == [1] * n
    assert bulk.execute(client, keys, deletes) == [0] * n


def test_many_commands_cross_socket_buffers(client):
    """More request and reply bytes than a socket buffer holds, in one call (the writer's largest batches)."""
    value = "x" * 200
    keys = [f"big:{i}" for i in range(20_000)]
    assert bulk.execute(client, keys, [hset(k, "f", value) for k in keys]) == [1] * len(keys)
    replies = bulk.execute(client, keys, [bulk.pack_command("HMGET", k, "f") for k in keys])
    assert replies == [[value.encode()]] * len(keys)
    assert bulk.execute(client, [], []) == []


def test_error_reply_raises_and_leaves_the_connection_usable(client):
    bulk.execute(client, ["plain"], [bulk.pack_command("SET", "plain", "1")])
    commands = [hset("h", "f", "v"), hset("plain", "f", "v"), hset("h2", "f", "v")]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        bulk.execute(client, ["h", "plain", "h2"], commands)
    # Every command ran (a pipeline does not stop at an error) and the replies were all read.
    reads = [bulk.pack_command("HGET", "h", "f"), bulk.pack_command("HGET", "h2", "f")]
    assert bulk.execute(client, ["h", "h2"], reads) == [b"v", b"v"]


def test_timeout_raises_a_redis_timeout_and_the_next_call_works(single):
    """A Redis that stops answering for longer than the client's socket timeout."""
    host, port = single.connection_pool.connection_kwargs["host"], single.connection_pool.connection_kwargs["port"]
    impatient = redis.Redis(host=host, port=port, socket_timeout=0.1)
    try:
        bulk.execute(impatient, ["k"], [bulk.pack_command("GET", "k")])
        single.execute_command("CLIENT", "PAUSE", "600", "ALL")
        with pytest.raises(redis.TimeoutError):
            bulk.execute(impatient, ["k"], [bulk.pack_command("GET", "k")])
        single.execute_command("CLIENT", "UNPAUSE")
        commands = [bulk.pack_command("SET", "k", "1"), bulk.pack_command("GET", "k")]
        assert bulk.execute(impatient, ["k", "k"], commands) == [b"OK", b"1"]
    finally:
        impatient.close()


def test_unreachable_redis_raises_a_connection_error():
    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_timeout=0.5, socket_connect_timeout=0.5)
    with pytest.raises(redis.ConnectionError):
        bulk.execute(client, ["k"], [bulk.pack_command("GET", "k")])


def test_cluster_sends_each_node_its_own_keys_in_one_batch(cluster):
    masters = cluster.get_primaries()
    assert len(masters) == 3
    before = {m.name: _calls(cluster, m, "hset") for m in masters}
    keys = [f"spread:{i}" for i in range(600)]
    bulk.execute(cluster, keys, [hset(k, "f", "v") for k in keys])
    owners = {m.name: 0 for m in masters}
    for key in keys:
        owners[cluster.nodes_manager.get_node_from_slot(key_slot(key.encode())).name] += 1
    assert all(count > 0 for count in owners.values())
    for master in masters:
        assert _calls(cluster, master, "hset") - before[master.name] == owners[master.name]
        # Each key is on its owner only: a direct connection to that node sees it.
        direct = master.redis_connection
        mine = [k for k in keys if cluster.nodes_manager.get_node_from_slot(key_slot(k.encode())).name == master.name]
        assert direct.hget(mine[0], "f") == b"v"


def test_cluster_follows_ask_and_moved_during_a_slot_migration(cluster):
    """A slot moves from one master to another under the client: ASK while migrating, MOVED after."""
    nodes = cluster.nodes_manager
    source = nodes.get_node_from_slot(key_slot(b"{mig}"))
    target = next(m for m in cluster.get_primaries() if m.name != source.name)
    slot = key_slot(b"{mig}")
    old, new = "{mig}:old", "{mig}:new"
    bulk.execute(cluster, [old], [hset(old, "replica-a", "1")])
    source_id = source.redis_connection.execute_command("CLUSTER", "MYID")
    target_id = target.redis_connection.execute_command("CLUSTER", "MYID")
    target.redis_connection.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.redis_connection.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    try:
        # `new` does not exist on the source: it answers ASK, and the write lands on the target.
        replies = bulk.execute(cluster, [new, old], [hset(new, "replica-a", "2"), bulk.pack_command("HGETALL", old)])
        assert replies[0] == 1 and as_dict(replies[1]) == {b"replica-a": b"1"}
        source.redis_connection.execute_command(
            "MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", old)  # fmt: skip
    finally:
        for master in cluster.get_primaries():
            master.redis_connection.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    assert target.redis_connection.hget(new, "replica-a") == b"2"  # the ASK was followed to the target
    assert nodes.get_node_from_slot(slot).name == source.name  # the client's map is stale now
    replies = bulk.execute(cluster, [old, new], [bulk.pack_command("HGETALL", old), bulk.pack_command("HGETALL", new)])
    assert [as_dict(reply) for reply in replies] == [{b"replica-a": b"1"}, {b"replica-a": b"2"}]
    assert nodes.get_node_from_slot(slot).name == target.name  # MOVED updated it


def _calls(cluster: RedisCluster, node, command: str) -> int:
    stats = node.redis_connection.info("commandstats")
    return stats.get(f"cmdstat_{command}", {}).get("calls", 0)


def test_clients_made_by_mirror_connect_work_on_both_topologies(client):
    """The clients a manager makes (mirror.connect): a plain or cluster client, or a stand-in that picks one late."""
    if isinstance(client, RedisCluster):
        node = client.get_primaries()[0]
        url = f"redis://{node.host}:{node.port}/0"
    else:
        kwargs = client.connection_pool.connection_kwargs
        url = f"redis://{kwargs['host']}:{kwargs['port']}/0"
    endpoint = RedisEndpoint(url, timeout_s=5.0)
    for made in (connect(endpoint), DeferredRedis(endpoint)):
        keys = [f"made:{i}" for i in range(50)]
        assert bulk.execute(made, keys, [hset(k, "f", "v") for k in keys]) == [1] * 50
        assert bulk.execute(made, keys, [bulk.pack_command("HDEL", k, "f") for k in keys]) == [1] * 50
        made.close()
