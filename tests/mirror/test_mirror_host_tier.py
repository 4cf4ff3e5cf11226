"""The Redis mirror with a host-memory tier: which tier each replica holds a block in, and routing by it.

Replica A serves with `--num-host-blocks`: a device pool of 8 usable blocks
and a host tier of 8. Replica B has no tier. A registered worker acknowledges
every step of A, so the host blocks that offloads pin are released. A 65-token
prompt caches 4 blocks; a 128-token filler then takes A's whole device pool,
which moves the prompt's 4 blocks to the host. B's cluster lookup must report
them as A's host tokens; a host eviction, a FLUSHALL and routing follow.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import pytest

from kv_manager_service.shared.events import BlockRemoved, BlockStored, Tier
from kv_manager_service.mirror.connect import RedisEndpoint, connect_now
from kv_manager_service.mirror.lookup import HOST_HIT_WEIGHT, ClusterIndex, ReplicaPrefix, choose_replica
from kv_manager_service.mirror.schema import KeySchema, Lease
from kv_manager_service import wire
from kvcache.v1 import kv_manager_pb2 as pb
from mirror_support import BLOCK_SIZE, CALL_TIMEOUT_S, CONVERGE_TIMEOUT_S, ManagerProcess, block_hashes, prompt, wait_until

WORKER = "gpu-0"
PROMPT = prompt(40, 4 * BLOCK_SIZE + 1)  # 4 full blocks, one token to compute
FILLER = prompt(41, 8 * BLOCK_SIZE)  # A's whole device pool
OTHER_FILLER = prompt(42, 8 * BLOCK_SIZE)
TIER = ["--num-host-blocks", "8", "--worker-timeout-s", "3600"]
SCHEMA = KeySchema("default", "sha256_cbor")


def tiers(replica: ManagerProcess, token_ids: list[int]) -> dict[str, tuple[int, int]]:
    """FindCacheHit(cluster=true) from `replica`: replica id -> (cached tokens in both tiers, host-only tokens)."""
    request = pb.FindCacheHitRequest(token_ids=token_ids, cluster=True)
    response = replica.client.stub.FindCacheHit(request, timeout=CALL_TIMEOUT_S)
    return {r.replica_id: (r.num_cached_tokens, r.num_host_cached_tokens) for r in response.replicas}


def register_worker(replica: ManagerProcess) -> None:
    """Register WORKER at A's next step (a WatchSteps stream, closed once GetStats lists it)."""
    from_step_id = replica.stats().last_step_id + 1
    stream = replica.client.stub.WatchSteps(pb.WatchStepsRequest(worker_id=WORKER, from_step_id=from_step_id))
    try:
        wait_until(lambda: [w.worker_id for w in replica.stats().workers], lambda ids: WORKER in ids,
                   CONVERGE_TIMEOUT_S, "the worker to be registered")  # fmt: skip
    finally:
        stream.cancel()


def run_acked(replica: ManagerProcess, request_id: str, token_ids: list[int], free: bool = True) -> None:
    """Allocate `token_ids` whole (then free them), acknowledging every step: the tier's pins are released."""
    result = replica.client.allocate(request_id, token_ids, num_new_tokens=len(token_ids))
    assert result.status.name == "OK", result
    if free:
        replica.client.free([request_id])
    replica.client.stub.AckSteps(
        pb.AckStepsRequest(worker_id=WORKER, step_id=replica.stats().last_step_id), timeout=CALL_TIMEOUT_S
    )


@pytest.fixture
def pair(mirror_redis, replicas) -> Iterator[tuple[ManagerProcess, ManagerProcess]]:
    """A (with the tier, its prompt moved to the host) and B (no tier), both mirrored in `mirror_redis`."""
    a, b = replicas.start_many(
        [
            dict(replica_id="replica-a", redis_url=mirror_redis.url, num_blocks=9, extra=TIER),
            dict(replica_id="replica-b", redis_url=mirror_redis.url, num_blocks=64),
        ]
    )
    register_worker(a)
    run_acked(a, "prompt", PROMPT)
    wait_until(lambda: tiers(b, PROMPT), lambda got: got.get("replica-a") == (64, 0), CONVERGE_TIMEOUT_S,
               "A's prompt on its device, seen from B")  # fmt: skip
    run_acked(a, "filler", FILLER)  # evicts the prompt's blocks into the host
    yield a, b


def test_a_prefix_moved_to_the_host_is_still_reported_as_host_tokens(mirror_redis, pair):
    a, b = pair
    answer = wait_until(lambda: tiers(b, PROMPT), lambda got: got.get("replica-a") == (64, 64), CONVERGE_TIMEOUT_S,
                        "A's prompt, now only on its host, seen from B")  # fmt: skip
    assert answer == {"replica-a": (64, 64), "replica-b": (0, 0)}
    assert tiers(a, PROMPT) == answer  # A answers for itself from its pool: the same
    # The filler took the device: its blocks are device entries (7 of 8 may be a hit: one token is computed).
    wait_until(lambda: tiers(b, FILLER), lambda got: got.get("replica-a") == (112, 0), CONVERGE_TIMEOUT_S,
               "A's filler on its device, seen from B")  # fmt: skip

    client = mirror_redis.client()
    try:
        key = SCHEMA.block(0, block_hashes(PROMPT)[0])
        assert client.hget(key, "replica-a") == f"{a.incarnation}:host".encode()
        # The mirror holds exactly A's host-only prompt blocks: nothing of them was deleted.
        values = [client.hget(SCHEMA.block(0, h), "replica-a") for h in block_hashes(PROMPT)]
        assert values == [f"{a.incarnation}:host".encode()] * 4

        client.flushall()  # Redis loses everything: the writers' resyncs restore both tiers
        wait_until(lambda: tiers(b, PROMPT), lambda got: got.get("replica-a") == (64, 64), CONVERGE_TIMEOUT_S,
                   "A's host-only prompt restored after FLUSHALL")  # fmt: skip
        wait_until(lambda: tiers(b, FILLER), lambda got: got.get("replica-a") == (112, 0), CONVERGE_TIMEOUT_S,
                   "A's device filler restored after FLUSHALL")  # fmt: skip
    finally:
        client.close()


