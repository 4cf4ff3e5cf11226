"""Stale block fields are collected: a restart's earlier incarnation, and a replica gone for good.

Real managers collect with a short interval here (`--redis-collect-interval-s`);
the lock key lets one collection run per interval among them. Both topologies.
"""

from __future__ import annotations

from mirror_support import (
    BLOCK_SIZE,
    CONVERGE_TIMEOUT_S,
    LEASE_TTL_S,
    block_hashes,
    namespace,
    prompt,
    replica_block_set,
    wait_mirror_converged,
    wait_until,
)

COLLECT_FAST = ["--redis-collect-interval-s", "0.5", "--redis-collect-after-s", "1"]


def _fields_of(client, ns: str, replica_id: str) -> dict[bytes, bytes]:
    """Every block key's field of `replica_id`: key -> value, whatever the incarnation."""
    keys = list(client.scan_iter(match=f"{ns}:block:*", count=1000))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hget(key, replica_id)
    return {key: value for key, value in zip(keys, pipe.execute()) if value is not None}


def test_a_restarts_earlier_incarnation_is_collected_and_the_live_entries_stay(mirror_redis, replicas):
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url, extra=COLLECT_FAST),
            dict(replica_id="replica-b", redis_url=mirror_redis.url, extra=COLLECT_FAST),
        ]
    )
    old_prompt, b_prompt = prompt(200, 6 * BLOCK_SIZE + 1), prompt(201, 3 * BLOCK_SIZE + 1)
    a.cache("old", old_prompt)
    b.cache("b", b_prompt)
    ns = namespace()
    wait_mirror_converged([a, b], mirror_redis, ns)
    old_incarnation = a.incarnation

    a.kill()
    a2 = replicas.start("replica-a", mirror_redis.url, extra=COLLECT_FAST)
    a2.cache("new-first-block", old_prompt[: BLOCK_SIZE + 1])  # one block of the old prompt again

    client = mirror_redis.client()
    try:
        # The old incarnation's 5 other blocks go; what a2 and b hold stays, exactly.
        wait_until(lambda: replica_block_set(client, ns, "replica-a", old_incarnation), lambda got: not got,
                   CONVERGE_TIMEOUT_S, "the earlier incarnation's fields to be collected")  # fmt: skip
        wait_mirror_converged([a2, b], mirror_redis, ns)
        assert set(_fields_of(client, ns, "replica-a").values()) == {str(a2.incarnation).encode()}
        assert len(_fields_of(client, ns, "replica-a")) == 1
        assert replica_block_set(client, ns, "replica-b", b.incarnation) == set(block_hashes(b_prompt))
    finally:
        client.close()
    assert b.cluster(old_prompt) == {"replica-a": BLOCK_SIZE, "replica-b": 0}
    assert a2.stats().mirror_failures == 0 and b.stats().mirror_failures == 0


def test_a_replica_gone_for_good_is_collected_whole(mirror_redis, replicas):
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url, extra=COLLECT_FAST),
            dict(replica_id="replica-b", redis_url=mirror_redis.url, extra=COLLECT_FAST),
        ]
    )
    shared = prompt(210, 4 * BLOCK_SIZE + 1)
    a.cache("shared", shared)
    b.cache("shared", shared)
    ns = namespace()
    wait_mirror_converged([a, b], mirror_redis, ns)

    a.kill()  # its lease lapses after the TTL; a second later it counts as gone
    client = mirror_redis.client()
    try:
        wait_until(lambda: (len(_fields_of(client, ns, "replica-a")), client.smembers(f"{ns}:replicas")),
                   lambda got: got == (0, {b"replica-b"}), LEASE_TTL_S + CONVERGE_TIMEOUT_S,
                   "the gone replica's fields and replica-set member to be collected")  # fmt: skip
        # The live replica's entries of the same blocks are untouched.
        assert replica_block_set(client, ns, "replica-b", b.incarnation) == set(block_hashes(shared))
        assert client.exists(f"{ns}:collector")
    finally:
        client.close()
    assert b.cluster(shared) == {"replica-b": 4 * BLOCK_SIZE}

    # The id comes back: it serves and is reported again.
    a2 = replicas.start("replica-a", mirror_redis.url, extra=COLLECT_FAST)
    a2.cache("again", shared[: 2 * BLOCK_SIZE + 1])
    wait_until(lambda: b.cluster(shared), lambda got: got == {"replica-a": 2 * BLOCK_SIZE, "replica-b": 4 * BLOCK_SIZE},
               CONVERGE_TIMEOUT_S, "the returning replica to be reported")  # fmt: skip
