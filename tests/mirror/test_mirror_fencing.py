"""Fencing: a dead replica's entries stop counting after its lease TTL; a restarted one's old entries never count."""

from __future__ import annotations


from mirror_support import (
    BLOCK_SIZE,
    CONVERGE_TIMEOUT_S,
    LEASE_TTL_S,
    block_hashes,
    namespace,
    prompt,
    replica_block_set,
    wait_until,
)


def test_killed_replica_is_no_longer_reported_after_its_lease_ttl(mirror_redis, replicas):
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url),
            dict(replica_id="replica-b", redis_url=mirror_redis.url),
        ]
    )
    tokens = prompt(20, 3 * BLOCK_SIZE + 1)
    a.cache("warm", tokens)
    wait_until(lambda: b.cluster(tokens), lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 0},
               CONVERGE_TIMEOUT_S, "replica-a's prefix to be reported")

    a.kill()  # SIGKILL: no graceful shutdown, the lease is left to expire
    client = mirror_redis.client()
    try:
        ns = namespace()
        # The entries themselves stay in Redis: only the lease fences them.
        assert replica_block_set(client, ns, "replica-a", a.incarnation) == set(block_hashes(tokens))
        answer = wait_until(
            lambda: b.cluster(tokens),
            lambda got: "replica-a" not in got,
            LEASE_TTL_S + CONVERGE_TIMEOUT_S,
            "the dead replica to drop out of the cluster answer",
        )
        assert answer == {"replica-b": 0}
        assert not client.exists(f"{ns}:lease:replica-a")
    finally:
        client.close()
    # And it stays out.
    assert b.cluster(tokens) == {"replica-b": 0}


def test_gracefully_stopped_replica_drops_out_at_once(mirror_redis, replicas):
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url),
            dict(replica_id="replica-b", redis_url=mirror_redis.url),
        ]
    )
    tokens = prompt(21, 2 * BLOCK_SIZE + 1)
    a.cache("warm", tokens)
    wait_until(lambda: b.cluster(tokens), lambda got: got.get("replica-a") == 2 * BLOCK_SIZE, CONVERGE_TIMEOUT_S,
               "replica-a's prefix to be reported")
    assert a.stop() == 0  # SIGTERM: the mirror deletes the lease on the way out
    client = mirror_redis.client()
    try:
        assert not client.exists(f"{namespace()}:lease:replica-a")
    finally:
        client.close()
    assert b.cluster(tokens) == {"replica-b": 0}


def test_restarted_replica_reports_only_what_its_new_incarnation_caches(mirror_redis, replicas):
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url),
            dict(replica_id="replica-b", redis_url=mirror_redis.url),
        ]
    )
    old_prompt = prompt(30, 4 * BLOCK_SIZE + 1)
    a.cache("old", old_prompt)
    wait_until(lambda: b.cluster(old_prompt), lambda got: got.get("replica-a") == 4 * BLOCK_SIZE,
               CONVERGE_TIMEOUT_S, "the old incarnation's prefix to be reported")
    old_incarnation = a.incarnation

    # Crash and restart at once under the same id: the old lease may well be alive still,
    # so only the incarnation fences the old entries.
    a.kill()
    a2 = replicas.start("replica-a", mirror_redis.url)
    assert a2.incarnation != old_incarnation and a2.incarnation > old_incarnation
    new_prompt = prompt(31, 2 * BLOCK_SIZE + 1)
    a2.cache("new", new_prompt)
    a2.cache("old-first-block", old_prompt[: BLOCK_SIZE + 1])  # re-caches only the first block of the old prompt

    wait_until(lambda: b.cluster(new_prompt), lambda got: got == {"replica-a": 2 * BLOCK_SIZE, "replica-b": 0},
               CONVERGE_TIMEOUT_S, "the new incarnation's prefix to be reported")
    wait_until(lambda: b.cluster(old_prompt[: BLOCK_SIZE + 1]), lambda got: got.get("replica-a") == BLOCK_SIZE,
               CONVERGE_TIMEOUT_S, "the re-cached first block to be reported")
    client = mirror_redis.client()
    try:
        ns = namespace()
        old_hashes = block_hashes(old_prompt)
        # The old incarnation's entries for blocks 2..4 are still in Redis, under the live replica id ...
        assert replica_block_set(client, ns, "replica-a", old_incarnation) == set(old_hashes[1:])
        lease = client.get(f"{ns}:lease:replica-a")
        assert lease is not None and str(a2.incarnation).encode() in lease
    finally:
        client.close()
    # ... and are never reported: the prefix stops after the block the new incarnation holds.
    assert b.cluster(old_prompt) == {"replica-a": BLOCK_SIZE, "replica-b": 0}
    assert a2.cluster(old_prompt) == {"replica-a": BLOCK_SIZE, "replica-b": 0}
    assert a2.client.find_cache_hit(old_prompt)[0].num_cached_tokens == BLOCK_SIZE
    # Long after the old lease's TTL, still the same answer.
    wait_until(lambda: b.cluster(new_prompt), lambda got: got == {"replica-a": 2 * BLOCK_SIZE, "replica-b": 0},
               CONVERGE_TIMEOUT_S, "the new incarnation to stay reported")
    assert b.cluster(old_prompt) == {"replica-a": BLOCK_SIZE, "replica-b": 0}


def test_answering_replica_is_always_in_its_own_cluster_answer(mirror_redis, replicas):
    """FindCacheHit(cluster=true) reports every live replica; the one answering is live by definition.

    With Redis down it answers for itself alone. With Redis up but its lease
    not (yet, or no longer) there -- right after a Redis restart, before the
    first heartbeat, or after a lost lease -- it must not vanish from its own
    answer while its local hit says it holds the prefix.
    """
    a = replicas.start("replica-a", mirror_redis.url)
    tokens = prompt(40, 2 * BLOCK_SIZE + 1)
    a.cache("warm", tokens)
    wait_until(lambda: a.cluster(tokens), lambda got: got == {"replica-a": 2 * BLOCK_SIZE}, CONVERGE_TIMEOUT_S,
               "the prefix to be published")

    client = mirror_redis.node_client_for(f"{namespace()}:lease:replica-a")
    try:
        ns = namespace()
        # The lease is gone (as after a Redis restart) and, for a moment, cannot be written
        # back: CLIENT PAUSE WRITE holds writes but serves reads, so the heartbeat cannot win the race.
        client.delete(f"{ns}:lease:replica-a")
        client.execute_command("CLIENT", "PAUSE", "1500", "WRITE")
        try:
            hit, replicas_ = a.client.find_cache_hit(tokens, cluster=True)
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
    finally:
        client.close()
    assert hit.num_cached_tokens == 2 * BLOCK_SIZE
    assert "replica-a" in [r.replica_id for r in replicas_], (
        f"the answering replica holds {hit.num_cached_tokens} cached tokens but its cluster answer is {replicas_}"
    )
