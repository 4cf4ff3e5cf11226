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
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from bench_stats import Series, fmt
from build_ab_bench import decode_round, start
from rpc_bench import BLOCK_SIZE, PROMPT_LEN, Workload, admit_rpc, make_client

from kv_manager_service.client import KVManagerClient
from kvcache.v1 import kv_manager_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
NUM_REQUESTS = 256
TARGET_RATIO = 1.05
NO_TIER, TIER = "no tier", "empty tier"


def pool_blocks(rounds: int, warmup: int, steps: int) -> int:
    """A device pool that holds every request to the end of the run: no eviction, so nothing reaches the tier."""
    tokens_per_request = PROMPT_LEN + rounds * (warmup + steps) + BLOCK_SIZE
    return NUM_REQUESTS * (-(-tokens_per_request // BLOCK_SIZE) + 1) + 1024


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

    num_blocks = pool_blocks(args.rounds, args.warmup, args.steps)
    extra_args = {NO_TIER: (), TIER: ("--num-host-blocks", str(args.num_host_blocks))}
    series = {name: Series() for name in extra_args}
    cpu_ms: dict[str, list[float]] = {name: [] for name in extra_args}  # server CPU ms per Step, per round
    ratios: list[float] = []
    cpu_ratios: list[float] = []
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
                order = list(extra_args) if round_index % 2 == 0 else list(reversed(extra_args))
                p50 = {}
                for name in order:
                    samples, cpu_per_step = decode_round(clients[name], work, servers[name].pid, args.warmup, args.steps)
                    cpu_ms[name].append(cpu_per_step)
                    series[name].add_samples(samples)
                    p50[name] = statistics.median(samples) / 1e6
                ratios.append(p50[TIER] / p50[NO_TIER])
                cpu_ratios.append(cpu_ms[TIER][-1] / cpu_ms[NO_TIER][-1])
                print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"{name} {p50[name]:.2f} ms" for name in extra_args), file=sys.stderr, flush=True)  # fmt: skip
            stats = check_tier_empty(clients[TIER], args.num_host_blocks)
            for client in clients.values():
                client.close()
        finally:
            for server in servers.values():
                server.stop()

    command = "python bench/" + Path(__file__).name + " " + shlex.join(argv if argv is not None else sys.argv[1:])
    ratio = statistics.median(ratios)
    print(f"# Cost of an empty host tier: 256-request decode Step round trip (columnar), {args.rounds} alternating "
          f"rounds of {args.steps} Steps after {args.warmup} warm-up")  # fmt: skip
    print()
    print(f"Command: `{command.strip()}`; both servers `kv-manager serve --num-blocks {num_blocks:,}`, the tier one "
          f"with `--num-host-blocks {args.num_host_blocks:,}`; {os.cpu_count()} CPUs. The tier stayed empty: "
          f"{stats.num_offloaded_blocks} offloads, {stats.num_free_host_blocks:,} of {stats.num_host_blocks:,} host "
          "blocks free at the end.")  # fmt: skip
    print()
    print("| round | " + " | ".join(f"{name} p50 ms" for name in extra_args) + " | ratio tier / no tier |")
    print("|---:|" + "---:|" * (len(extra_args) + 1))
    for index, round_ratio in enumerate(ratios):
        print(f"| {index + 1} | " + " | ".join(fmt(series[name].p50[index]) for name in extra_args)
              + f" | {round_ratio:.3f} |")  # fmt: skip
    print()
    print("| server | p50 ms (median over rounds) | p50 spread | p99 ms | server CPU ms per Step |")
    print("|---|---:|---:|---:|---:|")
    for name in extra_args:
        s = series[name]
        print(f"| {name} | {fmt(statistics.median(s.p50))} | {fmt(min(s.p50))}-{fmt(max(s.p50))} | "
              f"{fmt(statistics.median(s.p99))} | {fmt(statistics.median(cpu_ms[name]))} |")  # fmt: skip
    print()
    verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
    print(f"ratio empty tier / no tier, p50 round trip, median of per-round ratios: {ratio:.3f} "
          f"(rounds {min(ratios):.3f}-{max(ratios):.3f}); target <= {TARGET_RATIO} ({verdict})")  # fmt: skip
    print(f"ratio empty tier / no tier, server CPU per Step, median of per-round ratios: "
          f"{statistics.median(cpu_ratios):.3f} (rounds {min(cpu_ratios):.3f}-{max(cpu_ratios):.3f})")  # fmt: skip
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
