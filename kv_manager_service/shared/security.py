"""Who may call: TLS credentials, bearer tokens, the caller's tenant and role.

Transport. `ServerTLS` serves gRPC over TLS (`--tls-cert`, `--tls-key`); with
a client CA (`--tls-ca`) the server requires and verifies a client
certificate signed by it (mutual TLS). `ClientTLS` is the other side: the CA
that signed the server's certificate, and a client certificate for mTLS.

Bearer tokens. `--auth-token-file` names a YAML or JSON file:

    # tenant name -> its token, or -> {token, role, quota_blocks}
    acme: "0f3c9a...e1"                 # role "tenant"
    globex: {token: "77ab...", quota_blocks: 4096}
    infra: {token: "d41d...", role: operator}

or a file holding a single token on one line, which names one caller,
tenant "default", with the operator role (one credential for the whole
deployment). Tokens are printable ASCII without spaces, at least
`MIN_TOKEN_CHARS` long, and unique. They are read from files only (never a
command-line flag, which other users of the machine can read), and only
their SHA-256 digests are kept: tokens are never logged or printed.

Every call (health checks excepted: `grpc.health.v1.Health` stays open, so
orchestrators can probe without a credential) must carry the metadata
`authorization: Bearer <token>`; `BearerAuthInterceptor` ends a call with a
missing, malformed or unknown token with UNAUTHENTICATED before the handler
runs (the request is not even parsed), and a call to an operator method by a
tenant with PERMISSION_DENIED. A presented token is looked up by its
SHA-256 digest and then compared with `hmac.compare_digest`: the time a
lookup takes depends on the digest, which a caller cannot steer toward a
valid token, never on how much of a token matched.

Roles. `tenant` (the default) may schedule: Allocate, Free, Fork, Step,
FindCacheHit, GetBlockTables of named requests, GetConfig, GetStats.
`operator` (the serving engine's infrastructure: GPU workers, routers,
dashboards) may also call WatchSteps, AckSteps, ReportMissingKV, WatchEvents,
ResetPrefixCache and GetBlockTables of all requests. `member` (the other
managers of a high-availability group) may call no RPC: it may only follow
a group's primary, on the primary's replication listener, which lets in no
other role (server/replication.py).

The servicer learns who called with `TokenTable.caller(context)`, which reads
the same metadata again (the interceptor has already accepted it).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import logging
import os
import re
import stat
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

import grpc

from kv_manager_service.shared.errors import KVCacheError
from kv_manager_service.shared.errors import PermissionDeniedError, UnauthenticatedError
from kv_manager_service.shared.status import end_call, status_code

log = logging.getLogger("kv_manager_service.shared.security")

MIN_TOKEN_CHARS = 16
MIN_SECRET_BYTES = 16
# Tenant names become request-id prefixes (`tenant/request_id`) and metric labels.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces: a valid header value
HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


class Role(str, enum.Enum):
    TENANT = "tenant"
    OPERATOR = "operator"
    MEMBER = "member"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its tenant, its role and its own block quota (None: the default)."""

    tenant: str
    role: Role = Role.TENANT
    quota_blocks: int | None = None

    @property
    def is_operator(self) -> bool:
        return self.role is Role.OPERATOR


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("ascii")).digest()


class TokenTable:
    """Token digests -> principals. Holds no token in the clear; safe to log or repr."""

    def __init__(self, tokens: Mapping[str, Principal], names_tenants: bool = True) -> None:
        if not tokens:
            raise ValueError("a token table needs at least one token")
        self._by_digest = {_digest(token): (_digest(token), principal) for token, principal in tokens.items()}
        self.principals: tuple[Principal, ...] = tuple(sorted(tokens.values(), key=lambda p: p.tenant))
        # False for a single deployment-wide token (tenant "default").
        self.names_tenants = names_tenants

    def __repr__(self) -> str:
        return f"TokenTable(tenants={[p.tenant for p in self.principals]})"

    def authenticate(self, metadata: Iterable[tuple[str, Any]] | None) -> Principal | None:
        """The principal whose token the call carries as `authorization: Bearer <token>`; None if none does."""
        values = [value for key, value in metadata or () if key == "authorization"]
        if len(values) != 1 or not isinstance(values[0], str):
            return None
        scheme, _, token = values[0].partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not _TOKEN.fullmatch(token):
            return None
        digest = _digest(token)
        entry = self._by_digest.get(digest)
        if entry is None or not hmac.compare_digest(entry[0], digest):
            return None
        return entry[1]

    def caller(self, context: grpc.ServicerContext) -> Principal | None:
        """The caller of a call that `BearerAuthInterceptor` accepted."""
        return self.authenticate(context.invocation_metadata())


