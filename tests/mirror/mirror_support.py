"""Helpers of the Redis-mirror tests: a real redis-server, real replica processes, polling.

Nothing here fakes Redis: `RedisServer` runs the `redis-server` binary on a
free port (no persistence, so a SIGKILL loses everything, as a crashed
cache would), and `ReplicaFactory` starts `kv-manager serve` subprocesses
exactly as a user would, reading stdout until the ready line. Both start
their processes with `kv_tooling.launch` (through `processes`).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

import grpc
import redis
from redis.cluster import ClusterNode

from kv_tooling.launch import LaunchedProcess, free_cluster_port, launch_redis_cluster
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kv_manager_service.client import KVManagerClient
from kv_manager_service.core import AllocateStatus
from kv_manager_service.core.hashing import BlockHasher, HashAlgorithm
from kv_manager_service.mirror.schema import KeySchema
from kvcache.v1 import kv_manager_pb2 as pb
from processes import free_port, launch_many, launch_redis, stop_all

ROOT = Path(__file__).resolve().parents[2]  # the repository
REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")  # creates clusters

SHUTDOWN_TIMEOUT_S = 10.0  # the server's grace is 5 s; the mirror's stop adds little
CALL_TIMEOUT_S = 10.0
BLOCK_SIZE = 16
LEASE_TTL_S = 1.0
CONVERGE_TIMEOUT_S = 20.0  # generous: 2 slow cores, a writer that backs off up to 2 s

T = TypeVar("T")


def namespace(model_name: str = "default", seed: str | None = None) -> str:
    return KeySchema(model_name, HashAlgorithm.SHA256_CBOR.value, seed).namespace


def block_hashes(token_ids: Sequence[int], seed: str | None = None) -> list[bytes]:
    """The chained sha256_cbor hashes of every full 16-token block, as the replicas compute them."""
    hasher = BlockHasher(BLOCK_SIZE, HashAlgorithm.SHA256_CBOR, seed)
    return list(hasher.hash_blocks(hasher.root_hash, list(token_ids)))


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(num_tokens)]


def wait_until(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float, what: str) -> T:
    """Poll `probe` until `done(value)`; fail with the last value seen after `timeout_s`.

    The deadline only bounds the wait: no test asserts how long anything took.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last value: {value!r}")
        time.sleep(0.05)


# -- Redis --------------------------------------------------------------------------


class RedisServer:
    """One redis-server on a fixed port; kill (SIGKILL), restart on the same port, pause (SIGSTOP) and resume.

    `extra_args` go to redis-server (AUTH, TLS flags); with `tls`, the port is
    its TLS port. `client_kwargs` are what a client needs to get in
    (password, ssl...): `client()` connects with them, as a user would.
    """

    topology = "single"

    def __init__(
        self, directory: Path, port: int | None = None, extra_args: Sequence[str] = (), tls: bool = False,
        **client_kwargs: object,
    ) -> None:  # fmt: skip
        assert REDIS_SERVER is not None
        self.directory = directory
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.tls = tls
        self.client_kwargs = client_kwargs
        self.process: LaunchedProcess | None = None
        self.num_starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.address}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.running

    def start(self) -> None:
        assert not self.running, "already running"
        log_path = self.directory / f"redis-{self.port}-{self.num_starts}.log"
        self.num_starts += 1
        client = self.client()
        try:
            self.process = launch_redis(self.port, log_path, self.extra_args, self.tls, client)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: the data is gone (no persistence), connections drop."""
        assert self.running
        self.process.kill()

    def restart(self) -> None:
        self.start()

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing is answered (a Redis that is stuck, not gone)."""
        assert self.running
        self.process.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            self.process.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.running:
            self.process.kill()

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, db=0, socket_timeout=5.0, socket_connect_timeout=5.0,
            **self.client_kwargs,
        )  # fmt: skip

    def node_client_for(self, key: str) -> redis.Redis:
        """A client of the node that holds `key`: this server."""
        return self.client()


