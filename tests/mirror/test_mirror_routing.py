"""The router's side: choose_replica, the key schema, and ClusterIndex.lookup against a real Redis."""

from __future__ import annotations

import hashlib
import itertools

import pytest
import redis

from kv_manager_service.mirror.lookup import ClusterIndex, ReplicaPrefix, choose_replica
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


class CountingRedis(redis.Redis):
    """Counts round trips: each pipeline execute or plain command is one."""

    round_trips = 0

    def pipeline(self, transaction=True, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        original = pipe.execute
        outer = self

        def execute(raise_on_error=True):
            outer.round_trips += 1
            return original(raise_on_error)

        pipe.execute = execute
        return pipe

    def execute_command(self, *args, **options):
        self.round_trips += 1
        return super().execute_command(*args, **options)


def _publish(client: redis.Redis, schema: KeySchema, replica_id: str, incarnation: int, hashes, usage=0.5, requests=1):
    client.set(schema.lease(replica_id), Lease(replica_id, incarnation, "x:1", requests, usage, 10).to_json(), px=60_000)
    client.sadd(schema.replicas, replica_id)
    for block_hash in hashes:
        client.hset(schema.block(0, block_hash), replica_id, str(incarnation))


def test_lookup_is_one_round_trip_and_stops_at_the_first_miss(redis_server):
    schema = KeySchema("unit", "sha256_cbor")
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(8)]
    writer = redis_server.client()
    _publish(writer, schema, "full", 11, hashes, usage=0.9)
    _publish(writer, schema, "gap", 22, hashes[:2] + hashes[3:])  # block 2 missing: stops there
    _publish(writer, schema, "stale", 33, hashes)
    writer.set(schema.lease("stale"), Lease("stale", 34, "x:1", 0, 0.0, 10).to_json())  # restarted: new incarnation
    _publish(writer, schema, "dead", 44, hashes)
    writer.delete(schema.lease("dead"))  # lease expired
    _publish(writer, schema, "other-group", 55, [])
    for block_hash in hashes:
        writer.hset(schema.block(1, block_hash), "other-group", "55")  # group 1 does not count for group 0
    KeySchema("elsewhere", "sha256_cbor")  # another namespace's entries must not count
    _publish(writer, KeySchema("elsewhere", "sha256_cbor"), "full", 11, hashes)

    client = CountingRedis(host="127.0.0.1", port=redis_server.port)
    try:
        index = ClusterIndex(client, schema)
        first = {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes)}
        assert first == {"full": 8, "gap": 2, "stale": 0, "other-group": 0}
        client.round_trips = 0
        prefixes = index.lookup(0, hashes)
        assert client.round_trips == 1, "a lookup with known replicas takes one pipelined round trip"
        assert {p.replica_id: p.num_cached_blocks for p in prefixes} == first
        assert choose_replica(prefixes) == "full"
        assert index.lookup(0, []) and {p.num_cached_blocks for p in index.lookup(0, [])} == {0}

        # A replica whose lease expires drops out; a new one is picked up.
        writer.delete(schema.lease("gap"))
        _publish(writer, schema, "newcomer", 66, hashes[:5])
        after = {p.replica_id: p.num_cached_blocks for p in index.lookup(0, hashes)}
        assert after == {"full": 8, "stale": 0, "other-group": 0, "newcomer": 5}
    finally:
        client.close()
        writer.close()


def test_lookup_raises_cluster_unavailable_when_redis_is_down(redis_server):
    # As the server builds its client (from the URL, short timeouts).
    client = redis.Redis.from_url(redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    index = ClusterIndex(client, KeySchema("unit", "sha256_cbor"))
    assert index.lookup(0, [b"\x00" * 32]) == []
    redis_server.kill()
    with pytest.raises(ClusterUnavailableError):
        index.lookup(0, [b"\x00" * 32])
    client.close()
