"""The report of the Redis-mirror benchmarks: per-round series, the table's header and the paragraph above it.

Each figure is the median over rounds of the per-round figure; the spread
column shows the lowest and highest round's p50.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from typing import NamedTuple, Sequence

import grpc
import redis

from bench_stats import Series

TABLE_HEADER = [
    "| # | metric | p50 | p99 | unit | spread (round p50s) | target | note |",
    "|---|---|---:|---:|---|---|---|---|",
]


class Results(dict):
    """Metric name -> its per-round Series."""

    def get_series(self, key: str) -> Series:
        return self.setdefault(key, Series())


class RunStart(NamedTuple):
    """When a run started, and the machine's 1-minute load average then (other work on it)."""

    ns: int
    load_average: float

    @classmethod
    def now(cls) -> RunStart:
        return cls(time.perf_counter_ns(), os.getloadavg()[0])


def header(start: RunStart, redis_version: str, servers: Sequence[str], rounds: int,
           each_round: Sequence[str]) -> list[str]:
    """The title, the command, the machine and versions, the servers, what each round runs; then the table's header.

    `servers` describe the server processes and `each_round` what a round
    runs, one phrase per benchmark in the run. The run's length and load are
    taken now, from `start`.
    """
    command = shlex.join(["python", *sys.argv])
    seconds = (time.perf_counter_ns() - start.ns) / 1e9
    load = (start.load_average, os.getloadavg()[0])
    hiredis = "hiredis parser" if getattr(redis.utils, "HIREDIS_AVAILABLE", False) else "pure-Python parser"
    return [
        "# Redis mirror benchmarks",
        "",
        f"Command: `{command}`",
        "",
        f"Python {platform.python_version()} ({platform.python_implementation()}), {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} CPUs; grpcio {grpc.__version__}, redis-py {redis.__version__} "
        f"({hiredis}), redis-server {redis_version} (`--save '' --appendonly no`, loopback). Servers: "
        f"{', and '.join(servers)}, all on loopback with the client in the bench process, every process on "
        f"the same {os.cpu_count()} cores. {rounds} rounds; in each, {', '.join(each_round)}; medians over rounds of "
        f"per-round p50 / p99; total {seconds:.0f} s; 1-minute load average {load[0]:.2f} when it started "
        f"(other work on the machine), {load[1]:.2f} when it ended.",
        "",
        *TABLE_HEADER,
    ]