class RedisClusterServer:
    """A real Redis Cluster of local redis-server nodes (`launch_redis_cluster`), masters first.

    It stands where a `RedisServer` does in a test: `url` names its first
    master (a manager finds the others from it), `client()` is a cluster
    client, as a user's would be. `flush()` empties every master, so tests
    can share one cluster; `kill_master(i)` SIGKILLs one, and a replica of
    it takes its slots over once `cluster-node-timeout` has passed.
    """

    topology = "cluster"

    def __init__(
        self, directory: Path, num_masters: int = 3, replicas_per_master: int = 0, node_timeout_ms: int = 1000
    ) -> None:
        assert REDIS_SERVER is not None and REDIS_CLI is not None
        self.directory = directory
        self.num_masters = num_masters
        self.replicas_per_master = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.ports = [free_cluster_port() for _ in range(num_masters * (1 + replicas_per_master))]
        self.nodes: list[LaunchedProcess] = []

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        """Start the nodes; with replicas, return once each has its first copy of its master's data.

        A replica that never synced refuses to take over its master's slots,
        so a test that kills a master must not do it sooner. Replicas sync
        at once, not after redis-server's 5 s diskless-sync delay.
        """
        self.nodes = launch_redis_cluster(
            self.ports, self.directory, replicas_per_master=self.replicas_per_master,
            node_timeout_ms=self.node_timeout_ms, extra_args=["--repl-diskless-sync-delay", "0"],
        )  # fmt: skip
        for port in self.ports[self.num_masters :]:
            client = self.node_client(port)
            try:
                wait_until(lambda: client.info("replication").get("master_link_status"), lambda s: s == "up",
                           30.0, f"the replica on port {port} to sync with its master")  # fmt: skip
            finally:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            if node.running:
                node.kill()

    def client(self) -> redis.RedisCluster:
        """A cluster client that starts from every live node (the test may have killed the first)."""
        live = [ClusterNode("127.0.0.1", port) for port, node in zip(self.ports, self.nodes) if node.running]
        return redis.RedisCluster(startup_nodes=live, socket_timeout=5.0, socket_connect_timeout=5.0)

    def node_client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0, socket_connect_timeout=5.0)

    def node_client_for(self, key: str) -> redis.Redis:
        """A client of the master that holds `key`'s slot now (node-wide commands such as CLIENT PAUSE)."""
        cluster = self.client()
        try:
            node = cluster.get_node_from_key(key)
        finally:
            cluster.close()
        return self.node_client(node.port)

    def flush(self) -> None:
        """Empty every master (their replicas follow) and wait until each replica has."""
        for port in self.ports:
            node = self.node_client(port)
            try:
                if node.info("replication")["role"] == "master":
                    node.flushall()
            finally:
                node.close()
        wait_until(lambda: sum(self.num_keys_per_node().values()), lambda n: n == 0, 10.0, "every node to be empty")

    def num_keys_per_node(self) -> dict[int, int]:
        """Live nodes' port -> DBSIZE."""
        sizes = {}
        for port, node in zip(self.ports, self.nodes):
            if node.running:
                client = self.node_client(port)
                try:
                    sizes[port] = client.dbsize()
                finally:
                    client.close()
        return sizes

    def kill_master(self, index: int) -> int:
        """SIGKILL the `index`th node of `ports` (a master: they come first); its port."""
        self.nodes[index].kill()
        return self.ports[index]

    def wait_failed_over(self, killed_port: int, timeout_s: float = 30.0) -> None:
        """Until every live node marks the killed master failed and says cluster_state:ok (a replica took over)."""

        def views() -> list[str]:
            found = []
            for port, node in zip(self.ports, self.nodes):
                if not node.running:
                    continue
                client = self.node_client(port)
                try:
                    state = client.execute_command("CLUSTER INFO").get("cluster_state", b"?")
                    state = state.decode() if isinstance(state, bytes) else str(state)
                    nodes = client.execute_command("CLUSTER NODES")
                    flags = next(
                        (info["flags"] for address, info in nodes.items() if address.endswith(f":{killed_port}")), ""
                    )
                    found.append(f"{port}: {state}, killed node {flags or 'unknown'}")
                except redis.RedisError as error:
                    found.append(f"{port}: {error!r}")
                finally:
                    client.close()
            return found

        def failed_over(found: list[str]) -> bool:
            return all(view.split(": ", 1)[1].startswith("ok,") and "fail" in view and "fail?" not in view
                       for view in found)  # fmt: skip

        wait_until(views, failed_over, timeout_s, f"the cluster to fail the master on port {killed_port} over")


