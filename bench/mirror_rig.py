"""What the Redis-mirror benchmarks run against: a private Redis and `kv-manager serve` replicas.

Every process is started as a user starts it (`kv_tooling.launch`)
on loopback, the client staying in the bench process: `redis-server` on a
free port without persistence (`--topology single`), or a Redis Cluster of 3
such masters (`--topology cluster`, the servers given its first node's URL),
then `python -m kv_manager_service.cli serve --port 0 ...` replicas, all at
once. Also what the benchmarks share about
them: the pool shape `serve` builds, random prompts, and a tight poll until a
block's key names a replica in Redis.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import grpc
import redis

from bench_stats import print_round
from process_cpu import cpu_with_children_s
from kv_manager_service.cli.flags import build_config
from kv_manager_service.cli.main import make_parser as serve_parser
from kv_manager_service.core import BlockHasher, KVCacheConfig
from kv_manager_service.mirror.schema import KeySchema
from kv_tooling.launch import (
    LaunchedProcess,
    free_cluster_port,
    free_port,
    launch_many,
    launch_redis,
    launch_redis_cluster,
)
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, NotReadyError
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ("single", "cluster")
NUM_CLUSTER_MASTERS = 3
BLOCK_SIZE = 16  # the server's default pool: one full-attention group of 16-token blocks
VOCAB_SIZE = 150_000
SERVER_STOP_TIMEOUT_S = 15.0

OK = pb.ALLOCATE_STATUS_OK
now_ns = time.perf_counter_ns


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--quick and --rounds, shared by the benchmarks that run rounds against servers."""
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: fewer rounds, requests and samples")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5, quick 2)")


def add_redis_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "/usr/bin/redis-server",
                        help="the redis-server binary to start (default %(default)s)")  # fmt: skip
    parser.add_argument("--topology", choices=TOPOLOGIES, default="single",
                        help="one redis-server, or a Redis Cluster of 3 masters (default %(default)s)")  # fmt: skip


def num_rounds(args: argparse.Namespace) -> int:
    return args.rounds or (2 if args.quick else 5)


def run_rounds(rounds: int, one_round: Callable[[int], Sequence[str]]) -> None:
    """Call `one_round(index)` for every round; after each, a progress line on stderr with the figures it returns."""
    for index in range(rounds):
        round_start = now_ns()
        figures = one_round(index)
        print_round(index, rounds, f"{(now_ns() - round_start) / 1e9:.1f} s; {'; '.join(figures)}")


def server_argv(name: str, num_blocks: int, redis_url: str | None = None, model_name: str = "default") -> list[str]:
    """`kv-manager serve --port 0` for replica `name`; mirrored into `redis_url` under `model_name` when given."""
    argv = [
        sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", str(num_blocks),
        "--replica-id", name, "--log-level", "WARNING",
    ]  # fmt: skip
    if redis_url:
        argv += ["--redis-url", redis_url, "--model-name", model_name]
    return argv


class MirrorServer:
    """One running `kv-manager serve` replica and a raw gRPC stub to it, on its own connection."""

    def __init__(self, name: str, process: LaunchedProcess) -> None:
        self.name = name
        self.process = process
        self.argv = process.args
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.use_local_subchannel_pool", 1)]  # fmt: skip
        self.channel = grpc.insecure_channel(process.address, options=options)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = pb_grpc.KVManagerServiceStub(self.channel)
        self.incarnation = self.stub.GetConfig(pb.GetConfigRequest(), timeout=10).incarnation

    def cpu_s(self) -> float:
        """The server's CPU seconds so far, its mirror writer process's included."""
        return cpu_with_children_s(self.process.pid)

    def stop(self) -> str:
        """Stop the server; returns its log (warnings and errors only)."""
        self.channel.close()
        self.process.stop(SERVER_STOP_TIMEOUT_S)
        return self.process.log()


