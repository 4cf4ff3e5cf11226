"""Malformed data in the mirror's Redis keys is skipped and counted, never raised.

Everything a replica reads from Redis is untrusted: here real managers run
against a real redis-server into which the test writes garbage (values that
are not leases, replica-set members that are not UTF-8, fields that name no
replica, keys of the wrong Redis type). Lookups keep answering, each
replica's heartbeat keeps (and repairs) its lease, the collector keeps
collecting, and GetStats and /metrics count what was skipped. The replica
factory fails any test whose managers logged a traceback.
"""

from __future__ import annotations

import json
import logging
import random
import urllib.request
from collections import Counter
from typing import Callable

import redis
from prometheus_client.parser import text_string_to_metric_families

from mirror_support import (
    BLOCK_SIZE,
    CONVERGE_TIMEOUT_S,
    ManagerProcess,
    namespace,
    prompt,
    wait_until,
)
from processes import log_records

from kv_manager_service.broadcast_log import BroadcastLog
from kv_manager_service.mirror.schema import KeySchema, Lease
from kv_manager_service.mirror.writer import MirrorOptions, MirrorWriter

COLLECT_FAST = ["--redis-collect-interval-s", "0.5", "--redis-collect-after-s", "1"]
WITH_METRICS = ["--metrics-port", "0"]
STALE_INCARNATION = b"1"  # older than any replica's (a start time in ns)


def malformed_on_metrics(replica: ManagerProcess) -> dict[str, float]:
    """kvcache_mirror_malformed_total by kind, scraped from the replica's /metrics."""
    url = next(r["metrics_url"] for r in log_records(replica.process) if "metrics_url" in r)
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families["kvcache_mirror_malformed"]
    assert family.type == "counter"
    return {s.labels["kind"]: s.value for s in family.samples if s.name == "kvcache_mirror_malformed_total"}


def start_pair(replicas, redis_server, extra=()) -> tuple[ManagerProcess, ManagerProcess]:
    return tuple(replicas.start_many([
        dict(replica_id="replica-a", redis_url=redis_server.url, extra=[*WITH_METRICS, *extra]),
        dict(replica_id="replica-b", redis_url=redis_server.url, extra=[*WITH_METRICS, *extra]),
    ]))  # fmt: skip


def lease_of(client, ns: str, replica_id: str) -> tuple[dict | None, int]:
    """The replica's lease as JSON (None when absent or not JSON) and its remaining TTL in ms."""
    try:
        value = client.get(f"{ns}:lease:{replica_id}")
        lease = json.loads(value) if value is not None else None
    except (ValueError, redis.ResponseError):  # not JSON, or a key of another type: not a lease (yet)
        lease = None
    return lease, client.pttl(f"{ns}:lease:{replica_id}")


def test_garbage_leases_and_replica_members_leave_cluster_lookups_answering(mirror_redis, replicas):
    a, b = start_pair(replicas, mirror_redis)
    tokens = prompt(300, 3 * BLOCK_SIZE + 1)
    a.cache("a", tokens)
    wait_until(lambda: b.cluster(tokens), lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 0},
               CONVERGE_TIMEOUT_S, "replica-b to see replica-a's prefix")  # fmt: skip

    ns = namespace()
    client = mirror_redis.client()
    try:
        client.sadd(f"{ns}:replicas", "ghost-json", "ghost-hash", b"\xff\xfe not utf-8")
        client.set(f"{ns}:lease:ghost-json", b"{not json", px=60_000)
        client.hset(f"{ns}:lease:ghost-hash", "incarnation", "1")
    finally:
        client.close()

    for replica in (a, b):  # every lookup answers OK, with the live replicas only
        for _ in range(3):
            assert replica.cluster(tokens) == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 0}
    stats = b.stats()
    assert stats.mirror_malformed >= 3 and stats.mirror_failures == 0 and not stats.mirror_fenced
    assert stats.mirror_errors == 0  # all of it was expected: skipped and counted, nothing raised
    by_kind = malformed_on_metrics(b)
    assert by_kind["lease"] >= 1 and by_kind["replica_member"] >= 1 and by_kind["key_type"] >= 1, by_kind
    assert sum(by_kind.values()) == b.stats().mirror_malformed


