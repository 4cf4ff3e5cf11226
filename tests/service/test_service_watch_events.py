"""WatchEvents over real gRPC: numbering, replay from a sequence, and hashes checked independently.

The expected hashes are computed here with hashlib and cbor2 only:
h_i = sha256(cbor2.dumps([h_{i-1}, tokens of block i, extra_keys], canonical=True)),
root = sha256(cbor2.dumps("vllm-none-hash", canonical=True)).
"""

from __future__ import annotations

import hashlib

import cbor2
import grpc
import pytest

from kv_manager_service.client import KVManagerClient
from kvcache.v1 import kv_manager_pb2 as pb

from svc_support import OK, ROOT_HASH, alloc, chain_hashes, connect, pool_config, stats, take, watch_events

REPLICA = "events-replica"
BS = 16

A = [7000 + i for i in range(52)]  # three full blocks and 4
B = A[:32] + [8000 + i for i in range(33)]  # shares A's first two blocks; four full blocks and 1
A_EXT = A + [7100 + i for i in range(12)]  # A decoded to 64 tokens: a fourth full block
C = [9000 + i for i in range(81)]  # five full blocks and 1


@pytest.fixture(scope="module")
def events_server(module_server_factory):
    return module_server_factory.start("--replica-id", REPLICA, config=pool_config(8, BS))


@pytest.fixture(scope="module")
def stub(events_server):
    channel, stub = connect(events_server.address)
    yield stub
    channel.close()


@pytest.fixture(scope="module")
def history(stub):
    """Drive a fixed history; returns every event from sequence 1 as streamed from 0."""
    assert stub.Allocate(alloc("a", A)).status == OK  # blocks 1-4
    b = stub.Allocate(alloc("b", B))  # hit 1, 2; new 5, 6, 7: the pool is full
    assert b.status == OK and b.num_computed_tokens == 32
    assert stub.Allocate(alloc("a", A_EXT[52:])).num_scheduled_tokens == 12  # fills block 4
    stub.Free(pb.FreeRequest(request_ids=["a", "b"]))  # free queue: 7, 4, 3, 6, 5, 2, 1
    assert stub.Allocate(alloc("c", C)).status == OK  # pops 7, 4, 3, 6, 5, 2: evicts five, in one event
    stub.Free(pb.FreeRequest(request_ids=["c"]))
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()).ok
    n = stats(stub).last_event_sequence
    assert n == 6
    stream = watch_events(stub, 0)
    try:
        events = take(stream, n)
    finally:
        stream.cancel()
    return events


def kind(event: pb.KVEvent) -> str:
    return event.WhichOneof("event")


def test_events_are_numbered_from_one_and_carry_the_replica(stub, history):
    config = stub.GetConfig(pb.GetConfigRequest())
    assert [e.sequence for e in history] == list(range(1, 7))
    assert all(e.replica_id == REPLICA and e.incarnation == config.incarnation != 0 for e in history)
    assert [kind(e) for e in history] == ["block_stored"] * 3 + ["block_removed", "block_stored", "all_blocks_cleared"]


def test_block_stored_carries_raw_chained_hashes(history):
    a, b, a_ext, c = (chain_hashes(t, BS) for t in (A, B, A_EXT, C))
    assert a[:2] == b[:2] and a == a_ext[:3]
    assert ROOT_HASH == hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    stored = [(list(e.block_stored.block_hashes), e.block_stored.parent_block_hash, e.block_stored.group_id,
               e.block_stored.block_size) for e in history if kind(e) == "block_stored"]
    assert stored == [
        (a[:3], b"", 0, BS),  # the first block starts the sequence: no parent
        (b[2:4], a[1], 0, BS),  # after a hit of two blocks
        (a_ext[3:4], a[2], 0, BS),  # a decode filled a block
        (c[:5], b"", 0, BS),
    ]
    assert all(len(h) == 32 for e in history if kind(e) == "block_stored" for h in e.block_stored.block_hashes)


def test_block_removed_in_eviction_order(history):
    a, b, a_ext = (chain_hashes(t, BS) for t in (A, B, A_EXT))
    removed = [(list(e.block_removed.block_hashes), e.block_removed.group_id) for e in history if kind(e) == "block_removed"]
    assert removed == [([a_ext[3], a[2], b[3], b[2], a[1]], 0)]


@pytest.mark.parametrize("k", [1, 2, 4, 5, 6])
def test_replay_from_a_sequence_yields_exactly_the_rest_then_follows(stub, history, k):
    n = len(history)
    last_before = stats(stub).last_event_sequence  # earlier tests may have added events after the history
    stream = watch_events(stub, k)
    try:
        replayed = take(stream, last_before - k + 1)
        assert replayed[: n - k + 1] == history[k - 1 :]
        assert [e.sequence for e in replayed] == list(range(k, last_before + 1))
        # Nothing else was pending: what follows is exactly what a new step makes now.
        tokens = [50_000 + 100 * k + i for i in range(17)]
        assert stub.Allocate(alloc(f"live-{k}", tokens)).status == OK
        last = stats(stub).last_event_sequence
        following = take(stream, last - last_before)
    finally:
        stream.cancel()
    assert [e.sequence for e in following] == list(range(last_before + 1, last + 1))
    assert kind(following[-1]) == "block_stored"
    assert list(following[-1].block_stored.block_hashes) == chain_hashes(tokens, BS)
    assert all(kind(e) == "block_removed" for e in following[:-1])  # evictions come first
    stub.Free(pb.FreeRequest(request_ids=[f"live-{k}"]))
    # The retained history is unchanged by readers.
    stream = watch_events(stub, 1)
    try:
        assert take(stream, n) == history
    finally:
        stream.cancel()


