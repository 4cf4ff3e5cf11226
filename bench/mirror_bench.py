"""Benchmarks of the Redis mirror of the prefix index, against real server processes.

Starts its own `redis-server` on a free port (no persistence) and six
`python -m kv_manager_service.cli serve --port 0` processes, as a user
would: "off" (no mirror), "on" (`--redis-url`), and four mirrored cluster
replicas c0..c3 under their own `--model-name`. The client stays in the
bench process. It measures in one run:

1. Step latency, mirror on vs off. The same workload on each server: N
   requests (default 256) admitted in one Step, 1000-token prompts whose
   first 512 tokens are shared by groups of 8 (prefix sharing), then
   columnar decode Steps (`StepRequest.decode`, prebuilt requests): every
   16th Step fills a block in every request (N BlockStored events), and the
   pool is sized so that later rounds evict the earlier rounds' cached
   blocks (BlockRemoved events on the same Steps). Both servers hold the
   same requests at once and their Steps alternate in chunks of 16 (one
   fill in the middle of each; the first server swaps every chunk), so both
   see the same moments of a noisy machine, while the on-server's writer
   publishes each fill within its own chunk. Two modes: back to back (the
   worst case: the writer's CPU must overlap some Step) and paced (the
   client sleeps --gap-ms before each Step, standing for the model's
   forward pass). p50 / p99 of the Step round trips, split into the Steps
   that fill blocks, the Step right after a fill and the rest; the
   admission Step; each process's CPU per Step (/proc/PID/stat). The ratio
   on / off is taken within each round. After the on-server's admission the
   bench waits until its last block is in Redis (reported in section 2).
2. Mirror lag on the "on" server: admit a request with a fresh 64-token
   prompt (4 blocks, one BlockStored event logged inside the RPC), then poll
   Redis in a tight loop (HGET of the last block's key, computed with
   BlockHasher and KeySchema.block, until it names the server's
   incarnation). Lag is measured from the RPC's return (a lower bound of
   event-to-visible: the event is logged before the response is sent) and
   from its send (an upper bound). Also a burst: one Step admitting 4 fresh
   2048-token prompts (512 new blocks, an 8192-token prefill step), polled
   on its last block. After each sample GetStats.mirror_lag_ms (the
   writer's own figure: age of the newest event of the batch it last wrote,
   taken when the pipeline returned) is read.
3. Cluster lookup of an 8192-token prompt across 4 replicas: c0..c3 cache
   the first 2048, 4096, 6144 and 8192 tokens of it. FindCacheHit with
   cluster=true on c0 (the answer is checked: 2048, 4096, 6144 and 8176
   tokens), the same with cluster=false (the local floor), and
   ClusterIndex.lookup alone in the bench process over the 511 precomputed
   hashes (its own Redis connection), plus hashing the prompt in-process.
4. A routing simulation on the Mooncake synthetic trace with 4 replicas,
   in-process (no Redis): four KVCacheManager cores, each with its own pool,
   and an in-process copy of the mirror: per replica the hash counts that
   MirrorWriter would publish, kept from the same core events (BlockStored /
   BlockRemoved) after every scheduler step, so the router sees the mirror
   with zero lag and the same chained hashes. The first --sim-requests
   (default 1000) requests, scaled by --sim-scale (default 0.125: each
   512-token trace block becomes 64 tokens, 4 whole 16-token blocks, so the
   trace's sharing lands on block boundaries; outputs scale likewise). Time
   is simulated in ticks: requests arrive at their trace timestamps, and
   every tick each replica runs one step of replay.py's continuous-batching
   scheduler (chunked prefill under a token budget, preemption on
   NO_SPACE). Cache-aware routing builds one `ReplicaPrefix` per replica
   (leading cached blocks of the prompt, a `Lease` from the core's stats)
   and calls `cluster.choose_replica` (longest prefix, ties by usage, then
   requests), with leases fresh at each decision or refreshed every TTL/3
   as the heartbeat does; round-robin sends request i to replica i mod 4.
   One run per policy and pool size (--sim-pool-blocks, default 6000 and
   12000 blocks per replica: both evict). Reported: prefix-hit tokens at
   first admission and the hit rate, the hits the router expected, and the
   load: requests and prompt tokens per replica (max / min), peak usage,
   evictions, preemptions, queueing. Deterministic; the hit rate of one pool
   that never evicts is shown as the bound.

Sections 1 to 3 run every round (section 1 alternates which server goes
first, chunk by chunk, and section 3 the order of its series); each figure is the median over rounds of the per-round figure; ratios are
per round, then the median. The spread shows the lowest and highest round's
p50.

    python bench/mirror_bench.py            # full run, about 1.5 minutes on 2 cores
    python bench/mirror_bench.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import grpc
import redis

from bench_stats import Series, fmt, percentile
from kv_manager_service.rpc.ready_line import MANAGER_READY_PREFIX, NotReadyError, wait_for_ready_line
from kv_manager_service import cli
from kv_manager_service.mirror.lookup import ClusterIndex, ReplicaPrefix, choose_replica
from kv_manager_service.core import (
    AllocateOp,
    AllocateStatus,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    KVCacheConfig,
    KVCacheManager,
)
from kv_manager_service.mirror.schema import KeySchema, Lease
from kv_manager_service.cli.replay import sampled_token_id
from kv_manager_service.workload import DEFAULT_VOCAB_SIZE, TRACE_BLOCK_SIZE, TokenExpander, TraceRecord, load_trace
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK_SIZE = 16  # the server's default pool: one full-attention group of 16-token blocks
VOCAB_SIZE = 150_000
PROMPT_LEN = 1000
SHARED_LEN = 512  # leading tokens shared by each group of requests
SHARE_GROUP = 8  # requests per shared prefix
NUM_PREBUILT = 16  # distinct prebuilt decode requests, cycled
LAG_PROMPT_LEN = 64  # 4 blocks
BURST_REQUESTS, BURST_PROMPT_LEN = 4, 2048  # 512 new blocks in one Step
CLUSTER_PROMPT_LEN = 8192
CLUSTER_POOL_BLOCKS = 4096  # per cluster replica: no eviction of the 512 blocks of the prompt
NUM_CLUSTER_REPLICAS = 4
MODEL_ON, MODEL_CLUSTER = "mirror-bench", "mirror-bench-cluster"

# Targets (issue 5).
TARGET_STEP_RATIO = 1.10
TARGET_LAG_P99_MS = 50.0

OK = pb.ALLOCATE_STATUS_OK
now_ns = time.perf_counter_ns


# -- plumbing --------------------------------------------------------------------


class Results(dict):
    def get_series(self, key: str) -> Series:
        return self.setdefault(key, Series())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RedisServer:
    """A private `redis-server` on a free loopback port, without persistence."""

    def __init__(self, binary: str) -> None:
        self.port = free_port()
        self.argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit(f"redis-server did not start: {shlex.join(self.argv)}")
                time.sleep(0.05)
        self.version = client.info("server").get("redis_version", "?")
        client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Server:
    """`kv-manager serve --port 0` in a subprocess, as a user starts it. Call `wait_ready` next."""

    def __init__(self, name: str, num_blocks: int, redis_url: str | None = None, model_name: str = "default") -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"mirror_bench_{name}_", suffix=".log", delete=False)
        self.argv = [
            sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", str(num_blocks),
            "--replica-id", name, "--log-level", "WARNING",
        ]
        if redis_url:
            self.argv += ["--redis-url", redis_url, "--model-name", model_name]
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.pid = self.proc.pid
        self.address = ""
        self.channel: grpc.Channel | None = None

    def wait_ready(self) -> None:
        try:
            self.address = wait_for_ready_line(self.proc, MANAGER_READY_PREFIX, timeout_s=60)
        except NotReadyError as error:
            log = Path(self.log.name).read_text()
            self.stop()
            raise SystemExit(f"server {self.name} did not start ({error}); its log:\n{log}")
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.use_local_subchannel_pool", 1)]
        self.channel = grpc.insecure_channel(self.address, options=options)
        grpc.channel_ready_future(self.channel).result(timeout=30)
        self.stub = pb_grpc.KVManagerServiceStub(self.channel)
        self.incarnation = self.stub.GetConfig(pb.GetConfigRequest(), timeout=10).incarnation

    def cpu_s(self) -> float:
        return cpu_s(self.pid)

    def stop(self) -> str:
        """Stop the server; returns its log (warnings and errors only)."""
        if self.channel is not None:
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        text = Path(self.log.name).read_text()
        os.unlink(self.log.name)
        return text


def server_config() -> KVCacheConfig:
    """The pool shape `serve` builds without pool flags (num_blocks aside): hashing included."""
    args = cli.make_parser().parse_args(["serve"])
    return dataclasses.replace(cli.build_config(args), enable_events=True)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def wait_visible(client: redis.Redis, key: str, field_name: str, value: bytes, timeout_s: float = 30) -> int:
    """Poll HGET key field in a tight loop until it equals `value`; returns perf_counter_ns when seen."""
    hget = client.hget
    deadline = now_ns() + int(timeout_s * 1e9)
    while True:
        if hget(key, field_name) == value:
            return now_ns()
        if now_ns() > deadline:
            raise SystemExit(f"{key} field {field_name} never became {value!r} in Redis")


# -- plan ------------------------------------------------------------------------


@dataclass
class Plan:
    rounds: int
    num_requests: int  # section 1's requests per Step
    warmup: int
    steps: int  # timed back-to-back decode Steps per server and round
    paced_steps: int  # timed decode Steps with a gap before each
    gap_ms: float
    lag_samples: int  # single fresh-prompt admissions per round
    burst_samples: int  # 512-block bursts per round
    lookup_samples: int  # per series and round in section 3
    sim_requests: int
    sim_scale: float
    sim_pool_blocks: tuple[int, ...]  # one simulation per pool size
    sim_token_budget: int
    sim_max_running: int
    sim_tick_ms: float
    sim_replicas: int

    @property
    def blocks_per_request(self) -> int:
        return -(-(PROMPT_LEN + self.warmup + self.steps + self.paced_steps + BLOCK_SIZE) // BLOCK_SIZE) + 1

    @property
    def step_pool_blocks(self) -> int:
        """Half again what one round holds live: from the second round on, admissions evict cached blocks."""
        live = self.num_requests * self.blocks_per_request
        return live * 3 // 2 + BURST_REQUESTS * BURST_PROMPT_LEN // BLOCK_SIZE + 1024


# -- section 1: Step latency, mirror on vs off ---------------------------------------


class StepWork:
    """Prompts with shared prefixes and prebuilt columnar decode Steps for `n` requests."""

    def __init__(self, tag: str, n: int, rng: random.Random, hasher: BlockHasher) -> None:
        self.request_ids = [f"{tag}-{i}" for i in range(n)]
        prefixes = [random_tokens(rng, SHARED_LEN) for _ in range(-(-n // SHARE_GROUP))]
        self.prompts = [prefixes[i // SHARE_GROUP] + random_tokens(rng, PROMPT_LEN - SHARED_LEN) for i in range(n)]
        self.last_block_hash = hasher.hash_blocks(hasher.root_hash, self.prompts[-1])[-1]
        self.admit = pb.StepRequest(
            ops=[pb.StepOp(allocate=pb.AllocateRequest(request_id=r, token_ids=p, num_new_tokens=len(p)))
                 for r, p in zip(self.request_ids, self.prompts)]
        )
        self.decode = [
            pb.StepRequest(decode=pb.DecodeBatch(request_ids=self.request_ids, token_ids=random_tokens(rng, n)))
            for _ in range(NUM_PREBUILT)
        ]
        self.free = pb.FreeRequest(request_ids=self.request_ids)


def admit(server: Server, work: StepWork, results: Results, tag: str, poller: redis.Redis,
          schema: KeySchema) -> None:
    """One admission Step of every prompt; on a mirrored server, also wait until its last block is in Redis."""
    start = now_ns()
    response = server.stub.Step(work.admit, timeout=120)
    returned = now_ns()
    results.get_series(f"{tag}:admit").add_value((returned - start) / 1e6)
    assert all(r.allocate.status == OK for r in response.results), "admission failed: pool too small?"
    if tag == "on":
        # Let the writer finish before anything else is timed: it is the biggest job it gets.
        seen = wait_visible(poller, schema.block(0, work.last_block_hash), server.name, str(server.incarnation).encode())
        results.get_series("admit:visible").add_value((seen - returned) / 1e6)


def decode_chunks(plan: Plan, servers: dict[str, Server], stubs: dict, work: StepWork, order: list[str],
                  first_step: int, num_steps: int, gap_s: float, redis_pid: int, results: Results, prefix: str) -> None:
    """`num_steps` decode Steps on each server, alternating in chunks of BLOCK_SIZE (one fill each), the first
    server swapping every chunk; with `gap_s`, the client sleeps that long before each Step (a model's forward
    pass), so a background thread of the server can run between Steps."""
    n = plan.num_requests
    samples: dict[str, list[int]] = {"off": [], "on": []}
    filled: dict[str, list[bool]] = {"off": [], "on": []}
    cpu = {"off": 0.0, "on": 0.0}
    redis_cpu = {"off": 0.0, "on": 0.0}
    num_chunks = num_steps // BLOCK_SIZE
    for chunk in range(num_chunks):
        for tag in (order if chunk % 2 == 0 else order[::-1]):
            stub, server = stubs[tag], servers[tag]
            own_samples, own_filled = samples[tag], filled[tag]
            cpu0, redis0 = server.cpu_s(), cpu_s(redis_pid)
            for i in range(first_step + chunk * BLOCK_SIZE, first_step + (chunk + 1) * BLOCK_SIZE):
                if gap_s:
                    time.sleep(gap_s)
                request = work.decode[i % NUM_PREBUILT]
                start = now_ns()
                response = stub.Step(request, timeout=30)
                own_samples.append(now_ns() - start)
                statuses = response.decode.statuses
                assert len(statuses) == n and all(x == OK for x in statuses), "a decode op got NO_SPACE"
                own_filled.append(len(response.decode.changes) > 0)
            cpu[tag] += server.cpu_s() - cpu0
            redis_cpu[tag] += cpu_s(redis_pid) - redis0
    steps = num_chunks * BLOCK_SIZE
    s = results.get_series
    for tag in ("off", "on"):
        t, f = samples[tag], filled[tag]
        s(f"{prefix}{tag}:step").add_samples(t)
        s(f"{prefix}{tag}:fill").add_samples([x for x, y in zip(t, f) if y])
        s(f"{prefix}{tag}:nofill").add_samples([x for x, y in zip(t, f) if not y])
        s(f"{prefix}{tag}:after_fill").add_samples([x for j, x in enumerate(t) if j > 0 and f[j - 1]])
        s(f"{prefix}{tag}:server_cpu").add_value(cpu[tag] / steps * 1e3)
        s(f"{prefix}{tag}:redis_cpu").add_value(redis_cpu[tag] / steps * 1e3)
        s(f"{prefix}{tag}:mean").add_value(statistics.fmean(t) / 1e6)
    for key in ("step", "fill", "after_fill", "nofill"):
        s(f"{prefix}ratio:{key}_p50").add_value(s(f"{prefix}on:{key}").p50[-1] / s(f"{prefix}off:{key}").p50[-1])
        s(f"{prefix}ratio:{key}_p99").add_value(s(f"{prefix}on:{key}").p99[-1] / s(f"{prefix}off:{key}").p99[-1])
    for key in ("server_cpu", "mean"):
        s(f"{prefix}ratio:{key}").add_value(s(f"{prefix}on:{key}").p50[-1] / s(f"{prefix}off:{key}").p50[-1])


def section_step(index: int, plan: Plan, servers: dict[str, Server], redis_pid: int, poller: redis.Redis,
                 schema: KeySchema, hasher: BlockHasher, results: Results) -> None:
    """Both servers hold the same requests and run the same Steps, interleaved in chunks (decode_chunks), so
    both see the same moments of a noisy machine while the on-server's writer has its own chunk to publish in."""
    work = StepWork(f"r{index}", plan.num_requests, random.Random(index), hasher)
    order = ["off", "on"] if index % 2 == 0 else ["on", "off"]
    for tag in order:
        admit(servers[tag], work, results, tag, poller, schema)
    stubs = {tag: servers[tag].stub for tag in order}
    for tag in order:
        for i in range(plan.warmup):
            stubs[tag].Step(work.decode[i % NUM_PREBUILT], timeout=30)
    decode_chunks(plan, servers, stubs, work, order, plan.warmup, plan.steps, 0.0, redis_pid, results, "")
    if plan.paced_steps:
        decode_chunks(plan, servers, stubs, work, order, plan.warmup + plan.steps, plan.paced_steps,
                      plan.gap_ms / 1e3, redis_pid, results, "paced:")
    for tag in order:
        stubs[tag].Free(work.free, timeout=30)
    s = results.get_series
    s("ratio:admit").add_value(s("on:admit").p50[-1] / s("off:admit").p50[-1])


