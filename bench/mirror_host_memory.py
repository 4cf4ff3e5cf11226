"""What the mirror's publisher holds for a full host tier, and what a resync of it costs.

Every figure comes from a fresh child process that imports the manager from
a source tree: this one, and with --baseline DIR another checkout as well (a
`git worktree` of an older commit, its C extensions built), the two trees
alternating round by round, all against one real `redis-server` (flushed
before each child). The child builds the compact copy of a host index whose
every block holds a cached hash (what a replica's snapshot hands the
mirror), then:

1. the first republication: its wall time; with tracemalloc on (a second
   child), the bytes the publisher keeps per host key after it, and its
   peak per key;
2. a resync after half the tier's hashes changed: its wall time, and its
   peak per key beyond what the publisher kept, the tier's new copy
   included (the replica takes it for the resync).

    python bench/mirror_host_memory.py                                # this tree
    python bench/mirror_host_memory.py --baseline ../base --rounds 3  # before and after
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from bench_stats import alternating, command_line, load_averages, print_round
from kv_tooling.launch import free_port, launch_redis

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, sys, time, tracemalloc
from collections import Counter
import redis
from kv_manager_service.core.host_index import HostIndex, HostKeys
from kv_manager_service.mirror.publisher import EntryPublisher
from kv_manager_service.mirror.schema import KeySchema

port, num_keys, traced = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"

def full_index(offset):
    index = HostIndex(num_keys, 1, 32)
    for block_id in range(num_keys):
        seed = block_id + offset if block_id % 2 == 0 else block_id
        index.insert(block_id, 0, hashlib.sha256(seed.to_bytes(8, "little")).digest())
    return index

def copy_of(index):  # as the replica's snapshot takes it
    group_ids, hashes, _ = index.columns()
    try:
        return HostKeys(group_ids, hashes, 32, num_keys)
    except TypeError:  # a tree whose copy does not name its capacity
        return HostKeys(group_ids, hashes, 32)

client = redis.Redis(port=port)
client.flushall()
publisher = EntryPublisher(client, KeySchema("bench", "sha256_cbor"), "r", "1")
first, changed = copy_of(full_index(0)), full_index(num_keys)
if traced:
    tracemalloc.start()
started = time.perf_counter()
publisher.republish(Counter(), first)
first_s = time.perf_counter() - started
kept, first_peak = tracemalloc.get_traced_memory() if traced else (0, 0)
tracemalloc.reset_peak() if traced else None
started = time.perf_counter()
publisher.republish(Counter(), copy_of(changed))  # half of the hashes changed; the copy taken inside
resync_s = time.perf_counter() - started
_, resync_peak = tracemalloc.get_traced_memory() if traced else (0, 0)
assert client.dbsize() == num_keys
n = num_keys
print(json.dumps({"first_s": first_s, "resync_s": resync_s, "kept": kept / n, "first_peak": first_peak / n,
                  "resync_peak": (resync_peak - kept) / n} if traced else {"first_s": first_s, "resync_s": resync_s}))
"""


def child(tree: Path, port: int, num_keys: int, traced: bool) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(port), str(num_keys), "1" if traced else "0"],
        capture_output=True, text=True, env=env, cwd=tree, timeout=1800,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"the child in {tree} failed:\n{done.stderr}")
    return json.loads(done.stdout)


ROWS = [
    ("kept", "bytes the publisher keeps per host key (tracemalloc)", "{:.1f}"),
    ("first_peak", "peak of the first republication, per key (tracemalloc)", "{:.1f}"),
    ("resync_peak", "peak of a resync beyond what is kept, per key, the copy included (tracemalloc)", "{:.1f}"),
    ("first_s", "first republication (s)", "{:.2f}"),
    ("resync_s", "resync, half the hashes changed (s)", "{:.2f}"),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another source tree to measure the same way (the 'before')")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of timings (default %(default)s)")
    parser.add_argument("--host-keys", type=int, default=200_000, help="the full tier's keys (default %(default)s)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.host_keys < 2:
        parser.error(f"--rounds must be >= 1 and --host-keys >= 2, got {args.rounds} and {args.host_keys}")
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (Debian: apt-get install -y redis-server)")
    trees = {"after": ROOT}
    if args.baseline is not None:
        trees = {"before": args.baseline.resolve(), **trees}
    directory = Path(tempfile.mkdtemp(prefix="mirror-host-memory-"))
    port = free_port()
    server = launch_redis(port, directory / "redis.log")
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    try:
        for name, tree in trees.items():
            print(f"memory of {name} ({args.host_keys:,} host keys)", file=sys.stderr, flush=True)
            for key, value in child(tree, port, args.host_keys, traced=True).items():
                if key not in ("first_s", "resync_s"):
                    figures[name][key] = [value]
        for round_index in range(args.rounds):
            for name in alternating(list(trees), round_index):
                for key, value in child(trees[name], port, args.host_keys, traced=False).items():
                    figures[name].setdefault(key, []).append(value)
            print_round(round_index, args.rounds, ", ".join(
                f"{name}: resync {figures[name]['resync_s'][-1]:.2f} s" for name in trees
            ))  # fmt: skip
    finally:
        server.stop(5.0)
        shutil.rmtree(directory, ignore_errors=True)
    print(f"`{command_line(__file__, argv)}`; load averages {load_averages()}; medians over {args.rounds} rounds\n")
    print("| figure | " + " | ".join(trees) + (" | after / before |" if len(trees) == 2 else " |"))
    print("|---|" + "---:|" * (len(trees) + (len(trees) == 2)))
    for key, label, form in ROWS:
        values = [statistics.median(figures[name][key]) for name in trees]
        ratio = f" | {values[1] / values[0]:.3f}" if len(values) == 2 and values[0] else (" | " if len(values) == 2 else "")
        print(f"| {label} | " + " | ".join(form.format(v) for v in values) + ratio + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
