"""The mirror writer in-process, against a real Redis, with exact control over when a write is lost.

A stand-in pool (counts of cached hashes, and the bounded event log the
service keeps) feeds a real `MirrorWriter`. A Redis client wrapper can make
one batch of the writer land in Redis and then fail as if its reply had
been lost (a timeout against a slow Redis), running a callback in between,
so the races the writer must survive happen on cue. After every scenario
Redis must hold exactly the pool's cached set: the issue's "the mirror
converges to exactly what the pool holds".
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
import tracemalloc
from collections import Counter
from typing import Callable, Iterable, Iterator

import hiredis
import pytest
import redis

from kv_manager_service.broadcast_log import BroadcastLog
from kv_manager_service.core.host_index import HostIndex, HostKeys
from kv_manager_service.shared.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from kv_manager_service.mirror import bulk
from kv_manager_service.mirror import publisher as publisher_module
from kv_manager_service.mirror.connect import RedisEndpoint, connect
from kv_manager_service.mirror.publisher import EntryPublisher
from kv_manager_service.mirror.publisher_process import PublisherProcess
from kv_manager_service.mirror.writer import MirrorOptions, MirrorWriter
from kv_manager_service.server.memory_budget import MIRROR_HOST_BYTES_PER_BLOCK, MIRROR_HOST_TRANSIENT_BYTES_PER_BLOCK
from kv_manager_service.mirror.schema import KeySchema, Lease, ReplicaIdInUseError
from mirror_support import replica_block_set, wait_until
from processes import exited

REPLICA = "writer-under-test"
INCARNATION = 1_700_000_000_000_000_001
SCHEMA = KeySchema("writer-test", "sha256_cbor")
CONVERGE_S = 5.0


def h(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


HOST_CAPACITY = 64
"""The stand-in pools' host tier: blocks it can hold."""


def host_keys(keys: Iterable[tuple[int, bytes]]) -> HostKeys:
    """The compact copy of a host index holding `keys`, as a replica's snapshot gives it."""
    index = HostIndex(HOST_CAPACITY, 8, 32)
    for block_id, (group_id, block_hash) in enumerate(keys):
        index.insert(block_id, group_id, block_hash)
    group_ids, hashes, _ = index.columns()
    return HostKeys(group_ids, hashes, 32, HOST_CAPACITY)


class StandInPool:
    """The cached-hash counts of a pool and its event log, updated together under one lock."""

    def __init__(self, retention: int = 100_000) -> None:
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.events: BroadcastLog = BroadcastLog(retention)

    def _log(self, event) -> None:
        self.events.append((time.monotonic_ns(), event))

    def store(self, *hashes: bytes) -> None:
        with self.lock:
            self.counts.update(hashes)
            self._log(BlockStored(0, tuple(hashes), None, 16))

    def remove(self, *hashes: bytes) -> None:
        with self.lock:
            for block_hash in hashes:
                assert self.counts[block_hash] > 0
                self.counts[block_hash] -= 1
                if not self.counts[block_hash]:
                    del self.counts[block_hash]
            self._log(BlockRemoved(0, tuple(hashes)))

    def clear(self) -> None:
        with self.lock:
            self.counts.clear()
            self._log(AllBlocksCleared())

    def snapshot(self) -> tuple[Counter, HostKeys, int]:
        with self.lock:
            counts = Counter({(0, block_hash): n for block_hash, n in self.counts.items()})
            return counts, host_keys(()), self.events.last_id

    def cached(self) -> set[bytes]:
        with self.lock:
            return set(self.counts)


