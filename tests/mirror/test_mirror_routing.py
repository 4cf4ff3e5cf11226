"""The router's side: choose_replica, the key schema, and ClusterIndex.lookup against a real Redis."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from contextlib import ExitStack, closing

import pytest
import redis

from kv_manager_service.mirror import bulk
from kv_manager_service.mirror.lookup import (
    CHUNK_GROWTH,
    FIRST_CHUNK_BLOCKS,
    HMGET_MAX_FIELDS,
    ClusterIndex,
    ReplicaPrefix,
    choose_replica,
)
from kv_manager_service.mirror.schema import ClusterUnavailableError, KeySchema, Lease


def _prefix(replica_id: str, num_blocks: int, usage: float = 0.5, num_requests: int = 4) -> ReplicaPrefix:
    lease = Lease(replica_id, 1, f"{replica_id}:50051", num_requests, usage, 100)
    return ReplicaPrefix(replica_id, num_blocks, lease)


def _all_orders(prefixes: list[ReplicaPrefix]):
    return list(itertools.permutations(prefixes))


# -- choose_replica -------------------------------------------------------------------


def test_choose_replica_of_nothing_is_none():
    assert choose_replica([]) is None


def test_longest_prefix_wins_even_when_busier():
    prefixes = [_prefix("idle", 2, usage=0.0, num_requests=0), _prefix("busy", 3, usage=0.99, num_requests=500)]
    for order in _all_orders(prefixes):
        assert choose_replica(order) == "busy"


def test_tie_on_prefix_goes_to_lower_usage_before_fewer_requests():
    prefixes = [
        _prefix("a", 4, usage=0.7, num_requests=1),
        _prefix("b", 4, usage=0.2, num_requests=90),
        _prefix("c", 1, usage=0.0, num_requests=0),
    ]
    for order in _all_orders(prefixes):
        assert choose_replica(order) == "b"


def test_tie_on_prefix_and_usage_goes_to_fewer_requests():
    prefixes = [
        _prefix("a", 0, usage=0.25, num_requests=9),
        _prefix("b", 0, usage=0.25, num_requests=3),
        _prefix("c", 0, usage=0.25, num_requests=7),
    ]
    for order in _all_orders(prefixes):
        assert choose_replica(order) == "b"


def test_full_tie_is_decided_the_same_way_whatever_the_order():
    prefixes = [_prefix("r2", 2), _prefix("r1", 2), _prefix("r3", 2)]
    choices = {choose_replica(order) for order in _all_orders(prefixes)}
    assert len(choices) == 1


# -- KeySchema ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["seed-0", "my-secret-seed-123", "correct horse battery staple", "ünïcødé-seed"])
def test_key_schema_never_reveals_the_seed(seed):
    schema = KeySchema("llama", "xxh3_128", seed)
    keys = [schema.namespace, schema.block(0, b"\x01" * 16), schema.lease("r1"), schema.replicas]
    for key in keys:
        assert seed not in key
        assert seed.encode().hex() not in key
    # A fingerprint tells seeds apart without naming them.
    assert KeySchema("llama", "xxh3_128", seed + "x").namespace != schema.namespace
    assert KeySchema("llama", "xxh3_128", None).namespace != schema.namespace
    assert hashlib.sha256(seed.encode()).hexdigest() not in schema.namespace  # never the full digest either


def test_key_schema_separates_models_algorithms_and_seeds():
    namespaces = {
        KeySchema(model, algorithm, seed).namespace
        for model in ("m1", "m2")
        for algorithm in ("sha256_cbor", "xxh3_128")
        for seed in (None, "a", "b")
    }
    assert len(namespaces) == 12


def test_key_schema_matches_the_documented_layout():
    schema = KeySchema("m", "sha256_cbor")
    block_hash = bytes(range(32))
    assert schema.namespace == "kvcache:m:sha256_cbor:noseed"
    assert schema.block(3, block_hash) == f"kvcache:m:sha256_cbor:noseed:block:3:{block_hash.hex()}"
    assert schema.lease("r-1") == "kvcache:m:sha256_cbor:noseed:lease:r-1"
    assert schema.replicas == "kvcache:m:sha256_cbor:noseed:replicas"
    seeded = KeySchema("m", "sha256_cbor", "k")
    tag = hashlib.pbkdf2_hmac("sha256", b"k", b"kvcache.v1 namespace", 200_000)[:6].hex()
    assert seeded.namespace == f"kvcache:m:sha256_cbor:{tag}"


def test_lease_json_round_trip():
    lease = Lease("r", 1234567890123456789, "10.0.0.1:50051", 7, 0.625, 99)
    assert Lease.from_json("r", lease.to_json()) == lease
    assert Lease.from_json("r", lease.to_json().encode()) == lease


# -- ClusterIndex against a real Redis ------------------------------------------------------


def _publish(client, schema: KeySchema, replica_id: str, incarnation: int, hashes, usage=0.5, requests=1, group_id=0):
    lease = Lease(replica_id, incarnation, "x:1", requests, usage, 10)
    client.set(schema.lease(replica_id), lease.to_json(), px=60_000)
    client.sadd(schema.replicas, replica_id)
    pipe = client.pipeline(transaction=False)
    for block_hash in hashes:
        pipe.hset(schema.block(group_id, block_hash), replica_id, str(incarnation))
    pipe.execute()


def _hashes(n: int, tag: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


def _node_clients(server) -> list[redis.Redis]:
    """A client per node: the server itself, or every node of the cluster."""
    if server.topology == "single":
        return [server.client()]
    return [server.node_client(port) for port in server.ports]


def _hmget_calls(server) -> int:
    """HMGET commands the Redis ran so far, all nodes together (INFO commandstats)."""
    total = 0
    for node in _node_clients(server):
        try:
            total += node.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0)
        finally:
            node.close()
    return total


@pytest.fixture
def round_trips(monkeypatch) -> list[int]:
    """Counts the lookup's round trips: each mirror.bulk.execute call is one (in parallel over the nodes)."""
    calls: list[int] = []
    real_execute = bulk.execute

    def execute(client, keys, commands):
        calls.append(len(commands))
        return real_execute(client, keys, commands)

    monkeypatch.setattr(bulk, "execute", execute)
    return calls


