"""Redis fails under the replicas: they keep serving, and the mirror converges when it returns."""

from __future__ import annotations

import contextlib
import os
import signal

from mirror_support import (
    BLOCK_SIZE,
    CONVERGE_TIMEOUT_S,
    LoadThread,
    RedisServer,
    namespace,
    block_hashes,
    prompt,
    replica_block_set,
    wait_mirror_converged,
    wait_until,
)
from processes import exited

def test_redis_sigkill_under_load_then_mirror_converges_exactly(redis_server, replicas):
    """replica-a writes from a thread, replica-b from a writer process (--redis-writer)."""
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=redis_server.url, num_blocks=64),
            dict(replica_id="replica-b", redis_url=redis_server.url, num_blocks=64,
                 extra=["--redis-writer", "process"]),
        ]
    )
    ns = namespace()
    loads = [LoadThread(a, seed=1), LoadThread(b, seed=2)]
    for load in loads:
        load.start()
    try:
        def progress() -> list[int]:
            return [load.num_iterations for load in loads]

        # Load runs with Redis up, and the mirror publishes it.
        wait_until(progress, lambda n: min(n) >= 100, 30, "the load to get going")
        for replica in (a, b):
            wait_until(
                lambda: replica.stats().mirror_resyncs, lambda n: n >= 1, CONVERGE_TIMEOUT_S, "the first publication"
            )
        before_kill = progress()

        redis_server.kill()
        for replica in (a, b):
            wait_until(
                lambda: replica.stats().mirror_failures,
                lambda n: n > 0,
                CONVERGE_TIMEOUT_S,
                f"{replica.replica_id} to count a mirror failure",
            )
        # Serving goes on through the outage (every RPC error is recorded by the load threads).
        during = wait_until(
            progress,
            lambda n: all(x >= y + 150 for x, y in zip(n, before_kill)),
            30,
            "the load to progress while Redis is down",
        )
        assert [load.errors for load in loads] == [[], []]

        redis_server.restart()
        wait_until(
            progress,
            lambda n: all(x >= y + 150 for x, y in zip(n, during)),
            30,
            "the load to progress after Redis returned",
        )
    finally:
        for load in loads:
            load.stop()
    assert [load.errors for load in loads] == [[], []], "RPCs failed while Redis was down or restarting"
    assert all(load.num_cluster_lookups > 0 for load in loads)

    wait_mirror_converged([a, b], redis_server, ns)
    for replica in (a, b):
        stats = replica.stats()
        assert stats.mirror_enabled
        assert stats.mirror_failures > 0, stats
        assert stats.mirror_resyncs >= 2, stats
        wait_until(lambda: replica.stats().mirror_queue_depth, lambda d: d == 0, CONVERGE_TIMEOUT_S, "an empty queue")

    # Nothing else lives in Redis: every block entry belongs to a live incarnation.
    client = redis_server.client()
    try:
        live = {a.replica_id: str(a.incarnation).encode(), b.replica_id: str(b.incarnation).encode()}
        for key in client.scan_iter(match=f"{ns}:block:*"):
            fields = client.hgetall(key)
            assert fields, key
            for field, value in fields.items():
                assert live.get(field.decode()) == value, (key, field, value)
        assert {m.decode() for m in client.smembers(f"{ns}:replicas")} == {"replica-a", "replica-b"}
        for replica in (a, b):
            assert client.exists(f"{ns}:lease:{replica.replica_id}")
    finally:
        client.close()

    # And the cluster answer agrees with each replica's own answer again.
    probe = prompt(42, 3 * BLOCK_SIZE + 1)
    a.cache("after-outage", probe)
    wait_until(
        lambda: b.cluster(probe),
        lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": b.client.find_cache_hit(probe)[0].num_cached_tokens},
        CONVERGE_TIMEOUT_S,
        "a new prefix to be published after the outage",
    )