# -- files ---------------------------------------------------------------------------


def _read_private(path: Path, what: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
        mode = os.stat(path).st_mode
    except OSError as error:
        raise ValueError(f"{what} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: not UTF-8 text") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s %s can be read by other users of this machine (chmod 600 it)", what, path)
    return text


def _check_token(token: object, where: str) -> str:
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError(f"{where}: a token must be a string of printable ASCII characters without spaces")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{where}: a token must be at least {MIN_TOKEN_CHARS} characters long")
    return token


def load_token_file(path: Path) -> TokenTable:
    """Parse a token file (the module docstring gives its format). Errors never quote a token."""
    text = _read_private(path, "token file")
    try:
        data = json.loads(text) if Path(path).suffix == ".json" else _yaml_load(text)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        lines = text.strip().splitlines()
        if len(lines) != 1:
            raise ValueError(f"token file {path}: expected a mapping of tenant -> token, or one token on one line")
        token = _check_token(lines[0].strip(), f"token file {path}")
        return TokenTable({token: Principal("default", Role.OPERATOR)}, names_tenants=False)
    tokens: dict[str, Principal] = {}
    owners: dict[str, str] = {}
    for tenant, entry in data.items():
        where = f"token file {path}, tenant {tenant!r}"
        if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
            raise ValueError(
                f"{where}: a tenant name is 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        if isinstance(entry, dict):
            unknown = sorted(set(entry) - {"token", "role", "quota_blocks"})
            if unknown:
                raise ValueError(f"{where}: unknown keys {unknown}; known keys are ['quota_blocks', 'role', 'token']")
            token = entry.get("token")
            try:
                role = Role(entry.get("role", Role.TENANT.value))
            except ValueError:
                raise ValueError(f"{where}: role must be 'tenant', 'operator' or 'member'") from None
            quota = entry.get("quota_blocks")
            if quota is not None and (not isinstance(quota, int) or isinstance(quota, bool) or quota < 0):
                raise ValueError(f"{where}: quota_blocks must be an integer >= 0")
        else:
            token, role, quota = entry, Role.TENANT, None
        token = _check_token(token, where)
        if token in owners:
            raise ValueError(f"token file {path}: tenants {owners[token]!r} and {tenant!r} share one token")
        owners[token] = tenant
        tokens[token] = Principal(tenant, role, quota)
    if not tokens:
        raise ValueError(f"token file {path}: no tenants")
    return TokenTable(tokens)


def _yaml_load(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def read_token_file(path: Path) -> str:
    """A client's token: the one line of `path`."""
    lines = _read_private(path, "token file").strip().splitlines()
    if len(lines) != 1:
        raise ValueError(f"token file {path}: expected one token on one line")
    return _check_token(lines[0].strip(), f"token file {path}")


def read_secret_file(path: Path, what: str = "secret file", min_bytes: int = MIN_SECRET_BYTES) -> bytes:
    """A secret's bytes: the file's content without trailing line breaks; at least `min_bytes`."""
    secret = _read_private(path, what).rstrip("\r\n").encode("utf-8")
    if len(secret) < max(1, min_bytes):
        raise ValueError(f"{what} {path}: a secret must be at least {max(1, min_bytes)} bytes long")
    return secret


def _read_pem(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what} {path}: {error.strerror or error}") from None


# -- transport -------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate chain and key (PEM); with `client_ca_file`, mutual TLS."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # set: every client must present a certificate signed by this CA

    def credentials(self) -> grpc.ServerCredentials:
        cert = _read_pem(self.cert_file, "--tls-cert")
        key = _read_pem(self.key_file, "--tls-key")
        ca = _read_pem(self.client_ca_file, "--tls-ca")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def server_tls(
    cert_file: Path | None, key_file: Path | None, ca_file: Path | None, flag: str = "--tls"
) -> ServerTLS | None:
    """The server's TLS from its flags; None when neither certificate nor key is given."""
    if cert_file is None and key_file is None:
        if ca_file is not None:
            raise ValueError(f"{flag}-ca (mutual TLS) needs {flag}-cert and {flag}-key")
        return None
    if cert_file is None or key_file is None:
        raise ValueError(f"{flag}-cert and {flag}-key go together")
    return ServerTLS(Path(cert_file), Path(key_file), Path(ca_file) if ca_file else None)


@dataclass(frozen=True)
class ClientTLS:
    """How a client checks the server (CA, name) and, for mutual TLS, proves itself (certificate, key)."""

    ca_file: Path | None = None  # None: the system's trusted roots
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None  # the name to expect in the server's certificate, if not the address's host

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate and its key go together")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca_file, "CA file"),
            private_key=_read_pem(self.key_file, "client key"),
            certificate_chain=_read_pem(self.cert_file, "client certificate"),
        )


def client_tls(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> ClientTLS | None:
    """A client's TLS from its flags; None (plaintext) when none is given."""
    if ca_file is None and cert_file is None and key_file is None:
        return None
    return ClientTLS(ca_file, cert_file, key_file)


class _CallDetails(
    namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor
):
    """Adds `authorization: Bearer <token>` to every call of a channel (over TLS or not)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {_check_token(token, 'client token')}")

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation: Callable, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def client_channel(
    address: str, tls: ClientTLS | None = None, token: str | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to `address`: TLS when `tls` is given (else plaintext), with `token` on every call when given."""
    options = list(options)
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        channel = grpc.secure_channel(address, tls.credentials(), options=options)
    if token is not None:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel


def aio_client_channel(
    address: str, tls: ClientTLS | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` (made on the event loop that uses it): TLS when `tls` is given.
    A bearer token goes in each call's metadata."""
    options = list(options)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


# -- the server side -----------------------------------------------------------------


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without a valid bearer token (UNAUTHENTICATED), tenants' calls to
    `operator_methods`, and every call of the member role (PERMISSION_DENIED), before the handler runs.

    `open_methods` (full names, `/package.Service/Method`) pass without a token.
    An accepted call runs the service's own handler, untouched.
    """

    def __init__(
        self,
        tokens: TokenTable,
        operator_methods: Collection[str] = (),
        open_methods: Collection[str] = HEALTH_METHODS,
    ) -> None:
        self.tokens = tokens
        self.operator_methods = frozenset(operator_methods)
        self.open_methods = frozenset(open_methods)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method in self.open_methods:
            return continuation(handler_call_details)
        principal = self.tokens.authenticate(handler_call_details.invocation_metadata)
        if principal is None:
            error = UnauthenticatedError(
                "this call needs a valid bearer token (metadata 'authorization: Bearer <token>')"
            )
            return _rejection(continuation(handler_call_details), method, error)
        if principal.role is Role.MEMBER:
            name = method.rsplit("/", 1)[-1]
            error = PermissionDeniedError(
                f"{principal.tenant!r} has the member role: it may only follow a group's primary, not call {name}"
            )
            return _rejection(continuation(handler_call_details), method, error)
        if method in self.operator_methods and not principal.is_operator:
            error = PermissionDeniedError(
                f"{method.rsplit('/', 1)[-1]} is for the operator role; {principal.tenant!r} is a tenant"
            )
            return _rejection(continuation(handler_call_details), method, error)
        return continuation(handler_call_details)


def _rejection(handler: grpc.RpcMethodHandler | None, method: str, error: KVCacheError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `error`; the request stays unparsed."""

    def reject(request: Any, context: grpc.ServicerContext) -> None:
        log.info(
            "%s rejected: %s", method, error,
            extra={"method": method, "code": status_code(error).name, "reason": error.reason, "peer": context.peer()},
        )  # fmt: skip
        end_call(context, error)

    def reject_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        reject(request, context)
        yield from ()

    if handler is not None and handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(reject_stream)
    if handler is not None and handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(reject_stream)
    return grpc.unary_unary_rpc_method_handler(reject)
