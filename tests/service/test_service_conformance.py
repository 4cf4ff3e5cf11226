"""The core's exact-id conformance scenario, driven over gRPC against a real server.

Block size 16, one full-attention group, a pool of 11 blocks (10 usable).
Fresh blocks come from the head of the free queue; a freed request releases
its blocks last-to-first, unhashed ones to the head, hashed ones to the tail.
"""

from __future__ import annotations

import pytest

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateStatus
from kvcache.v1 import kv_manager_pb2 as pb

from svc_support import OK, alloc, chain_hashes, connect, pool_config, read_events, stats, tables

C = 16 * [0] + 16 * [1] + 16 * [2]


@pytest.fixture(scope="module")
def conformance_server(module_server_factory):
    return module_server_factory.start("--replica-id", "conformance", config=pool_config(11, 16))


def test_exact_block_ids_over_grpc(conformance_server):
    channel, stub = connect(conformance_server.address)
    with channel, KVManagerClient(conformance_server.address) as client:
        config = stub.GetConfig(pb.GetConfigRequest())
        assert config.num_blocks == 11 and [g.block_size for g in config.groups] == [16]

        r0 = stub.Allocate(alloc("r0", C + 7 * [3]))
        assert (r0.status, r0.num_computed_tokens, r0.num_scheduled_tokens, r0.step_id) == (OK, 0, 55, 1)
        assert [(list(g.hit_block_ids), list(g.new_block_ids), g.new_block_index) for g in r0.groups] == [
            ([], [1, 2, 3, 4], 0)
        ]

        # The typed client sees the same contract.
        r1 = client.allocate("r1", C + 5 * [3], 53)
        assert r1.status is AllocateStatus.OK and r1.step_id == 2
        assert (r1.num_computed_tokens, r1.num_scheduled_tokens) == (48, 5)
        assert [(g.hit_block_ids, g.new_block_ids, g.new_block_index) for g in r1.groups] == [((1, 2, 3), (5,), 3)]

        assert stub.Free(pb.FreeRequest(request_ids=["r0"])) == pb.FreeResponse(num_freed_blocks=1, step_id=3)
        assert stub.Free(pb.FreeRequest(request_ids=["r1"])) == pb.FreeResponse(num_freed_blocks=4, step_id=4)
        s = stats(stub)
        assert (s.num_free_blocks, s.num_requests, s.usage, s.last_step_id) == (10, 0, 0.0, 4)

        hit = stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=C + 6 * [3]))
        assert hit.num_cached_tokens == 48 and [list(g.block_ids) for g in hit.groups] == [[1, 2, 3]]

        r2 = stub.Allocate(alloc("r2", C + 6 * [3]))
        assert (r2.status, r2.num_computed_tokens, r2.num_scheduled_tokens, r2.step_id) == (OK, 48, 6, 5)
        assert [(list(g.hit_block_ids), list(g.new_block_ids), g.new_block_index) for g in r2.groups] == [
            ([1, 2, 3], [5], 3)
        ]
        assert tables(stub) == {"r2": (54, ((1, 2, 3, 5),))}
        assert stub.Free(pb.FreeRequest(request_ids=["r2"])).step_id == 6

        events_before = stats(stub).last_event_sequence
        r3 = stub.Allocate(alloc("r3", 160 * [99]))
        assert (r3.status, r3.num_computed_tokens, r3.num_scheduled_tokens, r3.step_id) == (OK, 0, 160, 7)
        assert [list(g.new_block_ids) for g in r3.groups] == [[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]]
        assert [list(g.hit_block_ids) for g in r3.groups] == [[]]
        s = stats(stub)
        assert (s.num_free_blocks, s.usage, s.num_requests, s.num_evictions) == (0, 1.0, 1, 3)
        assert stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=C + 6 * [3])).num_cached_tokens == 0

        # r3 evicted C's three blocks (popped 3, 2, 1 in that order), then cached its own ten.
        events = read_events(stub, events_before + 1, s.last_event_sequence - events_before)
        removed = [h for e in events if e.WhichOneof("event") == "block_removed" for h in e.block_removed.block_hashes]
        stored = [h for e in events if e.WhichOneof("event") == "block_stored" for h in e.block_stored.block_hashes]
        c_hashes = chain_hashes(C, 16)
        assert removed == [c_hashes[2], c_hashes[1], c_hashes[0]]
        assert stored == chain_hashes(160 * [99], 16)

        assert stub.Free(pb.FreeRequest(request_ids=["r3"])) == pb.FreeResponse(num_freed_blocks=10, step_id=8)
        assert stats(stub).num_free_blocks == 10
