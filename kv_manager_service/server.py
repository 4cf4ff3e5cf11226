"""The gRPC server process: the servicer, health checking, reflection and shutdown."""

from __future__ import annotations

import dataclasses
import gc
import logging
import signal
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kv_manager_service.core import KVCacheConfig, KVCacheManager
from kv_manager_service.metrics import (
    ManagerCollector,
    MetricsServer,
    RpcMetricsInterceptor,
    new_registry,
    start_metrics_server,
)
from kv_manager_service.ready_line import MANAGER_READY_PREFIX
from kv_manager_service.service import KVManagerServicer, ServiceLimits
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

log = logging.getLogger("kv_manager_service.server")

SERVICE = pb.DESCRIPTOR.services_by_name["KVManagerService"]
SERVICE_NAME = SERVICE.full_name


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    replica_id: str = field(default_factory=socket.gethostname)
    max_workers: int = 32  # threads; each open stream holds one
    max_message_bytes: int = 64 << 20
    grace_s: float = 5.0  # on SIGTERM, in-flight calls get this long
    limits: ServiceLimits = ServiceLimits()
    redis_url: str | None = None  # None: no mirror, the index stays in-process
    model_name: str = "default"  # namespaces the mirror's keys
    lease_ttl_s: float = 10.0
    metrics_port: int | None = None  # serve Prometheus metrics on host:metrics_port (0: any free port)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if not self.replica_id:
            raise ValueError("replica_id must not be empty")
        if self.max_workers < 2:
            raise ValueError(f"max_workers must be >= 2, got {self.max_workers}")


@dataclass
class RunningServer:
    server: grpc.Server
    servicer: KVManagerServicer
    health: health.HealthServicer
    address: str
    metrics: MetricsServer | None = None  # None: no --metrics-port

    @property
    def metrics_address(self) -> str | None:
        """HOST:PORT of the Prometheus endpoint (`/metrics`), or None when it is off."""
        return self.metrics.address if self.metrics is not None else None

    def stop(self, grace_s: float) -> None:
        """Refuse new calls, end the streams, let in-flight calls finish, drop the lease, close /metrics."""
        self.health.enter_graceful_shutdown()
        self.servicer.close()
        self.server.stop(grace_s).wait()
        if self.servicer.mirror is not None:
            self.servicer.mirror.stop()
        if self.metrics is not None:
            self.metrics.stop()


def start_server(config: KVCacheConfig, options: ServerOptions) -> RunningServer:
    """Build and start the server; returns once it accepts calls."""
    config = dataclasses.replace(config, enable_events=True)
    manager = KVCacheManager(config)
    incarnation = time.time_ns()  # new at every start, and increasing across restarts
    servicer = KVManagerServicer(manager, options.replica_id, incarnation, options.limits)
    metrics: MetricsServer | None = None
    interceptors: list[grpc.ServerInterceptor] = []
    if options.metrics_port is not None:
        registry = new_registry()
        registry.register(ManagerCollector(servicer))
        interceptors.append(RpcMetricsInterceptor(SERVICE, registry, "kvcache"))
        metrics = start_metrics_server(registry, options.host, options.metrics_port)
    try:
        running = _start_grpc(config, options, servicer, interceptors)
    except BaseException:
        if metrics is not None:
            metrics.stop()
        raise
    running.metrics = metrics
    if metrics is not None:
        log.info("metrics at %s", metrics.url, extra={"metrics_url": metrics.url})
    return running


def _start_grpc(
    config: KVCacheConfig,
    options: ServerOptions,
    servicer: KVManagerServicer,
    interceptors: list[grpc.ServerInterceptor],
) -> RunningServer:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=options.max_workers, thread_name_prefix="kv-rpc"),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_KVManagerServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{options.host}:{options.port}")
    if port == 0:
        raise OSError(f"could not bind {options.host}:{options.port}")
    server.start()
    address = f"{options.host}:{port}"
    servicer.address = address
    if options.redis_url:
        _start_mirror(servicer, config, options)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, servicer, health_servicer, address)


def _start_mirror(servicer: KVManagerServicer, config: KVCacheConfig, options: ServerOptions) -> None:
    """Turn the Redis mirror on. Redis may be down now: the writer retries in the background."""
    try:
        import redis
    except ImportError as e:
        raise ValueError("--redis-url needs the redis package: pip install 'kv-manager-service[redis]'") from e
    from kv_manager_service.cluster import ClusterIndex
    from kv_manager_service.mirror import MirrorOptions, MirrorWriter
    from kv_manager_service.redis_schema import KeySchema

    # Short timeouts: a slow Redis must not hold a lookup or the writer for long.
    client = redis.Redis.from_url(options.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    schema = KeySchema(options.model_name, config.hash_algorithm.value, config.hash_seed)
    servicer.mirror = MirrorWriter(
        client,
        schema,
        servicer.replica_id,
        servicer.incarnation,
        servicer.events,
        servicer.cached_snapshot,
        servicer.lease,
        MirrorOptions(lease_ttl_s=options.lease_ttl_s),
    )
    servicer.cluster = ClusterIndex(client, schema)
    servicer.mirror.start()
    log.info("mirroring the prefix index to %s under %s", _redact(options.redis_url), schema.namespace)


def _redact(url: str) -> str:
    """The URL without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest


def serve(config: KVCacheConfig, options: ServerOptions) -> int:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    running = start_server(config, options)
    # The pool's blocks live as long as the process: keep them out of the
    # collector's generations, and collect young objects less often. With the
    # defaults a 120k-block server paused ~30 ms every few hundred steps.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{MANAGER_READY_PREFIX}{running.address}", flush=True)
    log.info(
        "serving replica_id=%s incarnation=%d num_blocks=%d groups=%d",
        options.replica_id,
        running.servicer.incarnation,
        config.num_blocks,
        len(config.groups),
        extra={
            "replica_id": options.replica_id,
            "incarnation": running.servicer.incarnation,
            "address": running.address,
        },
    )
    while not stop.wait(1.0):
        pass
    log.info("shutting down, grace %.1fs", options.grace_s)
    running.stop(options.grace_s)
    return 0
