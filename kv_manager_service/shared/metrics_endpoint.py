"""The `/metrics` endpoint: one registry in the Prometheus text format, read with the same trust as the RPCs.

Who may read, decided once at start by `metrics_access` from the server's own
TLS and token settings:

| the server's RPCs | /metrics |
|---|---|
| no tokens, no client CA | open to whoever reaches it (HTTPS when the server has a certificate) |
| mutual TLS (`--tls-ca`), no tokens | HTTPS; the handshake requires a client certificate from that CA |
| bearer tokens | `Authorization: Bearer <token>`: a reader's token from the token file, or the scrape token |
| bearer tokens, no reader's token, loopback host | open on loopback only, without the private series |
| bearer tokens, no reader's token, other host | refused at start |

Two views. A token reader (for the manager: an operator, who may call every
RPC) reads everything. A scrape token, and a tokenless reader on loopback
(any local user), may call no RPC, so they read everything but the private
series: families with a sample labelled by one of `private_labels` (the
manager's `tenant`) are left out whole, and so are empty families.

A request without a valid token is answered 401 with `WWW-Authenticate`, a
valid token of a role that may not read 403; neither carries any metric.
TLS handshakes run in the connection's own thread, so a client that stalls
there holds no other reader up.
"""

from __future__ import annotations

import enum
import http.server
import ipaddress
import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Collection, Iterator
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from kv_manager_service.shared.security import Principal, Role, ServerTLS, TokenTable, read_token_file

log = logging.getLogger("kv_manager_service.shared.metrics_endpoint")

PATH = "/metrics"
CONNECTION_TIMEOUT_S = 10.0  # a connection idle this long, in its handshake or its request, is closed


class View(str, enum.Enum):
    """What a reader sees."""

    FULL = "full"  # every series
    PUBLIC = "public"  # every series but those with a private label


@dataclass(frozen=True)
class MetricsAccess:
    """Who may read /metrics and what they see; `metrics_access` builds it from a server's settings.

    Invariant: `open_view` is set exactly when no token is asked for; then the
    tokens are not read at all.
    """

    tls: ServerTLS | None = None  # HTTPS with the server's certificate; its client CA, if any, is required
    tokens: TokenTable | None = None  # the server's token file: principals with a role in `reader_roles` read FULL
    reader_roles: frozenset[Role] = frozenset({Role.OPERATOR})
    scrape_tokens: TokenTable | None = None  # read PUBLIC, whatever their role
    open_view: View | None = View.FULL  # what a request without a token reads; None: a token is required
    private_labels: frozenset[str] = frozenset()

    def describe(self) -> str:
        """Who may read, in words, for the start-up log."""
        if self.open_view is View.PUBLIC:
            return f"loopback only, no token, series labelled {sorted(self.private_labels)} left out"
        if self.open_view is View.FULL:
            mutual = self.tls is not None and self.tls.client_ca_file is not None
            return "a client certificate from --tls-ca" if mutual else "open to all"
        readers = []
        if self._has_readers(self.tokens):
            roles = " or ".join(sorted(role.value for role in self.reader_roles))
            readers.append(f"a token of --auth-token-file with the role {roles}")
        if self.scrape_tokens is not None:
            readers.append(f"the --metrics-token-file token (series labelled {sorted(self.private_labels)} left out)")
        return "bearer token: " + " or ".join(readers)

    def _has_readers(self, tokens: TokenTable | None) -> bool:
        return tokens is not None and any(p.role in self.reader_roles for p in tokens.principals)

    def view(self, authorization: list[str]) -> View | HTTPStatus:
        """The view of a request with these `Authorization` header values, or the HTTP status refusing it."""
        if self.open_view is not None:
            return self.open_view
        metadata = [("authorization", value) for value in authorization]
        principal: Principal | None = self.tokens.authenticate(metadata) if self.tokens is not None else None
        if principal is not None and principal.role in self.reader_roles:
            return View.FULL
        if self.scrape_tokens is not None and self.scrape_tokens.authenticate(metadata) is not None:
            return View.PUBLIC
        return HTTPStatus.FORBIDDEN if principal is not None else HTTPStatus.UNAUTHORIZED


