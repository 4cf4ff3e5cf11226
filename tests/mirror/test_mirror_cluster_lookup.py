"""Two replica processes share a Redis mirror: one caches a prefix, the other's cluster lookup sees it.

Every test runs on one redis-server and on a 3-master Redis Cluster (`mirror_redis`).
"""

from __future__ import annotations

from kv_manager_service.mirror.lookup import ClusterIndex, choose_replica
from kv_manager_service.mirror.schema import KeySchema
from mirror_support import BLOCK_SIZE, CONVERGE_TIMEOUT_S, block_hashes, namespace, prompt, wait_until


def test_cached_prefix_is_reported_to_the_other_replica_then_evicted(mirror_redis, replicas):
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url, num_blocks=16),
            dict(replica_id="replica-b", redis_url=mirror_redis.url, num_blocks=16),
        ]
    )
    tokens = prompt(1, 4 * BLOCK_SIZE + 1)  # four full blocks and one token to compute
    a.cache("warm", tokens)
    assert a.client.find_cache_hit(tokens)[0].num_cached_tokens == 4 * BLOCK_SIZE

    answer = wait_until(
        lambda: b.cluster(tokens),
        lambda got: got.get("replica-a") == 4 * BLOCK_SIZE,
        CONVERGE_TIMEOUT_S,
        "replica-b's cluster lookup to report replica-a's prefix",
    )
    assert answer == {"replica-a": 4 * BLOCK_SIZE, "replica-b": 0}
    hit, replicas_ = b.client.find_cache_hit(tokens, cluster=True)
    assert hit.num_cached_tokens == 0  # the local answer is untouched by the cluster answer
    assert [r.replica_id for r in replicas_] == ["replica-a", "replica-b"]
    # Replica A sees itself through the mirror as well.
    assert a.cluster(tokens) == {"replica-a": 4 * BLOCK_SIZE, "replica-b": 0}

    # Lengths: multiples of the block size, at least one token left to compute, prefixes only.
    assert b.cluster(tokens[: 4 * BLOCK_SIZE]) == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 0}
    assert b.cluster(tokens[: 2 * BLOCK_SIZE + 7]) == {"replica-a": 2 * BLOCK_SIZE, "replica-b": 0}
    assert b.cluster(tokens[:BLOCK_SIZE]) == {"replica-a": 0, "replica-b": 0}
    changed = list(tokens)
    changed[2 * BLOCK_SIZE + 3] += 1  # the third block differs: the prefix stops before it
    assert b.cluster(changed) == {"replica-a": 2 * BLOCK_SIZE, "replica-b": 0}
    assert b.cluster(prompt(2, 5 * BLOCK_SIZE)) == {"replica-a": 0, "replica-b": 0}
    # A cache salt changes every hash: no hit.
    _, salted = b.client.find_cache_hit(tokens, cache_salt="tenant-x", cluster=True)
    assert {r.replica_id: r.num_cached_tokens for r in salted} == {"replica-a": 0, "replica-b": 0}

    # Force the eviction: one request takes every block of A's pool (15 of 16; block 0 is null).
    filler = prompt(3, 15 * BLOCK_SIZE)
    result = a.client.allocate("filler", filler, num_new_tokens=len(filler))
    assert result.status.name == "OK", result
    assert a.client.find_cache_hit(tokens)[0].num_cached_tokens == 0
    a.client.free(["filler"])

    wait_until(
        lambda: b.cluster(tokens),
        lambda got: got == {"replica-a": 0, "replica-b": 0},
        CONVERGE_TIMEOUT_S,
        "the evicted prefix to disappear from replica-b's cluster answer",
    )
    # The filler's own blocks are cached now (14 full of 15, one token left): they are reported instead.
    wait_until(
        lambda: b.cluster(filler),
        lambda got: got == {"replica-a": 14 * BLOCK_SIZE, "replica-b": 0},
        CONVERGE_TIMEOUT_S,
        "the filler prompt to be reported for replica-a",
    )


def test_lookup_reports_each_replica_its_own_prefix_and_routes_to_the_longest(mirror_redis, replicas):
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url),
            dict(replica_id="replica-b", redis_url=mirror_redis.url),
        ]
    )
    shared = prompt(10, 2 * BLOCK_SIZE)
    long_prompt = shared + prompt(11, 3 * BLOCK_SIZE) + [7]
    a.cache("a-short", shared + [1])  # A holds the two shared blocks
    b.cache("b-long", long_prompt)  # B holds all five
    answer = wait_until(
        lambda: a.cluster(long_prompt),
        lambda got: got == {"replica-a": 2 * BLOCK_SIZE, "replica-b": 5 * BLOCK_SIZE},
        CONVERGE_TIMEOUT_S,
        "both replicas' prefixes in the cluster answer",
    )
    # Every replica gives the same answer, once the other's writer has published its prefix.
    wait_until(lambda: b.cluster(long_prompt), lambda got: got == answer, CONVERGE_TIMEOUT_S, "replica-b's answer")

    # The router helper agrees with the answer, from the same mirror.
    client = mirror_redis.client()
    try:
        index = ClusterIndex(client, KeySchema("default", "sha256_cbor"))
        assert index.schema.namespace == namespace()
        prefixes = index.lookup(0, block_hashes(long_prompt))
        assert {p.replica_id: p.num_cached_blocks for p in prefixes} == {"replica-a": 2, "replica-b": 5}
        assert choose_replica(prefixes) == "replica-b"
        lease_a = next(p.lease for p in prefixes if p.replica_id == "replica-a")
        assert lease_a.address == a.address and lease_a.incarnation == a.incarnation
    finally:
        client.close()


def test_hybrid_pool_cluster_answer_agrees_with_what_the_replica_would_reuse(mirror_redis, replicas):
    """Two full-attention groups of 48- and 32-token blocks: a hit is reported on lcm = 96 token
    boundaries, where both groups agree (docs/architecture.md, "Hit alignment"). The cluster answer for a replica must
    not promise more than that replica would reuse, nor disagree with its own answer for itself."""
    config = {
        "num_blocks": 64,
        "groups": [{"kind": "full_attention", "block_size": 48}, {"kind": "full_attention", "block_size": 32}],
    }
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url, config=config),
            dict(replica_id="replica-b", redis_url=mirror_redis.url, config=config),
        ]
    )
    tokens = prompt(70, 160)  # 3 blocks of 48 and 5 of 32 are full; the groups agree on 96 tokens
    a.cache("hybrid", tokens)
    local = a.client.find_cache_hit(tokens)[0].num_cached_tokens
    assert local == 96
    wait_until(lambda: b.cluster(tokens), lambda got: got.get("replica-a", 0) > 0, CONVERGE_TIMEOUT_S,
               "replica-a's hybrid prefix to be reported")
    wait_until(lambda: a.stats().mirror_queue_depth, lambda depth: depth == 0, CONVERGE_TIMEOUT_S, "the mirror to drain")
    answer = b.cluster(tokens)
    assert a.cluster(tokens)["replica-a"] == local
    assert answer == {"replica-a": local, "replica-b": 0}, (
        f"replica-b reports {answer['replica-a']} cached tokens on replica-a, which would reuse {local} "
        f"(hits are on 96-token boundaries)"
    )
