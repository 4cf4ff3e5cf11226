"""The gRPC server process: the servicer, health checking, reflection and shutdown.

It runs past 450 lines because one process's lifetime is read in one place: the options and their
checks, opening the journal, starting the mirror and the metrics endpoint, serving, and the graceful
shutdown that undoes each of them in order.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kv_manager_service.core import EvictionPolicy, HashAlgorithm, KVCacheConfig, KVCacheManager, hashing
from kv_manager_service.shared.aio import AioInterceptor, EventLoopThread
from kv_manager_service.server.journal import DEFAULT_COMPACT_BYTES, Journal
from kv_manager_service.shared.rpc_metrics import RpcMetricsInterceptor, new_registry
from kv_manager_service.shared.metrics_endpoint import MetricsAccess, MetricsServer, metrics_access, start_metrics_server
from kv_manager_service.server.replica_metrics import PRIVATE_LABELS, ManagerCollector
from kv_manager_service.shared.parse_errors import ParseErrorInterceptor
from kv_manager_service.shared.connections import connection_limit, connection_options
from kv_manager_service.shared.ports import PortUnavailableError, check_port_free, listen
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kv_manager_service.shared.security import (
    BearerAuthInterceptor,
    ClientTLS,
    Role,
    ServerTLS,
    TokenTable,
)
from kv_manager_service.shared.termination import TerminationSignals
from kv_manager_service.server.memory_budget import (
    MemoryEstimate,
    available_memory,
    check_fits,
    describe,
    estimate_memory,
)
from kv_manager_service.server.pool_identity import pool_description
from kv_manager_service.server.replica import Replica
from kv_manager_service.server.ha_options import HAOptions, MemberLink
from kv_manager_service.server.retention import ServiceLimits
from kv_manager_service.shared.errors import NotPrimaryError
from kv_manager_service.server.servicer import KVManagerServicer, add_to_server
from kv_manager_service.server.tenancy import Tenancy
from kvcache.v1 import kv_manager_pb2 as pb

if TYPE_CHECKING:  # the mirror needs the optional redis package
    from kv_manager_service.mirror.lookup import ClusterIndex
    from kv_manager_service.mirror.writer import MirrorMetrics, MirrorWriter
    from kv_manager_service.server.ha import GroupMember

log = logging.getLogger("kv_manager_service.server.process")

SERVICE = pb.DESCRIPTOR.services_by_name["KVManagerService"]
SERVICE_NAME = SERVICE.full_name
# Calls for the operator role only (workers, routers, dashboards), when tokens are on.
OPERATOR_METHODS = frozenset(
    f"/{SERVICE_NAME}/{name}"
    for name in (
        "WatchSteps",
        "AckSteps",
        "ReportMissingKV",
        "UnregisterWorker",
        "WatchEvents",
        "WatchEventBatches",
        "ResetPrefixCache",
    )
)
REDIS_CLUSTER_MODES = ("auto", "yes", "no")  # mirror.connect.CLUSTER_MODES, named here without importing redis
REDIS_WRITERS = ("thread", "process")  # --redis-writer


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    replica_id: str = field(default_factory=socket.gethostname)
    max_workers: int = 32  # threads for unary calls; streams and cheap reads run on the event loop
    max_message_bytes: int = 64 << 20
    max_connections: int | None = None  # None: the open-file limit less FDS_KEPT_FREE (see `connection_limit`)
    handshake_timeout_s: float = 10.0  # a connection that has not completed its HTTP/2 (and TLS) handshake is closed
    grace_s: float = 5.0  # on SIGTERM, in-flight calls get this long
    limits: ServiceLimits = ServiceLimits()
    redis_url: str | None = None  # None: no mirror, the index stays in-process
    redis_cluster: str = "auto"  # one of REDIS_CLUSTER_MODES: is --redis-url a Redis Cluster node (mirror/connect.py)
    redis_collect_interval_s: float = 300.0  # at most one collection of stale mirror fields per this long
    redis_collect_after_s: float = 600.0  # a replica id without a lease this long has all its fields collected
    redis_writer: str = "thread"  # one of REDIS_WRITERS: where the mirror's publisher runs (publisher_process.py)
    redis_writer_timeout_s: float = 30.0  # a writer process that answers no call this long is replaced
    model_name: str = "default"  # namespaces the mirror's keys
    lease_ttl_s: float = 10.0
    worker_timeout_s: float = 10.0  # a registered worker neither streaming nor acknowledging this long is dropped
    cluster_lookup_timeout_ms: int = 50  # a cluster lookup's Redis budget; past it, the local answer alone
    journal_path: Path | None = None  # None: no journal; a restart starts empty
    journal_fsync: str = "always"  # or "never": see kv_manager_service/server/journal.py
    journal_compact_bytes: int = DEFAULT_COMPACT_BYTES  # compact past this many bytes since the snapshot; 0: never
    metrics_port: int | None = None  # serve Prometheus metrics on metrics_host:metrics_port (0: any free port)
    metrics_host: str | None = None  # None: host
    metrics_tokens: TokenTable | None = None  # scrape tokens: read /metrics but the per-tenant series
    check_invariants: bool = False  # debugging/testing: check the core after every mutating call
    memory_check: bool = True  # refuse a pool whose estimated memory exceeds what is available (memory_budget.py)
    tls: ServerTLS | None = None  # None: plaintext gRPC
    tokens: TokenTable | None = None  # None: no bearer tokens, every caller may call everything
    multi_tenant: bool = False  # see tenancy.py
    tenant_secret: bytes | None = field(default=None, repr=False)  # keys the tenants' cache salts
    tenant_quota_blocks: int | None = None  # a tenant's quota unless its token entry sets one; None: no quota
    redis_tls_ca: Path | None = None  # CA that signed Redis's certificate (rediss:// URLs)
    redis_password: str | None = field(default=None, repr=False)  # Redis AUTH, instead of one in the URL
    redis_required: bool = False  # refuse to start while the Redis of redis_url does not answer
    ha_url: str | None = None  # a high-availability group's Redis (ha.py); None: this manager serves alone
    advertise_address: str | None = None  # HOST:PORT others reach this manager at; None: host and the bound port
    ha: HAOptions = HAOptions()
    ha_token: str | None = field(default=None, repr=False)  # with --auth-token-file: a member-role token
    ha_tls: ClientTLS | None = None  # with --tls-cert: how this member checks the others (and proves itself)
    ha_replication_port: int = 0  # the replication listener's port on --host; 0: a free one, which the lease names

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.journal_compact_bytes < 0:
            raise ValueError(f"--journal-compact-bytes must be >= 0, got {self.journal_compact_bytes}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.metrics_port is not None and self.metrics_port == self.port != 0:
            raise ValueError(f"--metrics-port must differ from --port, both are {self.port}")
        if self.metrics_port is None and (self.metrics_host is not None or self.metrics_tokens is not None):
            raise ValueError("--metrics-host and --metrics-token-file need --metrics-port")
        if self.metrics_port is not None:
            self.metrics_access()  # refuses an endpoint open to readers who may not call the RPCs
        if not self.replica_id:
            raise ValueError("replica_id must not be empty")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        connection_limit(self.max_connections)  # refuses a cap that leaves too few open files
        if not 0 < self.handshake_timeout_s <= 600:
            raise ValueError(f"--handshake-timeout-s must be in (0, 600], got {self.handshake_timeout_s}")
        if self.max_workers < 2:
            raise ValueError(f"max_workers must be >= 2, got {self.max_workers}")
        if not 0 <= self.grace_s <= 600:
            raise ValueError(f"--shutdown-grace-s must be in 0..600, got {self.grace_s}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"--worker-timeout-s must be > 0, got {self.worker_timeout_s}")
        if not 1 <= self.cluster_lookup_timeout_ms <= 60_000:
            raise ValueError(f"--cluster-lookup-timeout-ms must be in 1..60000, got {self.cluster_lookup_timeout_ms}")
        self._check_security()
        self._check_ha()

    def _check_ha(self) -> None:
        if self.advertise_address is not None:
            host, _, port = self.advertise_address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535 or " " in self.advertise_address:
                raise ValueError(f"--advertise-address must be HOST:PORT, got {self.advertise_address!r}")
        if not 0 <= self.ha_replication_port <= 65535:
            raise ValueError(f"--ha-replication-port must be in 0..65535, got {self.ha_replication_port}")
        if self.ha_url is None:
            return
        if not self.ha_url.startswith(("redis://", "rediss://")):
            raise ValueError(f"--ha-url must be a redis:// or rediss:// URL, got {_redact(self.ha_url)!r}")
        if self.multi_tenant:
            raise ValueError("--ha-url does not support --multi-tenant yet: run a tenant's replica without a group")
        if self.tokens is not None:
            if self.ha_token is None:
                raise ValueError("--ha-url with --auth-token-file needs --ha-token-file: the token this member "
                                 "follows the primary with, one of the token file's entries with role: member")  # fmt: skip
            caller = self.tokens.authenticate([("authorization", f"Bearer {self.ha_token}")])
            if caller is None or caller.role is not Role.MEMBER:
                raise ValueError("--ha-token-file's token must be an entry of --auth-token-file with role: member")
        elif self.ha_token is not None:
            raise ValueError("--ha-token-file needs --auth-token-file (the members check each other's token)")
        if self.tls is not None and (self.ha_tls is None or self.ha_tls.ca_file is None):
            raise ValueError("--ha-url with --tls-cert needs --ha-tls-ca: the CA that signed the other members' "
                             "certificates (and --ha-tls-cert/--ha-tls-key when they require client certificates)")  # fmt: skip
        if self.tls is None and self.ha_tls is not None:
            raise ValueError("--ha-tls-ca, --ha-tls-cert and --ha-tls-key need --tls-cert (the members serve TLS)")

    def metrics_access(self) -> MetricsAccess:
        """Who may read /metrics: the RPCs' TLS, operator tokens or a scrape token (shared/metrics_endpoint.py)."""
        host = self.metrics_host or self.host
        return metrics_access(host, self.tls, self.tokens, self.metrics_tokens, private_labels=PRIVATE_LABELS)

    def _check_security(self) -> None:
        if self.multi_tenant:
            if self.tokens is None or not self.tokens.names_tenants:
                raise ValueError("--multi-tenant needs --auth-token-file naming the tenants and their tokens")
            if self.tenant_secret is None:
                raise ValueError("--multi-tenant needs --tenant-secret-file (the key of the tenants' cache salts)")
        else:
            if self.tenant_secret is not None or self.tenant_quota_blocks is not None:
                raise ValueError("--tenant-secret-file and --tenant-quota-blocks need --multi-tenant")
            if self.tokens is not None and any(p.quota_blocks is not None for p in self.tokens.principals):
                raise ValueError("quota_blocks in the token file needs --multi-tenant")
        if not (self.redis_collect_interval_s > 0 and self.redis_collect_after_s > 0):
            raise ValueError(
                "--redis-collect-interval-s and --redis-collect-after-s must be > 0, got "
                f"{self.redis_collect_interval_s} and {self.redis_collect_after_s}"
            )
        if self.redis_cluster not in REDIS_CLUSTER_MODES:
            modes = ", ".join(REDIS_CLUSTER_MODES)
            raise ValueError(f"--redis-cluster must be one of {modes}, got {self.redis_cluster!r}")
        if self.redis_writer not in REDIS_WRITERS:
            raise ValueError(f"--redis-writer must be one of {', '.join(REDIS_WRITERS)}, got {self.redis_writer!r}")
        if not 0 < self.redis_writer_timeout_s <= 3600:
            raise ValueError(f"--redis-writer-timeout-s must be in (0, 3600], got {self.redis_writer_timeout_s}")
        if self.redis_required and not self.redis_url:
            raise ValueError("--redis-required needs --redis-url")
        if (self.redis_tls_ca is not None or self.redis_password is not None) and not self.redis_url:
            raise ValueError("--redis-tls-ca and --redis-password-file need --redis-url")
        if self.redis_tls_ca is not None and not self.redis_url.startswith("rediss://"):
            raise ValueError("--redis-tls-ca needs a rediss:// (TLS) --redis-url")
        if self.redis_password is not None and _redact(self.redis_url) != self.redis_url:
            raise ValueError("--redis-url holds a password and --redis-password-file gives one: keep one")


