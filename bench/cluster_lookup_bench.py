"""Cluster lookup across 4 mirrored replicas, against real servers and a real Redis.

Starts its own `redis-server` on a free port (no persistence) and four
mirrored `python -m kv_manager_service.cli serve --port 0` replicas c0..c3
under their own `--model-name`, as a user would; the client stays in the
bench process. c0..c3 cache the first 2048, 4096, 6144 and 8192 tokens of
an 8192-token prompt. Measured every round (section 3 of the mirror
benchmarks): FindCacheHit with cluster=true on c0 (the answer is checked:
2048, 4096, 6144 and 8176 tokens), the same with cluster=false (the local
floor), and ClusterIndex.lookup alone in the bench process over the 511
precomputed hashes (its own Redis connection), plus hashing the prompt
in-process. Rounds alternate the order of the series; each figure is the
median over rounds of the per-round figure. `bench/mirror_bench.py` runs
this section together with the others.

Section 3b, how a lookup grows: ClusterIndex.lookup in the bench process
against entries and leases written straight into Redis (no servers), for
4, 16 and 64 replicas and 1k, 8k and 32k-token prompts, in two shapes:
"staircase" (replica i of R holds the first (i+1)/R of the prompt, as c0..c3
do) and "one holder" (one replica holds the whole prompt, the others only
its first 8 blocks, a shared system prompt). Also the Redis commands one
lookup runs and the Redis CPU they take (INFO commandstats, every node). With `--compare-lookup PATH`
(the lookup.py of another checkout) both lookups run on the same entries,
call by call alternating, so an A/B comparison sees the same moments of a
noisy machine.

`--topology cluster` runs both sections on a Redis Cluster of 3 masters
instead of one redis-server.

    python bench/cluster_lookup_bench.py            # full run
    python bench/cluster_lookup_bench.py --quick    # smoke run
    python bench/cluster_lookup_bench.py --topology cluster --sections scaling --compare-lookup OTHER/lookup.py
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import redis

from bench_stats import alternating, fmt, med, row
from mirror_report import Results, RunStart, header
from mirror_rig import (
    BLOCK_SIZE,
    OK,
    MirrorServer,
    Rig,
    add_redis_argument,
    add_run_arguments,
    now_ns,
    num_rounds,
    random_tokens,
    run_rounds,
    server_argv,
    server_hasher,
    server_schema,
    wait_visible,
)
from kv_manager_service.core import BlockHasher
from kv_manager_service.mirror import bulk
from kv_manager_service.mirror.lookup import ClusterIndex
from kv_manager_service.mirror.schema import KeySchema, Lease
from kvcache.v1 import kv_manager_pb2 as pb

CLUSTER_PROMPT_LEN = 8192
CLUSTER_POOL_BLOCKS = 4096  # per cluster replica: no eviction of the 512 blocks of the prompt
NUM_CLUSTER_REPLICAS = 4
MODEL_CLUSTER = "mirror-bench-cluster"


SECTIONS = ("rpc", "scaling")
SCALE_SHAPES = ("staircase", "one holder")
SHARED_PREFIX_BLOCKS = 8  # "one holder": what the other replicas hold of the prompt
WORK_SAMPLES = 5  # lookups per case, lookup and round whose Redis work is counted (INFO commandstats)


@dataclass
class LookupPlan:
    rounds: int
    lookup_samples: int  # per series and round
    sections: tuple[str, ...] = SECTIONS
    scale_replicas: tuple[int, ...] = (4, 16, 64)
    scale_prompt_tokens: tuple[int, ...] = (1024, 8192, 32768)
    scale_samples: int = 30  # per case, lookup and round
    compare_lookup: Path | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lookup-samples", type=int, default=None, help="calls per lookup series and round (default 200, quick 30)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="which sections of the lookup benchmark: rpc (3), scaling (3b) (default %(default)s)")
    parser.add_argument("--scale-replicas", default="4,16,64", help="section 3b's replica counts (default %(default)s)")
    parser.add_argument("--scale-prompt-tokens", default="1024,8192,32768",
                        help="section 3b's prompt lengths in tokens (default %(default)s)")  # fmt: skip
    parser.add_argument("--scale-samples", type=int, default=None,
                        help="section 3b's calls per case, lookup and round (default 30, quick 8)")
    parser.add_argument("--compare-lookup", type=Path, default=None,
                        help="the mirror/lookup.py of another checkout: section 3b runs its ClusterIndex too, "
                             "call by call alternating with this one")  # fmt: skip


def plan_from_args(args: argparse.Namespace) -> LookupPlan:
    sections = tuple(args.sections.split(","))
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--sections: {sorted(unknown)} not among {', '.join(SECTIONS)}")
    return LookupPlan(
        rounds=num_rounds(args),
        lookup_samples=args.lookup_samples or (30 if args.quick else 200),
        sections=sections,
        scale_replicas=tuple(int(x) for x in args.scale_replicas.split(",")),
        scale_prompt_tokens=tuple(int(x) for x in args.scale_prompt_tokens.split(",")),
        scale_samples=args.scale_samples or (8 if args.quick else 30),
        compare_lookup=args.compare_lookup,
    )


def server_commands(redis_url: str) -> dict[str, list[str]]:
    """The cluster replicas c0..c3, mirrored into `redis_url` under their own model name."""
    return {
        f"c{i}": server_argv(f"c{i}", CLUSTER_POOL_BLOCKS, redis_url, MODEL_CLUSTER)
        for i in range(NUM_CLUSTER_REPLICAS)
    }


# -- section 3: cluster lookup ----------------------------------------------------------


@dataclass
class ClusterSetup:
    prompt: list[int]
    hashes: list[bytes]  # the 511 block hashes a lookup reads
    expected: dict[str, int]  # replica -> cached tokens FindCacheHit must report
    request: pb.FindCacheHitRequest
    local_request: pb.FindCacheHitRequest


def prepare_cluster(replicas: Sequence[MirrorServer], poller: redis.Redis, hasher: BlockHasher,
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


def section_cluster(index: int, plan: LookupPlan, entry: MirrorServer, setup: ClusterSetup, index_reader: ClusterIndex,
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


# -- section 3b: how a lookup grows with replicas and prompt length -----------------------


@dataclass
class ScaleCase:
    num_replicas: int
    num_blocks: int
    shape: str
    schema: KeySchema
    hashes: list[bytes]
    expected: dict[str, int]  # replica -> cached blocks

    @property
    def key(self) -> str:
        return f"scale:{self.num_replicas}:{self.num_blocks}:{self.shape}"


def held_blocks(shape: str, replica: int, num_replicas: int, num_blocks: int) -> int:
    if shape == "staircase":
        return -(-num_blocks * (replica + 1) // num_replicas)
    return num_blocks if replica == 0 else min(SHARED_PREFIX_BLOCKS, num_blocks)


def prepare_scaling(client, plan: LookupPlan) -> list[ScaleCase]:
    """Write each case's leases, replica set and block entries into Redis, as live writers would have."""
    cases = []
    for num_replicas in plan.scale_replicas:
        for num_tokens in plan.scale_prompt_tokens:
            num_blocks = num_tokens // BLOCK_SIZE
            hashes = [random.Random(f"{num_tokens}:{i}").randbytes(32) for i in range(num_blocks)]
            for shape in SCALE_SHAPES:
                schema = KeySchema(f"scale-{num_replicas}-{num_tokens}-{shape.replace(' ', '-')}", "sha256_cbor")
                keys, commands, expected = [], [], {}
                for replica in range(num_replicas):
                    replica_id, incarnation = f"r{replica:02d}", 1000 + replica
                    lease = Lease(replica_id, incarnation, "127.0.0.1:1", 0, 0.5, 100)
                    keys += [schema.lease(replica_id), schema.replicas]
                    commands += [bulk.pack_command("SET", schema.lease(replica_id), lease.to_json(), "PX", "3600000"),
                                 bulk.pack_command("SADD", schema.replicas, replica_id)]  # fmt: skip
                    held = held_blocks(shape, replica, num_replicas, num_blocks)
                    write = bulk.CommandTemplate(b"HSET", (replica_id.encode(), str(incarnation).encode()))
                    for block_hash in hashes[:held]:
                        key = schema.block(0, block_hash)
                        keys.append(key)
                        commands.append(write.pack(key))
                    expected[replica_id] = held
                bulk.execute(client, keys, commands)
                cases.append(ScaleCase(num_replicas, num_blocks, shape, schema, hashes, expected))
    return cases


