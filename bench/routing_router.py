"""Routers of the routing simulation, and the leases they read: what a router sees, and how it picks a replica.

A router picks a replica for each request from the mirror's answer: per
replica its cached prefix of the prompt (`ReplicaPrefix`) and its lease. The
lease is what the replica's heartbeat last wrote to Redis, once every TTL/3,
so between beats its load figures are stale: `LeaseBoard` models that
explicitly. Each replica beats on its own phase, replica i at ticks where
`tick % refresh_ticks == i * refresh_ticks // num_replicas`, so at a decision
lease i is 0 to refresh_ticks - 1 ticks old.

Every router counts its own in-flight requests: routed by it, their
response not yet complete (a router that proxies a request sees its stream
end). The routers:

- `RoundRobinRouter`: request i to replica i mod R; reads nothing.
- `LeaseRouter`: `lookup.choose_replica` on the mirror's answer as is:
  longest prefix, ties to the lowest lease usage, then lease requests. With
  stale leases a burst of new prompts ties on every replica and goes to the
  one the last beat showed least loaded, all of it.
- `InFlightRouter`: load-aware, in two bounds. A replica's in-flight load
  is the larger of the router's own in-flight count there (fresh, exact for
  its own requests) and the lease's request count (stale, but it counts
  other routers' requests too); candidates are within `slack` requests of
  the least loaded. Bursts spread at once, without waiting for a heartbeat.
  In-flight balance alone leaves the request counts uneven (a replica whose
  requests hit finishes them sooner and takes more), so a candidate must
  also stay within its share: after this request, at most
  (1 + `share_slack`) x the mean number of requests routed per replica, plus
  one (the bounded loads of consistent hashing, over the router's count);
  the in-flight bound applies among those. Of the candidates it takes the
  largest prefix score, the score choose_replica ranks by (`prefix_score`),
  ties to the lowest in-flight load, then the lease's usage, then the
  replica id. choose_replica itself is not called because its ties read the
  lease's usage before anything else, and the usage is the stale figure
  that makes the burst pile up.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

from kv_manager_service.mirror.lookup import HOST_HIT_WEIGHT, ReplicaPrefix, choose_replica
from kv_manager_service.mirror.schema import Lease


class LeaseBoard:
    """The leases as Redis holds them: each replica's last heartbeat, written every `refresh_ticks` ticks.

    Invariant: when the caller publishes, at every tick, the lease of each
    replica `due` then, `leases[i]` is replica i's lease as of its last beat
    (or as given at start).
    """

    def __init__(self, initial: Sequence[Lease], refresh_ticks: int) -> None:
        if refresh_ticks < 1:
            raise ValueError(f"refresh_ticks must be >= 1, got {refresh_ticks}")
        self.leases = list(initial)
        self.refresh_ticks = refresh_ticks

    def due(self, tick: int) -> list[int]:
        """The replicas whose heartbeat falls on `tick`."""
        num_replicas = len(self.leases)
        phase = tick % self.refresh_ticks
        return [i for i in range(num_replicas) if i * self.refresh_ticks // num_replicas == phase]

    def publish(self, index: int, lease: Lease) -> None:
        self.leases[index] = lease


def prefix_score(prefix: ReplicaPrefix) -> Fraction | int:
    """What a cached prefix saves, as choose_replica scores it: device blocks + HOST_HIT_WEIGHT x host-only blocks."""
    if not prefix.num_host_blocks:
        return prefix.num_cached_blocks  # the common case, without Fraction arithmetic
    return prefix.num_cached_blocks - prefix.num_host_blocks + HOST_HIT_WEIGHT * prefix.num_host_blocks


class Router:
    """Picks a replica per request and keeps its own in-flight count per replica.

    The simulation calls `choose`, then `routed` with the replica it used,
    and `finished` when that request's last token is out. `reads_prefixes`
    says whether `choose` needs the mirror's answer (a lookup per request).
    """

    reads_prefixes = True

    def __init__(self, num_replicas: int) -> None:
        self.in_flight = [0] * num_replicas
        self.num_routed = 0

    def choose(self, prefixes: Sequence[ReplicaPrefix]) -> int:
        """The index of the replica for the next request; `prefixes` in replica order (empty if not read)."""
        raise NotImplementedError

    def routed(self, index: int) -> None:
        self.in_flight[index] += 1
        self.num_routed += 1

    def finished(self, index: int) -> None:
        assert self.in_flight[index] > 0, f"replica {index} finished a request this router did not route"
        self.in_flight[index] -= 1


class RoundRobinRouter(Router):
    """Request i to replica i mod R, whatever the mirror holds."""

    reads_prefixes = False

    def choose(self, prefixes: Sequence[ReplicaPrefix]) -> int:
        return self.num_routed % len(self.in_flight)


class LeaseRouter(Router):
    """choose_replica on the mirror's answer: the prefix, then the lease's figures as the last beat left them."""

    def __init__(self, replica_ids: Sequence[str]) -> None:
        super().__init__(len(replica_ids))
        self.index_of = {replica_id: i for i, replica_id in enumerate(replica_ids)}

    def choose(self, prefixes: Sequence[ReplicaPrefix]) -> int:
        return self.index_of[choose_replica(prefixes)]


class InFlightRouter(Router):
    """The best prefix among the replicas within both load bounds (module docstring)."""

    def __init__(self, num_replicas: int, slack: int, share_slack: float) -> None:
        if slack < 0:
            raise ValueError(f"slack must be >= 0 requests, got {slack}")
        if share_slack < 0:
            raise ValueError(f"share_slack must be >= 0 (a fraction of the mean), got {share_slack}")
        super().__init__(num_replicas)
        self.slack = slack
        self.share_slack = share_slack
        self.num_routed_to = [0] * num_replicas

    def loads(self, prefixes: Sequence[ReplicaPrefix]) -> list[int]:
        """Per replica, the larger of this router's in-flight requests there and the lease's request count."""
        return [max(own, p.lease.num_requests) for own, p in zip(self.in_flight, prefixes)]

    def candidates(self, loads: Sequence[int]) -> list[int]:
        """The replicas within their share of the requests, and of those the ones within `slack` of the least loaded.

        Never empty: the replica with the fewest requests so far has at most
        the mean, so it is within its share.
        """
        share = (1 + self.share_slack) * (self.num_routed + 1) / len(loads) + 1
        within_share = [i for i, n in enumerate(self.num_routed_to) if n + 1 <= share]
        ceiling = min(loads[i] for i in within_share) + self.slack
        return [i for i in within_share if loads[i] <= ceiling]

    def choose(self, prefixes: Sequence[ReplicaPrefix]) -> int:
        loads = self.loads(prefixes)

        def rank(i: int) -> tuple:
            p = prefixes[i]
            return (-prefix_score(p), loads[i], p.lease.usage, p.replica_id)

        return min(self.candidates(loads), key=rank)

    def routed(self, index: int) -> None:
        super().routed(index)
        self.num_routed_to[index] += 1