class Rig:
    """A private Redis (one server or a cluster) and the servers started against it; `close` stops them all.

    The logs live in a temporary directory, removed on close; what a server
    logged (warnings and errors) is printed to stderr then. `redis` is the
    first (or only) node; `redis_nodes` every node.
    """

    def __init__(self, redis_binary: str, topology: str = "single") -> None:
        assert topology in TOPOLOGIES, topology
        self.started_ns = now_ns()
        self.topology = topology
        self._directory = tempfile.TemporaryDirectory(prefix="mirror_bench_")
        self.directory = Path(self._directory.name)
        self.servers: dict[str, MirrorServer] = {}
        try:
            if topology == "cluster":
                ports = []
                while len(ports) < NUM_CLUSTER_MASTERS:
                    port = free_cluster_port()
                    if port not in ports:
                        ports.append(port)
                self.redis_nodes = launch_redis_cluster(ports, self.directory)
            else:
                self.redis_nodes = [launch_redis(free_port(), self.directory / "redis.log", binary=redis_binary)]
        except NotReadyError as error:
            self._directory.cleanup()
            raise SystemExit(f"redis-server did not start: {error}") from None
        self.redis = self.redis_nodes[0]
        self.redis_url = f"redis://{self.redis.address}/0"
        client = self.node_client(self.redis)
        self.redis_version = client.info("server").get("redis_version", "?")
        client.close()

    @property
    def redis_pids(self) -> list[int]:
        return [node.pid for node in self.redis_nodes]

    def redis_client(self) -> redis.Redis | redis.RedisCluster:
        """A client of the Redis, as a user's: a cluster client on a cluster."""
        host, port = self.redis.address.rsplit(":", 1)
        if self.topology == "cluster":
            return redis.RedisCluster(host=host, port=int(port))
        return redis.Redis(host=host, port=int(port))

    def node_clients(self) -> list[redis.Redis]:
        """A plain client per node (node-wide commands: INFO, FLUSHALL)."""
        return [self.node_client(node) for node in self.redis_nodes]

    @staticmethod
    def node_client(node: LaunchedProcess) -> redis.Redis:
        host, port = node.address.rsplit(":", 1)
        return redis.Redis(host=host, port=int(port))

    def start_servers(self, commands: Mapping[str, Sequence[str]]) -> None:
        """Start a server per name -> argv (`server_argv`), all at once, and connect to each."""
        names = list(commands)
        try:
            processes = launch_many([commands[n] for n in names], MANAGER_READY_PREFIX,
                                    [self.directory / f"{n}.log" for n in names], cwd=ROOT)  # fmt: skip
        except NotReadyError as error:
            raise SystemExit(f"a server did not start: {error}") from None
        for index, (name, process) in enumerate(zip(names, processes)):
            try:
                self.servers[name] = MirrorServer(name, process)
            except BaseException:
                for unconnected in processes[index:]:
                    unconnected.stop(SERVER_STOP_TIMEOUT_S)
                raise
        print(f"started redis-server and {len(self.servers)} servers in {(now_ns() - self.started_ns) / 1e9:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        logs = {name: server.stop() for name, server in self.servers.items()}
        for node in self.redis_nodes:
            node.stop()
        self._directory.cleanup()
        for name, text in logs.items():
            if text.strip():
                print(f"server {name} logged:\n{text}", file=sys.stderr)

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_config() -> KVCacheConfig:
    """The pool shape `serve` builds without pool flags (num_blocks aside): hashing included."""
    args = serve_parser().parse_args(["serve"])
    return dataclasses.replace(build_config(args), enable_events=True)


def server_hasher() -> BlockHasher:
    """The block hashes the servers compute (and publish), as `serve` configures them."""
    config = server_config()
    return BlockHasher(config.hash_block_size, config.hash_algorithm, config.hash_seed)


def server_schema(model_name: str) -> KeySchema:
    """The Redis keys of the blocks the servers mirror under `model_name`."""
    config = server_config()
    return KeySchema(model_name, config.hash_algorithm.value, config.hash_seed)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def wait_visible(client: redis.Redis | redis.RedisCluster, key: str, field_name: str, value: bytes,
                 timeout_s: float = 30) -> int:
    """Poll HGET key field in a tight loop until it equals `value`; returns perf_counter_ns when seen."""
    hget = client.hget
    deadline = now_ns() + int(timeout_s * 1e9)
    while True:
        if hget(key, field_name) == value:
            return now_ns()
        if now_ns() > deadline:
            raise SystemExit(f"{key} field {field_name} never became {value!r} in Redis")
