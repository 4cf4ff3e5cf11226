"""Whether a server can listen on a port, checked before it starts (one clear error, no gRPC C-core log).

gRPC reports a failed bind as a bare RuntimeError, after its C core has
already logged its own line on stderr. Our servers probe their ports first,
binding a plain socket the way their listeners will bind (SO_REUSEADDR, as
gRPC and the metrics endpoint set it; never SO_REUSEPORT, which our gRPC
servers turn off), and close it again: a port in use is then one line that
names it, found before any slow start-up work.
"""

from __future__ import annotations

import errno
import socket

import grpc


class PortUnavailableError(OSError):
    """A server cannot listen on HOST:PORT; the message is one line for the user."""


def check_port_free(host: str, port: int, what: str = "port") -> None:
    """Raise PortUnavailableError unless a listener can bind `host`:`port` now.

    Port 0 (any free port) checks the host alone. A host that resolves to
    several addresses (localhost: 127.0.0.1 and ::1) is refused when any of
    them is in use, or when none can be bound. `what` names the port in the
    message ("port", "metrics port"). The port may still be taken between this
    check and the real bind; the server's own bind then fails as well.
    """
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise PortUnavailableError(f"cannot listen on {host}: the host does not resolve ({error.strerror})") from None
    failures: list[OSError] = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise PortUnavailableError(f"{what} {port} on {host} is in use") from None
                failures.append(error)
    if len(failures) == len(addresses):
        raise PortUnavailableError(f"cannot listen on {what} {port} on {host}: {failures[0].strerror}")


def listen(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Add the listening port (TLS with `credentials`, plaintext without) and return its number.

    A port taken since `check_port_free` is PortUnavailableError: gRPC says
    no more than "failed to bind".
    """
    try:
        if credentials is not None:
            return server.add_secure_port(f"{host}:{port}", credentials)
        return server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        raise PortUnavailableError(f"cannot listen on port {port} on {host}") from None
