"""How a server bounds its connections, so that idle sockets cannot starve real clients.

At most `connection_limit` connections at once: more are closed at accept, before any file of the
process runs out. One that has not finished its handshake (HTTP/2, and TLS) in the handshake
timeout is closed, as is one without a call for IDLE_CONNECTION_S (the client reconnects on its
next call). The server pings a quiet peer every KEEPALIVE_S and drops it when no answer comes
within KEEPALIVE_TIMEOUT_S, and refuses a client that pings more often than every
MIN_CLIENT_PING_S without calls (gRPC's strikes, then GOAWAY). An attacker who reconnects without
pause can still hold the slots, less the handshake timeout: per-address limits would need an
accept layer grpcio does not have.
"""

from __future__ import annotations

import resource

FDS_KEPT_FREE = 128  # open files the connections may not take (see `connection_limit`)
IDLE_CONNECTION_S = 300  # a connection without a call this long is closed (the client reconnects on its next call)
KEEPALIVE_S = 60  # the server pings a quiet peer this often ...
KEEPALIVE_TIMEOUT_S = 20  # ... and drops it when no answer comes within this
MIN_CLIENT_PING_S = 10  # a client's pings without calls, at most this often


def connection_options(max_connections: int | None, handshake_timeout_s: float) -> list[tuple[str, int]]:
    """The gRPC server options of this policy."""
    return [
        ("grpc.max_allowed_incoming_connections", connection_limit(max_connections)),
        ("grpc.server_handshake_timeout_ms", int(handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", IDLE_CONNECTION_S * 1000),
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_S * 1000),
    ]


def connection_limit(max_connections: int | None) -> int:
    """The connections the server accepts at once: `max_connections`, or by default the process's
    open-file limit less FDS_KEPT_FREE (the journal, Redis, the metrics endpoint, the writer process).
    ValueError when `max_connections` would leave fewer than FDS_KEPT_FREE files free."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft - FDS_KEPT_FREE if soft != resource.RLIM_INFINITY else 1 << 20
    if max_connections is None:
        return max(16, room)
    if max_connections > room:
        raise ValueError(
            f"--max-connections {max_connections} would leave fewer than {FDS_KEPT_FREE} of the {soft} files the "
            f"process may open (ulimit -n) for the journal, Redis and the rest: raise ulimit -n, or lower "
            f"--max-connections to {max(room, 1)} or less"
        )
    return max_connections
