"""The manager's own figures for Prometheus, read at scrape time by `ManagerCollector`.

Manager metrics (`kvcache_` prefix):

| name | type | what |
|---|---|---|
| `kvcache_num_blocks` | gauge | blocks in the pool, the null block included |
| `kvcache_num_free_blocks` | gauge | blocks free (cached free blocks included) |
| `kvcache_usage_ratio` | gauge | share of usable blocks in use, 0..1 (`GetStats.usage`) |
| `kvcache_num_requests_running` | gauge | live requests |
| `kvcache_prefix_cache_query_tokens_total` | counter | prompt tokens looked up in the prefix cache |
| `kvcache_prefix_cache_hit_tokens_total` | counter | of those, tokens found cached |
| `kvcache_prefix_cache_hit_ratio` | gauge | hits / queries since start (0 before any query) |
| `kvcache_evictions_total` | counter | cached blocks evicted for reuse |
| `kvcache_num_pending_copies` | gauge | block copies not yet acknowledged by the workers |
| `kvcache_last_step_id` | gauge | the last step id issued |
| `kvcache_workers_registered` | gauge | workers registered by WatchSteps (copies wait for each) |
| `kvcache_worker_lag_steps{worker_id}` | gauge | steps issued that the worker has not acknowledged |
| `kvcache_worker_streaming{worker_id}` | gauge | 1 while a WatchSteps stream of the worker is open |
| `kvcache_worker_idle_seconds{worker_id}` | gauge | since it was last heard from (0 while streaming); dropped at `--worker-timeout-s` |
| `kvcache_last_event_sequence` | gauge | the last cache event logged |
| `kvcache_mirror_enabled` | gauge | 1 when the Redis mirror is on |
| `kvcache_mirror_lag_seconds` | gauge | age of the newest event the mirror wrote, when it wrote it |
| `kvcache_mirror_queue_depth` | gauge | events logged but not yet written to Redis |
| `kvcache_mirror_failures_total` | counter | Redis calls that failed |
| `kvcache_mirror_resyncs_total` | counter | full re-publications of the cached set |
| `kvcache_mirror_fenced` | gauge | 1 when another live manager holds this replica id's lease: the mirror stopped writing |
| `kvcache_mirror_lookups_skipped_total` | counter | cluster lookups that skipped Redis after a recent failure |
| `kvcache_mirror_collections_total` | counter | collections of stale index fields this replica ran (it held the deployment's lock) |
| `kvcache_mirror_collected_fields_total` | counter | stale block fields (earlier incarnations', gone replicas') those collections deleted |
| `kvcache_mirror_collected_replicas_total` | counter | gone replica ids those collections dropped from the replica set |
| `kvcache_mirror_malformed_total{kind}` | counter | malformed Redis data the mirror skipped, by kind: `lease`, `replica_member`, `block_field`, `key_type` (mirror/schema.py `MALFORMED_KINDS`) |
| `kvcache_mirror_errors_total` | counter | unexpected exceptions of the mirror's threads (logged with a traceback), which survived them |
| `kvcache_num_pins` | gauge | live retention pins (docs/retention.md) |
| `kvcache_num_pinned_blocks` | gauge | the distinct blocks they hold |
| `kvcache_unpinned_blocks_total` | counter | blocks pins asked for that the quota had no room for |
| `kvcache_num_expected_requests` | gauge | waiting requests told ahead by expect ops |
| `kvcache_num_expected_blocks` | gauge | the hash blocks their prompts keep, within `--max-expected-blocks` |
| `kvcache_host_num_blocks` | gauge | blocks of the host-memory tier (host-tier series only with `--num-host-blocks`) |
| `kvcache_host_num_free_blocks` | gauge | host blocks free (cached free blocks included) |
| `kvcache_host_usage_ratio` | gauge | share of the host blocks pinned by pending tier copies, 0..1 |
| `kvcache_prefix_cache_host_hit_tokens_total` | counter | of the hit tokens, those loaded from the host tier |
| `kvcache_offloaded_blocks_total` | counter | blocks copied device -> host (offloads) |
| `kvcache_onloaded_blocks_total` | counter | blocks copied host -> device (onloads) |
| `kvcache_host_evictions_total` | counter | cached host blocks evicted for reuse |
| `kvcache_dropped_offloads_total` | counter | evicted device blocks not kept: every host block was pinned |
| `kvcache_num_pending_tier_copies` | gauge | tier copies not yet acknowledged (each pins its host block) |
| `kvcache_rpc_duration_seconds{method}` | histogram | time in the handler of each unary call |
| `kvcache_rpc_errors_total{method,code}` | counter | calls that ended with a status other than OK |
| `kvcache_tenant_blocks{tenant}` | gauge | with `--multi-tenant`: blocks the tenant holds (see tenancy.py) |
| `kvcache_tenant_quota_blocks{tenant}` | gauge | the tenant's quota, for tenants with one |
| `kvcache_tenant_requests{tenant}` | gauge | the tenant's live requests |
| `kvcache_tenant_quota_refusals_total{tenant}` | counter | its allocate ops answered NO_SPACE while its quota was the tighter limit |
| `kvcache_tenant_prefix_cache_query_tokens_total{tenant}`, `..._hit_tokens_total{tenant}` | counter | its prompt tokens looked up, and found, in the prefix cache |

plus the `process_*` metrics (CPU, memory, open files) of the process.

Tenant names are as private as the tenants' tokens: with bearer tokens on,
/metrics reads in full only with an operator token, who may call every RPC
(and sees every tenant's request ids) anyway. A scrape token, and a reader
on loopback without a token, read everything but the `kvcache_tenant_*`
families: `PRIVATE_LABELS` names the label that marks them
(see kv_manager_service/shared/metrics_endpoint.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterator, Sequence

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from kv_manager_service.core import HostTierStats, KVLossCount
from kv_manager_service.server.replica import Replica

TENANT_LABEL = "tenant"
PRIVATE_LABELS = frozenset({TENANT_LABEL})  # series only readers who may call every RPC see

if TYPE_CHECKING:  # the mirror needs the optional redis package
    from kv_manager_service.mirror.lookup import ClusterIndex
    from kv_manager_service.mirror.writer import MirrorMetrics


class ManagerCollector:
    """The replica's own figures, read at scrape time (pool stats under the replica's lock)."""

    def __init__(
        self, replica: Replica, mirror: MirrorMetrics | None = None, cluster: ClusterIndex | None = None
    ) -> None:
        """`mirror`: the mirror writer's figures, `cluster`: its lookups (None: no mirror)."""
        self.replica = replica
        self.mirror = mirror
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        stats, last_step_id, last_event_sequence, host_tier = self.replica.stats()
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        mirror = self.mirror
        num_mirror_failures = (mirror.num_failures if mirror else 0) + (self.cluster.num_failures if self.cluster else 0)
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        figures = [
            (gauge, "kvcache_num_blocks", "Blocks in the pool, the null block included.", stats.num_blocks),
            (gauge, "kvcache_num_free_blocks", "Free blocks, cached free blocks included.", stats.num_free_blocks),
            (gauge, "kvcache_usage_ratio", "Share of the usable blocks in use, 0..1.", stats.usage),
            (gauge, "kvcache_num_requests_running", "Live requests (allocated and not freed).", stats.num_requests),
            (counter, "kvcache_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.", queries),
            (counter, "kvcache_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", hits),
            (gauge, "kvcache_prefix_cache_hit_ratio", "Hit / query tokens since start; 0 before any query.",
             hits / queries if queries else 0.0),
            (counter, "kvcache_evictions", "Cached blocks evicted to be reused.", stats.num_evictions),
            (gauge, "kvcache_num_pending_copies", "Block copies not yet acknowledged by every worker.",
             stats.num_pending_copies),
            (gauge, "kvcache_num_pins", "Live retention pins.", stats.num_pins),
            (gauge, "kvcache_num_pinned_blocks", "Distinct blocks the retention pins hold.", stats.num_pinned_blocks),
            (counter, "kvcache_unpinned_blocks", "Blocks pins asked for that the pin quota had no room for.",
             stats.num_unpinned_blocks),
            (gauge, "kvcache_num_expected_requests", "Waiting requests told ahead by expect ops.",
             stats.num_expected_requests),
            (gauge, "kvcache_num_expected_blocks", "Hash blocks the expected requests' prompts keep.",
             stats.num_expected_blocks),
            (gauge, "kvcache_last_step_id", "The last step id issued.", last_step_id),
            (gauge, "kvcache_last_event_sequence", "The sequence number of the last cache event logged.",
             last_event_sequence),
            (gauge, "kvcache_mirror_enabled", "1 when the prefix index is mirrored to Redis.", int(mirror is not None)),
            (gauge, "kvcache_mirror_lag_seconds", "Age of the newest event the mirror wrote, when it wrote it.",
             mirror.lag_ms / 1e3 if mirror else 0.0),
            (gauge, "kvcache_mirror_queue_depth", "Cache events logged but not yet written to Redis.",
             mirror.queue_depth if mirror else 0),
            (counter, "kvcache_mirror_failures", "Redis calls of the mirror that failed.",
             num_mirror_failures),
            (gauge, "kvcache_mirror_fenced", "1 when another live manager holds this replica id's lease.",
             int(mirror.fenced) if mirror else 0),
            (counter, "kvcache_mirror_lookups_skipped", "Cluster lookups that skipped Redis after a recent failure.",
             self.cluster.num_skipped if self.cluster else 0),
            (counter, "kvcache_mirror_resyncs", "Full re-publications of the cached set to Redis.",
             mirror.num_resyncs if mirror else 0),
            (counter, "kvcache_mirror_collections", "Collections of stale index fields this replica ran.",
             mirror.collector.num_collections if mirror else 0),
            (counter, "kvcache_mirror_collected_fields", "Stale block fields deleted by this replica's collections.",
             mirror.collector.num_collected_fields if mirror else 0),
            (counter, "kvcache_mirror_collected_replicas", "Gone replica ids dropped from the replica set by them.",
             mirror.collector.num_collected_replicas if mirror else 0),
            (counter, "kvcache_mirror_errors", "Unexpected exceptions of the mirror's threads, logged and survived.",
             mirror.num_errors + mirror.collector.num_errors if mirror else 0),
        ]  # fmt: skip
        if host_tier is not None:
            figures += _host_tier_figures(host_tier)
        for family, name, documentation, value in figures:
            yield family(name, documentation, value=value)
        yield from _kv_loss_metrics(stats.kv_losses)
        if mirror is not None:
            yield _mirror_malformed_metric(mirror, self.cluster)
        if self.replica.tenancy is not None:
            yield from _tenant_metrics(self.replica)
        yield from _worker_metrics(self.replica)