def replica_block_set(client: redis.Redis, ns: str, replica_id: str, incarnation: int, group_id: int = 0) -> set[bytes]:
    """The block hashes Redis says `replica_id` holds under `incarnation`."""
    keys = list(client.scan_iter(match=f"{ns}:block:{group_id}:*", count=1000))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hget(key, replica_id)
    found = set()
    prefix = f"{ns}:block:{group_id}:"
    for key, value in zip(keys, pipe.execute()):
        if value is not None and value.decode() == str(incarnation):
            found.add(bytes.fromhex(key.decode()[len(prefix):]))
    return found


def all_redis_blobs(client: redis.Redis) -> dict[bytes, list[bytes]]:
    """Every key and every byte string stored under it (fields, values, members)."""
    blobs: dict[bytes, list[bytes]] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "hash":
            values = [b for pair in client.hgetall(key).items() for b in pair]
        elif kind == "string":
            value = client.get(key)
            values = [] if value is None else [value]
        elif kind == "set":
            values = list(client.smembers(key))
        elif kind == "list":
            values = client.lrange(key, 0, -1)
        elif kind == "zset":
            values = [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "none":  # expired meanwhile
            continue
        else:
            raise AssertionError(f"unexpected Redis type {kind} for {key!r}")
        blobs[key] = values
    return blobs


# -- replicas -----------------------------------------------------------------------


class ManagerProcess:
    """One running `kv-manager serve` subprocess and a client to it."""

    def __init__(self, process: LaunchedProcess, replica_id: str) -> None:
        self.process = process
        self.address = process.address
        self.replica_id = replica_id
        self.client = KVManagerClient(self.address, timeout_s=CALL_TIMEOUT_S)
        self.incarnation = self.client.get_config().incarnation

    def log(self) -> str:
        return self.process.log()

    def stats(self) -> pb.GetStatsResponse:
        return self.client.stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S)

    def cluster(self, token_ids: Sequence[int]) -> dict[str, int]:
        """FindCacheHit(cluster=true): replica id -> cached tokens (fails on a duplicate id)."""
        _, replicas = self.client.find_cache_hit(token_ids, cluster=True)
        answer = {r.replica_id: r.num_cached_tokens for r in replicas}
        assert len(answer) == len(replicas), f"a replica was reported twice: {replicas}"
        return answer

    def cache(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Run the whole prompt as one request, then free it: its full blocks stay cached."""
        result = self.client.allocate(request_id, token_ids, num_new_tokens=len(token_ids))
        assert result.status is AllocateStatus.OK, result
        self.client.free([request_id])

    def kill(self) -> None:
        self.process.kill()
        self.client.close()

    def stop(self) -> int:
        """SIGTERM, then wait for the exit code (-9: killed because it hung)."""
        self.client.close()
        return self.process.stop(SHUTDOWN_TIMEOUT_S)


class ReplicaFactory:
    """Starts replicas; `close` stops every one and checks the survivors exited 0 and none logged a traceback."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.replicas: list[ManagerProcess] = []
        self._processes: list[LaunchedProcess] = []  # every one started, in order: stopped even if its ManagerProcess failed
        self._count = 0

    def argv(
        self, replica_id: str, redis_url: str | None, num_blocks: int, model_name: str | None, extra: Iterable[str]
    ) -> list[str]:
        argv = [
            sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0",
            "--num-blocks", str(num_blocks), "--block-size", str(BLOCK_SIZE), "--replica-id", replica_id,
        ]
        if redis_url is not None:
            argv += ["--redis-url", redis_url, "--lease-ttl-s", str(LEASE_TTL_S)]
        if model_name is not None:
            argv += ["--model-name", model_name]
        return argv + list(extra)

    def start(
        self,
        replica_id: str,
        redis_url: str | None,
        num_blocks: int = 64,
        model_name: str | None = None,
        extra: Iterable[str] = (),
    ) -> ManagerProcess:
        spec = dict(replica_id=replica_id, redis_url=redis_url, num_blocks=num_blocks, model_name=model_name, extra=extra)
        return self.start_many([spec])[0]

    def start_many(self, specs: Sequence[dict]) -> list[ManagerProcess]:
        """Start several replicas at once (their imports overlap), in spec order.

        Each spec holds `start`'s arguments: replica_id, redis_url and optionally
        num_blocks, model_name, extra, or config (a pool config dict, instead of
        --num-blocks and --block-size).
        """
        argvs, log_paths = [], []
        for spec in specs:
            replica_id = spec["replica_id"]
            extra = list(spec.get("extra", ()))
            argv = self.argv(replica_id, spec["redis_url"], spec.get("num_blocks", 64), spec.get("model_name"), extra)
            if "config" in spec:  # a pool config file: its groups replace --num-blocks / --block-size
                path = self.directory / f"pool-{self._count}.json"
                path.write_text(json.dumps(spec["config"]), encoding="utf-8")
                i = argv.index("--num-blocks")
                del argv[i : i + 4]
                argv += ["--config", str(path)]
            argvs.append(argv)
            log_paths.append(self.directory / f"replica-{self._count}-{replica_id}.log")
            self._count += 1
        processes = launch_many(argvs, MANAGER_READY_PREFIX, log_paths)
        self._processes.extend(processes)
        for process, spec in zip(processes, specs):
            self.replicas.append(ManagerProcess(process, spec["replica_id"]))
        return self.replicas[-len(specs) :]

    def close(self) -> list[str]:
        """Stop every replica; the failures of their exit checks."""
        for replica in self.replicas:
            replica.client.close()
        failures = stop_all(self._processes, SHUTDOWN_TIMEOUT_S)
        self.replicas.clear()
        self._processes.clear()
        return failures


# -- the replica's own view: events -------------------------------------------------


def cached_set_from_events(replica: ManagerProcess, up_to_sequence: int, group_id: int = 0) -> set[bytes]:
    """The replica's cached hashes, replayed from its WatchEvents stream from sequence 1.

    Fails if the stream does not start at 1 (events were dropped from the
    retained window: the reconstruction would not be exact) or skips a number.
    """
    counts: Counter = Counter()
    if up_to_sequence == 0:
        return set()
    stream = replica.client.stub.WatchEvents(pb.WatchEventsRequest(from_sequence=0), timeout=30.0)
    expected = 1
    try:
        for event in stream:
            assert event.sequence == expected, f"event {event.sequence} where {expected} was expected"
            assert event.replica_id == replica.replica_id and event.incarnation == replica.incarnation, event
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                if event.block_stored.group_id == group_id:
                    counts.update(event.block_stored.block_hashes)
            elif kind == "block_removed":
                if event.block_removed.group_id == group_id:
                    for block_hash in event.block_removed.block_hashes:
                        assert counts[block_hash] > 0, f"event {event.sequence} removes {block_hash.hex()} never stored"
                        counts[block_hash] -= 1
                        if counts[block_hash] == 0:
                            del counts[block_hash]
            else:
                assert kind == "all_blocks_cleared", event
                counts.clear()
            if event.sequence == up_to_sequence:
                break
            expected += 1
    finally:
        stream.cancel()
    return set(counts)


EVENT_RETENTION = 100_000  # ServiceLimits.event_retention, the serve default


def mirror_matches_pool(replica: ManagerProcess, redis_client: redis.Redis, ns: str) -> tuple[bool, str]:
    """Compare Redis with the replica's cached set replayed from its events (exact: from sequence 1)."""
    stats = replica.stats()
    last = stats.last_event_sequence
    assert last < EVENT_RETENTION, "the event log dropped entries: the replay would not be exact"
    expected = cached_set_from_events(replica, last)
    mirrored = replica_block_set(redis_client, ns, replica.replica_id, replica.incarnation)
    if mirrored == expected:
        return True, ""
    return False, (
        f"{replica.replica_id} (events to {last}, queue depth {stats.mirror_queue_depth}): "
        f"{len(expected)} cached, {len(mirrored)} mirrored, {len(mirrored - expected)} stale in Redis, "
        f"{len(expected - mirrored)} missing from Redis"
    )


def wait_mirror_converged(
    replicas_: Sequence[ManagerProcess], redis_server: RedisServer | RedisClusterServer, ns: str
) -> None:
    """Until Redis holds exactly each replica's cached set under its incarnation."""
    client = redis_server.client()
    try:
        def probe() -> list[tuple[bool, str]]:
            return [mirror_matches_pool(r, client, ns) for r in replicas_]

        wait_until(probe, lambda results: all(ok for ok, _ in results), CONVERGE_TIMEOUT_S, "the mirror to converge")
    finally:
        client.close()


# -- load ---------------------------------------------------------------------------


class LoadThread(threading.Thread):
    """allocate / decode / free loops (with shared prefixes, evictions and resets) against one replica.

    Every RPC error is recorded: the test asserts there were none.
    """

    def __init__(self, replica: ManagerProcess, seed: int) -> None:
        super().__init__(name=f"load-{replica.replica_id}", daemon=True)
        self.replica = replica
        self.seed = seed
        self.stop_event = threading.Event()
        self.num_iterations = 0
        self.num_cluster_lookups = 0
        self.num_resets = 0
        self.errors: list[str] = []
        self.answers_without_self: list = []
        # Its own channel: the test thread uses the replica's client meanwhile.
        self.client = KVManagerClient(replica.address, timeout_s=CALL_TIMEOUT_S)

    def run(self) -> None:
        rng = random.Random(self.seed)
        bases = [prompt(self.seed * 100 + i, BLOCK_SIZE * rng.randint(1, 4)) for i in range(6)]
        live: list[str] = []
        client = self.client
        n = 0
        try:
            while not self.stop_event.is_set():
                n += 1
                try:
                    self._iteration(rng, bases, live, n)
                except (grpc.RpcError, Exception) as error:  # noqa: BLE001 - every error is a failure
                    self.errors.append(f"iteration {n}: {error!r}")
                    if len(self.errors) > 20:
                        return
                self.num_iterations += 1
        finally:
            try:
                if live:
                    client.free(live)
            except Exception as error:  # noqa: BLE001
                self.errors.append(f"final free: {error!r}")
            client.close()

    def _iteration(self, rng: random.Random, bases: list[list[int]], live: list[str], n: int) -> None:
        client = self.client
        request_id = f"{self.name}-{n}"
        tokens = bases[rng.randrange(len(bases))] + [rng.randrange(1, 32000) for _ in range(rng.randint(1, 40))]
        result = client.allocate(request_id, tokens, num_new_tokens=len(tokens))
        if result.status is AllocateStatus.OK:
            live.append(request_id)
        elif live:
            client.free([live.pop(0)])
        if live and rng.random() < 0.7:
            for _ in range(rng.randint(1, 20)):
                decoded = client.decode(live, [rng.randrange(1, 32000) for _ in live])
                stuck = [rid for rid, status in zip(live, decoded.statuses) if status is not AllocateStatus.OK]
                if stuck:
                    client.free(stuck)
                    live[:] = [rid for rid in live if rid not in stuck]
                    break
        while len(live) > 3:
            client.free([live.pop(0)])
        if n % 10 == 0:
            self.replica_cluster_lookup(tokens)
        if n % 60 == 0:
            if live:
                client.free(live)
                live.clear()
            if client.reset_prefix_cache():
                self.num_resets += 1

    def replica_cluster_lookup(self, tokens: Sequence[int]) -> None:
        """FindCacheHit(cluster=true) must answer (no RPC error) with Redis up, down or restarting.

        What it answers is checked elsewhere: here only the answers that omit
        the answering replica itself are counted (see test_mirror_fencing).
        """
        hit, replicas = self.client.find_cache_hit(tokens, cluster=True)
        if self.replica.replica_id not in [r.replica_id for r in replicas]:
            self.answers_without_self.append((hit.num_cached_tokens, tuple(replicas)))
        self.num_cluster_lookups += 1

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=30)
        assert not self.is_alive(), "the load thread did not stop"
