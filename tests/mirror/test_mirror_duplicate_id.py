"""Two managers with one --replica-id against one Redis: the second is refused or fenced, never merged.

The lease names its holder's incarnation and is claimed by compare-and-set:
a start that finds a live lease of another incarnation waits about one TTL
for it to lapse, then exits 2; a writer that finds its lease taken stops
writing for good and says so (an ERROR, GetStats.mirror_fenced).
"""

from __future__ import annotations

import json
import signal
import subprocess

from mirror_support import (
    BLOCK_SIZE,
    CONVERGE_TIMEOUT_S,
    ROOT,
    RedisClusterServer,
    RedisServer,
    block_hashes,
    namespace,
    prompt,
    replica_block_set,
    wait_until,
)
from processes import log_records

REFUSAL = "replica id 'replica-a' is held by another live manager"
REFUSED_START_TIMEOUT_S = 60.0  # generous: the refusal comes after about one lease TTL


def _lease_incarnation(redis_server: RedisServer | RedisClusterServer, replica_id: str) -> int | None:
    client = redis_server.client()
    try:
        text = client.get(f"{namespace()}:lease:{replica_id}")
    finally:
        client.close()
    return None if text is None else json.loads(text)["incarnation"]


def _published(redis_server: RedisServer | RedisClusterServer, replica_id: str, incarnation: int) -> set[bytes]:
    client = redis_server.client()
    try:
        return replica_block_set(client, namespace(), replica_id, incarnation)
    finally:
        client.close()


def test_second_manager_with_one_id_is_refused_while_the_first_lives(redis_server, replicas):
    # One server only: the same lease script runs on a cluster in the fencing test below, and this one is slow.
    a, c = replicas.start_many(
        [dict(replica_id="replica-a", redis_url=redis_server.url), dict(replica_id="replica-c", redis_url=redis_server.url)]
    )
    tokens = prompt(60, 3 * BLOCK_SIZE + 1)
    a.cache("warm", tokens)
    wait_until(lambda: c.cluster(tokens), lambda got: got.get("replica-a") == 3 * BLOCK_SIZE, CONVERGE_TIMEOUT_S,
               "replica-a's prefix to be reported")  # fmt: skip

    twin = subprocess.run(
        replicas.argv("replica-a", redis_server.url, 64, None, ()),
        cwd=ROOT, capture_output=True, text=True, timeout=REFUSED_START_TIMEOUT_S,
    )  # fmt: skip
    assert twin.returncode == 2, f"the twin exited {twin.returncode}\n{twin.stderr}"
    assert "listening" not in twin.stdout, twin.stdout
    assert REFUSAL in twin.stderr and "--replica-id" in twin.stderr, twin.stderr

    # The first never noticed: its lease and its entries are its own, and reported.
    assert _lease_incarnation(redis_server, "replica-a") == a.incarnation
    assert _published(redis_server, "replica-a", a.incarnation) == set(block_hashes(tokens))
    assert c.cluster(tokens) == {"replica-a": 3 * BLOCK_SIZE, "replica-c": 0}
    assert not a.stats().mirror_fenced

    # A clean stop drops the lease: the id is free at once.
    assert a.stop() == 0
    a2 = replicas.start("replica-a", redis_server.url)
    assert _lease_incarnation(redis_server, "replica-a") == a2.incarnation
    # A crash leaves the lease to lapse after its TTL: the next start waits for that, then serves.
    a2.kill()
    a3 = replicas.start("replica-a", redis_server.url)
    wait_until(lambda: _lease_incarnation(redis_server, "replica-a"), lambda got: got == a3.incarnation,
               CONVERGE_TIMEOUT_S, "the restarted replica to hold the lease")  # fmt: skip
    assert not a3.stats().mirror_fenced


def test_writer_whose_lease_was_taken_is_fenced_and_stops_writing(mirror_redis, replicas):
    """A manager frozen past its lease TTL (SIGSTOP: a VM pause, a stuck host) loses the id to a new one."""
    a = replicas.start("replica-a", mirror_redis.url)
    before = prompt(61, 2 * BLOCK_SIZE + 1)
    a.cache("before", before)
    wait_until(lambda: _published(mirror_redis, "replica-a", a.incarnation), lambda got: got == set(block_hashes(before)),
               CONVERGE_TIMEOUT_S, "replica-a's blocks to be published")  # fmt: skip

    a.process.process.send_signal(signal.SIGSTOP)
    try:
        b = replicas.start("replica-a", mirror_redis.url)  # waits for the frozen one's lease to lapse
    finally:
        a.process.process.send_signal(signal.SIGCONT)
    assert _lease_incarnation(mirror_redis, "replica-a") == b.incarnation

    wait_until(lambda: a.stats().mirror_fenced, bool, CONVERGE_TIMEOUT_S, "the frozen manager to be fenced")
    assert any(r["level"] == "ERROR" and REFUSAL in r["msg"] for r in log_records(a.process)), a.log()
    assert not b.stats().mirror_fenced

    after_a, after_b = prompt(62, 2 * BLOCK_SIZE + 1), prompt(63, 3 * BLOCK_SIZE + 1)
    a.cache("after", after_a)
    b.cache("after", after_b)
    wait_until(lambda: _published(mirror_redis, "replica-a", b.incarnation), lambda got: got == set(block_hashes(after_b)),
               CONVERGE_TIMEOUT_S, "the new manager's blocks to be published")  # fmt: skip
    # The fenced one wrote nothing more, and never touched the new one's lease or entries.
    assert not _published(mirror_redis, "replica-a", a.incarnation) & set(block_hashes(after_a))
    assert b.cluster(after_b) == {"replica-a": 3 * BLOCK_SIZE}
    assert a.stop() == 0  # its stop leaves the lease it does not hold
    assert _lease_incarnation(mirror_redis, "replica-a") == b.incarnation
    assert _published(mirror_redis, "replica-a", b.incarnation) == set(block_hashes(after_b))


def test_twins_started_while_redis_is_down_end_with_one_writer(tmp_path, redis_factory, replicas):
    """Redis down at start: both serve, and the lease decides once Redis is up. One is fenced, one writes."""
    redis_server = RedisServer(tmp_path)
    redis_factory.append(redis_server)
    first, second = replicas.start_many(
        [dict(replica_id="replica-a", redis_url=redis_server.url), dict(replica_id="replica-a", redis_url=redis_server.url)]
    )
    tokens = {first.incarnation: prompt(64, 2 * BLOCK_SIZE + 1), second.incarnation: prompt(65, 3 * BLOCK_SIZE + 1)}
    first.cache("warm", tokens[first.incarnation])
    second.cache("warm", tokens[second.incarnation])
    redis_server.start()

    def fenced() -> list[bool]:
        return [first.stats().mirror_fenced, second.stats().mirror_fenced]

    wait_until(fenced, lambda got: sum(got) == 1, CONVERGE_TIMEOUT_S, "exactly one twin to be fenced")
    loser, winner = (first, second) if first.stats().mirror_fenced else (second, first)
    assert REFUSAL in loser.log()
    wait_until(lambda: _published(redis_server, "replica-a", winner.incarnation),
               lambda got: got == set(block_hashes(tokens[winner.incarnation])), CONVERGE_TIMEOUT_S,
               "the winner's blocks to be published")  # fmt: skip
    assert _lease_incarnation(redis_server, "replica-a") == winner.incarnation
    assert fenced().count(True) == 1  # and it stays so
