"""The cost of an empty host tier: the 256-request decode Step round trip with and without one, in one run.

Starts two `kv-manager serve` processes from this tree with the same device
pool, one of them with `--num-host-blocks N` (default 100,000), admits the
same 256 requests of 1,000 tokens on each, then alternates rounds of
back-to-back columnar decode Steps (the request `rpc_bench.py` times as
"256-op Step"), switching the order every round. The pool is sized so that
the workload never evicts a block, so the tier stays empty: the run checks
this at the end with GetStats (no offloads, every host block free). It
reports each server's p50 per round, the medians over rounds, the server
process's CPU time per Step, and the median of the per-round ratios
(tier / no tier). Target: the ratio of p50s at most 1.05.

    python bench/tier_step_bench.py                 # 7 rounds of 200 Steps each, about a minute
    python bench/tier_step_bench.py --rounds 5 --steps 100
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from bench_stats import alternating, command_line, fmt, load_averages, per_round_ratios, print_round, ratio_summary
from build_ab_bench import NUM_REQUESTS, DecodeSeries, pool_blocks, start
from rpc_bench import BLOCK_SIZE, PROMPT_LEN, Workload, admit_rpc, make_client

from kv_manager_service.client import KVManagerClient
from kvcache.v1 import kv_manager_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.05
NO_TIER, TIER = "no tier", "empty tier"


def check_tier_empty(client: KVManagerClient, num_host_blocks: int) -> pb.GetStatsResponse:
    """The tier server's stats; SystemExit unless its tier has `num_host_blocks` blocks and none was ever used."""
    stats = client.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    used = (stats.num_offloaded_blocks, stats.num_onloaded_blocks, num_host_blocks - stats.num_free_host_blocks)
    if stats.num_host_blocks != num_host_blocks or any(used):
        raise SystemExit(
            f"the tier was not empty: num_host_blocks {stats.num_host_blocks} (expected {num_host_blocks}), "
            f"offloaded {used[0]}, onloaded {used[1]}, host blocks in use {used[2]}"
        )
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (default %(default)s, at least 5)")
    parser.add_argument("--steps", type=int, default=200, help="timed Steps per server and round (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed Steps before each series (default %(default)s)")
    parser.add_argument(
        "--num-host-blocks", type=int, default=100_000, help="the tier server's host tier (default %(default)s)"
    )
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "num_host_blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    # Every request is held to the end of the run: no eviction, so nothing reaches the tier.
    num_blocks = pool_blocks(PROMPT_LEN + args.rounds * (args.warmup + args.steps) + BLOCK_SIZE)
    extra_args = {NO_TIER: (), TIER: ("--num-host-blocks", str(args.num_host_blocks))}
    decode = {name: DecodeSeries() for name in extra_args}
    work = Workload("tier", NUM_REQUESTS, random.Random(0))
    with tempfile.TemporaryDirectory() as directory:
        servers = {
            name: start(ROOT, num_blocks, Path(directory) / f"{index}.log", extra)
            for index, (name, extra) in enumerate(extra_args.items())
        }
        try:
            clients = {name: make_client(server.address) for name, server in servers.items()}
            for client in clients.values():
                admit_rpc(client, work)
            for round_index in range(args.rounds):
                for name in alternating(list(extra_args), round_index):
                    decode[name].measure(clients[name], work, servers[name].pid, args.warmup, args.steps)
                print_round(round_index, args.rounds,
                            ", ".join(f"{name} {decode[name].round_trip.p50[-1]:.2f} ms" for name in extra_args))
            stats = check_tier_empty(clients[TIER], args.num_host_blocks)
            for client in clients.values():
                client.close()
        finally:
            for server in servers.values():
                server.stop()

    command = command_line(__file__, argv)
    ratios = per_round_ratios(decode[TIER].round_trip.p50, decode[NO_TIER].round_trip.p50)
    cpu_ratios = per_round_ratios(decode[TIER].cpu_ms, decode[NO_TIER].cpu_ms)
    print(f"# Cost of an empty host tier: 256-request decode Step round trip (columnar), {args.rounds} alternating "
          f"rounds of {args.steps} Steps after {args.warmup} warm-up")  # fmt: skip
    print()
    print(f"Command: `{command}`; both servers `kv-manager serve --num-blocks {num_blocks:,}`, the tier one "
          f"with `--num-host-blocks {args.num_host_blocks:,}`; {os.cpu_count()} CPUs. The tier stayed empty: "
          f"{stats.num_offloaded_blocks} offloads, {stats.num_free_host_blocks:,} of {stats.num_host_blocks:,} host "
          "blocks free at the end.")  # fmt: skip
    print()
    print("| round | " + " | ".join(f"{name} p50 ms" for name in extra_args) + " | ratio tier / no tier |")
    print("|---:|" + "---:|" * (len(extra_args) + 1))
    for index, round_ratio in enumerate(ratios):
        print(f"| {index + 1} | " + " | ".join(fmt(decode[name].round_trip.p50[index]) for name in extra_args)
              + f" | {round_ratio:.3f} |")  # fmt: skip
    print()
    print("| server | p50 ms (median over rounds) | p50 spread | p99 ms | server CPU ms per Step |")
    print("|---|---:|---:|---:|---:|")
    for name in extra_args:
        print(f"| {name} | {decode[name].cells()} |")
    print()
    verdict = "met" if statistics.median(ratios) <= TARGET_RATIO else "MISSED"
    print(f"ratio empty tier / no tier, p50 round trip, median of per-round ratios: {ratio_summary(ratios)}; "
          f"target <= {TARGET_RATIO} ({verdict})")
    if cpu_ratios:
        print(f"ratio empty tier / no tier, server CPU per Step, median of per-round ratios: {ratio_summary(cpu_ratios)}")
    print(f"load average at the end: {load_averages()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