@dataclass
class RunningServer:
    server: grpc.aio.Server
    loop: EventLoopThread  # runs `server`
    pool: futures.ThreadPoolExecutor  # runs the server's plain handlers
    replica: Replica
    servicer: KVManagerServicer
    health: health.aio.HealthServicer
    address: str
    mirror: MirrorWriter | None = None  # None: no --redis-url
    metrics: MetricsServer | None = None  # None: no --metrics-port
    worker_expiry: WorkerExpiry | None = None  # None: not started yet
    member: GroupMember | None = None  # None: no --ha-url

    @property
    def metrics_address(self) -> str | None:
        """HOST:PORT of the Prometheus endpoint (`/metrics`), or None when it is off."""
        return self.metrics.address if self.metrics is not None else None

    def stop(self, grace_s: float) -> None:
        """Shut down cleanly under any backlog; nothing is journaled after the journal closes.

        Health checks answer NOT_SERVING and the streams end; new calls are
        refused; calls in flight get `grace_s`, then are cancelled. Handlers
        still queued for the thread pool are dropped, and running ones are
        waited for, so no mutation is under way when the replica closes (it
        refuses any later one). Then the mirror drops its lease, /metrics
        closes, and the journal closes.
        """
        if self.member is not None:  # first: a standby takes over while this one drains
            self.member.stop()
        if self.worker_expiry is not None:
            self.worker_expiry.stop()
        self.loop.run(self.health.enter_graceful_shutdown())
        self.replica.end_streams()
        self.loop.run(self.server.stop(grace_s))
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.replica.close()
        self.loop.close()
        if self.mirror is not None:
            self.mirror.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self.replica.journal is not None:
            self.replica.journal.close()


