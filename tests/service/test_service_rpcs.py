"""Every RPC of KVManagerService over real gRPC, through the typed client and the raw stubs.

One server for the module (64 blocks of 16 tokens); every test frees what it
made and acknowledges every step, so each starts from an empty pool.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kv_manager_service.client import DecodeTableChange, KVManagerClient, ReplicaHit
from kv_manager_service.core import (
    AllocateOp,
    AllocateResult,
    AllocateStatus,
    ExpectOp,
    ExpectResult,
    ForkOp,
    ForkResult,
    FreeOp,
    FreeResult,
    LoraRef,
)
from kvcache.v1 import kv_manager_pb2 as pb

from svc_support import (
    NO_SPACE,
    OK,
    alloc,
    assert_error,
    connect,
    last_step_id,
    op_alloc,
    op_fork,
    op_free,
    read_events,
    read_steps,
    register_worker,
    release_everything,
    rpc_error,
    snapshot,
    stats,
    step_request,
    table,
    tables,
)

WORKER = "rpc-worker"
REPLICA = "replica-test"
SERVICE = "kvcache.v1.KVManagerService"


@pytest.fixture(scope="module")
def channel_and_stub(server):
    channel, stub = connect(server.address)
    yield channel, stub
    channel.close()


@pytest.fixture(scope="module")
def stub(channel_and_stub):
    return channel_and_stub[1]


@pytest.fixture(scope="module")
def client(server):
    with KVManagerClient(server.address) as client:
        client.wait_ready()
        yield client


@pytest.fixture(autouse=True)
def empty_pool_after(stub):
    """Each test starts with WORKER registered (copies wait for its acks), and leaves the pool empty."""
    register_worker(stub, WORKER)
    yield
    release_everything(stub, WORKER)


def prompt(seed: int, length: int) -> list[int]:
    """Tokens unique to `seed`, so tests never share cached blocks by accident."""
    return [seed * 1000 + i for i in range(length)]


# -- GetConfig -----------------------------------------------------------------------


def test_get_config_raw_and_typed(stub, client):
    config = stub.GetConfig(pb.GetConfigRequest())
    assert config.num_blocks == 64
    assert [(g.group_id, g.kind, g.block_size) for g in config.groups] == [(0, pb.GROUP_KIND_FULL_ATTENTION, 16)]
    assert config.hash_algorithm == "sha256_cbor"
    assert config.hash_block_size == 16
    assert config.replica_id == REPLICA
    assert config.incarnation != 0
    assert config.enable_prefix_caching
    assert config.max_model_len > 0 and config.max_num_requests > 0
    assert config.max_tokens_per_call == 1 << 20  # the CLI default
    assert (config.eviction_policy, config.max_expected_blocks) == ("lru", 16 * 64)  # the defaults
    assert client.get_config() == config
    assert stub.GetConfig(pb.GetConfigRequest()).incarnation == config.incarnation  # stable within one run


def test_get_config_lists_every_group_kind(server_factory):
    groups = [
        {"kind": "full_attention", "block_size": 32},
        {"kind": "sliding_window", "block_size": 16, "sliding_window": 48},
        {"kind": "chunked_local", "block_size": 16, "chunk_size": 64},
        {"kind": "mamba", "block_size": 32},
        {"kind": "cross_attention", "block_size": 16},
    ]
    hybrid = server_factory.start("--replica-id", "hybrid", config={"num_blocks": 80, "groups": groups})
    channel, stub = connect(hybrid.address)
    with channel:
        config = stub.GetConfig(pb.GetConfigRequest())
        assert [(g.group_id, g.kind, g.block_size, g.sliding_window, g.chunk_size) for g in config.groups] == [
            (0, pb.GROUP_KIND_FULL_ATTENTION, 32, 0, 0),
            (1, pb.GROUP_KIND_SLIDING_WINDOW, 16, 48, 0),
            (2, pb.GROUP_KIND_CHUNKED_LOCAL, 16, 0, 64),
            (3, pb.GROUP_KIND_MAMBA, 32, 0, 0),
            (4, pb.GROUP_KIND_CROSS_ATTENTION, 16, 0, 0),
        ]
        assert config.hash_block_size == 16  # gcd of the cacheable groups' block sizes
        assert config.num_blocks == 80 and config.replica_id == "hybrid" and config.incarnation != 0

        # FindCacheHit names exactly the table prefix an Allocate then adopts, null placeholders included.
        tokens = list(range(100))
        first = stub.Allocate(alloc("h-a", tokens, num_encoder_tokens=20))
        assert first.status == OK
        stub.Free(pb.FreeRequest(request_ids=["h-a"]))
        hit = stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=tokens))
        second = stub.Allocate(alloc("h-b", tokens, num_encoder_tokens=20))
        assert second.status == OK
        assert hit.num_cached_tokens == second.num_computed_tokens == 96
        assert [(g.group_id, list(g.block_ids)) for g in hit.groups] == [
            (g.group_id, list(g.hit_block_ids)) for g in second.groups
        ]
        window_hit = list(second.groups[1].hit_block_ids)
        assert len(window_hit) == 96 // 16 and window_hit[0] == 0 and window_hit[-1] != 0
        assert list(second.groups[4].hit_block_ids) == []  # cross-attention is never cached
        stub.Free(pb.FreeRequest(request_ids=["h-b"]))


# -- Allocate / Free -------------------------------------------------------------------


def test_allocate_continue_lookahead_and_free_typed(client, stub):
    base = last_step_id(stub)
    tokens = prompt(1, 40)  # two full blocks and 8 tokens
    first = client.allocate("a-1", tokens, len(tokens))
    assert first.status is AllocateStatus.OK
    assert (first.num_computed_tokens, first.num_scheduled_tokens, first.step_id) == (0, 40, base + 1)
    (group,) = first.groups
    assert group.group_id == 0 and group.hit_block_ids == () and group.new_block_index == 0
    assert len(group.new_block_ids) == 3 and len(set(group.new_block_ids)) == 3 and 0 not in group.new_block_ids
    assert first.copies == ()
    assert tables(stub, "a-1") == {"a-1": (40, (group.new_block_ids,))}

    decode = client.allocate("a-1", [7], 1)  # only the appended token
    assert (decode.num_computed_tokens, decode.num_scheduled_tokens, decode.step_id) == (40, 1, base + 2)
    assert decode.groups[0].new_block_ids == () and decode.groups[0].new_block_index == 3

    lookahead = client.allocate("a-1", [8], 1, num_lookahead_tokens=8)  # 42 + 8 slots: a fourth block
    assert (lookahead.num_computed_tokens, lookahead.num_scheduled_tokens) == (41, 1)
    assert lookahead.groups[0].new_block_index == 3 and len(lookahead.groups[0].new_block_ids) == 1
    full_table = list(group.new_block_ids) + list(lookahead.groups[0].new_block_ids)
    assert table(stub, "a-1") == full_table
    assert tables(stub, "a-1")["a-1"][0] == 42

    freed = client.free(["a-1"])
    assert freed == FreeResult(4, base + 4)
    assert tables(stub) == {}
    assert stats(stub).num_requests == 0


def test_chunked_prefill_raw_stub(stub):
    base = last_step_id(stub)
    tokens = prompt(2, 40)
    first = stub.Allocate(alloc("chunk", tokens, 16))
    assert (first.status, first.num_computed_tokens, first.num_scheduled_tokens, first.step_id) == (OK, 0, 16, base + 1)
    assert len(first.groups[0].new_block_ids) == 1
    second = stub.Allocate(alloc("chunk", [], 16))  # the next chunk carries no tokens
    assert (second.num_computed_tokens, second.num_scheduled_tokens) == (16, 16)
    assert second.groups[0].new_block_index == 1 and len(second.groups[0].new_block_ids) == 1
    third = stub.Allocate(alloc("chunk", [], 16))
    assert (third.num_computed_tokens, third.num_scheduled_tokens) == (32, 8)  # only 8 tokens were left
    assert third.groups[0].new_block_index == 2 and len(third.groups[0].new_block_ids) == 1
    assert table(stub, "chunk") == [
        *first.groups[0].new_block_ids, *second.groups[0].new_block_ids, *third.groups[0].new_block_ids
    ]
    assert tables(stub, "chunk")["chunk"][0] == 40
    freed = stub.Free(pb.FreeRequest(request_ids=["chunk"]))
    assert (freed.num_freed_blocks, freed.step_id) == (3, base + 4)


def test_prefix_hit_and_skip_prefix_cache(stub):
    tokens = prompt(3, 53)  # three full blocks and 5
    before = stats(stub)
    a = stub.Allocate(alloc("hit-a", tokens))
    b = stub.Allocate(alloc("hit-b", tokens))
    assert b.status == OK and b.num_computed_tokens == 48 and b.num_scheduled_tokens == 5
    assert list(b.groups[0].hit_block_ids) == list(a.groups[0].new_block_ids[:3])
    assert b.groups[0].new_block_index == 3 and len(b.groups[0].new_block_ids) == 1
    c = stub.Allocate(alloc("hit-c", tokens, skip_prefix_cache=True))
    assert c.num_computed_tokens == 0 and list(c.groups[0].hit_block_ids) == [] and len(c.groups[0].new_block_ids) == 4
    after = stats(stub)
    assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * 53  # a skipped lookup is no query
    assert after.prefix_cache_hits - before.prefix_cache_hits == 48
    freed = stub.Free(pb.FreeRequest(request_ids=["hit-a", "hit-b", "hit-c"]))
    assert freed.num_freed_blocks == 4 + 4 + 1  # a's shared blocks reach 0 only with b


# -- Fork ------------------------------------------------------------------------------


def test_fork_children_share_and_copy_on_write(client, stub):
    tokens = prompt(4, 20)  # block 1 is partly filled
    parent = client.allocate("f-p", tokens, len(tokens))
    parent_table = list(parent.groups[0].new_block_ids)
    base = last_step_id(stub)
    assert client.fork("f-p", ["f-c1", "f-c2"]) == ForkResult(base + 1)
    assert tables(stub, "f-c1", "f-c2", "f-p") == {
        rid: (20, (tuple(parent_table),)) for rid in ("f-c1", "f-c2", "f-p")
    }
    used = stats(stub).num_free_blocks

    # The child inherits tokens and progress: a continuation that writes into the shared block copies it first.
    c1 = client.allocate("f-c1", [5], 1)
    assert (c1.num_computed_tokens, c1.num_scheduled_tokens, c1.step_id) == (20, 1, base + 2)
    (copy,) = c1.copies
    assert copy.src_block_id == parent_table[1] and copy.dst_block_id not in parent_table
    assert c1.groups[0].new_block_index == 1 and c1.groups[0].new_block_ids == (copy.dst_block_id,)
    assert table(stub, "f-c1") == [parent_table[0], copy.dst_block_id]
    response = stub.GetBlockTables(pb.GetBlockTablesRequest())
    assert [(p.step_id, p.copy.src_block_id, p.copy.dst_block_id) for p in response.pending_copies] == [
        (base + 2, copy.src_block_id, copy.dst_block_id)
    ]
    assert stats(stub).num_pending_copies == 1 and stats(stub).num_free_blocks == used - 1

    c2 = client.allocate("f-c2", [6], 1)  # the parent still holds the block: another copy
    assert len(c2.copies) == 1 and c2.copies[0].src_block_id == parent_table[1]
    p = client.allocate("f-p", [7], 1)  # now only the pending copies retain it besides the parent: no copy
    assert p.copies == () and p.groups[0].new_block_ids == ()
    assert table(stub, "f-p") == parent_table

    client.ack_steps(WORKER, c2.step_id)
    assert stats(stub).num_pending_copies == 0
    assert set(tables(stub)) == {"f-p", "f-c1", "f-c2"}


# -- FindCacheHit ---------------------------------------------------------------------------


def test_find_cache_hit_typed_and_raw(client, stub):
    tokens = prompt(5, 50)
    admitted = stub.Allocate(alloc("fch", tokens))
    blocks = list(admitted.groups[0].new_block_ids)
    before = snapshot(stub)

    hit, replicas = client.find_cache_hit(tokens)
    assert hit.num_cached_tokens == 48 and hit.block_ids == (tuple(blocks[:3]),) and replicas == ()
    hit, _ = client.find_cache_hit(tokens[:48])  # capped so that one token is computed
    assert hit.num_cached_tokens == 32 and hit.block_ids == (tuple(blocks[:2]),)
    assert client.find_cache_hit(tokens, cache_salt="salt")[0].num_cached_tokens == 0
    assert client.find_cache_hit(tokens, lora=LoraRef("adapter", "/a"))[0].num_cached_tokens == 0
    assert client.find_cache_hit(prompt(6, 50))[0].num_cached_tokens == 0

    hit, replicas = client.find_cache_hit(tokens, cluster=True)
    assert replicas == (ReplicaHit(REPLICA, 48),)
    raw = stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=tokens, cluster=True))
    assert raw.num_cached_tokens == 48
    assert [(g.group_id, list(g.block_ids)) for g in raw.groups] == [(0, blocks[:3])]
    assert [(r.replica_id, r.num_cached_tokens) for r in raw.replicas] == [(REPLICA, 48)]
    empty = stub.FindCacheHit(pb.FindCacheHitRequest())
    assert empty.num_cached_tokens == 0

    assert snapshot(stub) == before  # a lookup changes nothing (not even the hit counters)


# -- Step ------------------------------------------------------------------------------------


def test_step_nested_ops_and_decode_batch_mixed(stub):
    base = last_step_id(stub)
    setup = stub.Step(
        step_request([op_alloc("s-p", prompt(7, 20)), op_alloc("s-d1", prompt(8, 31)), op_alloc("s-d2", prompt(9, 16)),
                      op_alloc("s-f", prompt(10, 33))])
    )
    assert setup.step_id == base + 1 and not setup.HasField("decode")
    assert [r.WhichOneof("result") for r in setup.results] == ["allocate"] * 4
    assert all(r.allocate.status == OK and r.allocate.step_id == base + 1 for r in setup.results)
    s_p_table = list(setup.results[0].allocate.groups[0].new_block_ids)

    mixed = stub.Step(
        step_request(
            [op_alloc("s-new", prompt(11, 10)), op_fork("s-p", "s-pc"), op_free("s-f")],
            decode=[("s-d1", 99), ("s-d2", 98)],
        )
    )
    assert mixed.step_id == base + 2
    assert [r.WhichOneof("result") for r in mixed.results] == ["allocate", "fork", "free"]
    new = mixed.results[0].allocate
    assert (new.status, new.num_computed_tokens, new.num_scheduled_tokens, new.step_id) == (OK, 0, 10, base + 2)
    assert mixed.results[1].fork.step_id == base + 2
    assert (mixed.results[2].free.num_freed_blocks, mixed.results[2].free.step_id) == (3, base + 2)
    decode = mixed.decode
    assert list(decode.statuses) == [OK, OK]
    assert list(decode.num_computed_tokens) == [31, 16]
    # s-d1 fills its second block (32 tokens): no change; s-d2's 17th token needs a second block.
    assert len(decode.changes) == 1
    change = decode.changes[0]
    assert (change.op_index, change.group_id, change.new_block_index, len(change.new_block_ids)) == (1, 0, 1, 1)
    assert list(decode.copies) == []

    live = tables(stub)
    assert set(live) == {"s-p", "s-pc", "s-d1", "s-d2", "s-new"}
    assert live["s-pc"] == live["s-p"] == (20, (tuple(s_p_table),))
    assert live["s-d1"][0] == 32 and live["s-d2"][0] == 17
    assert live["s-d2"][1][0][1] == change.new_block_ids[0]

    # A forked child decoding into the shared, partly filled block: the copy comes back in columns.
    cow = stub.Step(step_request(decode=[("s-pc", 1), ("s-d1", 2)]))
    assert cow.step_id == base + 3 and len(cow.results) == 0
    assert list(cow.decode.statuses) == [OK, OK] and list(cow.decode.num_computed_tokens) == [20, 32]
    (copy,) = cow.decode.copies
    assert copy.src_block_id == s_p_table[1]
    changes = [(c.op_index, c.group_id, c.new_block_index, list(c.new_block_ids)) for c in cow.decode.changes]
    assert changes[0] == (0, 0, 1, [copy.dst_block_id])  # the replaced slot
    assert changes[1][:3] == (1, 0, 2) and len(changes[1][3]) == 1  # s-d1's 33rd token opens block 2
    assert table(stub, "s-pc") == [s_p_table[0], copy.dst_block_id]


def test_step_and_decode_typed(client, stub):
    base = last_step_id(stub)
    result = client.step([AllocateOp("t-a", prompt(12, 16), 16), AllocateOp("t-b", prompt(13, 5), 5)])
    assert result.step_id == base + 1
    assert [type(r) for r in result.results] == [AllocateResult, AllocateResult]
    assert all(r.status is AllocateStatus.OK and r.step_id == base + 1 for r in result.results)

    decoded = client.decode(["t-a", "t-b"], [1, 2])
    assert decoded.step_id == base + 2
    assert decoded.statuses == (AllocateStatus.OK, AllocateStatus.OK)
    assert decoded.num_computed_tokens == (16, 5)
    assert len(decoded.changes) == 1 and decoded.changes[0][:3] == (0, 0, 1)
    assert isinstance(decoded.changes[0], DecodeTableChange) and decoded.copies == ()

    result = client.step([FreeOp(["t-b"]), ForkOp("t-a", ["t-a2"]), AllocateOp("t-c", prompt(14, 3), 3)])
    assert result.step_id == base + 3
    assert [type(r) for r in result.results] == [FreeResult, ForkResult, AllocateResult]
    assert result.results[0] == FreeResult(1, base + 3) and result.results[1] == ForkResult(base + 3)
    assert set(tables(stub)) == {"t-a", "t-a2", "t-c"}


# -- GetBlockTables / AckSteps -----------------------------------------------------------------


def test_get_block_tables_all_and_by_id(client, stub):
    empty = stub.GetBlockTables(pb.GetBlockTablesRequest())
    assert list(empty.tables) == [] and list(empty.pending_copies) == []
    assert empty.step_id == last_step_id(stub)
    a = stub.Allocate(alloc("bt-a", prompt(15, 17)))
    b = stub.Allocate(alloc("bt-b", prompt(16, 3)))
    every = stub.GetBlockTables(pb.GetBlockTablesRequest())
    assert every.step_id == b.step_id == last_step_id(stub)
    assert {t.request_id: (t.num_computed_tokens, [list(g.block_ids) for g in t.groups]) for t in every.tables} == {
        "bt-a": (17, [list(a.groups[0].new_block_ids)]),
        "bt-b": (3, [list(b.groups[0].new_block_ids)]),
    }
    assert all(g.group_id == 0 for t in every.tables for g in t.groups)
    by_id = stub.GetBlockTables(pb.GetBlockTablesRequest(request_ids=["bt-b", "bt-a"]))
    assert [t.request_id for t in by_id.tables] == ["bt-b", "bt-a"]  # in the order asked
    typed = client.block_tables(["bt-a"])
    assert typed.step_id == b.step_id and typed.pending_copies == ()
    assert [(t.request_id, t.num_computed_tokens, t.block_ids) for t in typed.tables] == [
        ("bt-a", 17, (tuple(a.groups[0].new_block_ids),))
    ]


def test_ack_steps_releases_copies_step_by_step(client, stub):
    stub.Allocate(alloc("ack-p", prompt(17, 20)))
    client.fork("ack-p", ["ack-c1", "ack-c2"])
    first = client.allocate("ack-c1", [1], 1)
    second = client.allocate("ack-c2", [1], 1)
    assert len(first.copies) == len(second.copies) == 1
    pending = client.block_tables().pending_copies
    assert [(p.step_id, p.copy) for p in pending] == [(first.step_id, first.copies[0]), (second.step_id, second.copies[0])]
    held = stats(stub).num_free_blocks

    assert stub.AckSteps(pb.AckStepsRequest(worker_id=WORKER, step_id=first.step_id - 1)) == pb.AckStepsResponse()
    assert stats(stub).num_pending_copies == 2
    client.ack_steps(WORKER, first.step_id)
    assert [p.step_id for p in client.block_tables().pending_copies] == [second.step_id]
    # The source is still held by ack-p and the destination by ack-c1: releasing frees nothing yet.
    assert stats(stub).num_free_blocks == held
    client.ack_steps(WORKER, second.step_id)
    client.ack_steps(WORKER, first.step_id)  # acknowledging an older step again is a no-op
    assert stats(stub).num_pending_copies == 0
    assert client.block_tables().pending_copies == ()


# -- ResetPrefixCache / GetStats ------------------------------------------------------------------


def test_reset_prefix_cache(client, stub):
    tokens = prompt(18, 40)
    stub.Allocate(alloc("rpc-r", tokens))
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()).ok is False  # blocks are held
    assert client.find_cache_hit(tokens)[0].num_cached_tokens == 32  # and nothing was forgotten
    client.free(["rpc-r"])
    assert client.find_cache_hit(tokens)[0].num_cached_tokens == 32
    steps_before = last_step_id(stub)
    assert client.reset_prefix_cache() is True
    assert client.find_cache_hit(tokens)[0].num_cached_tokens == 0
    assert last_step_id(stub) == steps_before  # not a step
    last = stats(stub).last_event_sequence
    (event,) = read_events(stub, last, 1)
    assert event.WhichOneof("event") == "all_blocks_cleared" and event.sequence == last


def test_get_stats_raw_and_typed(client, stub):
    before = stats(stub)
    assert before.num_blocks == 64 and before.num_free_blocks == 63 and before.usage == 0.0
    assert before.num_requests == 0 and before.num_pending_copies == 0
    tokens = prompt(19, 48)
    stub.Allocate(alloc("st-a", tokens))
    stub.Allocate(alloc("st-b", tokens))  # hits 32 tokens, computes the third block again
    after = stats(stub)
    assert after.num_requests == 2
    assert after.num_free_blocks == 63 - 4
    assert after.usage == pytest.approx(4 / 63)
    assert after.prefix_cache_queries - before.prefix_cache_queries == 96
    assert after.prefix_cache_hits - before.prefix_cache_hits == 32
    assert after.last_step_id == before.last_step_id + 2
    assert after.last_event_sequence > before.last_event_sequence  # their blocks entered the cache
    typed = client.stats()
    assert (typed.num_blocks, typed.num_free_blocks, typed.usage, typed.num_requests) == (64, 59, after.usage, 2)
    assert (typed.prefix_cache_queries, typed.prefix_cache_hits) == (after.prefix_cache_queries, after.prefix_cache_hits)
    assert (typed.num_evictions, typed.num_pending_copies) == (after.num_evictions, 0)


# -- the streams (in depth in their own modules) --------------------------------------------------


def test_watch_steps_and_events_typed_smoke(client, stub):
    result = client.allocate("w-a", prompt(20, 16), 16)
    stream = client.watch_steps(WORKER, result.step_id)
    try:
        delta = next(stream)
    finally:
        stream.cancel()
    assert delta.step_id == result.step_id
    assert [(r.request_id, r.num_computed_tokens, [list(g.block_ids) for g in r.groups]) for r in delta.rows_added] == [
        ("w-a", 16, [list(result.groups[0].new_block_ids)])
    ]
    last = stats(stub).last_event_sequence
    events = client.watch_events(last)
    try:
        event = next(events)
    finally:
        events.cancel()
    assert event.sequence == last and event.replica_id == REPLICA
    assert event.WhichOneof("event") == "block_stored"
    assert event.block_stored.block_size == 16 and len(event.block_stored.block_hashes) == 1
    assert len(read_steps(stub, WORKER, result.step_id, 1)) == 1


def test_no_space_is_a_result_with_a_step_id(stub):
    before = snapshot(stub)
    too_big = stub.Allocate(alloc("ns", prompt(21, 64 * 16)))  # more blocks than the pool has
    assert too_big.status == NO_SPACE and too_big.step_id == before["stats"]["last_step_id"] + 1
    assert (too_big.num_computed_tokens, too_big.num_scheduled_tokens, list(too_big.groups)) == (0, 0, [])
    after = snapshot(stub)
    assert after["stats"].pop("last_step_id") == too_big.step_id
    before["stats"].pop("last_step_id")
    assert after["tables_step_id"] == too_big.step_id
    before.pop("tables_step_id"), after.pop("tables_step_id")
    assert after == before


# -- health checking and reflection -----------------------------------------------------------------


def test_health_check_serving(channel_and_stub):
    channel = channel_and_stub[0]
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service


def test_reflection_lists_and_describes_the_service(channel_and_stub):
    channel = channel_and_stub[0]
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
    ]
    listed, described = list(reflection.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert SERVICE in names and "grpc.health.v1.Health" in names
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in described.file_descriptor_response.file_descriptor_proto]
    services = {(f.package, s.name): [m.name for m in s.method] for f in files for s in f.service}
    assert set(services[("kvcache.v1", "KVManagerService")]) >= {
        "GetConfig", "Allocate", "Free", "Fork", "FindCacheHit", "Step", "GetBlockTables",
        "WatchSteps", "AckSteps", "ResetPrefixCache", "GetStats", "WatchEvents",
    }


def test_step_expect_keeps_a_waiting_prompt_and_a_free_withdraws_it(client, stub):
    base = last_step_id(stub)
    result = client.step([ExpectOp("x-waiting", prompt(15, 40)), AllocateOp("x-live", prompt(16, 8), 8)])
    assert result.results[0] == ExpectResult(32, base + 1)  # two whole blocks of 16
    raw = stub.Step(step_request([pb.StepOp(expect=pb.ExpectRequest(request_id="x-raw", token_ids=prompt(17, 16)))]))
    assert raw.results[0].WhichOneof("result") == "expect"
    assert (raw.results[0].expect.num_expected_tokens, raw.results[0].expect.step_id) == (16, base + 2)
    figures = stats(stub)
    assert (figures.num_expected_requests, figures.num_expected_blocks) == (2, 3)
    error = rpc_error(stub.Step, step_request([pb.StepOp(expect=pb.ExpectRequest(request_id="x-live", token_ids=[1]))]))
    assert_error(error, grpc.StatusCode.ALREADY_EXISTS, "REQUEST_EXISTS", "ops[0].request_id")
    admitted = client.allocate("x-waiting", prompt(15, 40), 40)
    assert admitted.status is AllocateStatus.OK
    freed = client.step([FreeOp(["x-raw", "x-waiting", "x-live"])])
    assert freed.results[0].num_freed_blocks == 3 + 1  # x-waiting's 3 blocks and x-live's 1; x-raw held none
    assert set(tables(stub)).isdisjoint({"x-raw", "x-waiting", "x-live"})
    assert (stats(stub).num_expected_requests, stats(stub).num_expected_blocks) == (0, 0)
