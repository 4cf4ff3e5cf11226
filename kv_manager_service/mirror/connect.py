"""Connecting the mirror to Redis: one server, or a Redis Cluster reached through any of its nodes.

Why the topology matters. A plain client pointed at one node of a Redis
Cluster gets a MOVED reply for every key of a slot that node does not
serve: the lease claim fails, so the writer never holds its lease and never
writes, and the lookup's pipeline fails, so FindCacheHit(cluster=true)
answers for the asking replica alone. A cluster client (redis.RedisCluster)
maps each key to the master of its slot, sends a pipeline as one batch per
node (written to every node before any reply is read), follows MOVED and
ASK, and reloads its slot map after a connection error, as a failover
causes.

`--redis-cluster auto` (the default) asks the node the URL names: `INFO
cluster` says `cluster_enabled:1` on a cluster node. `no` skips the
question; `yes` refuses a node with cluster mode off (RedisTopologyError,
as is a database other than 0 on a cluster). A node that cannot be reached
at start leaves the answer open: `connect` then returns a `DeferredRedis`,
which asks on the first call that reaches Redis, so a manager still starts
and serves while Redis is down, as with one server.

Every failure of a client made here is a redis.RedisError, which is what
the writer and the lookup handle: redis-py raises a few cluster failures
(no node reachable, a slot no node serves) as RedisClusterException, which
is not one, so the cluster client converts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Union

import redis
from redis.cluster import ClusterPipeline
from redis.commands.core import Script
from redis.connection import Encoder, parse_url
from redis.exceptions import RedisClusterException

log = logging.getLogger("kv_manager_service.mirror.connect")

CLUSTER_MODES = ("auto", "yes", "no")
"""--redis-cluster: ask the node (auto), a Redis Cluster (yes), one Redis server (no)."""


@dataclass(frozen=True)
class RedisEndpoint:
    """Where the mirror's Redis is and how to reach it: one client's settings.

    `timeout_s` bounds every socket read and connect; the lookups' client
    has its budget here, the writer's a second or so.
    """

    url: str
    cluster: str = "auto"
    timeout_s: float = 1.0
    password: str | None = field(default=None, repr=False)  # AUTH, when the URL holds none
    ssl_ca_certs: str | None = None  # rediss:// URLs

    def __post_init__(self) -> None:
        if self.cluster not in CLUSTER_MODES:
            raise ValueError(f"--redis-cluster must be one of {', '.join(CLUSTER_MODES)}, got {self.cluster!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"a Redis timeout must be > 0 s, got {self.timeout_s}")

    def client_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s}
        if self.password is not None:
            kwargs["password"] = self.password
        if self.ssl_ca_certs is not None:
            kwargs["ssl_ca_certs"] = self.ssl_ca_certs
        return kwargs


MirrorRedis = Union[redis.Redis, "ClusterClient", "DeferredRedis"]


class RedisTopologyError(ValueError):
    """The URL does not fit the topology: --redis-cluster yes for a node with cluster mode off,
    or a database other than 0 on a cluster (which has only database 0)."""


def connect(endpoint: RedisEndpoint) -> MirrorRedis:
    """A client for `endpoint`'s topology; a DeferredRedis when Redis cannot be reached to tell it now.

    Raises RedisTopologyError when the URL does not fit the topology the node reports.
    """
    try:
        return connect_now(endpoint)
    except (redis.ConnectionError, redis.TimeoutError) as error:
        log.info("Redis at %s does not answer yet (%s); its topology is detected on first contact",
                 _host_port(endpoint.url), error)  # fmt: skip
        return DeferredRedis(endpoint)


def connect_now(endpoint: RedisEndpoint) -> redis.Redis | ClusterClient:
    """A client for `endpoint`'s topology, asking the node unless the mode is "no".

    Raises redis.ConnectionError or redis.TimeoutError when the node or the
    cluster cannot be reached, RedisTopologyError as `connect`.
    """
    if endpoint.cluster == "no":
        return redis.Redis.from_url(endpoint.url, **endpoint.client_kwargs())
    if not is_cluster_node(endpoint):
        if endpoint.cluster == "yes":
            raise RedisTopologyError(
                f"--redis-cluster yes, but the Redis at {_host_port(endpoint.url)} runs with cluster mode off "
                "(INFO cluster: cluster_enabled:0): use --redis-cluster auto or no for one Redis server"
            )
        return redis.Redis.from_url(endpoint.url, **endpoint.client_kwargs())
    database = parse_url(endpoint.url).get("db", 0)
    if database != 0:
        raise RedisTopologyError(
            f"--redis-url names database {database} of a Redis Cluster node at {_host_port(endpoint.url)}: "
            "a cluster has database 0 only (end the URL with /0 or nothing)"
        )
    with _cluster_errors_as_redis_errors():
        client = ClusterClient.from_url(endpoint.url, **endpoint.client_kwargs())
    log.debug("Redis at %s is a cluster of %d masters", _host_port(endpoint.url), len(client.get_primaries()))
    return client


def is_cluster_node(endpoint: RedisEndpoint) -> bool:
    """Whether the node `endpoint.url` names runs in cluster mode (`INFO cluster`: cluster_enabled:1).

    The question is asked on database 0, whatever the URL names: a cluster node refuses to SELECT
    another, and the caller's answer to a URL naming one is a RedisTopologyError, not that refusal.
    """
    pool = redis.ConnectionPool.from_url(endpoint.url, **endpoint.client_kwargs())
    pool.connection_kwargs["db"] = 0
    probe = redis.Redis(connection_pool=pool)
    try:
        return int(probe.info("cluster").get("cluster_enabled", 0)) == 1
    finally:
        probe.close()
        pool.disconnect()


class ClusterClient(redis.RedisCluster):
    """redis.RedisCluster whose failures are all redis.RedisError (see the module docstring)."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with _cluster_errors_as_redis_errors():
            return super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> GuardedClusterPipeline:
        return GuardedClusterPipeline(super().pipeline(transaction, shard_hint))


