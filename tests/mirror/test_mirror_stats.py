"""GetStats' mirror fields, and a replica without --redis-url that needs no Redis at all."""

from __future__ import annotations

from mirror_support import BLOCK_SIZE, CONVERGE_TIMEOUT_S, prompt, wait_until


def test_mirror_fields_with_and_without_redis(mirror_redis, replicas):
    mirrored, plain = replicas.start_many(
        [
            dict(replica_id="mirrored", redis_url=mirror_redis.url),
            dict(replica_id="plain", redis_url=None),
        ]
    )
    for i in range(20):
        tokens = prompt(100 + i, 3 * BLOCK_SIZE + i)
        mirrored.cache(f"r{i}", tokens)
        plain.cache(f"r{i}", tokens)

    stats = wait_until(mirrored.stats, lambda s: s.mirror_queue_depth == 0 and s.mirror_resyncs >= 1,
                       CONVERGE_TIMEOUT_S, "the mirror's queue to drain")
    assert stats.mirror_enabled
    assert stats.last_event_sequence > 0
    assert stats.mirror_failures == 0
    assert stats.mirror_lag_ms >= 0.0

    # Without --redis-url: no mirror, every mirror field zero, and the cluster answer is local only.
    off = plain.stats()
    assert not off.mirror_enabled
    assert (off.mirror_failures, off.mirror_resyncs, off.mirror_queue_depth, off.mirror_lag_ms) == (0, 0, 0, 0.0)
    assert off.last_event_sequence == stats.last_event_sequence  # same work, same events: they are still logged
    tokens = prompt(119, 3 * BLOCK_SIZE)  # the last prompt cached: not evicted
    hit, cluster = plain.client.find_cache_hit(tokens, cluster=True)
    assert [(r.replica_id, r.num_cached_tokens) for r in cluster] == [("plain", hit.num_cached_tokens)]
    assert hit.num_cached_tokens == 2 * BLOCK_SIZE
    # The mirrored replica's cluster answer does not list the unmirrored one.
    assert mirrored.cluster(tokens) == {"mirrored": 2 * BLOCK_SIZE}


def test_queue_depth_counts_pending_events_while_redis_is_down_then_drains(redis_server, replicas):
    a = replicas.start("replica-a", redis_server.url)
    a.cache("warm", prompt(200, 2 * BLOCK_SIZE + 1))
    wait_until(a.stats, lambda s: s.mirror_queue_depth == 0 and s.mirror_resyncs >= 1, CONVERGE_TIMEOUT_S,
               "the first publication")
    redis_server.kill()
    for i in range(5):
        a.cache(f"down-{i}", prompt(201 + i, 2 * BLOCK_SIZE + 1))
    down = wait_until(a.stats, lambda s: s.mirror_failures > 0 and s.mirror_queue_depth > 0, CONVERGE_TIMEOUT_S,
                      "pending events and a failure while Redis is down")
    assert down.mirror_queue_depth <= down.last_event_sequence
    redis_server.restart()
    wait_until(a.stats, lambda s: s.mirror_queue_depth == 0, CONVERGE_TIMEOUT_S, "the queue to drain after the restart")
