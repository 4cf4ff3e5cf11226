"""Prometheus metrics: RPC timing as a server interceptor, the manager's scrape-time collector, the endpoint.

Every server owns a `CollectorRegistry` of its own (never the process-wide
default), so several servers in one process do not collide. Values the
servicer already keeps (pool stats, step ids, the mirror's counters) are read
when Prometheus scrapes, by `ManagerCollector`; only what nothing else
records (per-RPC durations and error codes) is recorded per call, by
`RpcMetricsInterceptor`.

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
| `kvcache_last_event_sequence` | gauge | the last cache event logged |
| `kvcache_mirror_enabled` | gauge | 1 when the Redis mirror is on |
| `kvcache_mirror_lag_seconds` | gauge | age of the newest event the mirror wrote, when it wrote it |
| `kvcache_mirror_queue_depth` | gauge | events logged but not yet written to Redis |
| `kvcache_mirror_failures_total` | counter | Redis calls that failed |
| `kvcache_mirror_resyncs_total` | counter | full re-publications of the cached set |
| `kvcache_rpc_duration_seconds{method}` | histogram | time in the handler of each unary call |
| `kvcache_rpc_errors_total{method,code}` | counter | calls that ended with a status other than OK |
| `kvcache_tenant_blocks{tenant}` | gauge | with `--multi-tenant`: blocks the tenant holds (see tenancy.py) |
| `kvcache_tenant_quota_blocks{tenant}` | gauge | the tenant's quota, for tenants with one |
| `kvcache_tenant_requests{tenant}` | gauge | the tenant's live requests |
| `kvcache_tenant_quota_refusals_total{tenant}` | counter | its allocate ops answered NO_SPACE while its quota was the tighter limit |
| `kvcache_tenant_prefix_cache_query_tokens_total{tenant}`, `..._hit_tokens_total{tenant}` | counter | its prompt tokens looked up, and found, in the prefix cache |

plus the `process_*` metrics (CPU, memory, open files) of the process.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence
from wsgiref.simple_server import WSGIServer

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kv_manager_service.service import KVManagerServicer

# 0.1 ms .. 1 s: a point lookup takes tens of microseconds, a 256-op Step ~2 ms.
RPC_DURATION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def new_registry() -> CollectorRegistry:
    """A server's own registry, with the process's CPU, memory and file metrics in it."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    return registry