def memory_estimate(config: KVCacheConfig, options: ServerOptions) -> MemoryEstimate:
    limits = options.limits
    retention = limits.step_retention_bytes + limits.event_retention_bytes + limits.idempotency_retention_bytes
    by_frequency = config.eviction_policy is EvictionPolicy.FREQUENCY
    return estimate_memory(
        config.num_blocks, config.num_host_blocks, retention, by_frequency, config.expected_blocks_room,
        mirrored=options.redis_url is not None,
    )


def build_replica(config: KVCacheConfig, options: ServerOptions) -> Replica:
    """The replica a server with `options` runs: a fresh core, its tenancy, and its journal replayed."""
    if options.multi_tenant and config.hash_algorithm is not HashAlgorithm.SHA256_CBOR:
        raise ValueError(
            f"--multi-tenant refuses --hash-algorithm {config.hash_algorithm.value}: it is not collision-resistant, "
            "so one tenant could craft blocks whose hashes equal another's; use sha256_cbor"
        )
    if options.memory_check:  # before the pool or the journal takes any of it
        check_fits(memory_estimate(config, options), available_memory())
    config = dataclasses.replace(config, enable_events=True)
    tenancy = (
        Tenancy(options.tenant_secret, options.tokens, options.tenant_quota_blocks) if options.multi_tenant else None
    )
    journal = None
    if options.journal_path is not None:
        journal = Journal.open(
            options.journal_path, options.replica_id, pool_description(config), options.journal_fsync,
            on_write_failure=_stop_on_journal_failure, compact_bytes=options.journal_compact_bytes,
        )  # fmt: skip
    started = time.perf_counter()
    replica = Replica(
        KVCacheManager(config),
        options.replica_id,
        time.time_ns(),  # the incarnation: new at every start, and increasing across restarts
        options.limits,
        journal,
        tenancy,
        options.check_invariants,
        on_journal_failure=_stop_on_journal_failure,
        worker_timeout_s=options.worker_timeout_s,
    )
    if journal is not None:
        stats, last_step_id, _, _ = replica.stats()
        log.info(
            "journal %s: restored %d records in %.2fs: step %d, %d live requests, %d pending copies",
            options.journal_path, len(journal.records), time.perf_counter() - started, last_step_id,
            stats.num_requests, stats.num_pending_copies,
            extra={"journal": str(options.journal_path), "records": len(journal.records)},
        )  # fmt: skip
    return replica


