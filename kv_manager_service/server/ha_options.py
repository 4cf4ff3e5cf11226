"""The options of a high-availability group's member (ha.py), importable without the redis package."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_manager_service.shared.security import ClientTLS, ServerTLS, TokenTable


@dataclass(frozen=True)
class HAOptions:
    lease_s: float = 1.2  # the leadership lease's TTL: a dead primary is replaced within about this long
    sync_timeout_s: float = 0.5  # an in-sync standby this far behind a commit is dropped from the set
    history_retention: int = 100_000  # records kept for standbys that reconnect; older ones get a snapshot
    history_retention_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not 0.2 <= self.lease_s <= 60:
            raise ValueError(f"--ha-lease-ms must be in 200..60000, got {self.lease_s * 1000:g}")
        if not 0 < self.sync_timeout_s < self.lease_s:
            raise ValueError(
                f"--ha-sync-timeout-ms must be > 0 and below --ha-lease-ms ({self.lease_s * 1000:g}), "
                f"got {self.sync_timeout_s * 1000:g}"
            )

    @property
    def poll_s(self) -> float:
        return self.lease_s / 10


@dataclass(frozen=True)
class MemberLink:
    """How the members reach each other: the replication listener's host and port, its TLS and the tokens
    it accepts (of the member role), and what this member presents to the others."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, which the lease advertises
    server_tls: ServerTLS | None = None
    tokens: TokenTable | None = None
    client_tls: ClientTLS | None = None
    bearer_token: str | None = field(default=None, repr=False)