def _mirror_malformed_metric(mirror: MirrorMetrics, cluster: ClusterIndex | None) -> Metric:
    """Malformed Redis data skipped by the writer, its collector and the lookups, labelled by kind."""
    counts = mirror.malformed.by_kind()
    if cluster is not None:
        for kind, count in cluster.malformed.by_kind().items():
            counts[kind] += count
    family = CounterMetricFamily(
        "kvcache_mirror_malformed", "Malformed Redis data the mirror skipped (never raised), by kind.", labels=["kind"]
    )
    for kind, count in counts.items():
        family.add_metric([kind], count)
    return family


def _kv_loss_metrics(kv_losses: Sequence[KVLossCount]) -> Iterator[Metric]:
    """KV found missing from the workers' memory (see core/invalidation.py), labelled by cause."""
    families = [
        (CounterMetricFamily("kvcache_kv_loss_uncached_blocks", "Device blocks taken out of the prefix cache "
                             "because the workers did not hold them.", labels=["cause"]), 1),
        (CounterMetricFamily("kvcache_kv_loss_uncached_host_blocks", "Host blocks taken out of the prefix cache "
                             "because the workers did not hold them.", labels=["cause"]), 2),
        (CounterMetricFamily("kvcache_kv_loss_requests", "Live requests whose KV was lost (to recompute).",
                             labels=["cause"]), 3),
    ]  # fmt: skip
    for family, field in families:
        for count in kv_losses:
            family.add_metric([count.cause.name.lower()], count[field])
        yield family