def test_extra_keys_in_the_hashes(stub, history):
    """LoRA on every block, a multimodal item per overlapping block, the cache salt on the first block."""
    tokens = [60_000 + i for i in range(33)]
    first = stats(stub).last_event_sequence + 1
    response = stub.Allocate(
        alloc("x", tokens, cache_salt="pepper", lora_name="adapter", lora_path="/lora/a",
              mm_features=[pb.MMFeature(identifier="img-1", offset=10, length=10)])
    )
    assert response.status == OK
    last = stats(stub).last_event_sequence
    stream = watch_events(stub, first)
    try:
        events = take(stream, last - first + 1)
    finally:
        stream.cancel()
    stored = [e.block_stored for e in events if kind(e) == "block_stored"]
    assert len(stored) == 1
    lora = ["lora", "adapter", "/lora/a"]
    h0 = hashlib.sha256(cbor2.dumps(
        [ROOT_HASH, tokens[:16], [lora, ["mm", "img-1", 10], ["cache_salt", "pepper"]]], canonical=True)).digest()
    h1 = hashlib.sha256(cbor2.dumps([h0, tokens[16:32], [lora, ["mm", "img-1", -6]]], canonical=True)).digest()
    assert list(stored[0].block_hashes) == [h0, h1] and stored[0].parent_block_hash == b""
    stub.Free(pb.FreeRequest(request_ids=["x"]))


def test_a_group_with_bigger_blocks_names_each_block_by_its_last_hash(server_factory):
    """hash_block_size is the gcd (16); a 32-token block is named by the chain hash at its last 16-token boundary."""
    groups = [{"kind": "full_attention", "block_size": 32}, {"kind": "sliding_window", "block_size": 16, "sliding_window": 32}]
    server = server_factory.start("--replica-id", "hybrid-events", config={"num_blocks": 40, "groups": groups})
    channel, stub = connect(server.address)
    with channel:
        assert stub.GetConfig(pb.GetConfigRequest()).hash_block_size == 16
        tokens = list(range(70))
        assert stub.Allocate(alloc("a", tokens)).status == OK
        n = stats(stub).last_event_sequence
        stream = watch_events(stub, 1)
        try:
            events = take(stream, n)
        finally:
            stream.cancel()
        h = chain_hashes(tokens, 16)
        stored = sorted(
            (e.block_stored.group_id, e.block_stored.block_size, list(e.block_stored.block_hashes),
             e.block_stored.parent_block_hash)
            for e in events if kind(e) == "block_stored"
        )
        assert stored == [(0, 32, [h[1], h[3]], b""), (1, 16, h[:4], b"")]
        stub.Free(pb.FreeRequest(request_ids=["a"]))
        hit = stub.FindCacheHit(pb.FindCacheHitRequest(token_ids=tokens))
        assert hit.num_cached_tokens == 64  # on lcm (32) boundaries
        assert [len(g.block_ids) for g in hit.groups] == [2, 4]
        assert list(hit.groups[1].block_ids)[:2] == [0, 0]  # outside the window: null placeholders


@pytest.mark.parametrize("max_events", [0, 1, 3])
def test_batches_carry_the_same_events_in_order(stub, history, max_events):
    """WatchEventBatches streams WatchEvents' events, at most max_events_per_message a message (0: 1024)."""
    last = stats(stub).last_event_sequence
    request = pb.WatchEventBatchesRequest(from_sequence=2, max_events_per_message=max_events)
    stream = stub.WatchEventBatches(request, timeout=30)
    received: list[pb.KVEvent] = []
    try:
        for response in stream:
            assert 0 < len(response.events) <= (max_events or 1024)
            received += response.events
            if len(received) >= last - 1:
                break
    finally:
        stream.cancel()
    assert [e.sequence for e in received] == list(range(2, last + 1))
    assert received[: len(history) - 1] == history[1:]



def test_the_client_reads_batches_as_lists_of_events(events_server, stub, history):
    client = KVManagerClient(events_server.address)
    try:
        batches = client.watch_event_batches(from_sequence=1, max_events_per_message=4)
        received: list[pb.KVEvent] = []
        for batch in batches:
            assert 0 < len(batch) <= 4
            received += batch
            if len(received) >= len(history):
                break
        batches.close()
    finally:
        client.close()
    assert received[: len(history)] == history


def test_watch_events_is_deprecated_in_the_contract_in_favour_of_batches():
    """Every event of WatchEvents costs the server a message per watcher; the contract says so."""
    methods = pb.DESCRIPTOR.services_by_name["KVManagerService"].methods_by_name
    assert methods["WatchEvents"].GetOptions().deprecated
    assert not methods["WatchEventBatches"].GetOptions().deprecated