class LosingRedis(redis.Redis):
    """A client whose next matching writer batch lands, runs `then`, and fails as a lost reply.

    With `land=False` the batch fails before reaching Redis instead (a dropped connection).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trap: tuple | None = None
        self.sprung = threading.Event()

    def set_trap(
        self,
        matches: Callable[[list[tuple]], bool],
        then: Callable[[], None],
        fail: bool = True,
        land: bool = True,
        thread: str = "mirror-writer",
        before: Callable[[], None] | None = None,
    ) -> None:
        """Trap the next pipeline of `thread` that `matches`: run `before`, send it (if `land`),
        run `then`, and raise (if `fail`)."""
        self.sprung.clear()
        self.trap = (matches, then, fail, land, thread, before)

    def run_bulk(self, commands: list[bytes], send: Callable[[], list]) -> list:
        """One bulk write of this client (mirror.bulk.execute; `send` runs it), through the trap if it matches."""
        trap = self.trap
        if trap is None or threading.current_thread().name != trap[4] or not trap[0]([_args(c) for c in commands]):
            return send()
        self.trap = None
        matches, then, fail, land, _, before = trap
        if before is not None:
            before()
        if not land:
            then()
            self.sprung.set()
            raise redis.ConnectionError("injected: the connection dropped before the pipeline was sent")
        result = send()  # the commands run in Redis ...
        then()  # ... the pool moves on meanwhile ...
        self.sprung.set()
        if fail:
            raise redis.TimeoutError("injected: the reply was lost after Redis ran the pipeline")
        return result


def _args(packed: bytes) -> tuple[str, ...]:
    """A command packed in RESP, as its arguments."""
    reader = hiredis.Reader()
    reader.feed(packed)
    return tuple(arg.decode() for arg in reader.gets())


def hsets(block_hash: bytes) -> Callable[[list[tuple]], bool]:
    key = SCHEMA.block(0, block_hash)
    return lambda commands: any(args[0] == "HSET" and args[1] == key for args in commands)


def hdels(block_hash: bytes) -> Callable[[list[tuple]], bool]:
    key = SCHEMA.block(0, block_hash)
    return lambda commands: any(args[0] == "HDEL" and args[1] == key for args in commands)


@pytest.fixture
def rig(redis_server, monkeypatch) -> Iterator[Callable[..., tuple[MirrorWriter, StandInPool, LosingRedis]]]:
    made: list[tuple[MirrorWriter, redis.Redis]] = []
    real_execute = bulk.execute

    def execute(client, keys, commands):  # the writer's batches go out through mirror.bulk
        def send():
            return real_execute(client, keys, commands)

        return client.run_bulk(commands, send) if isinstance(client, LosingRedis) else send()

    monkeypatch.setattr(bulk, "execute", execute)

    def make(pool: StandInPool | None = None, start: bool = True):
        pool = pool or StandInPool()
        client = LosingRedis.from_url(redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        lease = Lease(REPLICA, INCARNATION, "127.0.0.1:1", 0, 0.0, 1)
        writer = MirrorWriter(
            client, SCHEMA, REPLICA, INCARNATION, pool.events, pool.snapshot, lambda: lease,
            MirrorOptions(lease_ttl_s=1.0, retry_backoff_s=0.05, max_retry_backoff_s=0.2),
        )
        made.append((writer, client))
        if start:
            writer.start()
        return writer, pool, client

    yield make
    for writer, client in made:
        writer.stop()
        client.close()


def mirrored(redis_server) -> set[bytes]:
    client = redis_server.client()
    try:
        return replica_block_set(client, SCHEMA.namespace, REPLICA, INCARNATION)
    finally:
        client.close()


def wait_converged(redis_server, pool: StandInPool, writer: MirrorWriter) -> None:
    def probe():
        got = mirrored(redis_server)
        want = pool.cached()
        return {"stale": {x.hex()[:8] for x in got - want}, "missing": {x.hex()[:8] for x in want - got},
                "queue_depth": writer.metrics.queue_depth, "resync_pending": writer._resync}

    wait_until(probe, lambda d: not d["stale"] and not d["missing"] and d["queue_depth"] == 0 and not d["resync_pending"],
               CONVERGE_S, "Redis to hold exactly the pool's cached set")


DEVICE_ENTRY = str(INCARNATION)
HOST_ENTRY = f"{INCARNATION}:host"


def entries(redis_server) -> dict[str, str]:
    """Every block entry of the replica in Redis: its key -> the value of the replica's field."""
    client = redis_server.client()
    try:
        found = {}
        for key in client.scan_iter(match=f"{SCHEMA.namespace}:block:*"):
            value = client.hget(key, REPLICA)
            if value is not None:
                found[key.decode()] = value.decode()
        return found
    finally:
        client.close()