def test_a_host_eviction_removes_the_prefix_from_the_cluster_answer(pair):
    a, b = pair
    wait_until(lambda: tiers(b, PROMPT), lambda got: got.get("replica-a") == (64, 64), CONVERGE_TIMEOUT_S,
               "A's prompt on its host, seen from B")  # fmt: skip
    # 8 more offloads (the filler's blocks) into a host of 8: its 4 free blocks, then the prompt's 4.
    run_acked(a, "other", OTHER_FILLER)
    wait_until(lambda: tiers(b, PROMPT), lambda got: got.get("replica-a") == (0, 0), CONVERGE_TIMEOUT_S,
               "A's prompt gone from the cluster answer after its host eviction")  # fmt: skip
    wait_until(lambda: tiers(b, FILLER), lambda got: got.get("replica-a") == (112, 112), CONVERGE_TIMEOUT_S,
               "A's filler, moved to the host, seen from B")  # fmt: skip
    assert a.stats().num_host_evictions == 4


def test_routing_weighs_host_hits_below_device_hits(mirror_redis, pair):
    a, b = pair
    hashes = block_hashes(PROMPT)
    client = connect_now(RedisEndpoint(mirror_redis.url))  # what a manager connects, either topology
    try:
        index = ClusterIndex(client, SCHEMA)

        def prefixes() -> dict[str, tuple[int, int]]:
            return {p.replica_id: (p.num_cached_blocks, p.num_host_blocks) for p in index.lookup(0, hashes)}

        b.cache("b-short", PROMPT[: BLOCK_SIZE + 1])  # B holds the prompt's first block on its device
        wait_until(prefixes, lambda got: got == {"replica-a": (4, 4), "replica-b": (1, 0)}, CONVERGE_TIMEOUT_S,
                   "a long host hit on A and a short device hit on B")  # fmt: skip
        assert choose_replica(index.lookup(0, hashes)) == "replica-a"  # 4 x 0.8 > 1

        b.cache("b-long", PROMPT)  # now B holds all 4 on its device
        wait_until(prefixes, lambda got: got == {"replica-a": (4, 4), "replica-b": (4, 0)}, CONVERGE_TIMEOUT_S,
                   "equally long hits, A's on its host and B's on its device")  # fmt: skip
        assert choose_replica(index.lookup(0, hashes)) == "replica-b"
    finally:
        client.close()


# -- choose_replica's weighting, without Redis ----------------------------------------


def _prefix(replica_id: str, num_device_blocks: int, num_host_blocks: int, usage: float = 0.5) -> ReplicaPrefix:
    lease = Lease(replica_id, 1, f"{replica_id}:50051", 4, usage, 100)
    return ReplicaPrefix(replica_id, num_device_blocks + num_host_blocks, lease, num_host_blocks)


@pytest.mark.parametrize(
    "prefixes, expected",
    [
        ([_prefix("device", 5, 0, usage=0.9), _prefix("host", 0, 5, usage=0.0)], "device"),  # equally long
        ([_prefix("device", 3, 0), _prefix("host", 0, 10)], "host"),  # much longer on the host
        ([_prefix("mixed", 2, 3), _prefix("device", 4, 0)], "mixed"),  # 2 + 2.4 > 4
        ([_prefix("mixed", 1, 3), _prefix("device", 4, 0)], "device"),  # 1 + 2.4 < 4
    ],
)
def test_choose_replica_scores_device_blocks_plus_weighted_host_blocks(prefixes, expected):
    for order in itertools.permutations(prefixes):
        assert choose_replica(order) == expected


def test_an_exact_tie_of_scores_goes_to_the_least_loaded_as_before():
    assert HOST_HIT_WEIGHT * 5 == 4  # exact: 4 device blocks score what 5 host blocks score
    prefixes = [_prefix("device", 4, 0, usage=0.7), _prefix("host", 0, 5, usage=0.2)]
    for order in itertools.permutations(prefixes):
        assert choose_replica(order) == "host"


# -- the events on the wire -------------------------------------------------------------


def test_a_device_event_is_sent_as_before_and_a_host_event_names_its_tier():
    block_hash = bytes(range(32))
    device = wire.kv_event(BlockStored(0, (block_hash,), None, 16), 1, "replica-a", 7)
    before = pb.KVEvent(sequence=1, replica_id="replica-a", incarnation=7)
    before.block_stored.block_hashes.append(block_hash)
    before.block_stored.group_id, before.block_stored.block_size = 0, 16
    assert device.SerializeToString() == before.SerializeToString()
    stored = wire.kv_event(BlockStored(0, (block_hash,), None, 0, Tier.HOST), 2, "replica-a", 7)
    removed = wire.kv_event(BlockRemoved(0, (block_hash,), Tier.HOST), 3, "replica-a", 7)
    assert stored.block_stored.tier == removed.block_removed.tier == pb.TIER_HOST
    assert wire.kv_event(BlockRemoved(0, (block_hash,)), 4, "replica-a", 7).block_removed.tier == pb.TIER_UNSPECIFIED
