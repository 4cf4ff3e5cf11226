"""`/metrics` with the same trust as the RPCs: TLS, mutual TLS, operator and scrape tokens, on real servers.

Every refusal is checked for what it must not carry: no metric and no
tenant name. Certificates come from the `openssl` command (tests/certs.py).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from certs import Certs, make_certs
from processes import ROOT, log_records
from prometheus_client.parser import text_string_to_metric_families
from svc_support import pool_config

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateStatus
from kv_tooling.launch import LaunchedProcess
from kv_manager_service.shared.security import ClientTLS

TENANT_TOKEN = "acme-token-Wq4Zr8Tn2Lb6Xv"
OTHER_TENANT_TOKEN = "globex-token-Jd3Hs7Pk1Mc5"
OPERATOR_TOKEN = "infra-token-Ny9Gf2Qa6Ue0Ri"
SCRAPE_TOKEN = "scrape-token-Ct5Vb8Ko3Ws1"
TENANTS = ("acme-tenant", "globex-tenant")
NO_REPLY = (urllib.error.URLError, ssl.SSLError, ConnectionError)  # the TLS handshake failed, or the peer hung up


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: str


def fetch(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> Reply:
    """GET `url`, with `Authorization: Bearer <token>` when given; an HTTP error status is a Reply too."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10, context=context) as r:
            return Reply(r.status, dict(r.headers), r.read().decode())
    except urllib.error.HTTPError as error:
        return Reply(error.code, dict(error.headers), error.read().decode())


