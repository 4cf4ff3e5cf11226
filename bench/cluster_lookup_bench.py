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

    python bench/cluster_lookup_bench.py            # full run
    python bench/cluster_lookup_bench.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Sequence

import redis

from mirror_report import Results, RunStart, header, row
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
from kv_manager_service.mirror.lookup import ClusterIndex
from kv_manager_service.mirror.schema import KeySchema
from kvcache.v1 import kv_manager_pb2 as pb

CLUSTER_PROMPT_LEN = 8192
CLUSTER_POOL_BLOCKS = 4096  # per cluster replica: no eviction of the 512 blocks of the prompt
NUM_CLUSTER_REPLICAS = 4
MODEL_CLUSTER = "mirror-bench-cluster"


@dataclass
class LookupPlan:
    rounds: int
    lookup_samples: int  # per series and round


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lookup-samples", type=int, default=None, help="calls per lookup series and round (default 200, quick 30)")


def plan_from_args(args: argparse.Namespace) -> LookupPlan:
    return LookupPlan(rounds=num_rounds(args), lookup_samples=args.lookup_samples or (30 if args.quick else 200))


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


def replicas_of(servers: dict[str, MirrorServer]) -> list[MirrorServer]:
    return [servers[f"c{i}"] for i in range(NUM_CLUSTER_REPLICAS)]


def progress(results: Results) -> str:
    """This round's headline figure, for the progress line."""
    return f"cluster FindCacheHit p50 {results.get_series('cluster:rpc').p50[-1]:.2f} ms"


# -- report ------------------------------------------------------------------------


def servers_text() -> str:
    return f"4 cluster replicas c0..c3 (`--num-blocks {CLUSTER_POOL_BLOCKS} --model-name {MODEL_CLUSTER}`)"


def each_round_text(plan: LookupPlan) -> str:
    return f"{plan.lookup_samples} calls per lookup series"


def rows(results: Results) -> list[str]:
    """The table rows of section 3."""
    s = results.get_series
    return [
        row("3", f"FindCacheHit cluster=true, {CLUSTER_PROMPT_LEN}-token prompt, 4 replicas", s("cluster:rpc"), "ms",
            note="on c0; answer checked (2048/4096/6144/8176 tokens)"),
        row("3", "FindCacheHit cluster=false (local only), same prompt", s("cluster:local"), "ms",
            note="hash + local lookup + gRPC"),
        row("3", "  cluster=true minus cluster=false, p50", s("cluster:over_local"), "ms", note="the mirror read"),
        row("3", f"ClusterIndex.lookup alone, {CLUSTER_PROMPT_LEN // BLOCK_SIZE - 1} hashes, in the bench process",
            s("cluster:lookup"), "ms", note="one pipelined round trip, precomputed hashes"),
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
    with Rig(args.redis_server) as rig:
        rig.start_servers(server_commands(rig.redis_url))
        poller = rig.redis_client()
        setup = prepare_cluster(replicas_of(rig.servers), poller, hasher, server_schema(MODEL_CLUSTER))
        poller.close()
        reader = ClusterIndex(rig.redis_client(), server_schema(MODEL_CLUSTER))

        def one_round(index: int) -> list[str]:
            section_cluster(index, plan, rig.servers["c0"], setup, reader, hasher, results)
            return [progress(results)]

        run_rounds(plan.rounds, one_round)
    lines = header(start, rig.redis_version, [servers_text()], plan.rounds, [each_round_text(plan)])
    print("\n".join(lines + rows(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
