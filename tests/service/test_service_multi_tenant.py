"""`kv-manager serve --multi-tenant`: tenants cannot see each other's cache or requests; quotas hold.

One server for the module, tenants `alice`, `bob` (quota 6 blocks), `carol`
and the operator `infra`; each test uses prompts of its own and leaves no
request live. The tenants' salts are recomputed here from the secret with
hmac and the hashes with cbor2 (the derivation the README documents), so
the tests also pin the wire-visible algorithm down.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import urllib.request
from typing import Any, Iterator

import pytest
from processes import ROOT, log_records
from prometheus_client.parser import text_string_to_metric_families
from svc_support import chain_hashes, pool_config, register_worker, snapshot, take

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateStatus, ExpectOp, FailedPreconditionError, FreeOp, RequestNotFoundError
from kv_manager_service.shared.ops import AllocateOp
from kvcache.v1 import kv_manager_pb2 as pb

SECRET = b"the-deployment-secret-5f1c0e9a"
TOKENS = {
    "alice": "alice-token-Nq4Wb8Yx2Lk6",
    "bob": "bob-token-Pz7Hc3Jv9Md1",
    "carol": "carol-token-Gs5Tf0Ra8Ue2",
    "infra": "infra-token-Kd2Xw6Qm4Bn9",
}
BOB_QUOTA = 6
BLOCK = 16
NUM_BLOCKS = 64
WORKER_ID = "mt-test-worker"


def tenant_salt(tenant: str, client_salt: str = "") -> str:
    key = hmac.new(SECRET, tenant.encode(), hashlib.sha256).digest()
    return hmac.new(key, client_salt.encode(), hashlib.sha256).hexdigest()


def salted_hashes(token_ids: list[int], salt: str) -> list[bytes]:
    """Block hashes as the core computes them with a cache salt: the salt is an extra key of block 0 only."""
    first = chain_hashes(token_ids[:BLOCK], BLOCK, extra=[["cache_salt", salt]])
    return first + chain_hashes(token_ids[BLOCK:], BLOCK, parent=first[-1])


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50_000 + 1 for i in range(num_tokens)]


def write_private(path, text: str):
    path.write_text(text, encoding="utf-8")
    os.chmod(path, 0o600)
    return path


def tenant_files(directory) -> list[str]:
    tokens = {
        "alice": TOKENS["alice"],
        "bob": {"token": TOKENS["bob"], "quota_blocks": BOB_QUOTA},
        "carol": TOKENS["carol"],
        "infra": {"token": TOKENS["infra"], "role": "operator"},
    }
    token_file = write_private(directory / "tokens.json", json.dumps(tokens))
    secret_file = write_private(directory / "secret", SECRET.decode() + "\n")
    return ["--multi-tenant", "--auth-token-file", str(token_file), "--tenant-secret-file", str(secret_file)]


def tenant_metrics(server: Any) -> dict[tuple[str, str], float]:
    """(metric sample name, tenant) -> value, scraped with the operator's token from the URL the server logged."""
    (url,) = [record["metrics_url"] for record in log_records(server) if "metrics_url" in record]
    scrape = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKENS['infra']}"})
    with urllib.request.urlopen(scrape, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, sample.labels["tenant"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("kvcache_tenant_")
        for sample in family.samples
    }


class Tenants:
    def __init__(self, address: str) -> None:
        self.clients = {name: KVManagerClient(address, token=token) for name, token in TOKENS.items()}

    def __getattr__(self, name: str) -> KVManagerClient:
        return self.clients[name]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


@pytest.fixture(scope="module")
def server(module_server_factory, tmp_path_factory) -> Any:
    directory = tmp_path_factory.mktemp("tenants")
    args = [*tenant_files(directory), "--tenant-quota-blocks", "40", "--metrics-port", "0", "--replica-id", "mt"]
    args += ["--worker-timeout-s", "3600"]  # the tests take turns registering workers
    return module_server_factory.start(*args, config=pool_config(NUM_BLOCKS, BLOCK))


@pytest.fixture(scope="module")
def tenants(server) -> Iterator[Tenants]:
    tenants = Tenants(server.address)
    yield tenants
    tenants.close()


@pytest.fixture(autouse=True)
def nothing_left_live(tenants) -> Iterator[None]:
    yield
    assert tenants.infra.stats().num_requests == 0, "a test left requests live"


def cache(client: KVManagerClient, request_id: str, token_ids: list[int], **kwargs: Any) -> None:
    result = client.allocate(request_id, token_ids, len(token_ids), **kwargs)
    assert result.status is AllocateStatus.OK, result
    client.free([request_id])


# -- what a tenant can learn of another's cache -----------------------------------------------


def test_a_tenant_cannot_learn_whether_another_cached_a_prompt(tenants):
    secret_prompt = prompt(1, 3 * BLOCK + 1)
    cache(tenants.bob, "b-1", secret_prompt)
    assert tenants.bob.find_cache_hit(secret_prompt)[0].num_cached_tokens == 3 * BLOCK  # bob's cache works

    hit, replicas = tenants.alice.find_cache_hit(secret_prompt, cluster=True)
    assert hit.num_cached_tokens == 0 and hit.block_ids == ((),)
    assert [(r.replica_id, r.num_cached_tokens) for r in replicas] == [("mt", 0)]
    result = tenants.alice.allocate("a-1", secret_prompt, len(secret_prompt))
    assert result.status is AllocateStatus.OK
    assert result.num_computed_tokens == 0 and result.groups[0].hit_block_ids == ()
    tenants.alice.free(["a-1"])

    # Bob's blocks were there all along, and still are.
    again = tenants.bob.allocate("b-2", secret_prompt, len(secret_prompt))
    assert again.num_computed_tokens == 3 * BLOCK
    tenants.bob.free(["b-2"])


def test_a_client_salt_cannot_reach_another_tenants_blocks(tenants):
    operator = tenants.infra
    secret_prompt = prompt(2, 2 * BLOCK + 1)
    first_event = operator.stub.GetStats(pb.GetStatsRequest(), timeout=10).last_event_sequence + 1
    cache(tenants.bob, "b-1", secret_prompt)
    # The blocks bob stored hash with his derived salt (read from the operator's event stream).
    stream = operator.watch_events(first_event)
    stored = [h for event in take(stream, 1) for h in event.block_stored.block_hashes]
    stream.cancel()
    assert stored == salted_hashes(secret_prompt, tenant_salt("bob"))
    assert stored != salted_hashes(secret_prompt, tenant_salt("alice"))
    assert stored[0] not in chain_hashes(secret_prompt, BLOCK)  # not the unsalted hash either

    # Whatever salt alice sends (bob's derived salt, bob's name, nothing), she reaches none of bob's blocks.
    for client_salt in (tenant_salt("bob"), "bob", None):
        assert tenants.alice.find_cache_hit(secret_prompt, cache_salt=client_salt)[0].num_cached_tokens == 0
        result = tenants.alice.allocate("a-1", secret_prompt, len(secret_prompt), cache_salt=client_salt)
        assert result.num_computed_tokens == 0, client_salt
        tenants.alice.free(["a-1"])
    # A client salt still separates a tenant's own requests, and a continuation may leave it out.
    cache(tenants.bob, "b-2", secret_prompt, cache_salt="conversation-7")
    assert tenants.bob.find_cache_hit(secret_prompt, cache_salt="conversation-7")[0].num_cached_tokens == 2 * BLOCK
    result = tenants.bob.allocate("b-3", secret_prompt, len(secret_prompt), cache_salt="conversation-7")
    assert result.num_computed_tokens == 2 * BLOCK
    assert tenants.bob.allocate("b-3", [5], 1).status is AllocateStatus.OK
    assert tenants.bob.step([AllocateOp("b-3", [6], 1, cache_salt="conversation-7")]).results[0].status is AllocateStatus.OK
    tenants.bob.free(["b-3"])


# -- request ids -----------------------------------------------------------------------------


def test_request_ids_are_per_tenant(tenants):
    alice, bob, operator = tenants.alice, tenants.bob, tenants.infra
    assert alice.allocate("same-id", prompt(3, 40), 40).status is AllocateStatus.OK
    assert bob.allocate("same-id", prompt(4, 20), 20).status is AllocateStatus.OK  # no ALREADY_EXISTS

    alice_tables = alice.block_tables()
    bob_tables = bob.block_tables(["same-id"])
    assert [t.request_id for t in alice_tables.tables] == ["same-id"]
    assert len(alice_tables.tables[0].block_ids[0]) == 3 and len(bob_tables.tables[0].block_ids[0]) == 2
    assert alice_tables.pending_copies == ()
    everything = operator.block_tables()
    assert sorted(t.request_id for t in everything.tables) == ["alice/same-id", "bob/same-id"]
    stats = alice.stats()
    assert stats.num_requests == 1  # hers, not the pool's two

    # Alice cannot name bob's request, not even by its internal id; her errors show her own ids.
    for request_id in ("bob/same-id", "other"):
        with pytest.raises(RequestNotFoundError) as caught:
            alice.free([request_id])
        assert f"'{request_id}'" in str(caught.value) and "alice/" not in str(caught.value)
    assert sorted(t.request_id for t in operator.block_tables().tables) == ["alice/same-id", "bob/same-id"]

    alice.free(["same-id"])
    assert bob.block_tables(["same-id"]).tables[0].request_id == "same-id"  # bob's is untouched
    first_step = bob.free(["same-id"]).step_id - 3
    # Workers see the internal ids.
    stream = operator.watch_steps(WORKER_ID, first_step)
    deltas = take(stream, 4)
    stream.cancel()
    assert [r.request_id for r in deltas[0].rows_added] == ["alice/same-id"]
    assert [r.request_id for r in deltas[1].rows_added] == ["bob/same-id"]
    assert list(deltas[2].requests_freed) == ["alice/same-id"]
    assert list(deltas[3].requests_freed) == ["bob/same-id"]
    operator.ack_steps(WORKER_ID, deltas[3].step_id)


def test_idempotency_keys_are_per_tenant(tenants):
    alice, bob = tenants.alice, tenants.bob

    def keyed(client: KVManagerClient, request_id: str) -> pb.StepResponse:
        request = pb.StepRequest(idempotency_key="retry-key-1")
        request.ops.add().allocate.CopyFrom(pb.AllocateRequest(request_id=request_id, token_ids=[1, 2, 3], num_new_tokens=3))
        return client.stub.Step(request, timeout=10)

    first = keyed(alice, "k-a")
    assert keyed(bob, "k-b").step_id == first.step_id + 1  # the same key, another tenant: a step of its own
    assert keyed(alice, "k-a") == first  # alice's retry: her stored response
    assert [t.request_id for t in bob.block_tables(["k-b"]).tables] == ["k-b"]
    alice.free(["k-a"])
    bob.free(["k-b"])


def test_a_tenant_reads_its_own_counters_and_the_pools_occupancy(tenants):
    carol = tenants.carol
    before = carol.stats()
    words = prompt(5, 2 * BLOCK + 1)
    cache(carol, "c-1", words)
    cache(carol, "c-2", words)  # a hit of two blocks
    cache(tenants.alice, "a-1", words)  # alice's lookups are not carol's
    after = carol.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * len(words)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * BLOCK
    pool = tenants.infra.stats()
    assert (after.num_blocks, after.num_free_blocks) == (pool.num_blocks, pool.num_free_blocks)
    assert pool.prefix_cache_queries - after.prefix_cache_queries >= len(words)  # the operator sees the pool's
    raw = carol.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert raw.last_event_sequence == 0 and tenants.infra.stub.GetStats(pb.GetStatsRequest()).last_event_sequence > 0


# -- quotas ------------------------------------------------------------------------------------


def test_a_tenant_past_its_quota_gets_no_space_while_others_allocate(tenants, server):
    alice, bob, operator = tenants.alice, tenants.bob, tenants.infra
    assert bob.allocate("q-1", prompt(6, 5 * BLOCK), 5 * BLOCK).status is AllocateStatus.OK  # 5 of 6 blocks
    assert bob.allocate("q-2", prompt(7, BLOCK), BLOCK).status is AllocateStatus.OK  # 6 of 6
    before = snapshot(operator.stub)
    refused = bob.allocate("q-3", prompt(8, BLOCK), BLOCK)
    assert refused.status is AllocateStatus.NO_SPACE and refused.groups == ()
    assert bob.decode(["q-2"], [9]).statuses == (AllocateStatus.NO_SPACE,)  # a 7th block, for the 17th token
    after = snapshot(operator.stub)
    # Nothing changed but the step ids the refusals took.
    assert after["tables"] == before["tables"] and after["stats"]["num_free_blocks"] == before["stats"]["num_free_blocks"]
    assert operator.stats().num_free_blocks > 20  # the pool itself had room

    # Meanwhile alice allocates more than bob's quota.
    assert alice.allocate("q-a", prompt(9, 10 * BLOCK), 10 * BLOCK).status is AllocateStatus.OK
    # Freeing and allocating in one step is net zero: within the quota.
    step = bob.step([FreeOp(["q-2"]), AllocateOp("q-3", prompt(8, BLOCK), BLOCK)])
    assert step.results[1].status is AllocateStatus.OK

    samples = tenant_metrics(server)
    assert samples["kvcache_tenant_blocks", "bob"] == BOB_QUOTA
    assert samples["kvcache_tenant_blocks", "alice"] == 10
    assert samples["kvcache_tenant_quota_blocks", "bob"] == BOB_QUOTA
    assert samples["kvcache_tenant_quota_blocks", "alice"] == 40  # --tenant-quota-blocks
    assert samples["kvcache_tenant_requests", "bob"] == 2
    assert samples["kvcache_tenant_quota_refusals_total", "bob"] == 2
    assert samples["kvcache_tenant_quota_refusals_total", "alice"] == 0
    pool = operator.stats()
    held = sum(samples["kvcache_tenant_blocks", t] for t in TOKENS)
    assert held == pool.num_blocks - 1 - pool.num_free_blocks  # no block is counted twice, or missed
    alice.free(["q-a"])
    bob.free(["q-1", "q-3"])


def test_copies_count_for_their_tenant_until_the_workers_acknowledge_them(tenants, server):
    carol, operator = tenants.carol, tenants.infra
    assert carol.allocate("f-1", prompt(10, BLOCK + 4), BLOCK + 4).status is AllocateStatus.OK  # 2 blocks
    carol.fork("f-1", ["f-2"])
    written = carol.decode(["f-2"], [11])  # writes into the shared partial block: copy-on-write
    assert len(written.copies) == 1
    assert tenant_metrics(server)["kvcache_tenant_blocks", "carol"] == 3
    carol.free(["f-1", "f-2"])
    # Freed, but the copy still holds its source and destination until acknowledged.
    assert tenant_metrics(server)["kvcache_tenant_blocks", "carol"] == 2
    register_worker(operator.stub, WORKER_ID)
    operator.ack_steps(WORKER_ID, operator.stub.GetStats(pb.GetStatsRequest(), timeout=10).last_step_id)
    assert tenant_metrics(server)["kvcache_tenant_blocks", "carol"] == 0
    pool = operator.stats()
    assert pool.num_pending_copies == 0 and pool.num_free_blocks == NUM_BLOCKS - 1


# -- startup -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--hash-algorithm", "xxh3_128", "--hash-seed", "a-secret-seed-0123"], "refuses --hash-algorithm xxh3_128"),
        (["--tenant-secret-file", None], "needs --tenant-secret-file"),
        (["--auth-token-file", "single"], "naming the tenants"),
    ],
    ids=["xxh3", "no-secret", "single-token"],
)
def test_multi_tenant_refuses_to_start_without_what_it_needs(tmp_path, extra, message):
    args = tenant_files(tmp_path)
    single = write_private(tmp_path / "single", "one-token-for-all-0123456789\n")
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in args:
            i = args.index(flag)
            del args[i : i + 2]
        if value is not None:
            args += [flag, str(single) if value == "single" else value]
    done = subprocess.run(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "16", *args],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr


def test_expect_ops_are_refused_in_multi_tenant_mode_and_change_nothing(tenants):
    before = tenants.alice.stats()
    with pytest.raises(FailedPreconditionError) as raised:
        tenants.alice.step([ExpectOp("waiting", prompt(90, 32))])
    assert raised.value.field == "expect" and "multi-tenant" in str(raised.value)
    assert tenants.alice.stats() == before