class GuardedClusterPipeline:
    """A ClusterPipeline whose `execute` raises redis.RedisError only; commands queue on it as on any pipeline."""

    def __init__(self, pipeline: ClusterPipeline) -> None:
        self._pipeline = pipeline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def __len__(self) -> int:
        return len(self._pipeline)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        with _cluster_errors_as_redis_errors():
            return self._pipeline.execute(raise_on_error)


class DeferredRedis:
    """Stands in for the client until a call reaches Redis and tells its topology; thread safe.

    Every attribute but `register_script` and `get_encoder` connects first
    (`connect_now`), and raises redis.ConnectionError while Redis stays
    unreachable; after that it is the real client's.
    """

    def __init__(self, endpoint: RedisEndpoint) -> None:
        self.endpoint = endpoint
        self._client: redis.Redis | ClusterClient | None = None
        self._lock = threading.Lock()

    @property
    def connected(self) -> redis.Redis | ClusterClient | None:
        """The real client, None until a call has reached Redis."""
        return self._client

    def resolve(self) -> redis.Redis | ClusterClient:
        """The real client, connected now if need be; raises a redis.RedisError while that fails.

        A URL that turns out not to fit the topology (RedisTopologyError) is
        reported the same way, with that message, on every call.
        """
        with self._lock:
            if self._client is None:
                try:
                    self._client = connect_now(self.endpoint)
                except RedisTopologyError as error:
                    raise redis.ConnectionError(str(error)) from error
                log.info("Redis at %s is reachable now: %s", _host_port(self.endpoint.url), topology(self._client))
            return self._client

    def register_script(self, script: str) -> Script:
        """The script, bound to this stand-in: it runs on the real client once there is one."""
        return Script(self, script)

    def get_encoder(self) -> Encoder:
        """The encoding every client made here uses (redis-py's default), so a Script hashes its text without Redis."""
        return Encoder("utf-8", "strict", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.resolve(), name)


def same_topology(endpoint: RedisEndpoint, client: MirrorRedis) -> RedisEndpoint:
    """`endpoint` told the topology `client` found (yes or no), so that a second client need not ask."""
    known = {"cluster": "yes", "single": "no"}.get(topology(client))
    return endpoint if known is None else dataclasses.replace(endpoint, cluster=known)


def topology(client: MirrorRedis) -> str:
    """'cluster' or 'single' once known, 'unknown' while a DeferredRedis has not reached Redis."""
    if isinstance(client, DeferredRedis):
        if client.connected is None:
            return "unknown"
        client = client.connected
    return "cluster" if isinstance(client, redis.RedisCluster) else "single"


def cluster_epoch(client: MirrorRedis) -> int | None:
    """A Redis Cluster's current configuration epoch (`CLUSTER INFO` of any node); None for one server.

    The epoch grows with every failover and every change of slot owners.
    """
    if isinstance(client, DeferredRedis):
        client = client.resolve()
    if not isinstance(client, redis.RedisCluster):
        return None
    return int(client.cluster_info(target_nodes=redis.RedisCluster.RANDOM)["cluster_current_epoch"])


@contextlib.contextmanager
def _cluster_errors_as_redis_errors() -> Iterator[None]:
    try:
        yield
    except RedisClusterException as error:
        raise redis.ConnectionError(f"Redis Cluster: {error}") from error


def _host_port(url: str) -> str:
    """The URL's host:port, without its credentials, for logs."""
    rest = url.partition("://")[2]
    return rest.rsplit("@", 1)[-1].split("/", 1)[0]