def _host_tier_figures(tier: HostTierStats) -> list[tuple[type, str, str, float]]:
    """The host tier's series (only a server with one exports them)."""
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    num_pinned = tier.num_host_blocks - tier.num_free_host_blocks
    return [
        (gauge, "kvcache_host_num_blocks", "Blocks of the host-memory tier.", tier.num_host_blocks),
        (gauge, "kvcache_host_num_free_blocks", "Free host blocks, cached free blocks included.",
         tier.num_free_host_blocks),
        (gauge, "kvcache_host_usage_ratio", "Share of the host blocks pinned by pending tier copies, 0..1.",
         num_pinned / tier.num_host_blocks),
        (counter, "kvcache_prefix_cache_host_hit_tokens", "Prompt tokens of prefix-cache hits loaded from the host.",
         tier.prefix_cache_host_hits),
        (counter, "kvcache_offloaded_blocks", "Blocks copied from the device pool to the host tier.",
         tier.num_offloaded_blocks),
        (counter, "kvcache_onloaded_blocks", "Blocks copied from the host tier to the device pool.",
         tier.num_onloaded_blocks),
        (counter, "kvcache_host_evictions", "Cached host blocks evicted to be reused.", tier.num_host_evictions),
        (counter, "kvcache_dropped_offloads", "Evicted device blocks not kept: every host block was pinned.",
         tier.num_dropped_offloads),
        (gauge, "kvcache_num_pending_tier_copies", "Tier copies not yet acknowledged by every worker.",
         tier.num_pending_tier_copies),
    ]  # fmt: skip


