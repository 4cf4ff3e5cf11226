"""Two builds of the manager side by side: the 256-request decode Step round trip, alternated in one run.

A change to the server is judged by a ratio measured in one run, on one
machine, at one moment: this script starts `kv-manager serve` from this tree
and from a baseline checkout (another commit), admits the same 256 requests
of 1,000 tokens on each, then alternates rounds of back-to-back columnar
decode Steps (the request `rpc_bench.py` times as "256-op Step"), switching
the order every round. It reports each build's median p50 and p99 over
rounds, the server process's CPU time per Step (less sensitive than wall time
to other load on the machine), and the medians of the per-round ratios
(this tree / baseline). Each round also runs a throughput series, as
`rpc_bench.py`'s: `--throughput-clients` clients, each on its own connection
with its own 256 requests, send back-to-back decode Steps at once.

The baseline is any checkout with its generated protos and C encoder built:

    git worktree add /tmp/base <commit>
    (cd /tmp/base && python setup.py -q build_ext --inplace)   # generates kvcache/ too
    python bench/build_ab_bench.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from bench_stats import Series, fmt
from process_cpu import cpu_s
from rpc_bench import BLOCK_SIZE, PROMPT_LEN, Workload, admit_rpc, check_decode, make_client, throughput, timed_calls

from kv_manager_service.rpc.launch import LaunchedProcess, launch
from kv_manager_service.rpc.ready_line import MANAGER_READY_PREFIX

ROOT = Path(__file__).resolve().parents[1]
NUM_REQUESTS = 256


def start(tree: Path, num_blocks: int, log_path: Path, extra_args: Sequence[str] = ()) -> LaunchedProcess:
    """`kv-manager serve` from `tree`'s sources (its own package first on the path)."""
    argv = [
        sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", str(num_blocks),
        "--replica-id", f"ab-{tree.name}", "--log-level", "WARNING", *extra_args,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree))
    return launch(argv, MANAGER_READY_PREFIX, log_path, cwd=tree, env=env)


def decode_round(client, work: Workload, pid: int, warmup: int, steps: int) -> tuple[list[int], float]:
    """`warmup + steps` back-to-back 256-request decode Steps on one server: the timed samples (ns) and the
    server's CPU per Step (ms)."""
    stub = client.stub
    cpu_before = cpu_s(pid)
    samples = timed_calls(
        lambda i: stub.Step(work.decode_requests[i % len(work.decode_requests)], timeout=30),
        lambda r: check_decode(r, NUM_REQUESTS),
        warmup,
        steps,
    )
    return samples, (cpu_s(pid) - cpu_before) * 1e3 / (warmup + steps)


def commit_of(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="checkout of the baseline build")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    parser.add_argument("--steps", type=int, default=200, help="timed Steps per build and round (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed Steps before each series (default 20)")
    parser.add_argument(
        "--throughput-clients", type=int, default=4,
        help="concurrent clients of the throughput series, each with its own 256 requests (default 4; 0: none)",
    )  # fmt: skip
    parser.add_argument("--throughput-steps", type=int, default=50, help="Steps per client and series (default 50)")
    args = parser.parse_args(argv)
    if not (args.baseline / "kv_manager_service").is_dir() or not (args.baseline / "kvcache").is_dir():
        parser.error(f"--baseline {args.baseline}: needs kv_manager_service/ and its generated kvcache/ (see --help)")
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")

    tokens_per_request = PROMPT_LEN + args.rounds * (args.warmup + args.steps + args.throughput_steps) + BLOCK_SIZE
    num_blocks = (1 + args.throughput_clients) * NUM_REQUESTS * (-(-tokens_per_request // BLOCK_SIZE) + 1) + 1024
    builds = {"baseline": args.baseline.resolve(), "this tree": ROOT}
    series = {name: Series() for name in builds}
    ratios: list[float] = []
    cpu_ms = {name: [] for name in builds}  # server CPU ms per Step, per round
    cpu_ratios: list[float] = []
    work = Workload("ab", NUM_REQUESTS, random.Random(0))
    # The throughput series: one client and one set of requests per thread (as rpc_bench.py's).
    works = [Workload(f"tp{i}", NUM_REQUESTS, random.Random(1 + i)) for i in range(args.throughput_clients)]
    rates = {name: [] for name in builds}  # request-steps/s, per round
    rate_ratios: list[float] = []
    with tempfile.TemporaryDirectory() as directory:
        servers = {name: start(tree, num_blocks, Path(directory) / f"{i}.log") for i, (name, tree) in enumerate(builds.items())}
        try:
            clients = {name: make_client(server.address) for name, server in servers.items()}
            for client in clients.values():
                admit_rpc(client, work)
            pools = {name: [make_client(server.address, own_connection=True) for _ in works] for name, server in servers.items()}
            for name, pool in pools.items():
                for client, each in zip(pool, works):
                    admit_rpc(client, each)
            for round_index in range(args.rounds):
                order = list(builds) if round_index % 2 == 0 else list(reversed(builds))
                p50 = {}
                for name in order:
                    samples, cpu_per_step = decode_round(clients[name], work, servers[name].pid, args.warmup, args.steps)
                    cpu_ms[name].append(cpu_per_step)
                    series[name].add_samples(samples)
                    p50[name] = statistics.median(samples)
                ratios.append(p50["this tree"] / p50["baseline"])
                if works:
                    for name in order:
                        rates[name].append(throughput(pools[name], works, args.throughput_steps)[0])
                    rate_ratios.append(rates["this tree"][-1] / rates["baseline"][-1])
                cpu_ratios.append(cpu_ms["this tree"][-1] / cpu_ms["baseline"][-1])
                print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"{name} {p50[name] / 1e6:.2f} ms" for name in builds), file=sys.stderr, flush=True)  # fmt: skip
            for client in [*clients.values(), *(c for pool in pools.values() for c in pool)]:
                client.close()
        finally:
            for server in servers.values():
                server.stop()

    command = "python bench/" + Path(__file__).name + " " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"256-request decode Step round trip (columnar), {args.rounds} alternating rounds of {args.steps} Steps")
    print(f"command: {command}")
    print()
    print("| build | commit | p50 ms (median over rounds) | p50 spread | p99 ms | server CPU ms per Step |")
    print("|---|---|---:|---:|---:|---:|")
    for name, tree in builds.items():
        s = series[name]
        print(f"| {name} | {commit_of(tree)} | {fmt(statistics.median(s.p50))} | "
              f"{fmt(min(s.p50))}-{fmt(max(s.p50))} | {fmt(statistics.median(s.p99))} | "
              f"{fmt(statistics.median(cpu_ms[name]))} |")  # fmt: skip
    print()
    if rate_ratios:
        print()
        print(f"throughput: {len(works)} concurrent clients, {args.throughput_steps} back-to-back 256-request decode "
              "Steps each per round and build (request-steps/s, median over rounds): "
              + ", ".join(f"{name} {statistics.median(rates[name]):,.0f}" for name in builds))  # fmt: skip
    for label, values in (("p50 round trip", ratios), ("server CPU per Step", cpu_ratios), ("throughput", rate_ratios)):
        if not values:
            continue
        print(f"ratio this tree / baseline, {label}, median of per-round ratios: {statistics.median(values):.3f} "
              f"(rounds: {min(values):.3f}-{max(values):.3f})")  # fmt: skip
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