class _ErrorCounts:
    """One method's error counter children, by status code, created on first use."""

    def __init__(self, counter: Counter, method: str) -> None:
        self._counter = counter
        self._method = method
        self._children: dict[grpc.StatusCode, Any] = {}

    def inc(self, code: grpc.StatusCode | None) -> None:
        # A handler that raised without setting a code ends with UNKNOWN.
        code = code or grpc.StatusCode.UNKNOWN
        child = self._children.get(code)
        if child is None:
            child = self._children.setdefault(code, self._counter.labels(self._method, code.name))
        child.inc()


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Times the unary calls of one service and counts its failed calls by method and status code.

    A unary call's duration is the handler's: from the deserialized request
    to the response object, rejected calls included (message parsing,
    serialization, queueing and the network are not in it). Server streams
    (the manager's `WatchSteps`, `WatchEvents`) are not timed, since a watch
    lasts as long as its watcher; a stream that ends with an error status is
    counted. Calls of other services (health checking, reflection) pass
    through untouched.

    Per call this costs a dict lookup, two clock reads and one histogram
    observation: the wrapped handler of each method, with its label children,
    is built on the method's first call and reused.
    """

    def __init__(
        self,
        service: ServiceDescriptor,
        registry: CollectorRegistry,
        prefix: str,
        buckets: Sequence[float] = RPC_DURATION_BUCKETS_S,
    ) -> None:
        self.durations = Histogram(
            f"{prefix}_rpc_duration_seconds",
            f"Time in the handler of each unary {service.name} call, rejected calls included.",
            ["method"],
            registry=registry,
            buckets=buckets,
        )
        self.errors = Counter(
            f"{prefix}_rpc_errors",
            f"{service.name} calls that ended with a status other than OK, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self._names = {f"/{service.full_name}/{method.name}": method.name for method in service.methods}
        for method in service.methods:
            if not method.server_streaming and not method.client_streaming:
                self.durations.labels(method.name)  # every method shows, at 0, before its first call
        # full method name -> (the handler it wraps, the wrapped handler)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        name = self._names.get(method)
        if handler is None or name is None:
            return handler
        wrapped = self._wrap(handler, name)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler: Any, name: str) -> Any:
        errors = _ErrorCounts(self.errors, name)
        if handler.unary_unary is not None:
            observe = self.durations.labels(name).observe
            return handler._replace(unary_unary=_timed_unary(handler.unary_unary, observe, errors))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_counted_stream(handler.unary_stream, errors))
        return handler  # client and bidirectional streams: none in these services


def _timed_unary(behavior: Callable, observe: Callable[[float], None], errors: _ErrorCounts) -> Callable:
    clock = time.perf_counter
    ok = grpc.StatusCode.OK

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        started = clock()
        try:
            response = behavior(request, context)
        except Exception:
            # context.abort raises after setting the code.
            errors.inc(context.code())
            raise
        finally:
            observe(clock() - started)
        code = context.code()
        if code is not None and code is not ok:
            errors.inc(code)
        return response

    return unary


def _counted_stream(behavior: Callable, errors: _ErrorCounts) -> Callable:
    def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(request, context)
        except Exception:
            errors.inc(context.code())
            raise

    return stream


class ManagerCollector:
    """The servicer's own figures, read at scrape time (pool stats under the servicer's lock)."""

    def __init__(self, servicer: KVManagerServicer) -> None:
        self.servicer = servicer

    def collect(self) -> Iterator[Metric]:
        servicer = self.servicer
        with servicer.lock:
            stats = servicer.manager.stats()
            last_step_id = servicer.manager.last_step_id
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        mirror = servicer.mirror.metrics if servicer.mirror is not None else None
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
            (gauge, "kvcache_last_step_id", "The last step id issued.", last_step_id),
            (gauge, "kvcache_last_event_sequence", "The sequence number of the last cache event logged.",
             servicer.events.last_id),
            (gauge, "kvcache_mirror_enabled", "1 when the prefix index is mirrored to Redis.", int(mirror is not None)),
            (gauge, "kvcache_mirror_lag_seconds", "Age of the newest event the mirror wrote, when it wrote it.",
             mirror.lag_ms / 1e3 if mirror else 0.0),
            (gauge, "kvcache_mirror_queue_depth", "Cache events logged but not yet written to Redis.",
             mirror.queue_depth if mirror else 0),
            (counter, "kvcache_mirror_failures", "Redis calls of the mirror that failed.",
             mirror.num_failures if mirror else 0),
            (counter, "kvcache_mirror_resyncs", "Full re-publications of the cached set to Redis.",
             mirror.num_resyncs if mirror else 0),
        ]  # fmt: skip
        for family, name, documentation, value in figures:
            yield family(name, documentation, value=value)
        if servicer.tenants is not None:
            yield from _tenant_metrics(servicer)


def _tenant_metrics(servicer: KVManagerServicer) -> Iterator[Metric]:
    """Per-tenant figures of a multi-tenant server (see tenancy.py), labelled by tenant."""
    with servicer.lock:
        usage = {tenant: dataclasses.replace(u) for tenant, u in servicer.tenants.usage.items()}
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
        metric = family(name, documentation, labels=["tenant"])
        for tenant, u in sorted(usage.items()):
            metric.add_metric([tenant], value(u))
        yield metric
    quotas = GaugeMetricFamily("kvcache_tenant_quota_blocks", "The tenant's block quota (tenants with one).", labels=["tenant"])
    for tenant, u in sorted(usage.items()):
        if u.quota_blocks is not None:
            quotas.add_metric([tenant], u.quota_blocks)
    yield quotas


@dataclass
class MetricsServer:
    """The HTTP endpoint serving one registry in the Prometheus text format."""

    httpd: WSGIServer
    thread: threading.Thread
    host: str

    @property
    def address(self) -> str:
        return f"{self.host}:{self.httpd.server_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket; returns once the serving thread has ended."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` at http://HOST:PORT/metrics (port 0: a free one) from a daemon thread."""
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise OSError(f"could not bind the metrics endpoint {host}:{port}: {error}") from error
    return MetricsServer(httpd, thread, host)