def wait_written(pool: StandInPool, writer: MirrorWriter) -> None:
    """Until the writer has written every event logged so far."""
    wait_until(lambda: writer._next_sequence, lambda n: n > pool.events.last_id, CONVERGE_S,
               "the writer to write every logged event")  # fmt: skip


def test_events_of_both_tiers_give_exactly_these_redis_entries(redis_server, rig):
    """Events in, the exact Redis contents out: per-tier counts, a device entry wins over a host copy,
    demotion rewrites, the last copy's removal deletes, and a clear drops every key of both tiers."""
    writer, pool, _ = rig()
    wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the first publication")

    def log(*events) -> None:
        for event in events:
            pool._log(event)
        wait_written(pool, writer)

    def key(group_id: int, i: int) -> str:
        return SCHEMA.block(group_id, h(i))

    log(BlockStored(0, (h(1), h(2)), None, 16),
        BlockStored(0, (h(2),), None, 16),  # a second device block carries h(2)
        BlockStored(1, (h(1),), None, 16),  # another group's block with the same hash: another key
        BlockStored(0, (h(3),), None, 0, Tier.HOST),
        BlockStored(0, (h(1),), None, 0, Tier.HOST))  # fmt: skip
    assert entries(redis_server) == {key(0, 1): DEVICE_ENTRY, key(0, 2): DEVICE_ENTRY, key(1, 1): DEVICE_ENTRY,
                                     key(0, 3): HOST_ENTRY}  # fmt: skip
    log(BlockRemoved(0, (h(1),)),  # only its host copy is left
        BlockRemoved(0, (h(2),)),  # one of two device copies
        BlockStored(0, (h(3),), None, 16),  # onloaded
        BlockRemoved(1, (h(1),)))  # fmt: skip
    assert entries(redis_server) == {key(0, 1): HOST_ENTRY, key(0, 2): DEVICE_ENTRY, key(0, 3): DEVICE_ENTRY}
    log(BlockRemoved(0, (h(2),)),
        BlockRemoved(0, (h(3),), Tier.HOST),  # its device block still carries it
        BlockRemoved(0, (h(1),), Tier.HOST),
        BlockStored(0, (h(4),), None, 16),
        BlockRemoved(0, (h(4),)))  # fmt: skip
    assert entries(redis_server) == {key(0, 3): DEVICE_ENTRY}
    log(BlockStored(2, (h(5),), None, 0, Tier.HOST), AllBlocksCleared(), BlockStored(0, (h(6),), None, 0, Tier.HOST))
    assert entries(redis_server) == {key(0, 6): HOST_ENTRY}
    assert writer.metrics.num_failures == 0 and writer.metrics.num_resyncs == 1


class TieredPool(StandInPool):
    """A stand-in pool whose snapshot also names the keys its host tier holds."""

    def __init__(self, host: set[bytes]) -> None:
        super().__init__()
        self.host = host

    def snapshot(self) -> tuple[Counter, HostKeys, int]:
        counts, _, last_id = super().snapshot()
        return counts, host_keys((0, block_hash) for block_hash in self.host), last_id


