"""A group's replication is authenticated like any other caller: bearer tokens with a role of their own,
TLS and mutual TLS between members."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from certs import make_certs
from ha_support import Group

from kv_manager_service.server import replication_link
from kv_manager_service.shared.security import ClientTLS, client_channel
from kvcache.replication.v1 import replication_pb2 as rpb
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

# A history no primary holds: a standby that says it is sent a snapshot at once.
UNKNOWN_HISTORY = {"last_seq": 1, "last_token": 1 << 62}
TENANT, OPERATOR, MEMBER = "tenant-token-0123456789", "operator-token-0123456789", "member-token-0123456789"


def _token_files(directory: Path) -> tuple[Path, Path]:
    tokens = directory / "tokens.yaml"
    tokens.write_text(
        f"sched: {TENANT}\ninfra: {{token: {OPERATOR}, role: operator}}\npeers: {{token: {MEMBER}, role: member}}\n"
    )
    member = directory / "member.token"
    member.write_text(MEMBER + "\n")
    tokens.chmod(0o600)
    member.chmod(0o600)
    return tokens, member


def _primary_by_log(group: Group) -> None:
    deadline = time.monotonic() + 10
    while "is the primary of replica" not in group.members[0].log():
        assert time.monotonic() < deadline, group.members[0].log()[-2000:]
        time.sleep(0.02)


def _refusal(address: str, token: str | None) -> str:
    """Why the replication listener at `address` refuses a standby following with `token` ('' if it does not)."""
    hello = rpb.FollowRequest(member_id="intruder", bearer_token=token or "", **UNKNOWN_HISTORY).SerializeToString()
    response = rpb.FollowResponse.FromString(replication_link.ask(address, hello, timeout_s=10))
    return response.refusal.reason


def test_members_follow_with_a_member_token_and_that_token_opens_nothing_else(group: Group, tmp_path: Path) -> None:
    tokens, member = _token_files(tmp_path)
    flags = ("--auth-token-file", str(tokens), "--ha-token-file", str(member))
    group.start(*flags)
    _primary_by_log(group)
    primary = group.members[0]
    group.wait_in_sync(group.start(*flags), primary)
    replication = group.replication_address()
    assert _refusal(replication, None) == "UNAUTHENTICATED"
    assert _refusal(replication, "not-a-token-0123456789") == "UNAUTHENTICATED"
    assert _refusal(replication, OPERATOR) == "PERMISSION_DENIED"
    assert _refusal(replication, TENANT) == "PERMISSION_DENIED"
    assert _refusal(replication, MEMBER) == ""  # let in: the answer is its first records
    with client_channel(primary.address, token=MEMBER) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            pb_grpc.KVManagerServiceStub(channel).GetStats(pb.GetStatsRequest())
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with client_channel(primary.address, token=TENANT) as channel:
        pb_grpc.KVManagerServiceStub(channel).Allocate(pb.AllocateRequest(request_id="r", token_ids=[1, 2, 3], num_new_tokens=3))


def test_members_follow_each_other_over_mutual_tls(group: Group, tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    flags = (
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-ca", str(certs.ca),
        "--ha-tls-ca", str(certs.ca), "--ha-tls-cert", str(certs.client_cert), "--ha-tls-key", str(certs.client_key),
    )  # fmt: skip
    group.start(*flags)
    _primary_by_log(group)
    group.wait_in_sync(group.start(*flags), group.members[0])
    replication = group.replication_address()
    assert not _answered(replication, None)  # plaintext
    assert not _answered(replication, ClientTLS(certs.ca))  # without a client certificate
    assert _answered(replication, ClientTLS(certs.ca, certs.client_cert, certs.client_key))


def _answered(address: str, tls: ClientTLS | None) -> bool:
    """Whether the replication listener at `address` answers a standby's first message over `tls`."""
    hello = rpb.FollowRequest(member_id="intruder", **UNKNOWN_HISTORY).SerializeToString()
    try:
        answer = replication_link.ask(address, hello, replication_link.client_context(tls), timeout_s=10)
    except OSError:  # ssl.SSLError among them
        return False
    return bool(rpb.FollowResponse.FromString(answer).records) if answer else False


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--auth-token-file", "{tokens}"], "needs --ha-token-file"),
        (["--auth-token-file", "{tokens}", "--ha-token-file", "{operator}"], "with role: member"),
        (["--tls-cert", "{cert}", "--tls-key", "{key}"], "needs --ha-tls-ca"),
        (["--multi-tenant"], "--multi-tenant"),
    ],
)
def test_a_group_without_what_authenticates_its_members_is_refused(tmp_path: Path, flags: list[str], message: str) -> None:
    tokens, _ = _token_files(tmp_path)
    operator = tmp_path / "operator.token"
    operator.write_text(OPERATOR)
    operator.chmod(0o600)
    certs = make_certs(tmp_path / "certs")
    values = {"tokens": tokens, "operator": operator, "cert": certs.server_cert, "key": certs.server_key}
    argv = [
        sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--replica-id", "r",
        "--ha-url", "redis://127.0.0.1:1/0", *(flag.format(**values) for flag in flags),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_standby_of_another_pool_is_refused_and_never_gets_in_sync(group: Group) -> None:
    """It would answer the same Steps with other evictions: the primary refuses it, naming both pools."""
    group.start()
    _primary_by_log(group)
    primary = group.members[0]
    standby = group.start("--eviction-policy", "frequency")
    deadline = time.monotonic() + 10
    while "FAILED_PRECONDITION the standby's pool configuration is not the primary's" not in standby.log():
        assert time.monotonic() < deadline, standby.log()[-3000:]
        time.sleep(0.05)
    assert 'eviction_policy' in standby.log()  # the standby's pool, in the message
    assert f" at {standby.address} follows" not in primary.log()
