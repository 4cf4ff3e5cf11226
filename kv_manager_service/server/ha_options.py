"""The options of a high-availability group's member (ha.py), importable without the redis package."""

from __future__ import annotations

from dataclasses import dataclass


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