def test_a_republication_writes_both_tiers_exactly_and_deletes_the_rest(redis_server, rig):
    stale = SCHEMA.block(0, h(9))
    admin = redis_server.client()
    try:
        pool = TieredPool(host={h(1), h(2)})
        pool.store(h(1), h(1), h(3))
        writer, pool, _ = rig(pool, start=False)
        writer.publisher.republish({}, host_keys([(0, h(9))]))  # an earlier life of this writer's, no longer held
        admin.hset(stale, REPLICA, HOST_ENTRY)
        writer.start()
        wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the first publication")
        assert entries(redis_server) == {SCHEMA.block(0, h(1)): DEVICE_ENTRY, SCHEMA.block(0, h(2)): HOST_ENTRY,
                                         SCHEMA.block(0, h(3)): DEVICE_ENTRY}  # fmt: skip
    finally:
        admin.close()


def test_a_republication_streams_pages_and_one_failed_part_way_is_swept_clean(redis_server, monkeypatch):
    """Pages of 3 writes: a republication of 40 keys makes many round trips and is exact; one that fails in
    its first page has already forgotten the keys it drops, so the next republication sweeps them."""
    monkeypatch.setattr(publisher_module, "WRITE_PAGE_KEYS", 3)
    client = redis_server.client()
    publisher = EntryPublisher(client, SCHEMA, REPLICA, str(INCARNATION))
    sent = []
    real_execute = bulk.execute

    def execute(client, keys, commands):
        sent.append(len(commands))
        if fail_at == len(sent):
            raise redis.ConnectionError("injected: the connection dropped")
        return real_execute(client, keys, commands)

    monkeypatch.setattr(bulk, "execute", execute)
    try:
        device = Counter({(0, h(i)): 1 for i in range(10)})
        host = [(0, h(i)) for i in range(5, 45)]  # h(5)..h(9) are on both tiers: device entries
        fail_at = None
        assert publisher.republish(device, host_keys(host)) == (45, 35)
        expected = {SCHEMA.block(0, h(i)): DEVICE_ENTRY for i in range(10)}
        expected |= {SCHEMA.block(0, h(i)): HOST_ENTRY for i in range(10, 45)}
        assert entries(redis_server) == expected and max(sent) <= 3 + 2 and len(sent) >= 15

        sent.clear()
        fail_at = 1
        with pytest.raises(redis.ConnectionError):
            publisher.republish(Counter(), host_keys(host[:20]))  # drops h(25)..h(44), then the first page fails
        assert entries(redis_server) == expected  # nothing landed
        fail_at = None
        assert publisher.republish(Counter(), host_keys(host[:20])) == (20, 20)
        assert entries(redis_server) == {SCHEMA.block(0, h(i)): HOST_ENTRY for i in range(5, 25)}

        publisher.apply([AllBlocksCleared(), BlockStored(0, (h(50),), None, 0, Tier.HOST)])  # a clear, in pages
        assert entries(redis_server) == {SCHEMA.block(0, h(50)): HOST_ENTRY}
    finally:
        client.close()


def test_a_batch_the_publisher_refuses_leaves_the_next_republication_to_sweep(redis_server):
    client = redis_server.client()
    publisher = EntryPublisher(client, SCHEMA, REPLICA, str(INCARNATION))
    try:
        publisher.republish(Counter({(0, h(1)): 1}), None)  # a replica without a host tier
        with pytest.raises(ValueError, match="host-tier event from a replica whose snapshot had no host tier"):
            publisher.apply([BlockRemoved(0, (h(1),)), BlockStored(0, (h(2),), None, 0, Tier.HOST)])
        assert entries(redis_server) == {SCHEMA.block(0, h(1)): DEVICE_ENTRY}  # the removal was never written
        publisher.republish(Counter(), None)
        assert entries(redis_server) == {}
    finally:
        client.close()


