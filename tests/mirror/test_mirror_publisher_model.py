"""The publisher against a model, on a real Redis: random event batches, clears and resyncs of both tiers.

The model is the replica's own state: a count per device key and the set of
host keys. After every batch or republication, Redis must hold exactly one
entry per key of either tier, naming the device while a device block carries
it. Pages of a few writes make every republication and clear span round trips.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_manager_service.core.host_index import HostIndex, HostKeys
from kv_manager_service.mirror import publisher as publisher_module
from kv_manager_service.mirror.publisher import EntryPublisher
from kv_manager_service.mirror.schema import KeySchema
from kv_manager_service.shared.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier

INCARNATION = "7"
HOST_CAPACITY = 5
KEYS = [(i % 2, hashlib.sha256(bytes([i])).digest()) for i in range(10)]
namespaces = itertools.count()

# An op: ("device+" | "device-" | "host+" | "host-", key index), ("clear",) or ("republish",).
ops = st.one_of(
    st.tuples(st.sampled_from(["device+", "device-", "host+", "host-"]), st.integers(0, len(KEYS) - 1)),
    st.just(("clear",)),
    st.just(("republish",)),
)


def host_copy(host: set[tuple[int, bytes]]) -> HostKeys:
    index = HostIndex(HOST_CAPACITY, 2, 32)
    for block_id, key in enumerate(sorted(host)):
        index.insert(block_id, *key)
    group_ids, hashes, _ = index.columns()
    return HostKeys(group_ids, hashes, 32, HOST_CAPACITY)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(st.lists(ops, min_size=1, max_size=8), min_size=1, max_size=8), page=st.integers(1, 4))
def test_redis_holds_exactly_both_tiers_after_every_batch(redis_server, script, page):
    schema = KeySchema(f"model-{next(namespaces)}", "sha256_cbor")
    client = redis_server.client()
    publisher = EntryPublisher(client, schema, "r", INCARNATION)
    device: Counter = Counter()
    host: set[tuple[int, bytes]] = set()
    saved_page = publisher_module.WRITE_PAGE_KEYS
    publisher_module.WRITE_PAGE_KEYS = page
    try:
        publisher.republish(Counter(), host_copy(host))
        for batch in script:
            events = []
            for op in batch:
                if op[0] == "republish":
                    publisher.apply(events)
                    events = []
                    publisher.republish(+device, host_copy(host))
                    continue
                if op[0] == "clear":
                    device.clear()
                    host.clear()
                    events.append(AllBlocksCleared())
                    continue
                kind, key = op[0], KEYS[op[1]]
                if kind == "device+":
                    device[key] += 1
                    events.append(BlockStored(key[0], (key[1],), None, 16))
                elif kind == "device-" and device[key] > 0:
                    device[key] -= 1
                    events.append(BlockRemoved(key[0], (key[1],)))
                elif kind == "host+" and key not in host and len(host) < HOST_CAPACITY:
                    host.add(key)  # the host tier holds a key at most once, in at most its capacity
                    events.append(BlockStored(key[0], (key[1],), None, 0, Tier.HOST))
                elif kind == "host-" and key in host:
                    host.discard(key)
                    events.append(BlockRemoved(key[0], (key[1],), Tier.HOST))
            publisher.apply(events)
            expected = {schema.block(*key): INCARNATION for key in +device}
            expected |= {schema.block(*key): f"{INCARNATION}:host" for key in host if not device[key]}
            assert entries(client, schema) == expected
    finally:
        publisher_module.WRITE_PAGE_KEYS = saved_page
        client.close()


def entries(client, schema: KeySchema) -> dict[str, str]:
    found = {}
    for key in client.scan_iter(match=schema.block_pattern()):
        value = client.hget(key, "r")
        if value is not None:
            found[key.decode()] = value.decode()
    return found