# -- section 2: mirror lag ------------------------------------------------------------


def section_lag(index: int, plan: Plan, on: Server, poller: redis.Redis, hasher: BlockHasher, schema: KeySchema,
                results: Results) -> None:
    rng = random.Random(10_000 + index)
    stub = on.stub
    field_name, value = on.name, str(on.incarnation).encode()
    stats_request = pb.GetStatsRequest()
    from_return, from_send, writer_lag, polls = [], [], [], []
    for i in range(plan.lag_samples):
        prompt = random_tokens(rng, LAG_PROMPT_LEN)
        key = schema.block(0, hasher.hash_blocks(hasher.root_hash, prompt)[-1])
        request = pb.AllocateRequest(request_id=f"lag-{index}-{i}", token_ids=prompt, num_new_tokens=len(prompt))
        sent = now_ns()
        response = stub.Allocate(request, timeout=10)
        returned = now_ns()
        hget, count = poller.hget, 1
        while hget(key, field_name) != value:
            count += 1
            if now_ns() - returned > 30e9:
                raise SystemExit(f"lag sample {i}: {key} never appeared")
        seen = now_ns()
        assert response.status == OK
        from_return.append(seen - returned)
        from_send.append(seen - sent)
        polls.append(count)
        writer_lag.append(stub.GetStats(stats_request, timeout=10).mirror_lag_ms)
        stub.Free(pb.FreeRequest(request_ids=[request.request_id]), timeout=10)
    s = results.get_series
    s("lag:return").add_samples(from_return)
    s("lag:send").add_samples(from_send)
    s("lag:writer").add_samples(writer_lag, 1)
    s("lag:polls").add_samples(polls, 1)

    from_return, from_send, writer_lag = [], [], []
    for i in range(plan.burst_samples):
        prompts = [random_tokens(rng, BURST_PROMPT_LEN) for _ in range(BURST_REQUESTS)]
        ids = [f"burst-{index}-{i}-{j}" for j in range(BURST_REQUESTS)]
        key = schema.block(0, hasher.hash_blocks(hasher.root_hash, prompts[-1])[-1])
        request = pb.StepRequest(ops=[
            pb.StepOp(allocate=pb.AllocateRequest(request_id=r, token_ids=p, num_new_tokens=len(p)))
            for r, p in zip(ids, prompts)
        ])
        sent = now_ns()
        response = stub.Step(request, timeout=30)
        returned = now_ns()
        seen = wait_visible(poller, key, field_name, value)
        assert all(r.allocate.status == OK for r in response.results)
        from_return.append(seen - returned)
        from_send.append(seen - sent)
        writer_lag.append(stub.GetStats(stats_request, timeout=10).mirror_lag_ms)
        stub.Free(pb.FreeRequest(request_ids=ids), timeout=10)
    s("burst:return").add_samples(from_return)
    s("burst:send").add_samples(from_send)
    s("burst:writer").add_samples(writer_lag, 1)
    stats = stub.GetStats(stats_request, timeout=10)
    s("mirror:failures").add_value(stats.mirror_failures)
    s("mirror:resyncs").add_value(stats.mirror_resyncs)
    s("mirror:queue_depth").add_value(stats.mirror_queue_depth)