def test_idle_replica_republishes_after_redis_restart(redis_server, replicas):
    """No events during the outage: the writer never fails a write, the vanished lease triggers the resync."""
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=redis_server.url),
            dict(replica_id="replica-b", redis_url=redis_server.url),
        ]
    )
    tokens = prompt(5, 3 * BLOCK_SIZE + 1)
    a.cache("warm", tokens)
    wait_until(lambda: b.cluster(tokens), lambda got: got.get("replica-a") == 3 * BLOCK_SIZE, CONVERGE_TIMEOUT_S,
               "the prefix to be published")
    redis_server.kill()
    redis_server.restart()  # empty: the prefix index and the leases are gone
    wait_until(
        lambda: b.cluster(tokens),
        lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 0},
        CONVERGE_TIMEOUT_S,
        "replica-a to re-publish its cached set into the restarted Redis",
    )
    client = redis_server.client()
    try:
        assert replica_block_set(client, namespace(), "replica-a", a.incarnation) == set(block_hashes(tokens))
    finally:
        client.close()
    assert a.stats().mirror_resyncs >= 2


def test_redis_down_at_start_serves_then_publishes_when_redis_comes_up(tmp_path, redis_factory, replicas):
    redis_server = RedisServer(tmp_path)  # a free port where nothing listens yet
    redis_factory.append(redis_server)
    a = replicas.start("replica-a", redis_server.url)
    tokens = prompt(7, 3 * BLOCK_SIZE + 5)

    a.cache("while-down", tokens)
    # The cluster answer falls back to this replica alone, without an error.
    hit, cluster = a.client.find_cache_hit(tokens, cluster=True)
    assert hit.num_cached_tokens == 3 * BLOCK_SIZE
    assert [(r.replica_id, r.num_cached_tokens) for r in cluster] == [("replica-a", 3 * BLOCK_SIZE)]
    stats = wait_until(a.stats, lambda s: s.mirror_failures > 0, CONVERGE_TIMEOUT_S, "a counted failure")
    assert stats.mirror_enabled
    resyncs_while_down = stats.mirror_resyncs  # an empty pool's first publication needs no Redis call

    redis_server.start()
    client = redis_server.client()
    try:
        ns = namespace()
        wait_until(
            lambda: replica_block_set(client, ns, "replica-a", a.incarnation),
            lambda got: got == set(block_hashes(tokens)),
            CONVERGE_TIMEOUT_S,
            "the cached set to be published once Redis is up",
        )
        wait_until(lambda: client.exists(f"{ns}:lease:replica-a"), bool, CONVERGE_TIMEOUT_S, "the lease")
        assert a.stats().mirror_resyncs > resyncs_while_down
        # Deltas flow again after the first publication.
        more = prompt(8, 2 * BLOCK_SIZE + 1)
        a.cache("after-up", more)
        wait_until(
            lambda: replica_block_set(client, ns, "replica-a", a.incarnation),
            lambda got: got == set(block_hashes(tokens)) | set(block_hashes(more)),
            CONVERGE_TIMEOUT_S,
            "a new prefix to be published",
        )
    finally:
        client.close()


def test_frozen_redis_does_not_hold_rpcs_and_the_mirror_converges_after(redis_server, replicas):
    """A Redis that hangs (SIGSTOP) rather than refusing connections: the writer waits out its
    socket timeout in the background while every RPC completes, Redis still frozen. (How fast
    they stay is measured by bench/mirror_bench.py, not here.)"""
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=redis_server.url, num_blocks=64),
            dict(replica_id="replica-b", redis_url=redis_server.url, num_blocks=64),
        ]
    )
    before = prompt(60, 2 * BLOCK_SIZE + 1)
    a.cache("before", before)
    wait_until(lambda: b.cluster(before), lambda got: got.get("replica-a") == 2 * BLOCK_SIZE, CONVERGE_TIMEOUT_S,
               "the prefix to be published")
    during = [prompt(61 + i, 2 * BLOCK_SIZE + 1) for i in range(6)]  # room for all: nothing is evicted
    redis_server.pause()
    try:
        for i, tokens in enumerate(during):
            for replica in (a, b):
                replica.cache(f"during-{i}", tokens)
                replica.client.find_cache_hit(tokens)
                replica.client.stats()
            if i == 0:
                # The writer is stuck on the frozen Redis meanwhile.
                wait_until(a.log, lambda text: "mirror's Redis" in text and "is unreachable" in text, CONVERGE_TIMEOUT_S,
                           "the writer to time out on the frozen Redis")
        # A cluster lookup cannot read Redis: it answers for this replica only, without an RPC error.
        hit, cluster = a.client.find_cache_hit(before, cluster=True)
        assert [(r.replica_id, r.num_cached_tokens) for r in cluster] == [("replica-a", hit.num_cached_tokens)]
    finally:
        redis_server.resume()
    assert a.stats().mirror_failures > 0

    wait_mirror_converged([a, b], redis_server, namespace())
    wait_until(lambda: b.cluster(during[-1]), lambda got: got == {"replica-a": 2 * BLOCK_SIZE,
                                                                   "replica-b": 2 * BLOCK_SIZE},
               CONVERGE_TIMEOUT_S, "prefixes cached during the freeze to be reported")


