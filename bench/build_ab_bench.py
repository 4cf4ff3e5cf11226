"""Two builds of the manager side by side: the 256-request decode Step round trip, alternated in one run.

A change to the server is judged by a ratio measured in one run, on one
machine, at one moment: this script starts `kv-manager serve` from this tree
and from a baseline checkout (another commit), admits the same 256 requests
of 1,000 tokens on each, then alternates rounds of back-to-back columnar
decode Steps (the request `rpc_bench.py` times as "256-op Step"), switching
the order every round. It reports each build's median p50 and p99 over
rounds, the server process's CPU time per Step (less sensitive than wall time
to other load on the machine), and the medians of the per-round ratios
(this tree / baseline).

Each round also runs two throughput series, in the same alternating order:
every client has its own connection and its own 256 admitted requests, and
sends `--throughput-steps` back-to-back decode Steps at once with the others.

- threads (`--throughput-clients`): the clients are threads of this process,
  as in `rpc_bench.py`; they share one GIL, so a server whose Step costs
  less than the client's own proto work is measured as the client's limit.
- processes (`--client-processes`): each client is a process of its own,
  started and admitted once, before the first round; in each round they
  start together at a barrier, and the rate is the request-steps of all of
  them over the span from the first start to the last finish, so neither
  process start-up nor admission is counted.

Both report the server's and the clients' CPU time per Step.

The baseline is any checkout with its generated protos and C encoder built:

    git worktree add /tmp/base <commit>
    (cd /tmp/base && python setup.py -q build_ext --inplace)   # generates kvcache/ too
    python bench/build_ab_bench.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Sequence

from bench_stats import (
    Series, alternating, command_line, fmt, load_averages, med, per_round_ratios, print_round, ratio_summary, spread,
)
from process_cpu import cpu_s
from rpc_bench import BLOCK_SIZE, PROMPT_LEN, Workload, admit_rpc, check_decode, make_client, throughput, timed_calls

from kv_tooling.launch import LaunchedProcess, launch
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX

ROOT = Path(__file__).resolve().parents[1]
NUM_REQUESTS = 256
# How long a client process waits for its siblings at the start barrier, or the bench for a client process's
# report, before it gives the round up: far longer than any series takes.
CLIENT_TIMEOUT_S = 300


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


@dataclass
class DecodeSeries:
    """One server's decode Step round trip, per round: its p50 and p99 (ms), and the server's CPU ms per Step."""

    round_trip: Series = field(default_factory=Series)
    cpu_ms: list[float] = field(default_factory=list)

    def measure(self, client, work: Workload, pid: int, warmup: int, steps: int) -> None:
        """One round of `decode_round`."""
        samples, cpu_per_step = decode_round(client, work, pid, warmup, steps)
        self.round_trip.add_samples(samples)
        self.cpu_ms.append(cpu_per_step)

    def cells(self) -> str:
        """The table cells: p50 (median over rounds), its spread over rounds, p99, server CPU per Step."""
        s = self.round_trip
        return f"{fmt(med(s))} | {spread(s.p50, '-')} | {fmt(med(s, 'p99'))} | {fmt(statistics.median(self.cpu_ms))}"


def pool_blocks(tokens_per_request: int, num_request_sets: int = 1) -> int:
    """A device pool that holds `num_request_sets` sets of requests grown to `tokens_per_request` tokens each:
    nothing is evicted during the run."""
    return num_request_sets * NUM_REQUESTS * (-(-tokens_per_request // BLOCK_SIZE) + 1) + 1024


def commit_of(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


# -- the throughput series ---------------------------------------------------------


def system_clock_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process of the machine, so client processes' times compare."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def client_process(address: str, tag: str, seed: int, warmup: int, conn: Connection, barrier: Barrier) -> None:
    """One client of the process series, run in a process of its own.

    Opens its own connection, admits its own 256 requests of 1,000 tokens (ids prefixed `tag`), runs
    `warmup` untimed Steps, then reports True on `conn` (ready). After that, for each step count it
    receives on `conn`: waits at `barrier` with its siblings, sends that many back-to-back decode Steps to
    the server and reports (start ns, end ns, this process's CPU s over those Steps). None ends it. A
    failure is reported as its traceback (a str), and ends it.
    """
    try:
        work = Workload(tag, NUM_REQUESTS, random.Random(seed))
        client = make_client(address, own_connection=True)
        admit_rpc(client, work)
        step, requests = client.stub.Step, work.decode_requests
        for i in range(warmup):
            check_decode(step(requests[i % len(requests)], timeout=30), NUM_REQUESTS)
        conn.send(True)
        while (num_steps := conn.recv()) is not None:
            barrier.wait(timeout=CLIENT_TIMEOUT_S)
            cpu_before = time.process_time()
            start_ns = system_clock_ns()
            response = None
            for i in range(num_steps):
                response = step(requests[i % len(requests)], timeout=30)
            end_ns = system_clock_ns()
            cpu = time.process_time() - cpu_before
            check_decode(response, NUM_REQUESTS)
            conn.send((start_ns, end_ns, cpu))
        client.close()
    except BaseException:  # noqa: BLE001 - the bench raises it, with this traceback
        barrier.abort()  # siblings waiting at the barrier fail at once rather than time out
        conn.send(traceback.format_exc())


class ClientProcesses:
    """`num_processes` client processes of one server (`client_process`), started and admitted at once,
    kept between rounds; `close` ends them."""

    def __init__(self, address: str, tag: str, seed: int, num_processes: int, warmup: int) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter each: gRPC does not survive fork
        # Held here: the children open the barrier's semaphores after start() returns, so they must outlive it.
        self.barrier = barrier = context.Barrier(num_processes)
        self.conns: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for i in range(num_processes):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=client_process, args=(address, f"{tag}.{i}", seed + i, warmup, theirs, barrier),
                name=f"client process {tag}.{i}", daemon=True,
            )  # fmt: skip
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)

    def wait_ready(self) -> None:
        for index in range(len(self.conns)):
            self._receive(index, "admitting its requests")

    def run(self, steps: int) -> tuple[float, float]:
        """Each process sends `steps` Steps, all starting at once: (request-steps/s from the first start to
        the last finish, the client processes' CPU seconds together)."""
        for index in range(len(self.conns)):
            self._send(index, steps, "sending Steps")
        timings = [self._receive(index, "sending Steps") for index in range(len(self.conns))]
        span_s = (max(end for _, end, _ in timings) - min(start for start, _, _ in timings)) / 1e9
        return len(self.conns) * NUM_REQUESTS * steps / span_s, sum(cpu for _, _, cpu in timings)

    def close(self) -> None:
        self.barrier.abort()  # after a failure, a process still waiting there fails now and exits
        for conn, process in zip(self.conns, self.processes):
            if process.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join()
            conn.close()

    def _send(self, index: int, message: int, doing: str) -> None:
        try:
            self.conns[index].send(message)
        except OSError:
            raise RuntimeError(f"{self.processes[index].name} exited while {doing}") from None

    def _receive(self, index: int, doing: str) -> object:
        """The next report of process `index`; a RuntimeError naming it if it failed, exited or is silent."""
        conn, name = self.conns[index], self.processes[index].name
        if not conn.poll(CLIENT_TIMEOUT_S):
            raise RuntimeError(f"{name} reported nothing for {CLIENT_TIMEOUT_S} s while {doing}")
        try:
            message = conn.recv()
        except EOFError:
            raise RuntimeError(f"{name} exited while {doing}") from None
        if isinstance(message, str):
            raise RuntimeError(f"{name} failed while {doing}:\n{message}")
        return message


@dataclass
class Throughput:
    """One throughput series of one build, per round: request-steps/s, and server and client CPU ms per Step."""

    rates: list[float] = field(default_factory=list)
    server_cpu_ms: list[float] = field(default_factory=list)
    client_cpu_ms: list[float] = field(default_factory=list)

    def add(self, rate: float, server_cpu_s: float, client_cpu_s: float, num_steps: int) -> None:
        self.rates.append(rate)
        self.server_cpu_ms.append(server_cpu_s * 1e3 / num_steps)
        self.client_cpu_ms.append(client_cpu_s * 1e3 / num_steps)


def ratios_of(values: dict[str, list[float]]) -> list[float]:
    """Per-round ratios this tree / baseline."""
    return per_round_ratios(values["this tree"], values["baseline"])


# -- the run -------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="checkout of the baseline build")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    parser.add_argument("--steps", type=int, default=200, help="timed Steps per build and round (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed Steps before each series (default 20)")
    parser.add_argument(
        "--throughput-clients", type=int, default=2,
        help="client threads of the thread throughput series, each with its own 256 requests (default 2; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--client-processes", type=int, default=2,
        help="client processes of the process throughput series, each with its own 256 requests (default 2; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--throughput-steps", type=int, default=200, help="Steps per client, series and round (default 200)"
    )
    return parser


@dataclass
class Results:
    """Per-round figures of both builds, keyed by build name."""

    builds: dict[str, Path]
    decode: dict[str, DecodeSeries]  # the single-client decode Step round trip
    threads: dict[str, Throughput]
    processes: dict[str, Throughput]

    @classmethod
    def empty(cls, builds: dict[str, Path]) -> Results:
        return cls(builds, {name: DecodeSeries() for name in builds},
                   {name: Throughput() for name in builds}, {name: Throughput() for name in builds})  # fmt: skip


def run(args: argparse.Namespace, results: Results) -> None:
    """Starts both servers and every client, admits every request set, then runs `args.rounds` rounds,
    each series on one build then the other, the order switching every round."""
    builds = results.builds
    # Every request set grows by at most this many tokens (the main one by warmup + steps a round, the
    # thread clients' by throughput_steps a round, the processes' by warmup once and throughput_steps a
    # round): the pool holds them all.
    tokens_per_request = PROMPT_LEN + args.rounds * (args.warmup + args.steps + args.throughput_steps) + BLOCK_SIZE
    num_request_sets = 1 + args.throughput_clients + args.client_processes
    num_blocks = pool_blocks(tokens_per_request, num_request_sets)
    work = Workload("ab", NUM_REQUESTS, random.Random(0))
    # The thread series: one client and one set of requests per thread (as rpc_bench.py's).
    works = [Workload(f"tp{i}", NUM_REQUESTS, random.Random(1 + i)) for i in range(args.throughput_clients)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as directory:
        servers = {name: start(tree, num_blocks, Path(directory) / f"{i}.log")
                   for i, (name, tree) in enumerate(builds.items())}  # fmt: skip
        client_processes: dict[str, ClientProcesses] = {}
        try:
            for index, (name, server) in enumerate(servers.items() if args.client_processes else ()):
                client_processes[name] = ClientProcesses(
                    server.address, f"proc{index}", 1000 * (index + 1), args.client_processes, args.warmup
                )
            clients = {name: make_client(server.address) for name, server in servers.items()}
            for client in clients.values():
                admit_rpc(client, work)
            pools = {name: [make_client(server.address, own_connection=True) for _ in works]
                     for name, server in servers.items()}  # fmt: skip
            for pool in pools.values():
                for client, each in zip(pool, works):
                    admit_rpc(client, each)
            for each in client_processes.values():
                each.wait_ready()
            print(f"admitted: {num_request_sets} sets of {NUM_REQUESTS} requests per build "
                  f"({args.client_processes} in client processes), {time.monotonic() - started:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            for round_index in range(args.rounds):
                order = alternating(list(builds), round_index)
                for name in order:
                    results.decode[name].measure(clients[name], work, servers[name].pid, args.warmup, args.steps)
                for name in order if works else ():
                    server_before, client_before = cpu_s(servers[name].pid), time.process_time()
                    rate, _ = throughput(pools[name], works, args.throughput_steps)
                    client_cpu = time.process_time() - client_before  # this process: the client threads
                    results.threads[name].add(rate, cpu_s(servers[name].pid) - server_before, client_cpu,
                                              len(works) * args.throughput_steps)  # fmt: skip
                for name in order if client_processes else ():
                    server_before = cpu_s(servers[name].pid)
                    rate, client_cpu = client_processes[name].run(args.throughput_steps)
                    results.processes[name].add(rate, cpu_s(servers[name].pid) - server_before, client_cpu,
                                                args.client_processes * args.throughput_steps)  # fmt: skip
                progress = ", ".join(f"{name} {results.decode[name].round_trip.p50[-1]:.2f} ms" for name in builds)
                if client_processes:
                    progress += "; processes " + ", ".join(
                        f"{name} {results.processes[name].rates[-1]:,.0f}/s" for name in builds)  # fmt: skip
                print_round(round_index, args.rounds, progress)
            for client in [*clients.values(), *(c for pool in pools.values() for c in pool)]:
                client.close()
        finally:
            for each in client_processes.values():
                each.close()
            for server in servers.values():
                server.stop()


def report(args: argparse.Namespace, results: Results, command: str) -> None:
    """The tables (markdown) and the ratio lines, on stdout."""
    builds = results.builds
    print(f"256-request decode Step round trip (columnar), {args.rounds} alternating rounds of {args.steps} Steps")
    print(f"command: {command}")
    print()
    print("| build | commit | p50 ms (median over rounds) | p50 spread | p99 ms | server CPU ms per Step |")
    print("|---|---|---:|---:|---:|---:|")
    for name, tree in builds.items():
        print(f"| {name} | {commit_of(tree)} | {results.decode[name].cells()} |")
    throughput_series = [
        (f"{args.throughput_clients} client threads", results.threads),
        (f"{args.client_processes} client processes", results.processes),
    ]
    throughput_series = [(label, by_build) for label, by_build in throughput_series if by_build["baseline"].rates]
    if throughput_series:
        print()
        print(f"throughput: each client on its own connection with its own {NUM_REQUESTS} requests, "
              f"{args.throughput_steps} back-to-back decode Steps per client, series and round; "
              "medians over rounds")  # fmt: skip
        print()
        print("| series | build | request-steps/s | spread | server CPU ms per Step | client CPU ms per Step |")
        print("|---|---|---:|---:|---:|---:|")
        for label, by_build in throughput_series:
            for name in builds:
                t = by_build[name]
                print(f"| {label} | {name} | {statistics.median(t.rates):,.0f} | "
                      f"{min(t.rates):,.0f}-{max(t.rates):,.0f} | {fmt(statistics.median(t.server_cpu_ms))} | "
                      f"{fmt(statistics.median(t.client_cpu_ms))} |")  # fmt: skip
    print()
    ratio_rows = [
        ("p50 round trip", ratios_of({name: results.decode[name].round_trip.p50 for name in builds})),
        ("server CPU per Step", ratios_of({name: results.decode[name].cpu_ms for name in builds})),
    ]
    for label, by_build in throughput_series:
        ratio_rows.append((f"throughput, {label}", ratios_of({name: by_build[name].rates for name in builds})))
        ratio_rows.append((f"server CPU per Step, {label}",
                           ratios_of({name: by_build[name].server_cpu_ms for name in builds})))  # fmt: skip
    for label, values in ratio_rows:
        if not values:
            print(f"ratio this tree / baseline, {label}: none (too short to measure in any round)")
            continue
        print(f"ratio this tree / baseline, {label}, median of per-round ratios: {ratio_summary(values)}")
    print(f"load average at the end: {load_averages()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not (args.baseline / "kv_manager_service").is_dir() or not (args.baseline / "kvcache").is_dir():
        parser.error(f"--baseline {args.baseline}: needs kv_manager_service/ and its generated kvcache/ (see --help)")
    for name, lowest in (("rounds", 1), ("steps", 1), ("warmup", 0), ("throughput_clients", 0),
                         ("client_processes", 0), ("throughput_steps", 1)):  # fmt: skip
        if getattr(args, name) < lowest:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= {lowest}")
    results = Results.empty({"baseline": args.baseline.resolve(), "this tree": ROOT})
    run(args, results)
    report(args, results, command_line(__file__, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