def test_duplicate_hashes_are_counted_and_a_clear_then_store_in_one_batch_is_exact(redis_server, rig):
    writer, pool, _ = rig()
    wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the first publication")
    pool.store(h(1), h(2))
    pool.store(h(2))  # the cache does not de-duplicate: two blocks carry h(2)
    pool.remove(h(2))
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(1), h(2)}
    pool.remove(h(2))
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(1)}
    # Many changes in one batch: the writer must apply their net effect.
    with pool.lock:  # hold the writer off so they all land in the same batch
        pool.counts.update([h(3)])
        pool._log(BlockStored(0, (h(3),), None, 16))
        pool.counts.clear()
        pool._log(AllBlocksCleared())
        pool.counts.update([h(3), h(4)])
        pool._log(BlockStored(0, (h(3), h(4)), None, 16))
        pool.counts.subtract([h(4)])
        del pool.counts[h(4)]
        pool._log(BlockRemoved(0, (h(4),)))
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(3)}
    assert writer.metrics.num_failures == 0


def test_a_lost_reply_to_a_delta_batch_is_cleaned_up_by_the_resync(redis_server, rig):
    writer, pool, client = rig()
    wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the first publication")
    client.set_trap(hsets(h(7)), then=lambda: pool.remove(h(7)))  # evicted while the reply was lost
    pool.store(h(6))
    pool.store(h(7))
    assert client.sprung.wait(CONVERGE_S)
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(6)}
    assert writer.metrics.num_failures >= 1 and writer.metrics.num_resyncs >= 2


def test_a_delta_batch_that_never_reached_redis_still_gets_its_removals_done(redis_server, rig):
    """The batch that removes h(7) fails before Redis sees it: h(7) is in Redis, no longer in
    the pool, and no longer among the writer's published counts. The resync must delete it."""
    writer, pool, client = rig()
    pool.store(h(6), h(7))
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(6), h(7)}
    client.set_trap(hdels(h(7)), then=lambda: None, land=False)
    pool.remove(h(7))
    assert client.sprung.wait(CONVERGE_S)
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(6)}
    assert writer.metrics.num_failures >= 1


def test_a_lost_reply_to_a_republication_is_cleaned_up_by_the_next_one(redis_server, rig):
    """The republication's own writes may have landed too, as a delta batch's may.

    The pool caches h(9) while the writer must resync; the republication
    that writes h(9) reaches Redis but its reply is lost (a slow Redis), and
    h(9) is evicted before the retry. The retry must delete h(9): it is not
    in the pool, and Redis holds it under this live incarnation.
    """
    pool = StandInPool()
    pool.store(h(8), h(9))
    writer, pool, client = rig(pool, start=False)
    client.set_trap(hsets(h(9)), then=lambda: pool.remove(h(9)))
    writer.start()
    assert client.sprung.wait(CONVERGE_S)
    wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the retried publication")
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(8)}


def test_falling_behind_the_bounded_log_resyncs_instead_of_growing(redis_server, rig):
    pool = StandInPool(retention=8)
    writer, pool, client = rig(pool)
    wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the first publication")

    def burst() -> None:  # while a write is in flight, 60 events: far past the log's 8
        for i in range(100, 130):
            pool.store(h(i))
        for i in range(100, 125):
            pool.remove(h(i))
        pool.clear()
        for i in range(200, 205):
            pool.store(h(i))

    client.set_trap(hsets(h(10)), then=burst, fail=False)
    pool.store(h(10))
    assert client.sprung.wait(CONVERGE_S)
    assert len(pool.events._entries) <= 8
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(i) for i in range(200, 205)}
    assert writer.metrics.num_resyncs >= 2


def test_a_flushed_redis_is_noticed_by_the_heartbeat_and_republished(redis_server, rig):
    """No write fails (nothing changes in the pool), yet Redis lost everything: the vanished lease tells."""
    pool = StandInPool()
    pool.store(h(11), h(12))
    writer, pool, _ = rig(pool)
    wait_converged(redis_server, pool, writer)
    admin = redis_server.client()
    try:
        # Once the first heartbeat has written the lease (the next test covers the time before).
        wait_until(lambda: admin.exists(SCHEMA.lease(REPLICA)), bool, CONVERGE_S, "the first lease")
        admin.flushall()
    finally:
        admin.close()
    wait_converged(redis_server, pool, writer)
    assert mirrored(redis_server) == {h(11), h(12)}
    assert writer.metrics.num_resyncs >= 2