def test_a_killed_writer_process_is_replaced_and_the_last_one_exits_with_its_server(redis_server, replicas):
    """With --redis-writer process the server's mirror publisher runs in a child process. Killed, it
    is replaced and the mirror converges exactly, evictions made meanwhile included; its server
    SIGKILLed, it exits."""
    a = replicas.start("replica-a", redis_server.url, extra=["--redis-writer", "process"])
    for i in range(12):
        a.cache(f"first-{i}", prompt(100 + i, 3 * BLOCK_SIZE))
    wait_mirror_converged([a], redis_server, namespace())
    dead = _writer_process_of(a.process.pid)
    os.kill(dead, signal.SIGKILL)
    for i in range(12):  # 36 more blocks in a 64-block pool: some of the first prompts' blocks are evicted
        a.cache(f"second-{i}", prompt(200 + i, 3 * BLOCK_SIZE))
    assert a.stats().num_evictions > 0
    wait_mirror_converged([a], redis_server, namespace())
    replacement = _writer_process_of(a.process.pid)
    assert replacement != dead
    a.kill()
    wait_until(lambda: os.path.exists(f"/proc/{replacement}"), lambda alive: not alive, CONVERGE_TIMEOUT_S,
               "the writer process to exit after its server")  # fmt: skip


def test_a_stopped_writer_process_shows_in_the_backlog_and_is_replaced(redis_server, replicas):
    """SIGSTOP the writer process: its server stays free, the mirror's queue depth and lag grow while the
    batch waits, and past --redis-writer-timeout-s the child is killed and replaced; the mirror converges."""
    a = replicas.start("replica-a", redis_server.url, extra=["--redis-writer", "process", "--redis-writer-timeout-s", "4"])
    a.cache("before", prompt(300, 3 * BLOCK_SIZE))
    wait_mirror_converged([a], redis_server, namespace())
    stopped = _writer_process_of(a.process.pid)
    os.kill(stopped, signal.SIGSTOP)
    try:
        for i in range(6):
            a.cache(f"while-stopped-{i}", prompt(310 + i, 3 * BLOCK_SIZE))
        # The heartbeat keeps the figures moving while the batch waits on the stopped child.
        wait_until(a.stats, lambda s: s.mirror_queue_depth > 0 and s.mirror_lag_ms >= 2000, CONVERGE_TIMEOUT_S,
                   "the backlog of a stalled writer to show")  # fmt: skip
        wait_until(lambda: _writer_processes_of(a.process.pid), lambda pids: pids and stopped not in pids,
                   CONVERGE_TIMEOUT_S, "a new writer process")  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed by its server, as it should be
            os.kill(stopped, signal.SIGCONT)
    wait_mirror_converged([a], redis_server, namespace())
    assert a.stats().mirror_failures >= 1 and exited(stopped)


def _writer_process_of(server_pid: int) -> int:
    """The pid of the server's mirror publisher process (its child running mirror.publisher_process)."""
    found = _writer_processes_of(server_pid)
    assert len(found) == 1, f"server {server_pid} has writer processes {found}"
    return found[0]


def _writer_processes_of(server_pid: int) -> list[int]:
    """The pids of the server's children running mirror.publisher_process, zombies left out."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(parent) == server_pid and state != "Z" and b"kv_manager_service.mirror.publisher_process" in argv:
            found.append(int(entry))
    return found
