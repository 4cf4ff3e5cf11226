"""The mirror's publisher in the writer's thread against one in its own process: wall time and GIL time.

Starts its own `redis-server` (no persistence) on a free port. Each round
hands both publishers (`--redis-writer thread` and `process`: the same
EntryPublisher, the second behind PublisherProcess) the events of one
admission Step that caches 8,704 new block hashes (256 BlockStored events of
34 hashes each, one group), then the matching BlockRemoved events, in
alternating order. Measured per call of `apply`: its wall time, and the CPU
time of the calling thread (`time.thread_time`), which is the time the
writer holds the server's GIL. Medians over rounds.

    python bench/mirror_publisher_bench.py              # 15 rounds
    python bench/mirror_publisher_bench.py --rounds 3   # smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench_stats import alternating, print_round
from kv_manager_service.shared.events import BlockRemoved, BlockStored
from kv_manager_service.mirror.connect import RedisEndpoint, connect
from kv_manager_service.mirror.publisher import EntryPublisher
from kv_manager_service.mirror.publisher_process import PublisherProcess
from kv_manager_service.mirror.schema import KeySchema
from kv_tooling.launch import free_port, launch_redis

NUM_EVENTS = 256
HASHES_PER_EVENT = 34  # 8,704 hashes, about section 1's admission in bench/mirror_writer_bench.py (8,832)
INCARNATION = "1796174572262368123"


def step_events(round_index: int) -> tuple[list[BlockStored], list[BlockRemoved]]:
    hashes = [hashlib.sha256(f"{round_index}-{i}".encode()).digest() for i in range(NUM_EVENTS * HASHES_PER_EVENT)]
    runs = [tuple(hashes[i * HASHES_PER_EVENT : (i + 1) * HASHES_PER_EVENT]) for i in range(NUM_EVENTS)]
    return [BlockStored(0, run, None, 16) for run in runs], [BlockRemoved(0, run) for run in runs]


def timed_apply(publisher, events) -> tuple[float, float]:
    """(wall ms, the calling thread's CPU ms) of one `apply`."""
    wall, cpu = time.perf_counter(), time.thread_time()
    publisher.apply(events)
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15,
                        help="rounds, each one Step's stores and removals (default %(default)s)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (Debian: apt-get install -y redis-server)")
    directory = Path(tempfile.mkdtemp(prefix="publisher-bench-"))
    port = free_port()
    server = launch_redis(port, directory / "redis.log")
    try:
        endpoint = RedisEndpoint(f"redis://127.0.0.1:{port}/0", cluster="no")
        publishers = {
            "thread": EntryPublisher(connect(endpoint), KeySchema("bench-thread", "sha256_cbor"), "t", INCARNATION),
            "process": PublisherProcess(endpoint, KeySchema("bench-process", "sha256_cbor"), "p", INCARNATION),
        }
        for publisher in publishers.values():
            publisher.republish({}, None)
        samples: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in publishers}
        for index in range(args.rounds):
            stored, removed = step_events(index)
            for name in alternating(list(publishers), index):
                samples[name].append((*timed_apply(publishers[name], stored), *timed_apply(publishers[name], removed)))
            print_round(index, args.rounds)
        for publisher in publishers.values():
            publisher.close()
    finally:
        server.stop(5.0)
        shutil.rmtree(directory, ignore_errors=True)
    print(f"Python {platform.python_version()}, redis-py {redis.__version__}, {args.rounds} rounds, "
          f"{NUM_EVENTS * HASHES_PER_EVENT:,} hashes per batch; medians, ms\n")  # fmt: skip
    print("| publisher | store: wall | store: GIL held | remove: wall | remove: GIL held |")
    print("|---|---:|---:|---:|---:|")
    for name, rows in samples.items():
        medians = [statistics.median(row[i] for row in rows) for i in range(4)]
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in medians) + " |")


if __name__ == "__main__":
    main()