def load_lookup(path: Path):
    """The ClusterIndex class of another checkout's mirror/lookup.py (its other imports come from this one)."""
    spec = importlib.util.spec_from_file_location("compared_lookup", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.ClusterIndex


def redis_work(node_clients: Sequence[redis.Redis]) -> tuple[int, int]:
    """Commands run so far and the Redis CPU they took (us), every node together (INFO commandstats),
    the INFO calls themselves left out."""
    calls = usec = 0
    for node in node_clients:
        for name, stats in node.info("commandstats").items():
            if name != "cmdstat_info":
                calls += stats["calls"]
                usec += stats["usec"]
    return calls, usec


def section_scaling(index: int, plan: LookupPlan, cases: Sequence[ScaleCase], make_index: Callable,
                    node_clients: Sequence[redis.Redis], results: Results, compared_class=None) -> None:
    """Every case: `plan.scale_samples` lookups by each ClusterIndex, call by call alternating."""
    for case in cases:
        readers = {"new": make_index(ClusterIndex, case.schema)}
        if compared_class is not None:
            readers["base"] = make_index(compared_class, case.schema)
        for name, reader in readers.items():
            got = {p.replica_id: p.num_cached_blocks for p in reader.lookup(0, case.hashes)}
            assert got == case.expected, f"{name} lookup of {case.key}: {got} != {case.expected}"
            calls, usec = redis_work(node_clients)
            for _ in range(WORK_SAMPLES):
                reader.lookup(0, case.hashes)
            calls_after, usec_after = redis_work(node_clients)
            results.get_series(f"{case.key}:{name}:commands").add_value((calls_after - calls) / WORK_SAMPLES)
            results.get_series(f"{case.key}:{name}:redis_us").add_value((usec_after - usec) / WORK_SAMPLES)
        samples: dict[str, list[int]] = {name: [] for name in readers}
        order = alternating(list(readers), index)
        for _ in range(plan.scale_samples):
            for name in order:
                start = now_ns()
                readers[name].lookup(0, case.hashes)
                samples[name].append(now_ns() - start)
        for name, values in samples.items():
            results.get_series(f"{case.key}:{name}").add_samples(values)
        for reader in readers.values():
            reader.client.close()


def work_note(s: Callable, key: str) -> str:
    return (f"{fmt(med(s(f'{key}:commands')))} Redis commands, {fmt(med(s(f'{key}:redis_us')))} us of Redis CPU "
            "per lookup")


def scaling_rows(plan: LookupPlan, topology: str, results: Results) -> list[str]:
    """The table rows of section 3b."""
    s = results.get_series
    lines = []
    compared = plan.compare_lookup is not None
    for num_replicas in plan.scale_replicas:
        for num_tokens in plan.scale_prompt_tokens:
            for shape in SCALE_SHAPES:
                key = f"scale:{num_replicas}:{num_tokens // BLOCK_SIZE}:{shape}"
                what = f"ClusterIndex.lookup, {topology}, {num_replicas} replicas, {num_tokens}-token prompt, {shape}"
                lines.append(row("3b", what, s(f"{key}:new"), "ms", note=work_note(s, f"{key}:new")))
                if compared:
                    lines.append(row("3b", "  the same, compared lookup (--compare-lookup)", s(f"{key}:base"), "ms",
                                     note=work_note(s, f"{key}:base")))
    return lines


def replicas_of(servers: dict[str, MirrorServer]) -> list[MirrorServer]:
    return [servers[f"c{i}"] for i in range(NUM_CLUSTER_REPLICAS)]


def progress(results: Results) -> str:
    """This round's headline figure, for the progress line."""
    return f"cluster FindCacheHit p50 {results.get_series('cluster:rpc').p50[-1]:.2f} ms"


# -- report ------------------------------------------------------------------------


def servers_text(topology: str = "single", with_replicas: bool = True) -> str:
    redis_text = "one redis-server" if topology == "single" else "a Redis Cluster of 3 masters"
    if not with_replicas:
        return f"none (section 3b writes its entries straight into {redis_text})"
    return (f"4 cluster replicas c0..c3 (`--num-blocks {CLUSTER_POOL_BLOCKS} --model-name {MODEL_CLUSTER}`), "
            f"mirrored into {redis_text}")  # fmt: skip


def each_round_text(plan: LookupPlan) -> str:
    parts = []
    if "rpc" in plan.sections:
        parts.append(f"{plan.lookup_samples} calls per lookup series")
    if "scaling" in plan.sections:
        parts.append(f"{plan.scale_samples} lookups per scaling case and lookup")
    return " and ".join(parts)


def rows(results: Results, topology: str = "single") -> list[str]:
    """The table rows of section 3."""
    s = results.get_series
    return [
        row("3", f"FindCacheHit cluster=true, {CLUSTER_PROMPT_LEN}-token prompt, 4 replicas, {topology} Redis",
            s("cluster:rpc"), "ms",
            note="on c0; answer checked (2048/4096/6144/8176 tokens)"),
        row("3", "FindCacheHit cluster=false (local only), same prompt", s("cluster:local"), "ms",
            note="hash + local lookup + gRPC"),
        row("3", "  cluster=true minus cluster=false, p50", s("cluster:over_local"), "ms", note="the mirror read"),
        row("3", f"ClusterIndex.lookup alone, {CLUSTER_PROMPT_LEN // BLOCK_SIZE - 1} hashes, in the bench process",
            s("cluster:lookup"), "ms", note="round trips in growing chunks (mirror.bulk), precomputed hashes"),
        row("3", f"  hashing the {CLUSTER_PROMPT_LEN}-token prompt in-process (sha256_cbor)", s("cluster:hash"), "ms"),
    ]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    add_arguments(parser)
    add_redis_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    plan = plan_from_args(args)
    start = RunStart.now()
    hasher = server_hasher()
    results = Results()
    compared_class = load_lookup(plan.compare_lookup) if plan.compare_lookup else None
    with Rig(args.redis_server, args.topology) as rig:
        setup = None
        if "rpc" in plan.sections:
            rig.start_servers(server_commands(rig.redis_url))
            poller = rig.redis_client()
            setup = prepare_cluster(replicas_of(rig.servers), poller, hasher, server_schema(MODEL_CLUSTER))
            poller.close()
            reader = ClusterIndex(rig.redis_client(), server_schema(MODEL_CLUSTER))
        cases: list[ScaleCase] = []
        node_clients = rig.node_clients()
        if "scaling" in plan.sections:
            writer = rig.redis_client()
            cases = prepare_scaling(writer, plan)
            writer.close()

        def make_index(index_class, schema: KeySchema):
            return index_class(rig.redis_client(), schema)

        def one_round(index: int) -> list[str]:
            figures = []
            if setup is not None:
                section_cluster(index, plan, rig.servers["c0"], setup, reader, hasher, results)
                figures.append(progress(results))
            if cases:
                section_scaling(index, plan, cases, make_index, node_clients, results, compared_class)
                figures.append(f"{len(cases)} scaling cases")
            return figures

        run_rounds(plan.rounds, one_round)
    servers = [servers_text(rig.topology, with_replicas=setup is not None)]
    lines = header(start, rig.redis_version, servers, plan.rounds, [each_round_text(plan)])
    if setup is not None:
        lines += rows(results, rig.topology)
    if cases:
        lines += scaling_rows(plan, rig.topology, results)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
