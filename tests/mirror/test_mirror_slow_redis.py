"""A stuck Redis does not slow the manager: cluster lookups have a budget and skip Redis after a failure.

SIGSTOP keeps Redis's connections open and answers nothing, the worst case
for a client: only its timeout ends a call. A lookup waits one budget
(--cluster-lookup-timeout-ms), then lookups skip Redis for a second and
answer from the local replica alone; Steps never wait on Redis.
"""

from __future__ import annotations

from mirror_support import BLOCK_SIZE, CONVERGE_TIMEOUT_S, LoadThread, prompt, wait_until

NUM_SKIPPED = 10


def test_cluster_lookups_skip_a_stuck_redis_and_steps_keep_flowing(redis_server, replicas):
    budget = ["--cluster-lookup-timeout-ms", "50"]
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=redis_server.url, extra=budget),
            dict(replica_id="replica-b", redis_url=redis_server.url, extra=budget),
        ]
    )
    tokens = prompt(70, 3 * BLOCK_SIZE + 1)
    a.cache("warm", tokens)
    wait_until(lambda: b.cluster(tokens), lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 0},
               CONVERGE_TIMEOUT_S, "replica-a's prefix to be reported")  # fmt: skip
    assert b.stats().mirror_lookups_skipped == 0

    load = LoadThread(b, seed=7)  # Steps, frees and a cluster lookup every 10 iterations
    load.start()
    redis_server.pause()
    try:
        # One lookup a second waits its budget and fails; the others skip Redis. Before the
        # budget, each one held a server thread for the client's whole 1 s socket timeout.
        answers = wait_until(
            lambda: (b.cluster(tokens), a.cluster(tokens), b.stats().mirror_lookups_skipped),
            lambda got: got[2] >= NUM_SKIPPED,
            CONVERGE_TIMEOUT_S,
            f"{NUM_SKIPPED} cluster lookups to skip the stuck Redis",
        )
        # Each replica answers for itself alone, from its own pool.
        assert answers[:2] == ({"replica-b": 0}, {"replica-a": 3 * BLOCK_SIZE})
        before = load.num_iterations
        wait_until(lambda: load.num_iterations, lambda n: n >= before + 50, CONVERGE_TIMEOUT_S,
                   "Steps to keep flowing while Redis is stuck")  # fmt: skip
    finally:
        redis_server.resume()

    # The next probe after the skip period finds Redis again.
    wait_until(lambda: b.cluster(tokens), lambda got: got == {"replica-a": 3 * BLOCK_SIZE, "replica-b": 0},
               CONVERGE_TIMEOUT_S, "cluster lookups to read Redis again")  # fmt: skip
    load.stop()
    assert not load.errors, load.errors
    assert b.stats().mirror_failures >= 1