# -- section 3: cluster lookup ----------------------------------------------------------


@dataclass
class ClusterSetup:
    prompt: list[int]
    hashes: list[bytes]  # the 511 block hashes a lookup reads
    expected: dict[str, int]  # replica -> cached tokens FindCacheHit must report
    request: pb.FindCacheHitRequest
    local_request: pb.FindCacheHitRequest


def prepare_cluster(replicas: Sequence[Server], poller: redis.Redis, hasher: BlockHasher,
                    schema: KeySchema) -> ClusterSetup:
    prompt = random_tokens(random.Random(424242), CLUSTER_PROMPT_LEN)
    all_hashes = hasher.hash_blocks(hasher.root_hash, prompt)
    max_blocks = (len(prompt) - 1) // BLOCK_SIZE
    expected = {}
    for i, server in enumerate(replicas):
        length = CLUSTER_PROMPT_LEN * (i + 1) // len(replicas)
        part = prompt[:length]
        response = server.stub.Allocate(
            pb.AllocateRequest(request_id="cluster-prefix", token_ids=part, num_new_tokens=len(part)), timeout=30)
        assert response.status == OK
        server.stub.Free(pb.FreeRequest(request_ids=["cluster-prefix"]), timeout=10)
        num_blocks = length // BLOCK_SIZE
        wait_visible(poller, schema.block(0, all_hashes[num_blocks - 1]), server.name, str(server.incarnation).encode())
        expected[server.name] = min(num_blocks, max_blocks) * BLOCK_SIZE
    return ClusterSetup(
        prompt, all_hashes[:max_blocks], expected,
        pb.FindCacheHitRequest(token_ids=prompt, cluster=True),
        pb.FindCacheHitRequest(token_ids=prompt, cluster=False),
    )