class WorkerExpiry:
    """Drops the workers whose lease ran out (`Replica.expire_workers`) and releases the retention pins
    whose TTL ran out (`Replica.expire_pins`) once every `period_s`, until stopped."""

    def __init__(self, replica: Replica, period_s: float = 1.0) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(replica, period_s), name="kv-worker-expiry", daemon=True
        )
        self._thread.start()

    def _run(self, replica: Replica, period_s: float) -> None:
        while not self._stopped.wait(period_s):
            try:
                replica.expire_workers()
                replica.expire_pins()
            except NotPrimaryError:
                pass  # a group's standby: its primary expires workers
            except Exception:
                log.exception("bug in the worker expiry")

    def stop(self) -> None:
        """Return once no expiry runs or will run."""
        self._stopped.set()
        self._thread.join()


def _stop_on_journal_failure(journal: Journal, error: OSError) -> None:
    """A manager that cannot journal stops at once, under the replica's lock: it has changed
    its state and must not answer, or let workers see the step, without the record."""
    log.critical("cannot write the journal %s (%s); stopping", journal.path, error, exc_info=error)
    os._exit(75)


def start_server(config: KVCacheConfig, options: ServerOptions) -> RunningServer:
    """Build and start the server; returns once it accepts calls.

    PortUnavailableError, before anything else starts, when --port or --metrics-port cannot be bound.
    """
    check_port_free(options.host, options.port)
    if options.metrics_port is not None:
        check_port_free(options.metrics_host or options.host, options.metrics_port, "metrics port")
    if options.ha_url and options.ha_replication_port:
        check_port_free(options.host, options.ha_replication_port, "--ha-replication-port")
    replica = build_replica(config, options)
    if options.tokens is not None and options.tls is None:
        log.warning("bearer tokens without --tls-cert travel in clear text: use TLS off a trusted network")
    registry = new_registry() if options.metrics_port is not None else None
    interceptors: list[grpc.ServerInterceptor] = []
    if registry is not None:
        interceptors.append(RpcMetricsInterceptor(SERVICE, registry, "kvcache"))
    if options.tokens is not None:
        # After the metrics (they count what it refuses), before the parser (a refused request is not parsed).
        interceptors.append(BearerAuthInterceptor(options.tokens, OPERATOR_METHODS))
    interceptors.append(ParseErrorInterceptor())  # last, so the metrics count what it refuses
    loop = EventLoopThread("kv-rpc-loop")
    pool = futures.ThreadPoolExecutor(max_workers=options.max_workers, thread_name_prefix="kv-rpc")
    server = loop.run(_new_server(pool, interceptors, options))
    try:
        return _start(server, loop, pool, replica, registry, config, options)
    except BaseException:
        loop.run(server.stop(None))
        pool.shutdown(cancel_futures=True)
        loop.close()
        raise