def test_writer_writes_nothing_under_another_incarnations_lease(redis_server, rig):
    """Another incarnation keeps the lease alive (a twin with this replica id): the writer never
    writes, refuses a start that waits for the lease, is fenced by its heartbeat, and its stop
    leaves the other's lease in place."""
    other = Lease(REPLICA, INCARNATION + 1, "127.0.0.1:2", 0, 0.0, 1).to_json()
    admin = redis_server.client()
    try:
        admin.set(SCHEMA.lease(REPLICA), other, px=60_000)
        pool = StandInPool()
        pool.store(h(15), h(16))
        writer, pool, _ = rig(pool, start=False)
        with pytest.raises(ReplicaIdInUseError, match=f"replica id '{REPLICA}' is held by another live manager"):
            writer.claim_at_start()
        writer.start()
        wait_until(lambda: writer.metrics.fenced, bool, CONVERGE_S, "the writer to be fenced")
        pool.store(h(17))
        writer.stop()
        assert not list(admin.scan_iter(match=f"{SCHEMA.namespace}:block:*"))
        assert admin.get(SCHEMA.lease(REPLICA)) == other.encode()
    finally:
        admin.close()


# -- the publisher in a process of its own (the server's default) ----------------------------------------


@pytest.fixture
def process_writer(mirror_redis) -> Iterator[Callable[[StandInPool], MirrorWriter]]:
    """A started writer whose publisher is a PublisherProcess, on either topology."""
    made: list[MirrorWriter] = []

    def make(pool: StandInPool) -> MirrorWriter:
        lease = Lease(REPLICA, INCARNATION, "127.0.0.1:1", 0, 0.0, 1)
        endpoint = RedisEndpoint(mirror_redis.url, timeout_s=1.0)
        client = connect(endpoint)
        writer = MirrorWriter(
            client, SCHEMA, REPLICA, INCARNATION, pool.events, pool.snapshot, lambda: lease,
            MirrorOptions(lease_ttl_s=1.0, retry_backoff_s=0.05, max_retry_backoff_s=0.2),
            PublisherProcess(endpoint, SCHEMA, REPLICA, str(INCARNATION)),
        )  # fmt: skip
        made.append(writer)
        writer.start()
        return writer

    yield make
    for writer in made:
        writer.stop()
        writer.client.close()


def test_a_writer_process_gives_exactly_the_entries_of_both_tiers(mirror_redis, process_writer):
    pool = TieredPool(host={h(1), h(2)})
    pool.store(h(1), h(3))
    writer = process_writer(pool)
    wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the first publication")
    pool._log(BlockStored(0, (h(4),), None, 0, Tier.HOST))
    pool._log(BlockRemoved(0, (h(1),)))  # its host copy is left
    pool._log(BlockStored(0, (h(2),), None, 16))  # onloaded
    wait_written(pool, writer)
    assert entries(mirror_redis) == {SCHEMA.block(0, h(1)): HOST_ENTRY, SCHEMA.block(0, h(2)): DEVICE_ENTRY,
                                     SCHEMA.block(0, h(3)): DEVICE_ENTRY, SCHEMA.block(0, h(4)): HOST_ENTRY}  # fmt: skip
    assert writer.publisher.num_starts == 1 and writer.metrics.num_failures == 0


def test_a_killed_writer_process_is_replaced_and_the_entries_it_published_are_swept(mirror_redis, process_writer):
    """The new process does not know what the dead one published: only its sweep deletes the entries
    of blocks the pool dropped while no process was running."""
    pool = StandInPool()
    writer = process_writer(pool)
    pool.store(*(h(i) for i in range(20)))
    wait_converged(mirror_redis, pool, writer)
    dead_pid = writer.publisher.pid
    os.kill(dead_pid, signal.SIGKILL)
    wait_until(lambda: exited(dead_pid), bool, CONVERGE_S, "the writer process to die")
    pool.remove(*(h(i) for i in range(10)))  # the batch that meets the dead process
    pool.store(h(20))
    wait_until(lambda: writer.publisher.num_starts, lambda n: n == 2, CONVERGE_S, "a new writer process")
    wait_converged(mirror_redis, pool, writer)
    assert writer.publisher.pid != dead_pid and writer.metrics.num_failures >= 1
    pool.remove(h(10))  # the new process follows the deltas
    wait_converged(mirror_redis, pool, writer)


