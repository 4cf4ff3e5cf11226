"""What lands in Redis: namespaced keys, block hashes and leases only, never token ids."""

from __future__ import annotations

import json
import struct

import cbor2

from kv_manager_service.mirror.schema import KeySchema
from mirror_support import (
    BLOCK_SIZE,
    CONVERGE_TIMEOUT_S,
    all_redis_blobs,
    block_hashes,
    namespace,
    prompt,
    replica_block_set,
    wait_until,
)


def test_two_model_names_never_see_each_others_entries(mirror_redis, replicas):
    m1a, m1b, m2 = replicas.start_many(
        [
            dict(replica_id="m1-a", redis_url=mirror_redis.url, model_name="llama-8b"),
            dict(replica_id="m1-b", redis_url=mirror_redis.url, model_name="llama-8b"),
            # Same replica id in the other deployment: still no collision.
            dict(replica_id="m1-a", redis_url=mirror_redis.url, model_name="qwen-7b"),
        ]
    )
    tokens = prompt(50, 3 * BLOCK_SIZE + 1)
    only_m2 = prompt(51, 2 * BLOCK_SIZE + 1)
    m1a.cache("same-prompt", tokens)
    m2.cache("same-prompt", tokens[: 2 * BLOCK_SIZE + 1])  # the same hashes, two of them
    m2.cache("own", only_m2)

    wait_until(lambda: m1b.cluster(tokens), lambda got: got == {"m1-a": 3 * BLOCK_SIZE, "m1-b": 0},
               CONVERGE_TIMEOUT_S, "llama-8b's prefix in its own deployment")
    wait_until(lambda: m2.cluster(tokens), lambda got: got == {"m1-a": 2 * BLOCK_SIZE},
               CONVERGE_TIMEOUT_S, "qwen-7b's prefix in its own deployment")
    wait_until(lambda: m2.cluster(only_m2), lambda got: got == {"m1-a": 2 * BLOCK_SIZE},
               CONVERGE_TIMEOUT_S, "qwen-7b's own prompt")
    assert m1a.cluster(tokens) == {"m1-a": 3 * BLOCK_SIZE, "m1-b": 0}  # not 2 blocks: qwen's m1-a is not ours
    assert m1b.cluster(only_m2) == {"m1-a": 0, "m1-b": 0}

    client = mirror_redis.client()
    try:
        ns1, ns2 = namespace("llama-8b"), namespace("qwen-7b")
        assert ns1 != ns2
        keys = [k.decode() for k in client.scan_iter(count=1000)]
        assert keys and all(k.startswith((ns1 + ":", ns2 + ":")) for k in keys), keys
        assert replica_block_set(client, ns1, "m1-a", m1a.incarnation) == set(block_hashes(tokens))
        # qwen-7b's answers above came from m2's own pool: wait for its writer.
        wait_until(lambda: replica_block_set(client, ns2, "m1-a", m2.incarnation),
                   lambda got: got == set(block_hashes(tokens[: 2 * BLOCK_SIZE])) | set(block_hashes(only_m2)),
                   CONVERGE_TIMEOUT_S, "qwen-7b's entries")  # fmt: skip
        assert {m.decode() for m in client.smembers(f"{ns1}:replicas")} == {"m1-a", "m1-b"}
        assert {m.decode() for m in client.smembers(f"{ns2}:replicas")} == {"m1-a"}
    finally:
        client.close()


def test_a_hash_seed_gets_its_own_namespace_and_is_not_written(mirror_redis, replicas):
    seed = "s3cret-seed-Zq81"
    plain, seeded = replicas.start_many(
        [
            dict(replica_id="plain", redis_url=mirror_redis.url),
            dict(replica_id="seeded", redis_url=mirror_redis.url, extra=["--hash-seed", seed]),
        ]
    )
    tokens = prompt(52, 2 * BLOCK_SIZE + 1)
    plain.cache("p", tokens)
    seeded.cache("p", tokens)
    wait_until(lambda: seeded.cluster(tokens), lambda got: got == {"seeded": 2 * BLOCK_SIZE},
               CONVERGE_TIMEOUT_S, "the seeded replica's prefix, in its own namespace")
    assert plain.cluster(tokens) == {"plain": 2 * BLOCK_SIZE}
    client = mirror_redis.client()
    try:
        # The answers above came from each replica's own pool: wait for the seeded one's writer.
        wait_until(lambda: replica_block_set(client, namespace(seed=seed), "seeded", seeded.incarnation),
                   lambda got: got == set(block_hashes(tokens, seed=seed)), CONVERGE_TIMEOUT_S,
                   "the seeded replica's entries")  # fmt: skip
        for key, values in all_redis_blobs(client).items():
            for blob in [key, *values]:
                assert seed.encode() not in blob, (key, blob)
    finally:
        client.close()


def _token_encodings(tokens: list[int]) -> list[bytes]:
    """Ways a prompt's token ids could be written: decimal, JSON, packed 32/64-bit, CBOR."""
    forms = [str(t).encode() for t in tokens]
    forms.append(json.dumps(tokens[:4]).encode())
    forms.append(",".join(map(str, tokens[:4])).encode())
    for i in range(0, len(tokens) - 1, 7):
        pair = tokens[i : i + 2]
        forms += [struct.pack("<2I", *pair), struct.pack(">2I", *pair), struct.pack("<2Q", *pair)]
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = tokens[start : start + BLOCK_SIZE]
        forms.append(cbor2.dumps(block))
        forms.append(cbor2.dumps(block)[1:9])  # any run of a few CBOR-encoded ids
    return forms


def test_only_hashes_are_written_never_token_ids(mirror_redis, replicas):
    a = replicas.start("replica-a", mirror_redis.url)
    # Distinctive ids (valid uint32): their decimal and packed forms cannot occur by chance.
    tokens = [3_141_592_653 + 7 * i for i in range(4 * BLOCK_SIZE + 3)]
    a.cache("secret-prompt", tokens)
    result = a.client.allocate("running", tokens[: 2 * BLOCK_SIZE + 9], num_new_tokens=2 * BLOCK_SIZE + 9)
    assert result.status.name == "OK"  # a live request too: its lease counts it
    client = mirror_redis.client()
    try:
        ns = namespace()
        expected = set(block_hashes(tokens))
        wait_until(lambda: replica_block_set(client, ns, "replica-a", a.incarnation), lambda got: got == expected,
                   CONVERGE_TIMEOUT_S, "the prompt's block hashes in Redis")
        wait_until(lambda: json.loads(client.get(f"{ns}:lease:replica-a") or b"{}").get("num_requests"),
                   lambda n: n == 1, CONVERGE_TIMEOUT_S, "the lease to count the running request")
        blobs = all_redis_blobs(client)
        schema = KeySchema("default", "sha256_cbor")
        # Exactly the documented keys: one per block hash, the lease, the replica set.
        assert set(blobs) == {schema.block(0, h).encode() for h in expected} | {
            schema.lease("replica-a").encode(),
            schema.replicas.encode(),
        }
        forms = _token_encodings(tokens)
        for key, values in blobs.items():
            for blob in [key, *values]:
                for form in forms:
                    assert form not in blob, f"{key!r} holds {blob!r}, which contains the token encoding {form!r}"
        lease = json.loads(blobs[schema.lease("replica-a").encode()][0])
        assert set(lease) == {"incarnation", "address", "num_requests", "usage", "num_free_blocks"}
        assert lease["incarnation"] == a.incarnation and lease["address"] == a.address
    finally:
        client.close()
        a.client.free(["running"])