def is_loopback(host: str) -> bool:
    """True for `localhost` and the loopback addresses (127.0.0.0/8, ::1); a name is never trusted to be one."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def metrics_access(
    host: str,
    tls: ServerTLS | None,
    tokens: TokenTable | None,
    scrape_tokens: TokenTable | None = None,
    reader_roles: Collection[Role] = (Role.OPERATOR,),
    private_labels: Collection[str] = (),
) -> MetricsAccess:
    """The access rule of a /metrics endpoint on `host` for a server with these TLS and tokens (module table).

    Raises ValueError, naming the flags, when the server asks for tokens, no
    token may read the metrics and `host` is not loopback: the endpoint would
    be open to readers who may not call the RPCs.
    """
    access = MetricsAccess(tls, tokens, frozenset(reader_roles), scrape_tokens, None, frozenset(private_labels))
    if access._has_readers(tokens) or scrape_tokens is not None:
        return access
    if tokens is None:  # no tokens on the RPCs either: the reader may call them all
        return MetricsAccess(tls, open_view=View.FULL)
    if not is_loopback(host):
        roles = " or ".join(sorted(role.value for role in reader_roles))
        raise ValueError(
            f"/metrics on {host} would be open to all: --auth-token-file has no {roles} token and no "
            "--metrics-token-file is given; give one, or bind /metrics to loopback (--metrics-host 127.0.0.1)"
        )
    return MetricsAccess(tls, open_view=View.PUBLIC, private_labels=frozenset(private_labels))


def load_scrape_token_file(path: Path) -> TokenTable:
    """The scrape token of `--metrics-token-file`: one token on one line, which reads /metrics and calls no RPC."""
    return TokenTable({read_token_file(path): Principal("metrics-scrape")}, names_tenants=False)


class _PublicView:
    """The registry without the families that have a sample with a private label, or no sample at all
    (a labelled family before its first child: its labels are not known here)."""

    def __init__(self, registry: CollectorRegistry, private_labels: frozenset[str]) -> None:
        self._registry = registry
        self._private_labels = private_labels

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.samples and not any(self._private_labels.intersection(s.labels) for s in family.samples):
                yield family


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _MetricsHTTPServer
    timeout = CONNECTION_TIMEOUT_S

    def do_GET(self) -> None:
        view = self.server.access.view(self.headers.get_all("Authorization") or [])
        if view is HTTPStatus.UNAUTHORIZED:
            self._refuse(view, 'Bearer realm="metrics"', "a bearer token that may read metrics is needed\n")
        elif view is HTTPStatus.FORBIDDEN:
            challenge = 'Bearer realm="metrics", error="insufficient_scope"'
            self._refuse(view, challenge, "this token may not read metrics\n")
        elif urlsplit(self.path).path != PATH:
            self._send(404, b"not found: metrics are at /metrics\n", "text/plain; charset=utf-8")
        else:
            self._send(200, generate_latest(self.server.views[view]), CONTENT_TYPE_LATEST)

    def _refuse(self, status: int, challenge: str, text: str) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8", {"WWW-Authenticate": challenge})

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002: the base class's name
        log.debug("%s: " + format, self.address_string(), *args)


class _MetricsHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        access: MetricsAccess,
        views: dict[View, Any],
        tls_context: ssl.SSLContext | None,
    ) -> None:
        self.address_family = family
        self.access = access
        self.views = views
        self.tls_context = tls_context
        super().__init__(address, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls_context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(CONNECTION_TIMEOUT_S)
        try:
            connection = self.tls_context.wrap_socket(request, server_side=True)  # the handshake, in this thread
        except (ssl.SSLError, OSError) as error:
            log.debug("metrics: TLS handshake with %s failed: %s", client_address, error)
            return
        with connection:
            super().finish_request(connection, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: connection from %s failed", client_address, exc_info=True)


def _tls_context(tls: ServerTLS) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.client_ca_file is not None:
            context.load_verify_locations(cafile=tls.client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"/metrics cannot use --tls-cert/--tls-key/--tls-ca: {error}") from None
    return context


@dataclass
class MetricsServer:
    """The HTTP(S) endpoint serving one registry at /metrics."""

    httpd: _MetricsHTTPServer
    thread: threading.Thread
    host: str

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.httpd.server_port}"

    @property
    def url(self) -> str:
        scheme = "https" if self.httpd.tls_context is not None else "http"
        return f"{scheme}://{self.address}{PATH}"

    @property
    def access(self) -> MetricsAccess:
        return self.httpd.access

    def stop(self) -> None:
        """Stop serving and close the socket; returns once the serving thread has ended."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def start_metrics_server(
    registry: CollectorRegistry, host: str, port: int, access: MetricsAccess = MetricsAccess()
) -> MetricsServer:
    """Serve `registry` at HOST:PORT/metrics (port 0: a free one) from a daemon thread, as `access` says.

    OSError naming the address when it cannot be bound; ValueError when the TLS files cannot be loaded.
    """
    tls_context = _tls_context(access.tls) if access.tls is not None else None
    views = {View.FULL: registry, View.PUBLIC: _PublicView(registry, access.private_labels)}
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        httpd = _MetricsHTTPServer(sockaddr[:2], family, access, views, tls_context)
    except OSError as error:
        raise OSError(f"could not bind the metrics endpoint {host}:{port}: {error}") from error
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread, host)