async def _new_server(
    pool: futures.ThreadPoolExecutor, interceptors: list[grpc.ServerInterceptor], options: ServerOptions
) -> grpc.aio.Server:
    """The gRPC server (not started); made on its event loop. Its connections are bounded so idle
    sockets cannot starve real clients (shared/connections.py)."""
    return grpc.aio.server(
        migration_thread_pool=pool,
        interceptors=[AioInterceptor(interceptor) for interceptor in interceptors],
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            # Responses are not limited: a step that was applied must be answered (a refused
            # send would tell the caller "refused"), and a worker must get every delta.
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
            *connection_options(options.max_connections, options.handshake_timeout_s),
        ],
    )


def _start(
    server: grpc.aio.Server,
    loop: EventLoopThread,
    pool: futures.ThreadPoolExecutor,
    replica: Replica,
    registry: CollectorRegistry | None,
    config: KVCacheConfig,
    options: ServerOptions,
) -> RunningServer:
    """Bind, add the services, the mirror and /metrics, and start serving."""
    port = listen(server, options.host, options.port, options.tls.credentials() if options.tls else None)
    address = options.advertise_address or f"{options.host}:{port}"
    new_writer, cluster, mirror_metrics = _mirror(replica, address, config, options) if options.redis_url else (None,) * 3
    member = _member(replica, address, options, pool, loop) if options.ha_url else None
    servicer = KVManagerServicer(replica, options.tokens, cluster, mirror_metrics, pool, member)
    add_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(services, server)
    metrics = None
    if registry is not None:
        registry.register(ManagerCollector(replica, mirror_metrics, cluster))
        try:
            metrics = start_metrics_server(
                registry, options.metrics_host or options.host, options.metrics_port, options.metrics_access()
            )
        except OSError as error:
            raise PortUnavailableError(str(error)) from None
        readers = metrics.access.describe()
        log.info("metrics at %s, read with %s", metrics.url, readers, extra={"metrics_url": metrics.url})
    running = RunningServer(
        server, loop, pool, replica, servicer, health_servicer, address, None, metrics, member=member
    )

    def set_health(status: int, names: tuple[str, ...] = (SERVICE_NAME,)) -> None:
        for name in names:
            loop.run(health_servicer.set(name, status))

    def start_mirror(takeover: bool) -> None:
        # Started after SERVING is said, so a thread's death is never said over.
        def mirror_thread_died(thread_name: str, error: BaseException) -> None:
            log.critical("the mirror's thread %s died: health checks answer NOT_SERVING from now on", thread_name)
            set_health(health_pb2.HealthCheckResponse.NOT_SERVING, ("", SERVICE_NAME))

        writer = new_writer(takeover)
        writer.on_thread_death = mirror_thread_died
        writer.start()
        running.mirror = writer
        log.info("mirroring the prefix index to %s under %s", _redact(options.redis_url), writer.schema.namespace)

    loop.run(server.start())
    set_health(health_pb2.HealthCheckResponse.SERVING, ("",))
    if member is None:
        set_health(health_pb2.HealthCheckResponse.SERVING)
        if new_writer is not None:
            start_mirror(takeover=False)
    else:
        set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

        def on_serving(serving: bool) -> None:
            if serving:
                replica.incarnation = member.token  # the mirror's entries name the leadership's token
                set_health(health_pb2.HealthCheckResponse.SERVING)
                if new_writer is not None:
                    start_mirror(takeover=True)
                return
            set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            if running.mirror is not None:
                running.mirror.stop()
                running.mirror = None

        member.on_serving = on_serving
        member.start()
    running.worker_expiry = WorkerExpiry(replica)
    return running


