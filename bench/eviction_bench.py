"""The core's cost of each eviction policy: the same replay under lru and frequency, round by round, with and
without expected requests.

Replays the first N requests of the Mooncake trace through the core
(`kv_tooling.replay`, `--arrivals asap`: no clock waits) in a pool small
enough to evict, once per policy per round, alternating, and reports the
median wall time per scheduler step and the median ratio to lru within a
round. The replay's scheduler runs in the same process, so the figures are an
upper bound on the core's own share; what differs between the rows is the
policy, and whether the scheduler tells the manager its waiting requests
(expect ops, `SchedulerConfig.expect_waiting`; every request waits from the
start). Prefill tokens computed are the same every round (the replay is
deterministic) and are reported beside.

    python bench/eviction_bench.py                 # 400 requests, 20,000 blocks, 5 rounds
    python bench/eviction_bench.py --quick         # smoke run, seconds
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_stats import alternating, command_line, load_averages, per_round_ratios, print_round, ratio_summary  # noqa: E402
from kv_manager_service.core import EvictionPolicy, GroupKind, GroupSpec, KVCacheConfig, KVCacheManager  # noqa: E402
from kv_tooling.replay import ReplayConfig, replay  # noqa: E402
from kv_tooling.workload import DEFAULT_TRACE, TokenExpander, load_trace  # noqa: E402


VARIANTS = {
    "lru": (EvictionPolicy.LRU, False),
    "lru + expect": (EvictionPolicy.LRU, True),
    "frequency": (EvictionPolicy.FREQUENCY, False),
    "frequency + expect": (EvictionPolicy.FREQUENCY, True),
}


def one_round(variant: str, records, num_blocks: int) -> tuple[float, int, int]:
    """(microseconds per step, steps, prefill tokens computed) of one replay of `variant`."""
    policy, expect_waiting = VARIANTS[variant]
    config = KVCacheConfig(num_blocks, groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16),), eviction_policy=policy)
    settings = ReplayConfig(arrivals="asap", expect_waiting=expect_waiting)
    result = replay(KVCacheManager(config), records, TokenExpander(), settings)
    return result.wall_s / result.num_steps * 1e6, result.num_steps, result.num_prefill_tokens_computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=400, help="trace requests per replay (default %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=20_000, help="pool blocks (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each running every policy (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="40 requests, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds = 40, 2
    records = load_trace(args.trace, limit=args.requests)
    variants = list(VARIANTS)
    per_step: dict[str, list[float]] = {v: [] for v in variants}
    outcome: dict[str, tuple[int, int]] = {}
    for round_index in range(args.rounds):
        for variant in alternating(variants, round_index):
            us, steps, computed = one_round(variant, records, args.num_blocks)
            per_step[variant].append(us)
            outcome[variant] = (steps, computed)
        print_round(round_index, args.rounds, ", ".join(f"{v} {per_step[v][-1]:.0f} us/step" for v in variants))
    print(f"\n`{command_line(__file__, None)}`: Python {platform.python_version()}, {platform.machine()}, "
          f"load averages {load_averages()}\n")  # fmt: skip
    print("| policy | wall per step (median of rounds) | rounds | / lru (per round) | steps | prefill tokens computed |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant in variants:
        values = per_step[variant]
        steps, computed = outcome[variant]
        ratios = ratio_summary(per_round_ratios(values, per_step["lru"]))
        print(f"| {variant} | {statistics.median(values):,.0f} us | {min(values):,.0f}-{max(values):,.0f} us | "
              f"{ratios} | {steps:,} | {computed:,} |")  # fmt: skip


if __name__ == "__main__":
    main()