def test_lookup_stops_at_the_first_miss_and_trusts_only_live_incarnations(mirror_redis, round_trips):
    schema = KeySchema("unit", "sha256_cbor")
    hashes = _hashes(200)
    writer = mirror_redis.client()
    _publish(writer, schema, "full", 11, hashes, usage=0.9)
    _publish(writer, schema, "gap", 22, hashes[:2] + hashes[3:])  # block 2 missing: stops there
    _publish(writer, schema, "chunk-end", 23, hashes[:FIRST_CHUNK_BLOCKS])  # holds exactly the first chunk
    _publish(writer, schema, "late-gap", 24, hashes[:100] + hashes[101:])  # a miss inside the second chunk
    _publish(writer, schema, "stale", 33, hashes)
    writer.set(schema.lease("stale"), Lease("stale", 34, "x:1", 0, 0.0, 10).to_json())  # restarted: new incarnation
    _publish(writer, schema, "dead", 44, hashes)
    writer.delete(schema.lease("dead"))  # lease expired
    _publish(writer, schema, "other-group", 55, hashes, group_id=1)  # group 1 does not count for group 0
    _publish(writer, KeySchema("elsewhere", "sha256_cbor"), "full", 11, hashes)  # another namespace

    client = mirror_redis.client()
    try:
        index = ClusterIndex(client, schema)
        want = {"full": 200, "gap": 2, "chunk-end": FIRST_CHUNK_BLOCKS, "late-gap": 100, "stale": 0, "other-group": 0}
        first = {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes)}
        assert first == want
        round_trips.clear()
        prefixes = index.lookup(0, hashes)
        assert {p.replica_id: p.num_cached_blocks for p in prefixes} == want
        # Chunks end at 64 and 200 blocks: two round trips, the first with the replica set and leases.
        assert len(round_trips) == 2 and FIRST_CHUNK_BLOCKS == 64 and CHUNK_GROWTH == 8
        assert choose_replica(prefixes) == "full"
        for n in (1, FIRST_CHUNK_BLOCKS - 1, FIRST_CHUNK_BLOCKS, FIRST_CHUNK_BLOCKS + 1, 100, 101):
            got = {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes[:n])}
            assert got == {r: min(b, n) for r, b in want.items()}, n
        assert {p.num_cached_blocks for p in index.lookup(0, [])} == {0}

        round_trips.clear()
        assert {p.num_cached_blocks for p in index.lookup(0, _hashes(512, "nobody"))} == {0}
        assert len(round_trips) == 1, "a prompt that nobody holds costs one round trip"

        # A replica whose lease expires drops out; a new one is picked up, and so is one alive again.
        writer.delete(schema.lease("gap"))
        _publish(writer, schema, "newcomer", 66, hashes[:40])
        after = {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes)}
        assert after == {**{r: b for r, b in want.items() if r != "gap"}, "newcomer": 40}
        writer.set(schema.lease("dead"), Lease("dead", 44, "x:1", 0, 0.0, 10).to_json())
        again = {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes)}
        assert again == {**after, "dead": 200}
        assert again == {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes)}
    finally:
        client.close()
        writer.close()