def _member(
    replica: Replica, address: str, options: ServerOptions, pool: futures.ThreadPoolExecutor, loop: EventLoopThread
) -> GroupMember:
    """This manager as a member of its high-availability group (not started: a standby until it leads)."""
    _require_redis("--ha-url")
    from kv_manager_service.mirror.connect import RedisEndpoint, connect
    from kv_manager_service.server.ha import GroupMember

    client = connect(RedisEndpoint(options.ha_url, options.redis_cluster, timeout_s=options.ha.lease_s / 4))
    link = MemberLink(
        options.host, options.ha_replication_port, options.tls, options.tokens, options.ha_tls, options.ha_token
    )
    try:
        member = GroupMember(replica, client, address, options.ha, pool, loop.loop, lambda serving: None, link)
    except OSError as error:
        raise PortUnavailableError(f"--ha-replication-port: {error}") from None
    log.info("high availability: member of replica %s's group in %s, at %s (replication at %s)",
             replica.replica_id, _redact(options.ha_url), address, member.replication_address)  # fmt: skip
    return member


def _require_redis(flag: str) -> None:
    """ValueError naming the extra when the optional redis package is missing (a manager-only install)."""
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} needs the redis package: pip install 'kv-manager-service[redis]'") from None


def _mirror(
    replica: Replica, address: str, config: KVCacheConfig, options: ServerOptions
) -> tuple[Callable[[bool], MirrorWriter], ClusterIndex, MirrorMetrics]:
    """What makes the Redis mirror's writer (not started, its lease claimed), the cluster lookup, and
    the writers' figures. `new_writer(takeover)`: see MirrorWriter.

    The writer's making raises ReplicaIdInUseError when another live manager
    holds the replica id's lease (unless it takes over a lower incarnation's:
    a group's new primary). Redis may be down then: the writer claims and
    retries in the background."""
    _require_redis("--redis-url")
    import redis

    from kv_manager_service.mirror.collector import CollectorOptions
    from kv_manager_service.mirror.connect import RedisEndpoint, connect, same_topology, topology
    from kv_manager_service.mirror.lookup import ClusterIndex
    from kv_manager_service.mirror.publisher_process import PublisherProcess
    from kv_manager_service.mirror.schema import KeySchema
    from kv_manager_service.mirror.writer import MirrorMetrics, MirrorOptions, MirrorWriter

    # Short timeouts: a slow Redis must not hold a lookup or the writer for long.
    endpoint = RedisEndpoint(
        options.redis_url,
        options.redis_cluster,
        timeout_s=1.0,
        password=options.redis_password,
        ssl_ca_certs=None if options.redis_tls_ca is None else str(options.redis_tls_ca),
    )
    client = connect(endpoint)
    if options.redis_required and topology(client) == "unknown":
        try:
            client.resolve()
        except redis.RedisError as error:
            raise ValueError(f"--redis-required, and the Redis of --redis-url does not answer: {error}") from None
    endpoint = same_topology(endpoint, client)  # the topology found, so that the other clients need not ask
    # The lookups' own connections, so that they never wait behind the writer; the timeout is their budget.
    budget_s = options.cluster_lookup_timeout_ms / 1000
    lookup_client = connect(dataclasses.replace(endpoint, timeout_s=budget_s))
    if topology(client) != "unknown":
        log.info("the mirror's Redis at %s: %s", _redact(options.redis_url), topology(client))
    schema = KeySchema(options.model_name, config.hash_algorithm.value, config.hash_seed)

    metrics = MirrorMetrics()

    def new_writer(takeover: bool) -> MirrorWriter:
        publisher = None  # "thread": the writer's own, on its client
        if options.redis_writer == "process":
            publisher = PublisherProcess(
                endpoint, schema, replica.replica_id, str(replica.incarnation), options.redis_writer_timeout_s
            )
        writer = MirrorWriter(
            client,
            schema,
            replica.replica_id,
            replica.incarnation,
            replica.events,
            replica.cached_set,
            lambda: replica.lease(address),
            MirrorOptions(
                lease_ttl_s=options.lease_ttl_s,
                collector=CollectorOptions(options.redis_collect_interval_s, options.redis_collect_after_s),
            ),
            publisher,
            metrics,
            takeover,
        )
        writer.claim_at_start()
        return writer

    if not options.ha_url:  # claimed before the server serves: a replica id in use stops the start
        writer = new_writer(False)
        return (lambda takeover: writer), ClusterIndex(lookup_client, schema), metrics
    return new_writer, ClusterIndex(lookup_client, schema), metrics


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
    signals = TerminationSignals()
    print(f"{MANAGER_READY_PREFIX}{running.address}", flush=True)
    memory = memory_estimate(config, options)
    log.info(
        "serving replica_id=%s incarnation=%d num_blocks=%d num_host_blocks=%d groups=%d; memory up to %.2f GiB (%s)",
        options.replica_id,
        running.replica.incarnation,
        config.num_blocks,
        config.num_host_blocks,
        len(config.groups),
        memory.total / 2**30,
        describe(memory),
        extra={
            "memory_estimate_bytes": memory.total,
            "replica_id": options.replica_id,
            "incarnation": running.replica.incarnation,
            "address": running.address,
        },
    )
    log.info("sha256_cbor block hashes by %s", hashing.implementation())
    received = signals.wait()
    log.info("%s: shutting down, grace %.1fs", received.name, options.grace_s)
    running.stop(options.grace_s)
    return 0
