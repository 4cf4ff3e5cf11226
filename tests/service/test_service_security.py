"""Who may call `kv-manager serve`: TLS, mutual TLS, bearer tokens and roles, on real server processes.

Certificates come from the `openssl` command (tests/certs.py). A refused
call must change nothing: every check of a refusal compares the server's
observable state (stats, step id, tables) before and after.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from certs import Certs, make_certs
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_support import CALL_TIMEOUT_S, alloc, pool_config, rpc_error, snapshot, stream_error

from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateStatus
from kv_manager_service.shared.security import ClientTLS, Role, TokenTable, load_token_file
from kv_manager_service.shared.status import ERROR_DOMAIN, error_info
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

SCHEDULER_TOKEN = "sched-Hq3vT9xL2pW7rK4mZ8nB"
OPERATOR_TOKEN = "infra-Yc6dJ1sF5gN0aV3eU7iO"
ONE_TOKEN = "the-only-token-R2kP8wQ5zX1c"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


def write_private(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    os.chmod(path, 0o600)
    return path


def tokens_file(directory: Path) -> Path:
    data = {"sched": SCHEDULER_TOKEN, "infra": {"token": OPERATOR_TOKEN, "role": "operator"}}
    return write_private(directory / "tokens.json", json.dumps(data))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def stub_for(channel: grpc.Channel) -> pb_grpc.KVManagerServiceStub:
    return pb_grpc.KVManagerServiceStub(channel)


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def assert_refused(error: grpc.RpcError, code: grpc.StatusCode) -> None:
    assert error.code() == code, (error.code(), error.details())
    info = error_info(error)
    assert info is not None and info.domain == ERROR_DOMAIN and info.reason == code.name, info


# -- TLS -----------------------------------------------------------------------------


def test_tls_serves_clients_that_trust_its_ca_and_no_one_else(server_factory, certs, tmp_path):
    server = server_factory.start(
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
        "--auth-token-file", str(tokens_file(tmp_path)), config=pool_config(32),
    )  # fmt: skip
    operator = KVManagerClient(server.address, tls=ClientTLS(certs.ca), token=OPERATOR_TOKEN)
    scheduler = KVManagerClient(server.address, tls=ClientTLS(certs.ca), token=SCHEDULER_TOKEN)
    with operator, scheduler:
        operator.wait_ready()
        assert scheduler.allocate("r-1", list(range(40)), 40).status is AllocateStatus.OK
        before = operator.block_tables(), operator.stats()

        # Plaintext to a TLS port, and TLS to a server whose certificate the client's CA did not sign.
        with grpc.insecure_channel(server.address) as plain:
            assert rpc_error(stub_for(plain).GetConfig, pb.GetConfigRequest(), metadata=bearer(OPERATOR_TOKEN)).code() == (
                grpc.StatusCode.UNAVAILABLE
            )
        with KVManagerClient(server.address, tls=ClientTLS(certs.other_ca), token=OPERATOR_TOKEN) as untrusting:
            error = rpc_error(untrusting.stub.Allocate, alloc("r-2", range(40)))
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        # TLS alone is no credential: the bearer token is still required.
        with KVManagerClient(server.address, tls=ClientTLS(certs.ca)) as anonymous:
            assert_refused(rpc_error(anonymous.stub.Allocate, alloc("r-2", range(40))), UNAUTHENTICATED)

        assert (operator.block_tables(), operator.stats()) == before
        scheduler.free(["r-1"])
    log = server.log()
    for token in (SCHEDULER_TOKEN, OPERATOR_TOKEN):
        assert token not in log


def test_mutual_tls_refuses_a_client_without_a_certificate_from_its_ca(server_factory, certs):
    server = server_factory.start(
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-ca", str(certs.ca),
        config=pool_config(32),
    )  # fmt: skip
    with KVManagerClient(server.address, tls=ClientTLS(certs.ca, certs.client_cert, certs.client_key)) as client:
        client.wait_ready()
        assert client.allocate("m-1", list(range(20)), 20).status is AllocateStatus.OK
        before = client.block_tables(), client.stats()
        for refused_tls in (
            ClientTLS(certs.ca),  # no client certificate
            ClientTLS(certs.ca, certs.other_client_cert, certs.other_client_key),  # signed by an unknown CA
        ):
            with KVManagerClient(server.address, tls=refused_tls) as refused:
                error = rpc_error(refused.stub.Allocate, alloc("m-2", range(20)))
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert (client.block_tables(), client.stats()) == before
        client.free(["m-1"])


# -- bearer tokens and roles ---------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(module_server_factory, tmp_path_factory) -> Any:
    """A plaintext server with bearer tokens: tenant 'sched' and operator 'infra'."""
    directory = tmp_path_factory.mktemp("tokens")
    server = module_server_factory.start("--worker-timeout-s", "3600", "--auth-token-file", str(tokens_file(directory)), config=pool_config(32))
    channel = grpc.insecure_channel(server.address)
    grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
    with channel:
        yield server, stub_for(channel)


def operator_snapshot(stub: pb_grpc.KVManagerServiceStub) -> dict:
    return snapshot(_WithMetadata(stub, bearer(OPERATOR_TOKEN)))


class _WithMetadata:
    """A stub whose every call carries `metadata`."""

    def __init__(self, stub: pb_grpc.KVManagerServiceStub, metadata: list[tuple[str, str]]) -> None:
        self._stub = stub
        self._metadata = metadata

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        return lambda request, **kwargs: method(request, metadata=self._metadata, **kwargs)


@pytest.mark.parametrize(
    "metadata",
    [
        [],
        bearer("not-the-token-at-all-0000"),
        bearer(SCHEDULER_TOKEN + "x"),
        bearer(SCHEDULER_TOKEN[:-1]),
        [("authorization", f"Basic {SCHEDULER_TOKEN}")],
        [("authorization", SCHEDULER_TOKEN)],
        bearer(SCHEDULER_TOKEN) + bearer(SCHEDULER_TOKEN),  # two credentials: ambiguous
    ],
    ids=["none", "unknown", "longer", "shorter", "basic-scheme", "no-scheme", "twice"],
)
def test_a_call_without_a_valid_token_is_unauthenticated_and_changes_nothing(guarded, metadata):
    _, stub = guarded
    before = operator_snapshot(stub)
    calls = [
        (stub.Allocate, alloc("u-1", range(40))),
        (stub.Step, pb.StepRequest(ops=[pb.StepOp(allocate=alloc("u-2", range(40)))])),
        (stub.Free, pb.FreeRequest(request_ids=["u-1"])),
        (stub.GetConfig, pb.GetConfigRequest()),
        (stub.GetStats, pb.GetStatsRequest()),
        (stub.FindCacheHit, pb.FindCacheHitRequest(token_ids=list(range(40)))),
        (stub.ResetPrefixCache, pb.ResetPrefixCacheRequest()),
    ]
    for call, request in calls:
        assert_refused(rpc_error(call, request, metadata=metadata), UNAUTHENTICATED)
    for call, request in [
        (stub.WatchSteps, pb.WatchStepsRequest(worker_id="w", from_step_id=0)),
        (stub.WatchEvents, pb.WatchEventsRequest()),
    ]:
        assert_refused(stream_error(lambda r, call=call, **kw: call(r, metadata=metadata, **kw), request), UNAUTHENTICATED)
    assert operator_snapshot(stub) == before


def test_health_checks_need_no_token_and_everything_else_does(guarded):
    server, stub = guarded
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = health.Check(health_pb2.HealthCheckRequest(service="kvcache.v1.KVManagerService"), timeout=CALL_TIMEOUT_S)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    config = stub.GetConfig(pb.GetConfigRequest(), metadata=bearer(SCHEDULER_TOKEN), timeout=CALL_TIMEOUT_S)
    assert config.num_blocks == 32


def test_a_tenant_schedules_but_only_the_operator_follows_steps_and_events(guarded):
    _, stub = guarded
    tenant, operator = bearer(SCHEDULER_TOKEN), bearer(OPERATOR_TOKEN)
    assert stub.Allocate(alloc("t-1", range(40)), metadata=tenant, timeout=CALL_TIMEOUT_S).status == pb.ALLOCATE_STATUS_OK
    named = stub.GetBlockTables(pb.GetBlockTablesRequest(request_ids=["t-1"]), metadata=tenant, timeout=CALL_TIMEOUT_S)
    assert [t.request_id for t in named.tables] == ["t-1"]
    before = operator_snapshot(stub)
    last_step = before["stats"]["last_step_id"]
    for call, request in [
        (stub.AckSteps, pb.AckStepsRequest(worker_id="w", step_id=last_step)),
        (stub.UnregisterWorker, pb.UnregisterWorkerRequest(worker_id="w")),
        (stub.ResetPrefixCache, pb.ResetPrefixCacheRequest()),
        (stub.GetBlockTables, pb.GetBlockTablesRequest()),  # every request: the operator's view
    ]:
        assert_refused(rpc_error(call, request, metadata=tenant), PERMISSION_DENIED)
    for call, request in [
        (stub.WatchSteps, pb.WatchStepsRequest(worker_id="w", from_step_id=0)),
        (stub.WatchEvents, pb.WatchEventsRequest()),
    ]:
        assert_refused(stream_error(lambda r, call=call, **kw: call(r, metadata=tenant, **kw), request), PERMISSION_DENIED)
    assert operator_snapshot(stub) == before

    # The operator may do all of it.
    stream = stub.WatchSteps(pb.WatchStepsRequest(worker_id="w", from_step_id=1), metadata=operator, timeout=20)
    assert next(stream).step_id == 1
    stream.cancel()
    assert any(t.request_id == "t-1" for t in stub.GetBlockTables(pb.GetBlockTablesRequest(), metadata=operator).tables)
    stub.Free(pb.FreeRequest(request_ids=["t-1"]), metadata=tenant, timeout=CALL_TIMEOUT_S)
    last_step = stub.GetStats(pb.GetStatsRequest(), metadata=operator).last_step_id
    stub.AckSteps(pb.AckStepsRequest(worker_id="w", step_id=last_step), metadata=operator, timeout=CALL_TIMEOUT_S)
    stub.UnregisterWorker(pb.UnregisterWorkerRequest(worker_id="w"), metadata=operator, timeout=CALL_TIMEOUT_S)
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), metadata=operator, timeout=CALL_TIMEOUT_S).ok


def test_the_client_sends_its_token_on_every_call(guarded):
    server, _ = guarded
    with KVManagerClient(server.address, token=SCHEDULER_TOKEN) as client:
        assert client.allocate("c-1", list(range(20)), 20).status is AllocateStatus.OK
        assert client.find_cache_hit(list(range(20)))[0].num_cached_tokens == 16
        assert client.decode(["c-1"], [5]).statuses == (AllocateStatus.OK,)
        assert client.block_tables(["c-1"]).tables[0].request_id == "c-1"
        client.free(["c-1"])
    assert SCHEDULER_TOKEN not in server.log() and OPERATOR_TOKEN not in server.log()


def test_a_single_token_file_names_one_operator_for_the_whole_deployment(server_factory, tmp_path):
    path = write_private(tmp_path / "token", ONE_TOKEN + "\n")
    server = server_factory.start("--auth-token-file", str(path), config=pool_config(32))
    with KVManagerClient(server.address, token=ONE_TOKEN) as client:
        assert client.allocate("s-1", list(range(20)), 20).status is AllocateStatus.OK
        assert next(iter(client.watch_steps("w", 1))).step_id == 1
        assert [t.request_id for t in client.block_tables().tables] == ["s-1"]
    with KVManagerClient(server.address) as anonymous:
        with pytest.raises(grpc.RpcError) as caught:
            anonymous.stats()
        assert caught.value.code() == UNAUTHENTICATED


# -- the token file -------------------------------------------------------------------------


def test_the_token_file_formats(tmp_path):
    yaml_file = write_private(
        tmp_path / "tokens.yaml",
        f"a: {SCHEDULER_TOKEN}\nb: {{token: {OPERATOR_TOKEN}, role: operator, quota_blocks: 7}}\n",
    )
    table = load_token_file(yaml_file)
    assert [(p.tenant, p.role, p.quota_blocks) for p in table.principals] == [
        ("a", Role.TENANT, None),
        ("b", Role.OPERATOR, 7),
    ]
    assert table.names_tenants
    assert table.authenticate(bearer(SCHEDULER_TOKEN)).tenant == "a"
    assert table.authenticate([("authorization", f"bearer {OPERATOR_TOKEN}")]).tenant == "b"  # the scheme's case
    assert table.authenticate(bearer(SCHEDULER_TOKEN[:-1])) is None
    assert SCHEDULER_TOKEN not in repr(table) and OPERATOR_TOKEN not in repr(table)

    single = load_token_file(write_private(tmp_path / "one", f"  {ONE_TOKEN}\n"))
    assert [(p.tenant, p.role) for p in single.principals] == [("default", Role.OPERATOR)]
    assert not single.names_tenants
    assert isinstance(single, TokenTable) and single.authenticate(bearer(ONE_TOKEN)) is not None


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"a": "short"}', "at least 16 characters"),
        (json.dumps({"a": SCHEDULER_TOKEN, "b": SCHEDULER_TOKEN}), "share one token"),
        (json.dumps({"a/b": SCHEDULER_TOKEN}), "tenant name"),
        (json.dumps({"a": {"token": SCHEDULER_TOKEN, "rol": "operator"}}), "unknown keys"),
        (json.dumps({"a": {"token": SCHEDULER_TOKEN, "role": "admin"}}), "role must be"),
        (json.dumps({"a": {"token": SCHEDULER_TOKEN, "quota_blocks": -1}}), "quota_blocks"),
        (json.dumps({"a": SCHEDULER_TOKEN[:8] + " " + SCHEDULER_TOKEN[8:]}), "printable ASCII"),
        (f"{SCHEDULER_TOKEN}\n{OPERATOR_TOKEN}\n", "one token on one line"),
        ("{}", "no tenants"),
    ],
)
def test_a_bad_token_file_is_refused_without_quoting_a_token(tmp_path, text, message):
    path = write_private(tmp_path / ("tokens.json" if text.startswith("{") else "tokens.txt"), text)
    with pytest.raises(ValueError) as caught:
        load_token_file(path)
    assert message in str(caught.value)
    for token in (SCHEDULER_TOKEN, OPERATOR_TOKEN, SCHEDULER_TOKEN[8:]):
        assert token not in str(caught.value)