def section_cluster(index: int, plan: Plan, entry: Server, setup: ClusterSetup, index_reader: ClusterIndex,
                    hasher: BlockHasher, results: Results) -> None:
    stub = entry.stub
    response = stub.FindCacheHit(setup.request, timeout=10)
    got = {r.replica_id: r.num_cached_tokens for r in response.replicas}
    assert got == setup.expected, f"cluster FindCacheHit reported {got}, expected {setup.expected}"
    prefixes = index_reader.lookup(0, setup.hashes)
    got = {p.replica_id: p.num_cached_blocks * BLOCK_SIZE for p in prefixes}
    assert got == setup.expected, f"ClusterIndex.lookup reported {got}, expected {setup.expected}"

    def rpc_cluster() -> None:
        stub.FindCacheHit(setup.request, timeout=10)

    def rpc_local() -> None:
        stub.FindCacheHit(setup.local_request, timeout=10)

    def lookup() -> None:
        index_reader.lookup(0, setup.hashes)

    def hash_prompt() -> None:
        hasher.hash_blocks(hasher.root_hash, setup.prompt)

    series = [("cluster:rpc", rpc_cluster), ("cluster:local", rpc_local), ("cluster:lookup", lookup),
              ("cluster:hash", hash_prompt)]
    if index % 2:
        series.reverse()
    warmup = max(3, plan.lookup_samples // 10)
    for key, call in series:
        for _ in range(warmup):
            call()
        samples = []
        for _ in range(plan.lookup_samples):
            start = now_ns()
            call()
            samples.append(now_ns() - start)
        results.get_series(key).add_samples(samples)
    s = results.get_series
    s("cluster:over_local").add_value(s("cluster:rpc").p50[-1] - s("cluster:local").p50[-1])


# -- section 4: routing simulation -------------------------------------------------------


class SimRequest:
    __slots__ = ("index", "request_id", "arrival_tick", "prompt_len", "num_output_tokens", "token_ids", "hashes",
                 "num_sent", "num_computed", "running", "first_hit", "expected_hit", "admit_tick", "first_token_tick",
                 "replica")

    def __init__(self, index: int, record: TraceRecord, tick_ms: float, expander: TokenExpander,
                 hasher: BlockHasher) -> None:
        self.index = index
        self.request_id = f"sim-{index}"
        self.arrival_tick = int(record.timestamp_ms // tick_ms)
        self.token_ids = expander.prompt_token_ids(record)
        self.prompt_len = len(self.token_ids)
        self.num_output_tokens = expander.output_length(record)
        # What a router hashes: the prompt's full blocks a hit may cover (one token is left to compute).
        self.hashes = hasher.hash_blocks(hasher.root_hash, self.token_ids)[: (self.prompt_len - 1) // BLOCK_SIZE]
        self.num_sent = self.num_computed = 0
        self.running = False
        self.first_hit: int | None = None
        self.expected_hit = 0
        self.admit_tick = self.first_token_tick = -1
        self.replica = -1


class SimReplica:
    """One replica: its own core and pool, the scheduler loop of replay.py one step at a time, and the
    mirror's view of it (hash -> count of cached blocks carrying it, from the core's events)."""

    def __init__(self, replica_id: str, plan: Plan, num_blocks: int) -> None:
        self.replica_id = replica_id
        self.manager = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, enable_events=True))
        self.token_budget = plan.sim_token_budget
        self.max_running = plan.sim_max_running
        self.mirror: Counter = Counter()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.num_routed = self.routed_tokens = self.num_preemptions = self.max_waiting = 0
        self.peak_usage = 0.0
        self.busy_ticks = 0
        self.last_tick = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def lease(self) -> Lease:
        stats = self.manager.stats()
        return Lease(self.replica_id, 1, "", stats.num_requests, stats.usage, stats.num_free_blocks)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` in the mirror: what ClusterIndex.lookup would report."""
        mirror = self.mirror
        n = 0
        for block_hash in hashes:
            if block_hash not in mirror:
                break
            n += 1
        return n

    def route(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self.num_routed += 1
        self.routed_tokens += request.prompt_len
        self.max_waiting = max(self.max_waiting, len(self.waiting))

    def _drain_events(self) -> None:
        mirror = self.mirror
        for event in self.manager.take_events():
            if type(event) is BlockStored:
                for block_hash in event.block_hashes:
                    mirror[block_hash] += 1
            elif type(event) is BlockRemoved:
                for block_hash in event.block_hashes:
                    count = mirror[block_hash] - 1
                    if count:
                        mirror[block_hash] = count
                    else:
                        del mirror[block_hash]
            else:  # AllBlocksCleared: the simulation never resets the cache
                mirror.clear()

    def _preempt_newest(self) -> SimRequest:
        victim = self.running.pop()
        self.manager.free((victim.request_id,))
        victim.running = False
        victim.num_sent = victim.num_computed = 0
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def _advance(self, request: SimRequest, num_computed: int, computed: list[SimRequest]) -> None:
        request.num_sent = len(request.token_ids)
        request.num_computed = num_computed
        if num_computed == len(request.token_ids):
            computed.append(request)

    def step(self, tick: int) -> list[SimRequest]:
        """One scheduler step (replay.py's loop body); returns the requests that finished."""
        manager = self.manager
        self.busy_ticks += 1
        self.last_tick = tick
        budget = self.token_budget
        ops = []
        for request in self.running:
            if budget == 0:
                break
            num_tokens = min(len(request.token_ids) - request.num_computed, budget)
            ops.append(AllocateOp(request.request_id, request.token_ids[request.num_sent:], num_tokens))
            budget -= num_tokens
        results = manager.step(ops).results if ops else ()
        computed: list[SimRequest] = []
        preempted = False
        for request, op, result in zip(self.running[: len(ops)], ops, results):
            if not request.running:
                continue
            while result.status is AllocateStatus.NO_SPACE:
                preempted = True
                if self._preempt_newest() is request:
                    if not self.running:
                        raise SystemExit(f"sim request {request.index} does not fit in a replica's pool alone; "
                                         "raise --sim-pool-blocks")
                    break
                result = manager.step((op,)).results[0]
            if request.running:
                self._advance(request, result.num_computed_tokens + result.num_scheduled_tokens, computed)
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not preempted:
            request = self.waiting[0]
            result = manager.allocate(request.request_id, request.token_ids, budget)
            if result.status is AllocateStatus.NO_SPACE:
                if not self.running:
                    raise SystemExit(f"sim request {request.index}: prefix + prefill chunk do not fit an idle pool; "
                                     "raise --sim-pool-blocks or lower --sim-token-budget")
                break
            self.waiting.popleft()
            request.running = True
            self.running.append(request)
            if request.first_hit is None:
                request.first_hit = result.num_computed_tokens
                request.admit_tick = tick
            budget -= result.num_scheduled_tokens
            self._advance(request, result.num_computed_tokens + result.num_scheduled_tokens, computed)
        self.peak_usage = max(self.peak_usage, manager.stats().usage)
        finished = []
        for request in computed:
            if request.first_token_tick < 0:
                request.first_token_tick = tick
            num_output = len(request.token_ids) - request.prompt_len + 1
            if num_output == request.num_output_tokens:
                finished.append(request)
            else:
                request.token_ids.append(sampled_token_id(request.index, len(request.token_ids), DEFAULT_VOCAB_SIZE))
        if finished:
            manager.free([r.request_id for r in finished])
            for request in finished:
                request.running = False
                request.token_ids = None
            self.running[:] = [r for r in self.running if r.running]
        manager.ack(manager.last_step_id)
        self._drain_events()
        return finished


POLICIES = (
    ("cache-aware", "cache-aware: choose_replica, leases fresh at each decision"),
    ("cache-aware-stale", "cache-aware: choose_replica, leases refreshed every TTL/3 (3.33 s), as the heartbeat does"),
    ("round-robin", "round-robin"),
)
LEASE_REFRESH_MS = 10_000 / 3  # the default --lease-ttl-s 10 over the heartbeat's 3 beats per TTL


@dataclass
class SimResult:
    policy: str
    pool_blocks: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int  # at each request's first admission
    expected_hit_tokens: int  # what the router saw in the mirror when it routed
    manager_queries: int  # readmissions after preemption included
    manager_hits: int
    replicas: list[SimReplica]
    ttft_ticks: list[int]
    queue_ticks: list[int]
    route_us: list[float]
    wall_s: float
    num_ticks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens


def simulate(policy: str, pool_blocks: int, records: Sequence[TraceRecord], plan: Plan) -> SimResult:
    started = now_ns()
    expander = TokenExpander(scale=plan.sim_scale)
    hasher = BlockHasher(BLOCK_SIZE)
    replicas = [SimReplica(f"r{i}", plan, pool_blocks) for i in range(plan.sim_replicas)]
    requests = [SimRequest(i, r, plan.sim_tick_ms, expander, hasher) for i, r in enumerate(records)]
    refresh_ticks = max(1, round(LEASE_REFRESH_MS / plan.sim_tick_ms))
    leases = [r.lease() for r in replicas]
    leases_tick = 0
    route_us = []
    tick = next_index = 0
    while next_index < len(requests) or any(r.busy for r in replicas):
        if not any(r.busy for r in replicas) and requests[next_index].arrival_tick > tick:
            tick = requests[next_index].arrival_tick  # idle: skip to the next arrival
        while next_index < len(requests) and requests[next_index].arrival_tick <= tick:
            request = requests[next_index]
            start = now_ns()
            if policy == "round-robin":
                target = request.index % len(replicas)
                request.expected_hit = replicas[target].cached_prefix(request.hashes) * BLOCK_SIZE
            else:
                if policy == "cache-aware":
                    leases = [r.lease() for r in replicas]
                elif tick - leases_tick >= refresh_ticks:
                    leases, leases_tick = [r.lease() for r in replicas], tick
                prefixes = [ReplicaPrefix(r.replica_id, r.cached_prefix(request.hashes), lease)
                            for r, lease in zip(replicas, leases)]
                chosen = choose_replica(prefixes)
                target = next(i for i, r in enumerate(replicas) if r.replica_id == chosen)
                request.expected_hit = prefixes[target].num_cached_blocks * BLOCK_SIZE
            route_us.append((now_ns() - start) / 1e3)
            request.replica = target
            replicas[target].route(request)
            next_index += 1
        for replica in replicas:
            if replica.busy:
                replica.step(tick)
        tick += 1
    return SimResult(
        policy=policy,
        pool_blocks=pool_blocks,
        num_requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        hit_tokens=sum(r.first_hit for r in requests),
        expected_hit_tokens=sum(r.expected_hit for r in requests),
        manager_queries=sum(r.manager.prefix_cache_queries for r in replicas),
        manager_hits=sum(r.manager.prefix_cache_hits for r in replicas),
        replicas=replicas,
        ttft_ticks=[r.first_token_tick - r.arrival_tick for r in requests],
        queue_ticks=[r.admit_tick - r.arrival_tick for r in requests],
        route_us=route_us,
        wall_s=(now_ns() - started) / 1e9,
        num_ticks=tick,
    )


def unbounded_hits(records: Sequence[TraceRecord], plan: Plan) -> tuple[int, int]:
    """Hit tokens of one pool that never evicts and sees every prompt in trace order (the bound)."""
    expander = TokenExpander(scale=plan.sim_scale)
    hasher = BlockHasher(BLOCK_SIZE)
    seen: set[bytes] = set()
    hit = total = 0
    for record in records:
        tokens = expander.prompt_token_ids(record)
        hashes = hasher.hash_blocks(hasher.root_hash, tokens)
        n = 0
        for block_hash in hashes[: (len(tokens) - 1) // BLOCK_SIZE]:
            if block_hash not in seen:
                break
            n += 1
        hit += n * BLOCK_SIZE
        total += len(tokens)
        seen.update(hashes)
    return hit, total


# -- report ------------------------------------------------------------------------


def med(series: Series, which: str = "p50") -> float:
    return statistics.median(getattr(series, which))


def row(number: str, metric: str, series: Series, unit: str, target: str = "", note: str = "",
        met: bool | None = None) -> str:
    p50 = fmt(med(series)) if series.p50 else "n/a"
    p99 = fmt(med(series, "p99")) if series.p99 else ""
    spread = f"{fmt(min(series.p50))} - {fmt(max(series.p50))}" if len(series.p50) > 1 else ""
    if met is not None:
        target = f"{target} ({'met' if met else 'MISSED'})"
    return f"| {number} | {metric} | {p50} | {p99} | {unit} | {spread} | {target} | {note} |"


def render(results: Results, plan: Plan, command: str, seconds: float, redis_server: RedisServer,
           servers: dict[str, Server], load: tuple[float, float]) -> list[str]:
    s = results.get_series
    lag_p99 = med(s("lag:return"), "p99")
    lag_send_p99 = med(s("lag:send"), "p99")
    burst_p99 = med(s("burst:send"), "p99")
    n = plan.num_requests
    # Blocks the admission caches: each group's shared prefix once, then every prompt's own full blocks.
    cached_blocks = -(-n // SHARE_GROUP) * (SHARED_LEN // BLOCK_SIZE) + n * (PROMPT_LEN - SHARED_LEN) // BLOCK_SIZE
    hiredis = "hiredis parser" if getattr(redis.utils, "HIREDIS_AVAILABLE", False) else "pure-Python parser"
    server_argv = shlex.join(["python", *servers["on"].argv[1:]])
    lines = [
        "# Redis mirror benchmarks",
        "",
        f"Command: `{command}`",
        "",
        f"Python {platform.python_version()} ({platform.python_implementation()}), {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} CPUs; grpcio {grpc.__version__}, redis-py {redis.__version__} "
        f"({hiredis}), redis-server {redis_server.version} (`--save '' --appendonly no`, loopback). Servers: "
        f"`{server_argv}` (\"on\"), the same without `--redis-url` (\"off\"), and 4 cluster replicas c0..c3 "
        f"(`--num-blocks {CLUSTER_POOL_BLOCKS} --model-name {MODEL_CLUSTER}`), all on loopback with the client in the bench process, every process on "
        f"the same {os.cpu_count()} cores. {plan.rounds} rounds; in each, both servers hold the same requests and run "
        f"the same decode Steps, interleaved in chunks of {BLOCK_SIZE} (one fill each; the first server swaps every "
        f"chunk): {plan.steps} back to back and {plan.paced_steps} paced (the client sleeps {plan.gap_ms:g} ms before "
        f"each, standing for the model's forward pass) per server after {plan.warmup} warm-up; {plan.lag_samples} lag "
        f"samples + "
        f"{plan.burst_samples} bursts, {plan.lookup_samples} calls per lookup series; medians over rounds of "
        f"per-round p50 / p99; total {seconds:.0f} s; 1-minute load average {load[0]:.2f} when it started "
        f"(other work on the machine), {load[1]:.2f} when it ended.",
        "",
        "| # | metric | p50 | p99 | unit | spread (round p50s) | target | note |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for prefix, mode in (("", "back to back"), ("paced:", f"paced, {plan.gap_ms:g} ms gap")):
        if not s(f"{prefix}off:step").p50:
            continue
        ratio_p50, ratio_p99 = med(s(f"{prefix}ratio:step_p50")), med(s(f"{prefix}ratio:step_p99"))
        steps = plan.steps if not prefix else plan.paced_steps
        lines += [
            row("1", f"Step, {n} decode ops (columnar), {mode}, mirror off", s(f"{prefix}off:step"), "ms",
                note=f"{steps} Steps per round; {n} requests, {PROMPT_LEN}-token prompts, {SHARED_LEN} shared per "
                     f"{SHARE_GROUP}"),
            row("1", f"Step, {n} decode ops (columnar), {mode}, mirror on", s(f"{prefix}on:step"), "ms"),
            row("1", f"**ratio on / off, Step p50, {mode}**", s(f"{prefix}ratio:step_p50"), "x",
                f"<= {TARGET_STEP_RATIO}", "per round, same workload", met=ratio_p50 <= TARGET_STEP_RATIO),
            row("1", f"**ratio on / off, Step p99, {mode}**", s(f"{prefix}ratio:step_p99"), "x",
                f"<= {TARGET_STEP_RATIO}", met=ratio_p99 <= TARGET_STEP_RATIO),
            row("1", "  ratio on / off, mean Step", s(f"{prefix}ratio:mean"), "x"),
            row("1", "  Steps that fill a block in every request, off", s(f"{prefix}off:fill"), "ms",
                note=f"1 in {BLOCK_SIZE}: {n} BlockStored (+ BlockRemoved once evicting)"),
            row("1", "  Steps that fill a block in every request, on", s(f"{prefix}on:fill"), "ms"),
            row("1", "  ratio on / off, fill Steps p50", s(f"{prefix}ratio:fill_p50"), "x"),
            row("1", "  ratio on / off, fill Steps p99", s(f"{prefix}ratio:fill_p99"), "x"),
            row("1", "  the Step right after a fill, off", s(f"{prefix}off:after_fill"), "ms",
                note="may run while the writer publishes the fill"),
            row("1", "  the Step right after a fill, on", s(f"{prefix}on:after_fill"), "ms"),
            row("1", "  ratio on / off, Step after a fill p50", s(f"{prefix}ratio:after_fill_p50"), "x"),
            row("1", "  ratio on / off, Step after a fill p99", s(f"{prefix}ratio:after_fill_p99"), "x"),
            row("1", "  Steps that fill nothing, off", s(f"{prefix}off:nofill"), "ms"),
            row("1", "  Steps that fill nothing, on", s(f"{prefix}on:nofill"), "ms"),
            row("1", "  ratio on / off, Steps that fill nothing p50", s(f"{prefix}ratio:nofill_p50"), "x"),
            row("1", "  server process CPU per Step, off", s(f"{prefix}off:server_cpu"), "ms", note="/proc/PID/stat"),
            row("1", "  server process CPU per Step, on", s(f"{prefix}on:server_cpu"), "ms",
                note="writer thread included"),
            row("1", "  ratio on / off, server CPU", s(f"{prefix}ratio:server_cpu"), "x"),
            row("1", "  redis-server CPU per Step, during the on-server's Steps", s(f"{prefix}on:redis_cpu"), "ms"),
        ]
    lines += [
        row("1", f"admission Step ({n} prompts, {n * (PROMPT_LEN // BLOCK_SIZE):,} blocks, {cached_blocks:,} newly "
                 "cached), off", s("off:admit"), "ms", note="one sample per round"),
        row("1", "admission Step, on", s("on:admit"), "ms"),
        row("1", "  ratio on / off, admission", s("ratio:admit"), "x"),
        row("2", f"mirror lag, fresh {LAG_PROMPT_LEN}-token prompt: RPC return -> visible", s("lag:return"), "ms",
            f"p99 <= {TARGET_LAG_P99_MS:g}", "lower bound (event logged before the reply)",
            met=lag_p99 <= TARGET_LAG_P99_MS),
        row("2", "  the same from RPC send -> visible", s("lag:send"), "ms", f"p99 <= {TARGET_LAG_P99_MS:g}",
            "upper bound (includes the whole Allocate)", met=lag_send_p99 <= TARGET_LAG_P99_MS),
        row("2", "  HGET polls until visible", s("lag:polls"), "", note="tight loop, one connection"),
        row("2", "  GetStats.mirror_lag_ms after each sample", s("lag:writer"), "ms",
            note="writer's figure: event logged -> pipeline returned (read just after the poll saw the key)"),
        row("2", f"mirror lag, burst ({BURST_REQUESTS} x {BURST_PROMPT_LEN}-token prompts in one Step, "
                 f"{BURST_REQUESTS * BURST_PROMPT_LEN // BLOCK_SIZE} blocks): return -> visible", s("burst:return"),
            "ms", note="last block of the last prompt polled"),
        row("2", "  the same from RPC send -> visible", s("burst:send"), "ms", f"p99 <= {TARGET_LAG_P99_MS:g}",
            met=burst_p99 <= TARGET_LAG_P99_MS),
        row("2", "  GetStats.mirror_lag_ms after each burst", s("burst:writer"), "ms"),
        row("2", f"mirror lag, section 1's admission ({cached_blocks:,} new block hashes): return -> visible",
            s("admit:visible"), "ms", note="one sample per round; its last block polled"),
        row("2", "mirror failures / resyncs / queue depth at round end", s("mirror:failures"), "",
            note=f"resyncs {fmt(med(s('mirror:resyncs')))}, queue depth {fmt(med(s('mirror:queue_depth')))}"),
        row("3", f"FindCacheHit cluster=true, {CLUSTER_PROMPT_LEN}-token prompt, 4 replicas", s("cluster:rpc"), "ms",
            note="on c0; answer checked (2048/4096/6144/8176 tokens)"),
        row("3", "FindCacheHit cluster=false (local only), same prompt", s("cluster:local"), "ms",
            note="hash + local lookup + gRPC"),
        row("3", "  cluster=true minus cluster=false, p50", s("cluster:over_local"), "ms", note="the mirror read"),
        row("3", f"ClusterIndex.lookup alone, {CLUSTER_PROMPT_LEN // BLOCK_SIZE - 1} hashes, in the bench process",
            s("cluster:lookup"), "ms", note="one pipelined round trip, precomputed hashes"),
        row("3", f"  hashing the {CLUSTER_PROMPT_LEN}-token prompt in-process (sha256_cbor)", s("cluster:hash"), "ms"),
    ]
    return lines


def render_sim(sims: Sequence[SimResult], bound: tuple[int, int], plan: Plan, trace: Path) -> list[str]:
    scaled_block = round(TRACE_BLOCK_SIZE * plan.sim_scale)
    labels = dict(POLICIES)

    def spread(values: Sequence[float], percent: bool = False) -> str:
        body = " / ".join(f"{v:.0%}" if percent else f"{v:,}" for v in values)
        low, high = min(values), max(values)
        return f"{body} ({high / low:.2f})" if low else f"{body} (inf)"

    first = sims[0]
    refresh_ticks = max(1, round(LEASE_REFRESH_MS / plan.sim_tick_ms))
    lines = [
        "",
        f"## 4. Routing simulation: the first {first.num_requests} Mooncake requests over {plan.sim_replicas} replicas",
        "",
        f"Trace `{trace.name}` scaled by {plan.sim_scale} (every 512-token trace block becomes {scaled_block} "
        f"tokens, outputs likewise: {first.prompt_tokens:,} prompt tokens); block {BLOCK_SIZE}. Per replica an "
        f"in-process KVCacheManager with its own pool, replay.py's scheduler (token budget {plan.sim_token_budget} "
        f"per step, <= {plan.sim_max_running} running, chunked prefill, preemption on NO_SPACE), one step per replica "
        f"per tick; requests arrive at their trace timestamps, one tick = {plan.sim_tick_ms:g} ms (a scaled step "
        "stands for 1/scale real steps of ~30 ms). The router reads an in-process copy of the mirror: per replica "
        "the cached hash counts kept from its core's BlockStored / BlockRemoved events after every step (what "
        "MirrorWriter publishes, with zero lag), and Leases from each core's stats (num_requests, usage) either "
        f"fresh at each decision or refreshed every {refresh_ticks} ticks (TTL/3 of the default 10 s lease, like "
        "the heartbeat). It calls `cluster.choose_replica` on ReplicaPrefix values (longest cached prefix, ties to "
        "the lowest usage, then fewest requests, then replica id). Round-robin sends request i to replica i mod "
        f"{plan.sim_replicas}. Deterministic: one run each. Bound: one pool that never evicts and sees every "
        f"prompt in trace order hits {bound[0]:,} tokens ({bound[0] / bound[1]:.1%}).",
        "",
        "Per-replica columns list r0 / r1 / r2 / r3, then (max / min). Hits are counted at each request's first "
        "admission; 'router saw' is the prefix the mirror showed for the chosen replica when routing.",
        "",
        "| pool / replica | policy | prefix-hit tokens | hit rate | vs round-robin | router saw | requests per "
        "replica | prompt tokens per replica | peak usage per replica | evictions | preemptions | longest queue "
        "| queue p50 / p99 | first token p50 / p99 | route p50 / p99 |",
        "|---:|---|---:|---:|---:|---:|---|---|---|---:|---:|---|---|---|---|",
    ]
    rr_hits = {r.pool_blocks: r.hit_tokens for r in sims if r.policy == "round-robin"}
    for r in sims:
        reps = r.replicas
        base = rr_hits.get(r.pool_blocks)
        vs = f"{r.hit_tokens / base:.2f}x" if base else ""
        lines.append(
            f"| {r.pool_blocks:,} | {labels[r.policy]} | {r.hit_tokens:,} | {r.hit_rate:.1%} | {vs} | "
            f"{r.expected_hit_tokens:,} | {spread([x.num_routed for x in reps])} | "
            f"{spread([x.routed_tokens for x in reps])} | {spread([x.peak_usage for x in reps], True)} | "
            f"{sum(x.manager.pool.num_evictions for x in reps):,} | {sum(x.num_preemptions for x in reps)} | "
            f"{' / '.join(str(x.max_waiting) for x in reps)} | "
            f"{percentile(r.queue_ticks, 50):,} / {percentile(r.queue_ticks, 99):,} ticks | "
            f"{percentile(r.ttft_ticks, 50):,} / {percentile(r.ttft_ticks, 99):,} ticks | "
            f"{statistics.median(r.route_us):.1f} / {percentile(r.route_us, 99):.1f} us |"
        )
    lines += [
        "",
        f"Simulation wall time: {sum(r.wall_s for r in sims):.1f} s for {len(sims)} runs; the route column times "
        "the router in-process (prefix count per replica over the in-process mirror, leases, choose_replica), "
        "not a Redis read (section 3 times that).",
    ]
    return lines


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: fewer rounds, requests and samples")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5, quick 2)")
    parser.add_argument("--requests", type=int, default=None, help="section 1's requests per Step (default 256, quick 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode Steps per server and round (default 400, quick 64)")
    parser.add_argument("--paced-steps", type=int, default=None,
                        help="timed decode Steps per server and round with --gap-ms before each (default 320, quick 32; "
                             "0: none)")
    parser.add_argument("--gap-ms", type=float, default=5.0,
                        help="client sleep before each paced Step, standing for the model's forward pass "
                             "(default %(default)s)")
    parser.add_argument("--lag-samples", type=int, default=None, help="fresh-prompt lag samples per round (default 200, quick 30)")
    parser.add_argument("--burst-samples", type=int, default=None, help="512-block bursts per round (default 20, quick 4)")
    parser.add_argument("--lookup-samples", type=int, default=None, help="calls per lookup series and round (default 200, quick 30)")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "/usr/bin/redis-server",
                        help="the redis-server binary to start (default %(default)s)")
    sim = parser.add_argument_group("routing simulation (section 4)")
    sim.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace (default: %(default)s)")
    sim.add_argument("--sim-requests", type=int, default=None, help="first N trace requests (default 1000, quick 200)")
    sim.add_argument("--sim-scale", type=float, default=0.125,
                     help="trace scale: each 512-token block becomes round(512 * SCALE) tokens (default %(default)s: "
                          "64 tokens, 4 whole blocks of 16)")
    sim.add_argument("--sim-pool-blocks", default="6000,12000",
                     help="blocks per replica's pool, comma-separated: one simulation per size (default %(default)s: "
                          "both policies evict at both)")
    sim.add_argument("--sim-token-budget", type=int, default=None,
                     help="tokens per scheduler step per replica (default round(8192 * scale))")
    sim.add_argument("--sim-max-running", type=int, default=64, help="running requests per replica (default %(default)s)")
    sim.add_argument("--sim-tick-ms", type=float, default=None,
                     help="trace milliseconds per scheduler step (default 30 / scale: a scaled step stands for "
                          "1/scale real ~30 ms steps)")
    sim.add_argument("--sim-replicas", type=int, default=NUM_CLUSTER_REPLICAS, help="replicas (default %(default)s)")
    sim.add_argument("--skip-sim", action="store_true", help="skip section 4")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    quick = args.quick
    if args.steps is not None and args.steps < BLOCK_SIZE:
        parser.error(f"--steps must be >= {BLOCK_SIZE} (Steps alternate between the servers in chunks of {BLOCK_SIZE})")
    plan = Plan(
        rounds=args.rounds or (2 if quick else 5),
        num_requests=args.requests or (64 if quick else 256),
        warmup=16 if quick else 32,
        steps=(args.steps or (64 if quick else 400)) // BLOCK_SIZE * BLOCK_SIZE,
        paced_steps=(args.paced_steps if args.paced_steps is not None else (32 if quick else 320)) // BLOCK_SIZE
        * BLOCK_SIZE,
        gap_ms=args.gap_ms,
        lag_samples=args.lag_samples or (30 if quick else 200),
        burst_samples=args.burst_samples or (4 if quick else 20),
        lookup_samples=args.lookup_samples or (30 if quick else 200),
        sim_requests=args.sim_requests or (200 if quick else 1000),
        sim_scale=args.sim_scale,
        sim_pool_blocks=tuple(int(x) for x in args.sim_pool_blocks.split(",")),
        sim_token_budget=args.sim_token_budget or round(8192 * args.sim_scale),
        sim_max_running=args.sim_max_running,
        sim_tick_ms=args.sim_tick_ms or 30 / args.sim_scale,
        sim_replicas=args.sim_replicas,
    )
    started = now_ns()
    load_start = os.getloadavg()[0]
    config = server_config()
    hasher = BlockHasher(config.hash_block_size, config.hash_algorithm, config.hash_seed)
    schema_on = KeySchema(MODEL_ON, config.hash_algorithm.value, config.hash_seed)
    schema_cluster = KeySchema(MODEL_CLUSTER, config.hash_algorithm.value, config.hash_seed)
    redis_server = RedisServer(args.redis_server)
    servers: dict[str, Server] = {}
    logs: dict[str, str] = {}
    results = Results()
    try:
        servers["off"] = Server("off", plan.step_pool_blocks)
        servers["on"] = Server("on", plan.step_pool_blocks, redis_server.url, MODEL_ON)
        for i in range(NUM_CLUSTER_REPLICAS):
            servers[f"c{i}"] = Server(f"c{i}", CLUSTER_POOL_BLOCKS, redis_server.url, MODEL_CLUSTER)
        for server in servers.values():
            server.wait_ready()
        poller = redis_server.client()
        reader = ClusterIndex(redis_server.client(), schema_cluster)
        replicas = [servers[f"c{i}"] for i in range(NUM_CLUSTER_REPLICAS)]
        setup = prepare_cluster(replicas, poller, hasher, schema_cluster)
        print(f"started redis-server and {len(servers)} servers in {(now_ns() - started) / 1e9:.1f} s",
              file=sys.stderr, flush=True)
        for index in range(plan.rounds):
            round_start = now_ns()
            section_step(index, plan, servers, redis_server.proc.pid, poller, schema_on, hasher, results)
            section_lag(index, plan, servers["on"], poller, hasher, schema_on, results)
            section_cluster(index, plan, servers["c0"], setup, reader, hasher, results)
            s = results.get_series
            print(f"round {index + 1}/{plan.rounds}: {(now_ns() - round_start) / 1e9:.1f} s; Step p50 off "
                  f"{s('off:step').p50[-1]:.2f} on {s('on:step').p50[-1]:.2f} ms (x{s('ratio:step_p50').p50[-1]:.3f}); "
                  f"lag p50/p99 {s('lag:return').p50[-1]:.2f}/{s('lag:return').p99[-1]:.2f} ms; cluster "
                  f"FindCacheHit p50 {s('cluster:rpc').p50[-1]:.2f} ms", file=sys.stderr, flush=True)
        poller.close()
    finally:
        for name, server in servers.items():
            logs[name] = server.stop()
        redis_server.stop()
    for name, text in logs.items():
        if text.strip():
            print(f"server {name} logged:\n{text}", file=sys.stderr)

    sims: list[SimResult] = []
    bound = (0, 1)
    if not args.skip_sim:
        records = load_trace(args.trace, limit=plan.sim_requests)
        for pool_blocks in plan.sim_pool_blocks:
            for policy, _ in POLICIES:
                sims.append(simulate(policy, pool_blocks, records, plan))
                print(f"simulation {policy}, {pool_blocks} blocks: {sims[-1].wall_s:.1f} s, hit rate "
                      f"{sims[-1].hit_rate:.1%}", file=sys.stderr, flush=True)
        bound = unbounded_hits(records, plan)
    command = shlex.join(["python", *sys.argv])
    load = (load_start, os.getloadavg()[0])
    lines = render(results, plan, command, (now_ns() - started) / 1e9, redis_server, servers, load)
    if sims:
        lines += render_sim(sims, bound, plan, args.trace)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
