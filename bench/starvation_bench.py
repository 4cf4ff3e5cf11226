"""Do open streams or a long mutation starve the manager? This tree, and optionally a baseline build, in one run.

For each build, `kv-manager serve` (default flags, 32 threads) is measured in
three ways:

1. idle streams: GetStats and gRPC health checks (2 s deadline each) with no
   stream open, then with `--streams` idle WatchSteps/WatchEvents streams
   open (half each, over 4 channels): p50, p99 and calls that timed out;
2. a long mutation: the longest GetStats round trip while one 65,536-op
   Step runs (the Step's own duration beside it);
3. unread streams: 256-request decode Steps per second for `--seconds`,
   with no stream, then with 8 WatchSteps + 8 WatchEvents streams that are
   never read, then the same with WatchEventBatches instead of WatchEvents
   (skipped on a build without it);
4. a stopped Redis: the same Steps per second while `--lookup-clients`
   threads each send a cluster lookup (FindCacheHit with cluster=true) every
   20 ms, with the mirror's Redis running, then frozen (SIGSTOP), as a hung
   Redis would be.

    python bench/starvation_bench.py [--baseline /tmp/base]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import grpc
from bench_stats import command_line
from build_ab_bench import start
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_cpu import cpu_s
from rpc_bench import Workload, admit_rpc, make_client

from kv_tooling.launch import free_port, launch_redis
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import kv_manager_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 2.0
BIG_STEP_OPS = 1 << 16


def open_streams(address: str, count: int, batches: bool = False) -> tuple[list[grpc.Channel], list]:
    """`count` streams from what comes next, half WatchSteps (each its own worker id) and half
    WatchEvents (or, with `batches`, WatchEventBatches); none is read."""
    channels = [grpc.insecure_channel(address) for _ in range(4)]
    now = pb_grpc.KVManagerServiceStub(channels[0]).GetStats(pb.GetStatsRequest(), timeout=30)
    next_step, next_event = now.last_step_id + 1, now.last_event_sequence + 1
    streams = []
    for index in range(count):
        stub = pb_grpc.KVManagerServiceStub(channels[index % len(channels)])
        if index % 2 and batches:
            streams.append(stub.WatchEventBatches(pb.WatchEventBatchesRequest(from_sequence=next_event)))
        elif index % 2:
            streams.append(stub.WatchEvents(pb.WatchEventsRequest(from_sequence=next_event)))
        else:
            streams.append(stub.WatchSteps(pb.WatchStepsRequest(worker_id=f"idle-{index}", from_step_id=next_step)))
    return channels, streams


def close_streams(channels: list[grpc.Channel], streams: list) -> None:
    for stream in streams:
        stream.cancel()
    for channel in channels:
        channel.close()


def latencies(call: Callable[[], object], n: int) -> tuple[list[float], int]:
    """Round trips in ms of `n` calls, and how many timed out."""
    samples, timeouts = [], 0
    for _ in range(n):
        started = time.perf_counter()
        try:
            call()
        except grpc.RpcError as error:
            if error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            timeouts += 1
            continue
        samples.append((time.perf_counter() - started) * 1e3)
    return samples, timeouts


def summary(samples: list[float], timeouts: int) -> str:
    if not samples:
        return f"all {timeouts} timed out"
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    text = f"p50 {statistics.median(ordered):.2f} ms, p99 {p99:.2f} ms"
    return text + (f", {timeouts} timed out" if timeouts else "")


def idle_streams(address: str, num_streams: int, calls: int) -> list[str]:
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.KVManagerServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    rows = []
    for count in (0, num_streams):
        channels, streams = open_streams(address, count)
        time.sleep(1.0)  # let the server take every stream
        for name, call in (
            ("GetStats", lambda: stub.GetStats(pb.GetStatsRequest(), timeout=DEADLINE_S)),
            ("health Check", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S)),
        ):
            rows.append(f"{name} with {count} idle streams: {summary(*latencies(call, calls))}")
        close_streams(channels, streams)
    channel.close()
    return rows


def long_mutation(address: str) -> str:
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
    stub = pb_grpc.KVManagerServiceStub(channel)
    big = pb.StepRequest()
    for index in range(BIG_STEP_OPS):
        big.ops.add().allocate.CopyFrom(pb.AllocateRequest(request_id=f"big-{index}", token_ids=[index], num_new_tokens=1))
    done = threading.Event()
    took: list[float] = []

    def run() -> None:
        started = time.perf_counter()
        try:
            stub.Step(big, timeout=300)
            took.append(time.perf_counter() - started)
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    longest = 0.0
    while not done.is_set():
        started = time.perf_counter()
        stub.GetStats(pb.GetStatsRequest(), timeout=300)
        longest = max(longest, time.perf_counter() - started)
    thread.join()
    if not took:
        raise RuntimeError("the long Step failed (see above)")
    freed = pb.StepRequest()
    freed.ops.add().free.request_ids.extend(f"big-{index}" for index in range(BIG_STEP_OPS))
    stub.Step(freed, timeout=300)
    channel.close()
    return f"longest GetStats during a {BIG_STEP_OPS}-op Step: {longest * 1e3:.0f} ms (the Step took {took[0] * 1e3:.0f} ms)"


def serves_event_batches(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            next(pb_grpc.KVManagerServiceStub(channel).WatchEventBatches(pb.WatchEventBatchesRequest(), timeout=5))
        except grpc.RpcError as error:
            return error.code() is not grpc.StatusCode.UNIMPLEMENTED
    return True


# Holds unread streams in a process of its own, so that receiving them costs the measuring client nothing.
HOLDER = """
import sys, time
sys.path[:0] = sys.argv[4:]
import grpc
from starvation_bench import open_streams
channels, streams = open_streams(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "batches")
print("open", flush=True)
time.sleep(3600)
"""


@contextlib.contextmanager
def streams_held_elsewhere(address: str, count: int, batches: bool) -> Iterator[None]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, address, str(count), "batches" if batches else "events", *sys.path],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "open", "the stream holder did not start"
        time.sleep(1.0)  # let the server take every stream
        yield
    finally:
        holder.kill()
        holder.wait()


def unread_streams(address: str, server_pid: int, seconds: float) -> list[str]:
    client = make_client(address)
    work = Workload("starve", 256, random.Random(0))
    admit_rpc(client, work)
    rows, base = [], None
    serves_batches = serves_event_batches(address)
    for label, count, batches in (
        ("no stream", 0, False),
        ("8 WatchSteps + 8 WatchEvents streams never read", 16, False),
        ("8 WatchSteps + 8 WatchEventBatches streams never read", 16, True),
    ):
        if batches and not serves_batches:
            rows.append(f"256-request decode Steps/s, {label}: skipped (no WatchEventBatches in this build)")
            continue
        with streams_held_elsewhere(address, count, batches):
            cpu_before = cpu_s(server_pid)
            rate, num_steps = steps_per_s(client, work, seconds)
            cpu_ms = (cpu_s(server_pid) - cpu_before) * 1e3 / num_steps
        base = base or rate
        rows.append(f"256-request decode Steps/s, {label}: {rate:.0f} ({rate / base:.2f}); server CPU {cpu_ms:.2f} ms per Step")
    client.close()
    return rows


def steps_per_s(client, work: Workload, seconds: float) -> tuple[float, int]:
    """Back-to-back decode Steps for `seconds`: (Steps per second, Steps)."""
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        client.stub.Step(work.decode_requests[steps % len(work.decode_requests)], timeout=60)
        steps += 1
    return steps / (time.perf_counter() - started), steps


def stopped_redis(tree: Path, directory: Path, seconds: float, num_lookup_clients: int) -> list[str]:
    port = free_port()
    redis_server = launch_redis(port, directory / f"redis-{tree.name}.log")
    server = start(tree, 300_000, directory / f"mirror-{tree.name}.log", ["--redis-url", f"redis://127.0.0.1:{port}/0"])
    rows = []
    try:
        client = make_client(server.address)
        work = Workload("redis", 256, random.Random(0))
        admit_rpc(client, work)
        lookup = pb.FindCacheHitRequest(token_ids=work.prompts[0], cluster=True)
        lookups = make_client(server.address, own_connection=True)
        stop = threading.Event()
        num_lookups = [0]

        def look() -> None:
            while not stop.wait(0.02):
                lookups.stub.FindCacheHit(lookup, timeout=60)
                num_lookups[0] += 1

        threads = [threading.Thread(target=look) for _ in range(num_lookup_clients)]
        for thread in threads:
            thread.start()
        try:
            for state in ("running", "frozen (SIGSTOP)"):
                if state != "running":
                    redis_server.process.send_signal(signal.SIGSTOP)
                before = num_lookups[0]
                rate, _ = steps_per_s(client, work, seconds)
                rows.append(f"Redis {state}: {rate:.0f} decode Steps/s, {(num_lookups[0] - before) / seconds:.0f} cluster lookups/s beside them")
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
            stop.set()
            for thread in threads:
                thread.join()
        client.close()
        lookups.close()
    finally:
        server.stop()
        redis_server.stop()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="also measure this checkout (see build_ab_bench.py)")
    parser.add_argument("--streams", type=int, default=300, help="idle streams of part 1 (default %(default)s)")
    parser.add_argument("--calls", type=int, default=100, help="calls of each kind in part 1 (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each series of parts 3 and 4 (default %(default)s)")
    parser.add_argument("--lookup-clients", type=int, default=32, help="cluster lookup threads of part 4 (default %(default)s)")
    args = parser.parse_args(argv)
    builds = {"this tree": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    print(f"command: {command_line(__file__, argv)}")
    with tempfile.TemporaryDirectory() as directory:
        for index, (name, tree) in enumerate(builds.items()):
            server = start(tree, BIG_STEP_OPS + 300_000, Path(directory) / f"{index}.log")
            try:
                print(f"\n## {name}")
                for line in idle_streams(server.address, args.streams, args.calls):
                    print(f"- {line}")
                print(f"- {long_mutation(server.address)}")
                for line in unread_streams(server.address, server.pid, args.seconds):
                    print(f"- {line}")
            finally:
                server.stop()
            for line in stopped_redis(tree, Path(directory), args.seconds, args.lookup_clients):
                print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