def test_garbage_at_a_replicas_own_lease_is_overwritten_by_its_next_renewal(redis_server, replicas):
    a, b = start_pair(replicas, redis_server)
    tokens = prompt(310, 2 * BLOCK_SIZE + 1)
    a.cache("a", tokens)
    expected = {"replica-a": 2 * BLOCK_SIZE, "replica-b": 0}
    wait_until(lambda: b.cluster(tokens), lambda got: got == expected, CONVERGE_TIMEOUT_S, "replica-b to see replica-a")

    ns = namespace()
    client = redis_server.client()
    try:
        for garbage in (lambda key: client.set(key, b"\x00garbage{"),  # not JSON, and no TTL
                        lambda key: client.set(key, json.dumps({"incarnation": 1.5})),  # names no incarnation
                        lambda key: (client.delete(key), client.hset(key, "incarnation", a.incarnation))):  # a hash
            garbage(f"{ns}:lease:replica-a")
            lease, ttl_ms = wait_until(
                lambda: lease_of(client, ns, "replica-a"),
                lambda got: got[0] is not None and got[0].get("incarnation") == a.incarnation and got[1] > 0,
                CONVERGE_TIMEOUT_S, "replica-a's heartbeat to write its lease again",
            )  # fmt: skip
            wait_until(lambda: b.cluster(tokens), lambda got: got == expected, CONVERGE_TIMEOUT_S,
                       "replica-b to see replica-a again")  # fmt: skip
    finally:
        client.close()
    stats = a.stats()
    assert not stats.mirror_fenced and stats.mirror_malformed >= 3
    assert malformed_on_metrics(a)["lease"] >= 2 and malformed_on_metrics(a)["key_type"] >= 1


def test_the_collector_collects_past_malformed_leases_fields_and_keys(redis_server, replicas):
    a, b = start_pair(replicas, redis_server, COLLECT_FAST)
    a.cache("a", prompt(320, 2 * BLOCK_SIZE + 1))
    ns = namespace()
    client = redis_server.client()
    try:
        wait_until(lambda: client.exists(f"{ns}:lease:replica-a", f"{ns}:lease:replica-b"), lambda n: n == 2,
                   CONVERGE_TIMEOUT_S, "both leases")  # fmt: skip
        client.sadd(f"{ns}:replicas", "ghost", b"\xff")
        client.set(f"{ns}:lease:ghost", b"\xff not a lease")
        client.set(f"{ns}:block:0:{'ab' * 32}", b"a string at a block key")
        client.hset(f"{ns}:block:0:{'cd' * 32}", mapping={b"\xfe\xff": b"1", "replica-b": b"not an incarnation"})
        stale_key = f"{ns}:block:0:{'ef' * 32}"
        client.hset(stale_key, "replica-b", STALE_INCARNATION)  # an earlier incarnation's field: collected

        def junk_left() -> dict:
            return {
                "stale field": client.hexists(stale_key, "replica-b"),
                "string block key": client.exists(f"{ns}:block:0:{'ab' * 32}"),
                "fields of the odd key": client.hgetall(f"{ns}:block:0:{'cd' * 32}"),
                "non-utf-8 member": client.sismember(f"{ns}:replicas", b"\xff"),
            }

        wait_until(junk_left, lambda left: not any(left.values()), CONVERGE_TIMEOUT_S,
                   "the collector to remove the stale field and the junk")  # fmt: skip
    finally:
        client.close()
    assert a.stats().mirror_failures == 0 and b.stats().mirror_failures == 0
    counted = [malformed_on_metrics(r) for r in (a, b)]
    assert sum(c["key_type"] for c in counted) >= 1 and sum(c["block_field"] for c in counted) >= 2, counted
    assert sum(c["replica_member"] for c in counted) >= 1 and sum(c["lease"] for c in counted) >= 1, counted