def _worker_metrics(replica: Replica) -> Iterator[Metric]:
    """The registered workers (see workers.py), labelled by worker_id."""
    statuses, last_step_id = replica.worker_statuses()
    yield GaugeMetricFamily(
        "kvcache_workers_registered", "Workers registered by WatchSteps; copies wait for each.", value=len(statuses)
    )
    lag = GaugeMetricFamily(
        "kvcache_worker_lag_steps", "Steps issued that the worker has not acknowledged.", labels=["worker_id"]
    )
    streaming = GaugeMetricFamily(
        "kvcache_worker_streaming", "1 while a WatchSteps stream of the worker is open.", labels=["worker_id"]
    )
    idle = GaugeMetricFamily(
        "kvcache_worker_idle_seconds", "Since the worker was last heard from; 0 while it streams.", labels=["worker_id"]
    )
    for status in statuses:
        lag.add_metric([status.worker_id], max(0, last_step_id - status.acked_step_id))
        streaming.add_metric([status.worker_id], int(status.num_streams > 0))
        idle.add_metric([status.worker_id], status.idle_s)
    yield from (lag, streaming, idle)


def _tenant_metrics(replica: Replica) -> Iterator[Metric]:
    """Per-tenant figures of a multi-tenant server (see tenancy.py), labelled by tenant."""
    with replica.lock:
        usage = {tenant: dataclasses.replace(u) for tenant, u in replica.tenancy.usage.items()}
    families = [
        (GaugeMetricFamily, "kvcache_tenant_blocks",
         "Blocks the tenant holds (its tables' distinct blocks, and those only its unacknowledged copies hold).",
         lambda u: u.num_blocks),
        (GaugeMetricFamily, "kvcache_tenant_requests", "The tenant's live requests.", lambda u: u.num_requests),
        (CounterMetricFamily, "kvcache_tenant_quota_refusals",
         "The tenant's allocate ops answered NO_SPACE while its quota, not the pool, was the tighter limit.",
         lambda u: u.num_quota_refusals),
        (CounterMetricFamily, "kvcache_tenant_prefix_cache_query_tokens",
         "The tenant's prompt tokens looked up in the prefix cache.", lambda u: u.prefix_cache_queries),
        (CounterMetricFamily, "kvcache_tenant_prefix_cache_hit_tokens",
         "The tenant's prompt tokens found in the prefix cache.", lambda u: u.prefix_cache_hits),
    ]  # fmt: skip
    for family, name, documentation, value in families:
        metric = family(name, documentation, labels=[TENANT_LABEL])
        for tenant, u in sorted(usage.items()):
            metric.add_metric([tenant], value(u))
        yield metric
    quotas = GaugeMetricFamily(
        "kvcache_tenant_quota_blocks", "The tenant's block quota (tenants with one).", labels=[TENANT_LABEL]
    )
    for tenant, u in sorted(usage.items()):
        if u.quota_blocks is not None:
            quotas.add_metric([tenant], u.quota_blocks)
    yield quotas