def family_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def write_private(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    os.chmod(path, 0o600)
    return path


def tenant_flags(directory: Path, operator: bool = True) -> list[str]:
    tokens: dict = {TENANTS[0]: TENANT_TOKEN, TENANTS[1]: OTHER_TENANT_TOKEN}
    if operator:
        tokens["infra"] = {"token": OPERATOR_TOKEN, "role": "operator"}
    token_file = write_private(directory / "tokens.json", json.dumps(tokens))
    secret_file = write_private(directory / "secret", "the-tenant-secret-0123456789")
    return ["--multi-tenant", "--auth-token-file", str(token_file), "--tenant-secret-file", str(secret_file)]


def metrics_url(process: LaunchedProcess) -> str:
    (url,) = [record["metrics_url"] for record in log_records(process) if "metrics_url" in record]
    return url


def trusting(certs: Certs, client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if client_cert:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    return context


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@dataclass(frozen=True)
class Guarded:
    process: LaunchedProcess
    url: str
    context: ssl.SSLContext


@pytest.fixture(scope="module")
def guarded(module_server_factory, tmp_path_factory, certs) -> Guarded:
    """A multi-tenant server over TLS, with tokens, a scrape token, and an acme request live."""
    directory = tmp_path_factory.mktemp("guarded")
    process = module_server_factory.start(
        *tenant_flags(directory), "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
        "--metrics-port", "0", "--metrics-token-file", str(write_private(directory / "scrape", SCRAPE_TOKEN + "\n")),
        config=pool_config(32),
    )  # fmt: skip
    with KVManagerClient(process.address, tls=ClientTLS(certs.ca), token=TENANT_TOKEN) as tenant:
        assert tenant.allocate("r-1", list(range(40)), 40).status is AllocateStatus.OK
    return Guarded(process, metrics_url(process), trusting(certs))


@pytest.mark.parametrize(
    "token", [None, "not-a-token-of-this-server-0123", SCRAPE_TOKEN[:-1]], ids=["none", "unknown", "cut"]
)
def test_a_scrape_without_a_valid_token_is_401_and_carries_no_metric(guarded, token):
    reply = fetch(guarded.url, token, guarded.context)
    assert reply.status == 401
    assert reply.headers["WWW-Authenticate"].startswith("Bearer ")
    assert "kvcache_" not in reply.body and "process_" not in reply.body
    assert not any(tenant in reply.body for tenant in TENANTS)


def test_a_tenant_token_is_403_even_for_its_own_figures(guarded):
    reply = fetch(guarded.url, TENANT_TOKEN, guarded.context)
    assert reply.status == 403
    assert 'error="insufficient_scope"' in reply.headers["WWW-Authenticate"]
    assert "kvcache_" not in reply.body and not any(tenant in reply.body for tenant in TENANTS)


def test_an_operator_reads_everything_over_tls(guarded):
    assert guarded.url.startswith("https://")
    reply = fetch(guarded.url, OPERATOR_TOKEN, guarded.context)
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
    samples = {
        (sample.name, sample.labels.get("tenant")): sample.value
        for family in text_string_to_metric_families(reply.body)
        for sample in family.samples
    }
    assert samples[("kvcache_num_requests_running", None)] == 1
    assert samples[("kvcache_tenant_requests", "acme-tenant")] == 1
    assert samples[("kvcache_tenant_requests", "globex-tenant")] == 0


def test_the_scrape_token_reads_everything_but_the_tenants(guarded):
    reply = fetch(guarded.url, SCRAPE_TOKEN, guarded.context)
    assert reply.status == 200
    names = family_names(reply.body)
    assert {"kvcache_num_requests_running", "kvcache_rpc_duration_seconds", "process_resident_memory_bytes"} <= names
    assert not any(name.startswith("kvcache_tenant_") for name in names)
    assert not any(tenant in reply.body for tenant in TENANTS)


def test_the_tls_endpoint_speaks_only_tls_to_clients_that_trust_the_ca(guarded, certs):
    with pytest.raises(NO_REPLY):  # plain HTTP to the HTTPS port: no HTTP reply at all
        fetch(guarded.url.replace("https://", "http://"), OPERATOR_TOKEN)
    with pytest.raises(NO_REPLY):  # a client that does not trust the server's CA
        fetch(guarded.url, OPERATOR_TOKEN, ssl.create_default_context(cafile=str(certs.other_ca)))
    for token in (OPERATOR_TOKEN, SCRAPE_TOKEN, TENANT_TOKEN):
        assert token not in guarded.process.log()


def test_mutual_tls_requires_a_client_certificate_from_the_ca(server_factory, certs):
    server = server_factory.start(
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-ca", str(certs.ca),
        "--metrics-port", "0", config=pool_config(16),
    )  # fmt: skip
    url = metrics_url(server)
    assert fetch(url, context=trusting(certs, client_cert=True)).status == 200
    with pytest.raises(NO_REPLY):
        fetch(url, context=trusting(certs))
    stranger = trusting(certs)
    stranger.load_cert_chain(certs.other_client_cert, certs.other_client_key)
    with pytest.raises(NO_REPLY):
        fetch(url, context=stranger)


def test_without_a_readers_token_metrics_stay_on_loopback_without_the_tenants(server_factory, tmp_path):
    server = server_factory.start(
        *tenant_flags(tmp_path, operator=False), "--metrics-host", "127.0.0.1", "--metrics-port", "0",
        config=pool_config(16),
    )  # fmt: skip
    url = metrics_url(server)
    assert url.startswith("http://127.0.0.1:")
    (line,) = [record["msg"] for record in log_records(server) if "metrics_url" in record]
    assert "loopback only" in line
    reply = fetch(url)
    assert reply.status == 200 and "kvcache_num_blocks" in family_names(reply.body)
    assert not any(tenant in reply.body for tenant in TENANTS)


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "16", *args],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--host", "0.0.0.0", "--metrics-port", "0"], "/metrics on 0.0.0.0 would be open to all"),
        (["--metrics-host", "0.0.0.0", "--metrics-port", "0"], "/metrics on 0.0.0.0 would be open to all"),
        (["--metrics-host", "127.0.0.1"], "--metrics-host and --metrics-token-file need --metrics-port"),
        (["--metrics-token-file", "scrape"], "--metrics-host and --metrics-token-file need --metrics-port"),
    ],
    ids=["any-host", "any-metrics-host", "host-without-port", "token-without-port"],
)
def test_a_metrics_endpoint_that_would_leak_is_refused_at_start(tmp_path, extra, message):
    scrape = write_private(tmp_path / "scrape", SCRAPE_TOKEN)
    extra = [str(scrape) if value == "scrape" else value for value in extra]
    done = run_serve(*tenant_flags(tmp_path, operator=False), *extra)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr
    if "open to all" in message:
        assert "--metrics-token-file" in done.stderr and "--metrics-host 127.0.0.1" in done.stderr