# -- fuzz ------------------------------------------------------------------------------------------

FUZZ_ROUNDS = 150  # a few seconds on 2 cores, lookups included


def random_bytes(rng: random.Random) -> bytes:
    choices = [
        lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))),
        lambda: b"",
        lambda: b"[" * rng.randrange(1, 4000),
        lambda: json.dumps(rng.choice([[1, 2], {"incarnation": -1}, {"incarnation": "12"}, {"incarnation": 2.5},
                                       {"incarnation": 7, "usage": "high"}, {"incarnation": 7, "address": 3},
                                       {"incarnation": True}, None, "x"])).encode(),
        lambda: b"1" * rng.randrange(1, 50) + rng.choice([b"", b":host", b":"]),
    ]  # fmt: skip
    return rng.choice(choices)()


def corrupt(client, rng: random.Random, key: bytes | str) -> None:
    """Write random bytes, or a value of a random Redis type, at `key` (replacing what it holds, or adding to it)."""
    kind = rng.choice(["string", "hash", "set", "list", "zset", "add"])
    writes = client.pipeline(transaction=True)  # MULTI: the replicas write these keys too, meanwhile
    if kind == "add":  # to what is there, whatever its type
        kind = {b"hash": "hash", b"set": "set"}.get(client.type(key), "string")
    else:
        writes.delete(key)
    if kind == "string":
        writes.set(key, random_bytes(rng))
    elif kind == "hash":
        writes.hset(key, random_bytes(rng) or b"f", random_bytes(rng))
    elif kind == "set":
        writes.sadd(key, random_bytes(rng) or b"m")
    elif kind == "list":
        writes.rpush(key, random_bytes(rng))
    else:
        writes.zadd(key, {random_bytes(rng) or b"z": 1.0})
    try:
        writes.execute()
    except redis.ResponseError as error:  # added to a key a replica rewrote with another type since: leave it
        assert str(error).startswith("WRONGTYPE"), error


def test_fuzzed_mirror_keys_never_stop_lookups_heartbeats_or_collections(redis_server, replicas):
    a, b = start_pair(replicas, redis_server, COLLECT_FAST)
    tokens = prompt(330, 3 * BLOCK_SIZE + 1)
    a.cache("a", tokens)
    b.cache("b", tokens)
    ns = namespace()
    client = redis_server.client()
    rng = random.Random(20240917)
    try:
        wait_until(lambda: b.cluster(tokens), lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 3 * BLOCK_SIZE},
                   CONVERGE_TIMEOUT_S, "both replicas to see both prefixes")  # fmt: skip
        real_block_keys = sorted(client.scan_iter(match=f"{ns}:block:*"))
        patterns = [  # every key pattern of mirror/schema.py
            lambda: rng.choice(real_block_keys),
            lambda: f"{ns}:block:{rng.randrange(3)}:{rng.randbytes(32).hex()}",
            lambda: f"{ns}:lease:{rng.choice(['replica-a', 'replica-b', 'ghost'])}",
            lambda: f"{ns}:replicas",
            lambda: f"{ns}:collector",
        ]
        for round_number in range(FUZZ_ROUNDS):
            corrupt(client, rng, rng.choice(patterns)())
            if round_number % 3 == 0:  # lookups answer OK throughout (an RPC error fails the test here)
                for replica in (a, b):
                    replica.cluster(tokens)

        # Heartbeats renew: both leases are leases with a TTL again, in the replica set, and each replica sees the other.
        for replica_id, replica in (("replica-a", a), ("replica-b", b)):
            wait_until(lambda: lease_of(client, ns, replica_id),
                       lambda got: got[0] is not None and got[0].get("incarnation") == replica.incarnation and got[1] > 0,
                       CONVERGE_TIMEOUT_S, f"{replica_id}'s lease to be renewed")  # fmt: skip
            wait_until(lambda: client.type(f"{ns}:replicas") == b"set" and client.sismember(f"{ns}:replicas", replica_id),
                       bool, CONVERGE_TIMEOUT_S, f"{replica_id} to be in the replica set again")  # fmt: skip
        fresh = prompt(331, 2 * BLOCK_SIZE + 1)
        a.cache("fresh-a", fresh)
        b.cache("fresh-b", fresh)
        for replica in (a, b):
            wait_until(lambda: replica.cluster(fresh),
                       lambda got: got == {"replica-a": 2 * BLOCK_SIZE, "replica-b": 2 * BLOCK_SIZE},
                       CONVERGE_TIMEOUT_S, "each replica to see both fresh prefixes")  # fmt: skip

        # The collector collects: a stale field is removed.
        stale_key = f"{ns}:block:0:{rng.randbytes(32).hex()}"
        client.hset(stale_key, "replica-a", STALE_INCARNATION)
        wait_until(lambda: client.hexists(stale_key, "replica-a"), lambda held: not held, CONVERGE_TIMEOUT_S,
                   "the collector to remove a stale field after the fuzzing")  # fmt: skip
    finally:
        client.close()
    for replica in (a, b):
        on_metrics = sum(malformed_on_metrics(replica).values())  # first: the counts only grow
        stats = replica.stats()
        assert not stats.mirror_fenced
        assert stats.mirror_malformed >= on_metrics > 0


