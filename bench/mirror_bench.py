"""Benchmarks of the Redis mirror of the prefix index, against real server processes.

Starts its own `redis-server` on a free port (no persistence; with
`--topology cluster` a Redis Cluster of 3 masters instead) and six
`python -m kv_manager_service.cli serve --port 0` processes at once, as a
user would: "off" (no mirror), "on" (`--redis-url`), and four mirrored
cluster replicas c0..c3 under their own `--model-name`. The client stays in
the bench process. Each section is a benchmark of its own, described where
it lives:

1. Step latency, mirror on vs off, and 2. mirror lag:
   `bench/mirror_writer_bench.py`.
3. Cluster lookup of an 8192-token prompt across 4 replicas, and 3b. how
   a lookup grows with 4 to 64 replicas and 1k to 32k-token prompts:
   `bench/cluster_lookup_bench.py`.
4. A routing simulation on the Mooncake synthetic trace with 4, 16 and 64
   replicas, in-process (no Redis): `bench/routing_sim.py` (its flags, e.g.
   `--sim-replicas 4` for a shorter run).

Sections 1 to 3 run every round, so they see the same moments of a noisy
machine (section 1 alternates which server goes first, chunk by chunk, and
section 3 the order of its series); each figure is the median over rounds of
the per-round figure; ratios are per round, then the median. The spread
shows the lowest and highest round's p50. Section 4 runs last.

    python bench/mirror_bench.py            # full run, about 1.5 minutes on 2 cores
    python bench/mirror_bench.py --quick    # smoke run
    python bench/mirror_bench.py --topology cluster   # against a Redis Cluster of 3 masters
"""

from __future__ import annotations

import argparse
from typing import Sequence

import cluster_lookup_bench as lookup
import mirror_writer_bench as writer
import routing_sim
from mirror_report import Results, RunStart, header
from mirror_rig import Rig, add_redis_argument, add_run_arguments, run_rounds, server_hasher, server_schema
from kv_manager_service.mirror.lookup import ClusterIndex


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    writer.add_arguments(parser)
    lookup.add_arguments(parser)
    add_redis_argument(parser)
    sim = routing_sim.add_arguments(parser)
    sim.add_argument("--skip-sim", action="store_true", help="skip section 4")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    writer_plan = writer.plan_from_args(args, parser)
    lookup_plan = lookup.plan_from_args(args)
    sim_plan = routing_sim.plan_from_args(args)
    start = RunStart.now()
    hasher = server_hasher()
    schema_on, schema_cluster = server_schema(writer.MODEL_ON), server_schema(lookup.MODEL_CLUSTER)
    results = Results()
    with Rig(args.redis_server, args.topology) as rig:
        rig.start_servers(writer.server_commands(writer_plan, rig.redis_url) | lookup.server_commands(rig.redis_url))
        poller = rig.redis_client()
        reader = ClusterIndex(rig.redis_client(), schema_cluster)
        setup = lookup.prepare_cluster(lookup.replicas_of(rig.servers), poller, hasher, schema_cluster)
        compared_class = lookup.load_lookup(lookup_plan.compare_lookup) if lookup_plan.compare_lookup else None
        cases = lookup.prepare_scaling(poller, lookup_plan) if "scaling" in lookup_plan.sections else []
        node_clients = rig.node_clients()

        def make_index(index_class, schema):
            return index_class(rig.redis_client(), schema)

        def one_round(index: int) -> list[str]:
            writer.run_round(index, writer_plan, rig.servers, rig.redis_pids, poller, schema_on, hasher, results)
            lookup.section_cluster(index, lookup_plan, rig.servers["c0"], setup, reader, hasher, results)
            if cases:
                lookup.section_scaling(index, lookup_plan, cases, make_index, node_clients, results, compared_class)
            return [writer.progress(results), lookup.progress(results)]

        run_rounds(writer_plan.rounds, one_round)
        poller.close()

    sims: list[routing_sim.SimResult] = []
    bound = (0, 1)
    if not args.skip_sim:
        sims, bound = routing_sim.run_simulations(sim_plan, args.trace)
    servers = [writer.servers_text(rig.servers, rig.topology), lookup.servers_text(rig.topology)]
    lines = header(start, rig.redis_version, servers, writer_plan.rounds,
                   [writer.each_round_text(writer_plan), lookup.each_round_text(lookup_plan)])
    lines += writer.rows(results, writer_plan) + lookup.rows(results, rig.topology)
    if cases:
        lines += lookup.scaling_rows(lookup_plan, rig.topology, results)
    if sims:
        lines += routing_sim.render_sim(sims, bound, sim_plan, args.trace)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