def test_a_writer_process_killed_with_a_host_tier_is_replaced_and_both_tiers_come_out_exact(
    mirror_redis, process_writer
):
    """The host keys cross to the child as the compact copy; the host evictions and offloads logged while
    no process runs are written by the next child, whose sweep also drops the evicted keys."""
    pool = TieredPool(host={h(i) for i in range(30, 40)})
    pool.store(h(1), h(2))
    writer = process_writer(pool)
    wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the first publication")
    dead_pid = writer.publisher.pid
    os.kill(dead_pid, signal.SIGKILL)
    wait_until(lambda: exited(dead_pid), bool, CONVERGE_S, "the writer process to die")
    with pool.lock:
        pool.host -= {h(30), h(31)}
        pool.host.add(h(2))  # offloaded: its device copy still carries it
        pool.host.add(h(40))
        pool._log(BlockRemoved(0, (h(30), h(31)), Tier.HOST))
        pool._log(BlockStored(0, (h(2), h(40)), None, 0, Tier.HOST))
    expected = {SCHEMA.block(0, h(i)): DEVICE_ENTRY for i in (1, 2)}
    expected |= {SCHEMA.block(0, h(i)): HOST_ENTRY for i in (*range(32, 41),)}
    wait_until(lambda: entries(mirror_redis), lambda found: found == expected, CONVERGE_S, "both tiers, exactly")
    assert writer.publisher.num_starts == 2 and writer.publisher.pid != dead_pid


def test_a_stopped_writer_stops_its_process(mirror_redis, process_writer):
    writer = process_writer(StandInPool())
    wait_until(lambda: writer.metrics.num_resyncs, lambda n: n >= 1, CONVERGE_S, "the first publication")
    pid = writer.publisher.pid
    writer.stop()
    assert writer.publisher.pid is None
    wait_until(lambda: exited(pid), bool, CONVERGE_S, "the writer process to exit")


def test_the_publisher_holds_a_full_host_tier_in_flat_arrays_and_republishes_it_in_pages(redis_server, monkeypatch):
    """Memory, not time: what the publisher keeps of a full host tier, and a resync's peak beyond it (the
    tier's copy included). A page of writes costs about 1 KB a key whatever the tier's size: small pages
    here, so that the part that grows with the tier shows."""
    monkeypatch.setattr(publisher_module, "WRITE_PAGE_KEYS", 200)
    num_blocks = 20_000
    index = HostIndex(num_blocks, 1, 32)
    for block_id in range(num_blocks):
        index.insert(block_id, 0, hashlib.sha256(block_id.to_bytes(4, "little")).digest())

    def copy() -> HostKeys:  # as the replica's cached_set takes it
        group_ids, hashes, _ = index.columns()
        return HostKeys(group_ids, hashes, 32, num_blocks)

    client = redis_server.client()
    publisher = EntryPublisher(client, SCHEMA, REPLICA, str(INCARNATION))
    publisher.republish(Counter(), copy())
    tracemalloc.start()
    try:
        publisher.republish(Counter(), copy())  # a resync of the same full tier
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        client.close()
    key_set = publisher._published_host
    assert len(key_set) == num_blocks and key_set.nbytes / num_blocks <= MIRROR_HOST_BYTES_PER_BLOCK
    assert peak / num_blocks <= MIRROR_HOST_TRANSIENT_BYTES_PER_BLOCK
    assert redis_server.client().dbsize() == num_blocks
