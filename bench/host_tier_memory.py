"""The host tier's footprint: bytes per host block, the start of a large tier, and what it adds to a Step.

Every figure comes from fresh child processes that import the core of a
source tree: this one, and with --baseline DIR another checkout as well (a
`git worktree` of an older commit, its C extensions built), the two trees
alternating round by round. Only the core's public API is used, so both
trees run the same code here.

1. bytes per host block, counted by tracemalloc (every allocation of
   Python's allocator: arrays, dicts, objects, the hash bytes a tier keeps
   alive): a manager with N host blocks less the same manager without a
   tier, both empty; then both after the same workload, which fills every
   host block with a cached hash (a small device pool evicts through the
   tier; every copy acknowledged, no events), again the difference over N.
2. start: the wall time of `KVCacheManager(...)` with 10^7 host blocks (a
   device pool of 1,000 blocks), and the growth of the child's resident
   memory (RSS) over it; median over the rounds.
3. the tier's bookkeeping in a Step, two managers in one child, alternating
   series: the 256-request decode Step (1,000-token prompts, one
   DecodeBatch per Step, as core_bench.py's decode row) without a tier and
   with an empty tier of 10^5 blocks; and an evicting Step plus its ack: an
   admission of a 64-block prompt that evicts 64 cached blocks, without a
   tier and with a full tier of 4,096 blocks (so each offload also evicts a
   host hash), reported per evicted block as the difference of the two.
   Timings are medians of per-series medians.

    python bench/host_tier_memory.py                               # this tree, about two minutes
    python bench/host_tier_memory.py --baseline ../base --rounds 5  # before and after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from bench_stats import alternating, command_line, load_averages, print_round

ROOT = Path(__file__).resolve().parents[1]
NUM_START_BLOCKS = 10**7

CHILD = r"""
import gc, json, statistics, sys, time, tracemalloc
from kv_manager_service.core import AllocateOp, DecodeBatch, FreeOp, KVCacheConfig, KVCacheManager

def manager(num_blocks, num_host_blocks):
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, num_host_blocks=num_host_blocks))

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

def admit_and_free(m, request_id, first_token, num_tokens):
    tokens = range(first_token, first_token + num_tokens)
    m.ack(m.step([AllocateOp(request_id, tokens, num_tokens)]).step_id)
    m.ack(m.step([FreeOp([request_id])]).step_id)

def footprint(num_host_blocks):
    # 1,025 device blocks, requests of 64 blocks: every request evicts the one before it.
    device, tokens = 1025, 64 * 16
    def fill(m):
        for i in range((num_host_blocks + device) // 64 + 2):
            admit_and_free(m, f"r{i}", i * tokens, tokens)
    tracemalloc.start()
    gc.collect(); t0 = tracemalloc.get_traced_memory()[0]
    bare = manager(device, 0)
    gc.collect(); t1 = tracemalloc.get_traced_memory()[0]
    tiered = manager(device, num_host_blocks)
    gc.collect(); t2 = tracemalloc.get_traced_memory()[0]
    fill(bare)
    gc.collect(); t3 = tracemalloc.get_traced_memory()[0]
    fill(tiered)
    gc.collect(); t4 = tracemalloc.get_traced_memory()[0]
    stats = tiered.host_tier_stats()
    assert stats.num_offloaded_blocks >= num_host_blocks and stats.num_dropped_offloads == 0, stats
    assert stats.num_free_host_blocks == num_host_blocks and stats.num_pending_tier_copies == 0, stats
    empty = ((t2 - t1) - (t1 - t0)) / num_host_blocks
    full = ((t2 - t1 + t4 - t3) - (t1 - t0 + t3 - t2)) / num_host_blocks
    return {"empty_bytes_per_block": empty, "full_bytes_per_block": full}

def start(num_host_blocks):
    gc.collect()
    before, started = rss(), time.perf_counter()
    m = manager(1000, num_host_blocks)
    seconds = time.perf_counter() - started
    return {"start_s": seconds, "start_rss_bytes_per_block": (rss() - before) / num_host_blocks}

def series(step, num_steps):
    times = []
    for i in range(num_steps):
        started = time.perf_counter_ns()
        step(i)
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times)

