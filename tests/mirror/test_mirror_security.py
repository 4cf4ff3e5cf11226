"""The Redis mirror with AUTH and TLS, and what a multi-tenant deployment leaves in Redis.

Real redis-server processes: one started with `--requirepass`, one serving
TLS only (`--port 0 --tls-port P`, certificates from the `openssl` command).
A replica with the right credentials mirrors as usual (another replica's
cluster lookup sees its prefix); one with a wrong password, or without TLS,
fails visibly (`mirror_failures` grows) and still serves every RPC.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from certs import Certs, make_certs
from mirror_support import (
    BLOCK_SIZE,
    CONVERGE_TIMEOUT_S,
    LEASE_TTL_S,
    ROOT,
    RedisServer,
    all_redis_blobs,
    namespace,
    prompt,
    wait_until,
)
from processes import launch, stop_all

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateStatus
from kv_manager_service.core.hashing import BlockHasher, HashAlgorithm, HashExtras
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX

PASSWORD = "redis-pw-Tq8zL3vN"
SECRET = "mirror-deployment-secret-7c2e"
TOKENS = {"alice": "alice-token-Wm5Rk2Pz8Hq1", "bob": "bob-token-Jd4Ns7Cx1Vb6", "carol": "carol-token-Ye9Gu3Lo5Af0"}


def write_private(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    os.chmod(path, 0o600)
    return path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def mirror_failures(replica) -> int:
    return replica.stats().mirror_failures


def assert_serves_without_the_mirror(replica, seed: int) -> None:
    """RPCs go on: a prefix is cached locally, and a cluster lookup answers for this replica alone."""
    wait_until(lambda: mirror_failures(replica), lambda n: n > 0, CONVERGE_TIMEOUT_S, "a counted mirror failure")
    tokens = prompt(seed, 2 * BLOCK_SIZE + 1)
    replica.cache("served", tokens)
    assert replica.cluster(tokens) == {replica.replica_id: 2 * BLOCK_SIZE}
    assert replica.stats().mirror_enabled


def test_the_mirror_authenticates_to_redis_and_a_wrong_password_fails_visibly(tmp_path, redis_factory, replicas):
    server = RedisServer(tmp_path, extra_args=["--requirepass", PASSWORD], password=PASSWORD)
    redis_factory.append(server)
    server.start()
    password_file = write_private(tmp_path / "redis-password", PASSWORD + "\n")
    url, bare = f"redis://:{PASSWORD}@{server.address}/0", f"redis://{server.address}/0"
    in_url, from_file, wrong, anonymous = replicas.start_many(
        [
            dict(replica_id="in-url", redis_url=url),
            dict(replica_id="from-file", redis_url=bare, extra=["--redis-password-file", str(password_file)]),
            dict(replica_id="wrong", redis_url=f"redis://:not-{PASSWORD}@{server.address}/0"),
            dict(replica_id="anonymous", redis_url=bare),
        ]
    )
    tokens = prompt(1, 3 * BLOCK_SIZE + 1)
    in_url.cache("warm", tokens)
    wait_until(lambda: from_file.cluster(tokens), lambda got: got.get("in-url") == 3 * BLOCK_SIZE,
               CONVERGE_TIMEOUT_S, "the password-file replica to see the URL-password replica's prefix")  # fmt: skip
    from_file.cache("warm", tokens[: 2 * BLOCK_SIZE + 1])
    wait_until(lambda: in_url.cluster(tokens), lambda got: got.get("from-file") == 2 * BLOCK_SIZE,
               CONVERGE_TIMEOUT_S, "the URL-password replica to see the password-file replica's prefix")  # fmt: skip

    for refused, seed in ((wrong, 2), (anonymous, 3)):
        assert_serves_without_the_mirror(refused, seed)
    client = server.client()
    try:
        assert client.exists(f"{namespace()}:lease:wrong", f"{namespace()}:lease:anonymous") == 0
        assert not {r.decode() for r in client.smembers(f"{namespace()}:replicas")} & {"wrong", "anonymous"}
    finally:
        client.close()
    for replica in (in_url, from_file, wrong, anonymous):
        assert PASSWORD not in replica.log(), replica.replica_id
    assert in_url.stats().mirror_failures == 0


def test_the_mirror_over_tls_and_a_plaintext_client_fails_visibly(tmp_path, redis_factory, replicas, certs):
    tls_args = ["--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
                "--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "no", "--requirepass", PASSWORD]  # fmt: skip
    server = RedisServer(tmp_path, extra_args=tls_args, tls=True, ssl=True, ssl_ca_certs=str(certs.ca), password=PASSWORD)
    redis_factory.append(server)
    server.start()
    password_file = write_private(tmp_path / "redis-password", PASSWORD)
    secure = f"rediss://{server.address}/0"
    flag, query, plaintext, untrusting = replicas.start_many(
        [
            dict(replica_id="ca-flag", redis_url=secure,
                 extra=["--redis-tls-ca", str(certs.ca), "--redis-password-file", str(password_file)]),
            dict(replica_id="ca-query", redis_url=f"rediss://:{PASSWORD}@{server.address}/0?ssl_ca_certs={certs.ca}"),
            dict(replica_id="plaintext", redis_url=f"redis://:{PASSWORD}@{server.address}/0"),
            # Its CA did not sign the server's certificate: the handshake fails.
            dict(replica_id="untrusting", redis_url=secure,
                 extra=["--redis-tls-ca", str(certs.other_ca), "--redis-password-file", str(password_file)]),
        ]
    )  # fmt: skip
    tokens = prompt(4, 3 * BLOCK_SIZE + 1)
    flag.cache("warm", tokens)
    wait_until(lambda: query.cluster(tokens), lambda got: got.get("ca-flag") == 3 * BLOCK_SIZE,
               CONVERGE_TIMEOUT_S, "a TLS replica to see the other's prefix")  # fmt: skip
    for refused, seed in ((plaintext, 5), (untrusting, 6)):
        assert_serves_without_the_mirror(refused, seed)
    assert flag.cluster(tokens) == {"ca-flag": 3 * BLOCK_SIZE, "ca-query": 0}
    for replica in (flag, query, plaintext, untrusting):
        assert PASSWORD not in replica.log(), replica.replica_id


def test_a_bad_redis_security_flag_stops_the_start(tmp_path, certs):
    for args, message in [
        (["--redis-url", "redis://127.0.0.1:1/0", "--redis-tls-ca", str(certs.ca)], "needs a rediss://"),
        (["--redis-tls-ca", str(certs.ca)], "need --redis-url"),
        (["--redis-url", f"redis://:{PASSWORD}@127.0.0.1:1/0", "--redis-password-file", str(certs.ca)], "keep one"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "16", *args],
            cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert PASSWORD not in done.stderr


# -- multi-tenant replicas ------------------------------------------------------------------------


def tenant_salt(tenant: str, client_salt: str = "") -> str:
    key = hmac.new(SECRET.encode(), tenant.encode(), hashlib.sha256).digest()
    return hmac.new(key, client_salt.encode(), hashlib.sha256).hexdigest()


def hashes(token_ids: list[int], cache_salt: str | None) -> list[bytes]:
    hasher = BlockHasher(BLOCK_SIZE, HashAlgorithm.SHA256_CBOR)
    return list(hasher.hash_blocks(hasher.root_hash, token_ids, 0, HashExtras(cache_salt=cache_salt)))


@pytest.fixture
def tenant_replicas(tmp_path, redis_server) -> Iterator[dict[str, dict[str, KVManagerClient]]]:
    """Two multi-tenant replicas of one deployment (one secret) on one Redis: replica -> tenant -> client."""
    token_file = write_private(tmp_path / "tokens.json", json.dumps(TOKENS))
    secret_file = write_private(tmp_path / "secret", SECRET)
    processes = []
    try:
        for replica_id in ("r1", "r2"):
            argv = [
                sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "64",
                "--block-size", str(BLOCK_SIZE), "--replica-id", replica_id, "--redis-url", redis_server.url,
                "--lease-ttl-s", str(LEASE_TTL_S), "--multi-tenant", "--auth-token-file", str(token_file),
                "--tenant-secret-file", str(secret_file),
            ]  # fmt: skip
            processes.append(launch(argv, MANAGER_READY_PREFIX, tmp_path / f"{replica_id}.log"))
        clients = {
            process.args[process.args.index("--replica-id") + 1]: {
                tenant: KVManagerClient(process.address, token=token) for tenant, token in TOKENS.items()
            }
            for process in processes
        }
        yield clients
        for by_tenant in clients.values():
            for client in by_tenant.values():
                client.close()
    finally:
        failures = stop_all(processes)
    assert not failures, "\n\n".join(failures)


def cluster(client: KVManagerClient, token_ids: list[int]) -> dict[str, int]:
    return {r.replica_id: r.num_cached_tokens for r in client.find_cache_hit(token_ids, cluster=True)[1]}


def test_the_mirror_does_not_tell_one_tenant_what_another_cached(redis_server, tenant_replicas):
    r1, r2 = tenant_replicas["r1"], tenant_replicas["r2"]
    shared_prompt = prompt(7, 3 * BLOCK_SIZE + 1)
    for client, request_id in ((r1["alice"], "a"), (r2["bob"], "b")):
        assert client.allocate(request_id, shared_prompt, len(shared_prompt)).status is AllocateStatus.OK
        client.free([request_id])

    # One deployment, one secret: alice's hashes agree across replicas, so she is routed to r1.
    wait_until(lambda: cluster(r2["alice"], shared_prompt), lambda got: got == {"r1": 3 * BLOCK_SIZE, "r2": 0},
               CONVERGE_TIMEOUT_S, "alice's prefix on r1, seen from r2")  # fmt: skip
    wait_until(lambda: cluster(r1["bob"], shared_prompt), lambda got: got == {"r1": 0, "r2": 3 * BLOCK_SIZE},
               CONVERGE_TIMEOUT_S, "bob's prefix on r2, seen from r1")  # fmt: skip
    assert cluster(r1["carol"], shared_prompt) == {"r1": 0, "r2": 0}  # carol learns of neither

    alice_hashes = set(hashes(shared_prompt, tenant_salt("alice")))
    bob_hashes = set(hashes(shared_prompt, tenant_salt("bob")))
    client = redis_server.client()
    try:
        blobs = all_redis_blobs(client)
    finally:
        client.close()
    prefix = f"{namespace()}:block:0:"
    stored = {bytes.fromhex(key.decode()[len(prefix) :]) for key in blobs if key.decode().startswith(prefix)}
    # The same prompt is two unrelated sets of hashes, each only computable with the secret.
    assert stored == alice_hashes | bob_hashes and not alice_hashes & bob_hashes
    guessable = [None, "", "alice", "bob", "carol", "default", "alice/", "bob/", tenant_salt("bob").upper()]
    for guess in guessable:
        assert not set(hashes(shared_prompt, guess)) & stored, guess
    for wrong_secret in (b"", b"secret", SECRET.encode()[:-1]):
        key = hmac.new(wrong_secret, b"bob", hashlib.sha256).digest()
        assert not set(hashes(shared_prompt, hmac.new(key, b"", hashlib.sha256).hexdigest())) & stored
    # Nor does any key or value name a tenant.
    for key, values in blobs.items():
        for blob in (key, *values):
            for tenant in TOKENS:
                assert tenant.encode() not in blob, (key, blob)