# -- the writer's threads, in process ---------------------------------------------------------------


class ThreadKilled(BaseException):
    """Not an Exception: what the mirror's loops do not catch (as they let a SystemExit through)."""


def in_process_writer(redis_server, lease: Callable[[], Lease]) -> MirrorWriter:
    return MirrorWriter(
        redis_server.client(), KeySchema("thread-test", "sha256_cbor"), "replica-t", 1, BroadcastLog(16),
        lambda: (Counter(), None, 0), lease, MirrorOptions(lease_ttl_s=0.3),
    )  # fmt: skip


def test_the_heartbeat_survives_exceptions_from_its_work(redis_server):
    calls = []

    def lease() -> Lease:
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("no lease yet")
        return Lease("replica-t", 1, "127.0.0.1:1", 0, 0.0, 1)

    writer = in_process_writer(redis_server, lease)
    writer.start()
    try:
        wait_until(lambda: writer.client.get(writer.schema.lease("replica-t")), bool, CONVERGE_TIMEOUT_S,
                   "the heartbeat to claim the lease after two failed beats")  # fmt: skip
        assert writer.metrics.num_errors == 2 and writer.dead_thread is None
    finally:
        writer.stop()
        writer.client.close()


def test_a_mirror_thread_that_dies_is_named_logged_and_reported(redis_server, caplog):
    def lease() -> Lease:
        raise ThreadKilled("the lease could not be built")

    writer = in_process_writer(redis_server, lease)
    deaths: list[tuple[str, type]] = []
    writer.on_thread_death = lambda name, error: deaths.append((name, type(error)))
    with caplog.at_level(logging.CRITICAL, logger="kv_manager_service.mirror.writer"):
        writer.start()
        try:
            wait_until(lambda: list(deaths), bool, CONVERGE_TIMEOUT_S, "the heartbeat's death to be reported")
        finally:
            writer.stop()
            writer.client.close()
    assert deaths == [("mirror-heartbeat", ThreadKilled)] and writer.dead_thread == "mirror-heartbeat"
    assert any("thread mirror-heartbeat died" in r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL)


def test_a_block_key_parses_back_and_anything_else_is_refused():
    schema = KeySchema("ns:with:colons", "sha256_cbor")
    block_hash = bytes(range(32))
    assert schema.parse_block(schema.block(3, block_hash).encode()) == (3, block_hash)
    other = KeySchema("ns", "sha256_cbor")
    for key in (other.block(3, block_hash), "ns:with:colons:block:x:00", "ns:with:colons:block:3:zz",
                "ns:with:colons:block:3:abc", "ns:with:colons:lease:r"):  # fmt: skip
        assert schema.parse_block(key.encode()) is None, key