def decode(num_series, num_steps):
    num_requests, prompt_len = 256, 1000
    max_len = prompt_len + 2 * num_series * num_steps + 1
    managers = {"none": manager(num_requests * (max_len // 16 + 1) + 64, 0)}
    managers["tier"] = manager(num_requests * (max_len // 16 + 1) + 64, 100_000)
    request_ids = [f"d{i}" for i in range(num_requests)]
    for m in managers.values():
        for i, request_id in enumerate(request_ids):
            prompt = [(i * 104729 + j) % 50_000 for j in range(prompt_len)]
            m.step([AllocateOp(request_id, prompt, prompt_len)])
    medians = {name: [] for name in managers}
    for k in range(num_series):
        for name in (("none", "tier") if k % 2 == 0 else ("tier", "none")):
            m = managers[name]
            def step(i):
                m.step((), decode=DecodeBatch(request_ids, [(7919 * r + i) % 50_000 for r in range(num_requests)]))
            medians[name].append(series(step, num_steps))
    return {f"decode_step_us_{name}": statistics.median(v) / 1e3 for name, v in medians.items()}

def evict(num_series, num_steps):
    tokens = 64 * 16
    managers = {"none": manager(2 * 64 + 1, 0), "tier": manager(2 * 64 + 1, 4096)}
    counter = {name: 0 for name in managers}
    def step_of(name):
        m = managers[name]
        def step(i):
            n = counter[name] = counter[name] + 1
            result = m.step([AllocateOp(f"e{n}", range(n * tokens, (n + 1) * tokens), tokens)])
            m.ack(result.step_id)
            m.step([FreeOp([f"e{n}"])])
        return step
    for name in managers:  # fill the tier, so that each offload evicts a host hash
        series(step_of(name), 4096 // 64 + 2)
    medians = {name: [] for name in managers}
    for k in range(num_series):
        for name in (("none", "tier") if k % 2 == 0 else ("tier", "none")):
            medians[name].append(series(step_of(name), num_steps))
    stats = managers["tier"].host_tier_stats()
    assert stats.num_host_evictions > 0 and stats.num_dropped_offloads == 0, stats
    none, tier = (statistics.median(medians[name]) / 1e3 for name in ("none", "tier"))
    return {"evict_step_us_none": none, "evict_step_us_tier": tier, "offload_us": (tier - none) / 64}

mode, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
print(json.dumps({"footprint": footprint, "start": start, "decode": decode, "evict": evict}[mode](*args)))
"""


def child(tree: Path, mode: str, *args: int) -> dict[str, float]:
    """Run one measurement in a fresh process importing the core from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, *map(str, args)],
        capture_output=True, text=True, env=env, cwd=tree, timeout=900,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{mode} in {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout)


ROWS = [
    ("empty_bytes_per_block", "bytes per host block, empty tier (tracemalloc)", "{:.1f}"),
    ("full_bytes_per_block", "bytes per host block, every host block cached (tracemalloc)", "{:.1f}"),
    ("start_s", "start of a manager with 10^7 host blocks (s)", "{:.3f}"),
    ("start_rss_bytes_per_block", "RSS growth over that start, per host block (bytes)", "{:.1f}"),
    ("decode_step_us_none", "256-request decode Step, no tier (us)", "{:.0f}"),
    ("decode_step_us_tier", "256-request decode Step, empty tier of 10^5 blocks (us)", "{:.0f}"),
    ("evict_step_us_none", "Step evicting 64 blocks, + ack, no tier (us)", "{:.0f}"),
    ("evict_step_us_tier", "Step evicting 64 blocks, + ack, full tier of 4,096 blocks (us)", "{:.0f}"),
    ("offload_us", "the tier's bookkeeping per evicted block (us)", "{:.2f}"),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another source tree to measure the same way (the 'before')")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of start and Step timings (default %(default)s)")
    parser.add_argument("--host-blocks", type=int, default=200_000,
                        help="the tier filled for the footprint (default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--series", type=int, default=6, help="series per manager in one Step child (default %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=50, help="Steps per series (default %(default)s)")
    args = parser.parse_args(argv)
    trees = {"after": ROOT}
    if args.baseline is not None:
        trees = {"before": args.baseline.resolve(), **trees}
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    for name, tree in trees.items():
        print(f"footprint of {name} ({args.host_blocks:,} host blocks)", file=sys.stderr, flush=True)
        for key, value in child(tree, "footprint", args.host_blocks).items():
            figures[name][key] = [value]
    for round_index in range(args.rounds):
        for name in alternating(list(trees), round_index):
            step_args = (args.series, args.steps)
            for mode, mode_args in (("start", (NUM_START_BLOCKS,)), ("decode", step_args), ("evict", step_args)):
                for key, value in child(trees[name], mode, *mode_args).items():
                    figures[name].setdefault(key, []).append(value)
        print_round(round_index, args.rounds, ", ".join(
            f"{name}: start {figures[name]['start_s'][-1]:.2f} s, "
            f"decode {figures[name]['decode_step_us_tier'][-1]:.0f} us"
            for name in trees
        ))  # fmt: skip

    print(f"`{command_line(__file__, argv)}`; load averages {load_averages()}; medians over {args.rounds} rounds\n")
    print("| figure | " + " | ".join(trees) + (" | after / before |" if len(trees) == 2 else " |"))
    print("|---|" + "---:|" * (len(trees) + (len(trees) == 2)))
    for key, label, form in ROWS:
        values = [statistics.median(figures[name][key]) for name in trees]
        ratio = ""
        if len(values) == 2:
            ratio = f" | {values[1] / values[0]:.3f}" if values[0] else " | "
        print(f"| {label} | " + " | ".join(form.format(v) for v in values) + ratio + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
