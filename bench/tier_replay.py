"""Prefix-hit rate with a host-memory tier, against a device pool as large as both, in one run.

Replays the first N Mooncake requests (the `kv-manager replay` defaults:
16-token blocks, token budget 8192, <= 256 running, scale 1) through three
in-process cores:

1. a device pool of 100,000 blocks alone;
2. the same device pool with a 700,000-block host tier (write-back on eviction);
3. a device pool of 800,000 blocks alone.

It prints each run's hit rate (split by tier for run 2), the ratio of run 2's
to run 3's (the issue's target: >= 95%), and the tier's copy volume per
generated token. Write-back's copies are counted by the core. Write-through's
offloads (every newly cached block copied to the host at once, as vLLM's
offloading connector does) are counted from run 2's own BlockStored events: a
stored hash is copied unless a host LRU of the same size, fed by every store,
still holds it. The device pool behaves the same under both policies, so that
count is the copy volume write-through would have had on this run; its onloads
are at least write-back's (its host holds a superset of recent blocks).

    python bench/tier_replay.py                  # 3993 requests, a few minutes
    python bench/tier_replay.py --requests 400   # a quick look
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path

from bench_stats import command_line, replay_progress_printer
from kv_tooling.replay import ReplayConfig, ReplayProgress, ReplayResult, replay
from kv_manager_service.core import BlockStored, GroupKind, GroupSpec, KVCacheConfig, KVCacheManager
from kv_manager_service.shared.events import Tier
from kv_tooling.workload import DEFAULT_TRACE, TokenExpander, load_trace

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16
TARGET_RATIO = 0.95


class WriteThroughCounter:
    """Counts the offloads write-through would make: stored hashes not on an LRU host of `num_host_blocks`."""

    def __init__(self, num_host_blocks: int) -> None:
        self.num_host_blocks = num_host_blocks
        self.host: OrderedDict[bytes, None] = OrderedDict()
        self.num_offloaded_blocks = 0

    def consume(self, manager: KVCacheManager) -> None:
        host = self.host
        for event in manager.take_events():
            if type(event) is not BlockStored or event.tier is not Tier.DEVICE:  # the device pool's stores only
                continue
            for block_hash in event.block_hashes:
                if block_hash in host:
                    host.move_to_end(block_hash)
                    continue
                self.num_offloaded_blocks += 1
                host[block_hash] = None
                if len(host) > self.num_host_blocks:
                    host.popitem(last=False)


def run(
    label: str, num_blocks: int, num_host_blocks: int, records: list, write_through: WriteThroughCounter | None
) -> ReplayResult:
    config = KVCacheConfig(
        num_blocks=num_blocks,
        groups=(GroupSpec(GroupKind.FULL_ATTENTION, BLOCK_SIZE),),
        num_host_blocks=num_host_blocks,
        enable_events=write_through is not None,
    )
    manager = KVCacheManager(config)
    print(f"[{label}] device {num_blocks:,} blocks, host {num_host_blocks:,} blocks", file=sys.stderr, flush=True)
    show = replay_progress_printer(label, len(records), manager, every_steps=500)

    def progress(p: ReplayProgress) -> None:
        if write_through is not None:
            write_through.consume(manager)  # drained every step: the queue never grows
        show(p)

    result = replay(manager, records, TokenExpander(), ReplayConfig(progress_every_steps=1), progress=progress)
    if write_through is not None:
        write_through.consume(manager)
    summary = f"[{label}] done in {result.wall_s:.1f} s: hit rate {result.prefix_hit_rate:.1%}"
    print(summary, file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=3993, help="replay the first N requests (default %(default)s)")
    parser.add_argument("--device-blocks", type=int, default=100_000)
    parser.add_argument("--host-blocks", type=int, default=700_000)
    args = parser.parse_args(argv)
    records = load_trace(args.trace, limit=args.requests)
    big = args.device_blocks + args.host_blocks
    write_through = WriteThroughCounter(args.host_blocks)
    device = run("device", args.device_blocks, 0, records, None)
    tier = run("device+host", args.device_blocks, args.host_blocks, records, write_through)
    large = run("large device", big, 0, records, None)

    generated = tier.num_output_tokens
    ratio = tier.prefix_hit_rate / large.prefix_hit_rate if large.prefix_hit_rate else 0.0
    print(f"\n## Host tier on the Mooncake trace ({len(records)} requests, block {BLOCK_SIZE})\n")
    print("| pool | prefix-hit rate | device hits | host hits | tokens hit of looked up |")
    print("|---|---:|---:|---:|---:|")
    for name, result in (
        (f"device {args.device_blocks:,}", device),
        (f"device {args.device_blocks:,} + host {args.host_blocks:,}", tier),
        (f"device {big:,}", large),
    ):
        print(
            f"| {name} | {result.prefix_hit_rate:.1%} | {result.device_hit_rate:.1%} | {result.host_hit_rate:.1%} "
            f"| {result.prefix_cache_hits:,} of {result.prefix_cache_queries:,} |"
        )
    verdict = "met" if ratio >= TARGET_RATIO else "NOT met"
    print(f"\ntier / large device: {ratio:.1%} of the large pool's hit rate (target >= {TARGET_RATIO:.0%}: {verdict})")
    if device.prefix_hit_rate:
        print(f"tier / device alone: {tier.prefix_hit_rate / device.prefix_hit_rate:.2f}x")
    print(f"\nCopy volume over {generated:,} generated tokens (blocks of {BLOCK_SIZE} tokens):\n")
    print("| policy | offloaded blocks | per generated token | onloaded blocks | per generated token |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| write-back on eviction (built) | {tier.num_offloaded_blocks:,} "
        f"| {tier.num_offloaded_blocks / generated:.2f} "
        f"| {tier.num_onloaded_blocks:,} | {tier.num_onloaded_blocks / generated:.2f} |"
    )
    wt = write_through.num_offloaded_blocks
    print(
        f"| write-through (counted from the same run's stores) | {wt:,} | {wt / generated:.2f} "
        f"| >= {tier.num_onloaded_blocks:,} | >= {tier.num_onloaded_blocks / generated:.2f} |"
    )
    print(
        f"\nhost evictions {tier.num_host_evictions:,}, offloads dropped (every host block pinned) "
        f"{tier.num_dropped_offloads:,}"
    )
    print(f"\ncommand: {command_line(__file__, argv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