def test_a_replica_that_stopped_matching_is_not_read_any_further(mirror_redis):
    """512 blocks: "short" holds the first 3, "long" all of them, "dead" too but its lease expired. HMGETs
    that name "short" stop after the first chunk, none names "dead"; with "long" gone, the whole lookup reads
    one chunk (counted by Redis, all nodes)."""
    schema = KeySchema("unit", "sha256_cbor")
    hashes = _hashes(512)
    writer = mirror_redis.client()
    _publish(writer, schema, "short", 1, hashes[:3])
    _publish(writer, schema, "long", 2, hashes)
    _publish(writer, schema, "dead", 3, hashes)
    writer.delete(schema.lease("dead"))
    client = mirror_redis.client()
    try:
        index = ClusterIndex(client, schema)
        assert {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes)} == {"long": 512, "short": 3}
        fields = _fields_read(mirror_redis, lambda: index.lookup(0, hashes))
        assert fields == {"long": 512, "short": FIRST_CHUNK_BLOCKS}

        writer.delete(schema.lease("long"))  # dead: its 512 entries stay, but are not read past the first chunk
        before = _hmget_calls(mirror_redis)
        assert {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes)} == {"short": 3}
        assert _hmget_calls(mirror_redis) - before == FIRST_CHUNK_BLOCKS
    finally:
        client.close()
        writer.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_many_replicas_are_read_whole_and_agree_with_few(mirror_redis, protocol):
    """More live replicas than HMGET_MAX_FIELDS: entries are read whole (HGETALL, a map in RESP3 and a flat
    list in RESP2) until few still match, with the same answer, host-only blocks and stale values included."""
    schema = KeySchema("unit", "sha256_cbor")
    hashes = _hashes(300)
    writer = mirror_redis.client()
    want = {}
    for i in range(HMGET_MAX_FIELDS + 4):
        replica_id, held = f"r{i:02d}", 25 * i
        _publish(writer, schema, replica_id, 100 + i, hashes[:held])
        want[replica_id] = held
    writer.hset(schema.block(0, hashes[10]), "r11", "111:host")  # host-only: still counts
    writer.hset(schema.block(0, hashes[30]), "r10", "99")  # an earlier incarnation's entry: stops r10 at 30
    want["r10"] = 30
    if mirror_redis.topology == "single":
        client = redis.Redis(host="127.0.0.1", port=mirror_redis.port, protocol=protocol)
    else:
        client = redis.RedisCluster(host="127.0.0.1", port=mirror_redis.ports[0], protocol=protocol)
    try:
        index = ClusterIndex(client, schema)
        for _ in range(2):  # the first lookup discovers the replicas, the second reads them as known
            prefixes = index.lookup(0, hashes)
            assert {p.replica_id: p.num_cached_blocks for p in prefixes} == want
            assert {p.replica_id: p.num_host_blocks for p in prefixes} == {r: int(r == "r11") for r in want}
    finally:
        client.close()
        writer.close()


def _fields_read(server, lookup) -> Counter:
    """Per replica id, how many block entries `lookup()` read its field of: every node's MONITOR, until a marker."""
    with ExitStack() as stack:
        nodes = [stack.enter_context(closing(node)) for node in _node_clients(server)]
        monitors = [stack.enter_context(node.monitor()) for node in nodes]
        lookup()
        counts: Counter = Counter()
        for node, monitor in zip(nodes, monitors):
            node.echo("end-of-lookup")
            while True:
                words = monitor.next_command()["command"].split(" ")
                if words[0] == "ECHO" and words[1:] == ["end-of-lookup"]:
                    break
                if words[0] == "HMGET":
                    counts.update(words[2:])
        return counts


def test_lookup_raises_cluster_unavailable_when_redis_is_down(redis_server):
    # As the server builds its client (from the URL, short timeouts).
    client = redis.Redis.from_url(redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    index = ClusterIndex(client, KeySchema("unit", "sha256_cbor"))
    assert index.lookup(0, [b"\x00" * 32]) == []
    redis_server.kill()
    with pytest.raises(ClusterUnavailableError):
        index.lookup(0, [b"\x00" * 32])
    client.close()
