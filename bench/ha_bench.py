"""The cost of one synchronous standby: a lone manager against a primary with one in-sync standby, in one run.

Starts, as a user would, on this machine's loopback: a lone manager (`kv-manager serve` without
`--ha-url`), and a group: a real redis-server and two `serve --ha-url` members of one replica id. The
first becomes primary after one lease; the second follows it and joins the in-sync set, so every
mutating call is answered only once the standby has acknowledged its record. All three have the same
pool; the client is this process. Rounds alternate (the lone manager first in even rounds, the group
first in odd ones), and each measures on both:

1. the 256-request decode Step round trip (`rpc_bench.py`'s workload: 256 requests admitted with
   1,000-token prompts, then columnar `StepRequest.decode` Steps through the raw stub, prebuilt
   requests): p50 and p90; with --vllm-python, --vllm-source and --vllm-baseline (the baselines kit),
   vLLM's own in-process decode step, run once a round right after, and each p50's ratio to it;
2. back-to-back 256-request Steps from one client: request-steps/s, and the CPU seconds per Step of
   the server (the primary) and of the standby.

Ratios are taken round by round, then the median over rounds: single runs swing by up to 2x on a
shared 2-core machine. Then, once, with no load while a standby catches up:

3. catch-up, for pauses of at most 500 Steps, then of `--catch-up-steps`: the tail: the standby is
   paused (SIGSTOP) while the primary applies that many decode Steps of 256 live requests (it leaves
   the in-sync set after the sync timeout), then resumed, and timed until the primary logs it "is in
   sync" again; the snapshot: a fresh standby takes its place, and is timed until it is in sync (the
   primary sends it a snapshot of its whole state, then the records after it). The snapshot's size is
   that of one this script asks for right after, on the same state, through a connection of its own.
   A standby that never gets in sync is reported, with what its retries cost the primary's Step, and
   the script then exits 1 after its report.

    python bench/ha_bench.py            # full run, about 2 minutes on 2 cores
    python bench/ha_bench.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench_stats import (
    Series, alternating, busy_machine_warning, command_line, fmt, load_averages, med, percentile, print_round,
    spread,
)
from process_cpu import cpu_s
from rpc_bench import (
    BLOCK_SIZE, NUM_PREBUILT, PROMPT_LEN, ROOT, VllmBaseline, Workload, admit_rpc, check_decode, make_client,
    throughput, timed_calls,
)

from kv_tooling.launch import LaunchedProcess, free_port, launch, launch_redis
from kv_manager_service.client import KVManagerClient
from kv_manager_service.server import replication_link
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, NotReadyError
from kvcache.journal.v1 import journal_pb2 as jpb
from kvcache.replication.v1 import replication_pb2 as rpb

SERVICE = "kvcache.v1.KVManagerService"  # SERVING on the primary only
NUM_REQUESTS = 256
CONFIGS = ("lone", "group")
CATCH_UP_TIMEOUT_S = 60.0
STREAM_END_GRACE_S = 5.0  # a standby not in sync this long after its stream to the primary ended: given up
STREAM_END = re.compile(r"following \S+ ended: ")  # the standby's line (replication.Follower)
STUCK_NUM_REQUESTS = 16
STUCK_INTERVAL_S = 0.01
STUCK_SECONDS = 2.0

# Targets (see the brief): with a standby, the Step round trip at most vLLM's in-process step, and
# at least 80% of a lone manager's throughput.
TARGET_RATIO_TO_VLLM = 1.0
TARGET_THROUGHPUT_SHARE = 0.80

now_ns = time.perf_counter_ns


# -- the servers -------------------------------------------------------------------


@dataclass
class Server:
    """A lone manager, or a group's primary with its standby; the client talks to `processes[0]`."""

    processes: list[LaunchedProcess]
    client: KVManagerClient
    client2: KVManagerClient  # a second caller, on its own connection

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]


def start_manager(num_blocks: int, log_path: Path, replica_id: str, ha_url: str | None = None) -> LaunchedProcess:
    """`kv-manager serve --port 0` with the given pool, at INFO (the primary logs who is in sync)."""
    argv = [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", str(num_blocks),
            "--replica-id", replica_id]  # fmt: skip
    if ha_url is not None:
        argv += ["--ha-url", ha_url]
    try:
        return launch(argv, MANAGER_READY_PREFIX, log_path, cwd=ROOT)
    except NotReadyError as error:
        raise SystemExit(f"a manager did not start: {error}") from None


def wait_serving(address: str, timeout_s: float) -> None:
    """Until the health service says SERVING for the manager service (a group's member: it leads)."""
    deadline = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=SERVICE)
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while stub.Check(request, timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > deadline:
                raise SystemExit(f"{address} did not become primary within {timeout_s:g} s")
            time.sleep(0.02)


def log_entries(process: LaunchedProcess) -> list[dict[str, Any]]:
    """The process's JSON log lines so far (other lines, such as gRPC's own, are skipped)."""
    entries = []
    for line in process.log().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return entries


def wait_for_entry(process: LaunchedProcess, matches: Callable[[dict[str, Any]], bool], after: int,
                   timeout_s: float, what: str, also: LaunchedProcess | None = None) -> dict[str, Any]:
    """The first log entry of `process` past its first `after` that `matches`, waited for; SystemExit with
    the logs' tails (of `also` too) when none comes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        for entry in log_entries(process)[after:]:
            if matches(entry):
                return entry
        if time.monotonic() > deadline or not process.running:
            tails = "\n".join(f"--- {p.log_path.name}:\n{p.log()[-3000:]}" for p in (process, also) if p is not None)
            raise SystemExit(f"{what}: not seen within {timeout_s:g} s\n{tails}")
        time.sleep(0.005)


def follows_from(standby: LaunchedProcess) -> Callable[[dict[str, Any]], bool]:
    """Matches the primary's line 'standby M at HOST:PORT follows from record N' of `standby`."""
    port = standby.address.rsplit(":", 1)[1]
    return lambda entry: f":{port} follows from record" in entry.get("msg", "")


def in_sync(member_id: str) -> Callable[[dict[str, Any]], bool]:
    """Matches the primary's line 'standby M is in sync at record N' of member `member_id`."""
    return lambda entry: "is in sync" in entry.get("msg", "") and entry.get("member_id") == member_id


def record_number(entry: dict[str, Any], after: str) -> int:
    """The record number that follows `after` in a log entry's message."""
    return int(re.search(re.escape(after) + r" (\d+)", entry["msg"])[1])


def log_time(entry: dict[str, Any]) -> float:
    """A log entry's wall-clock time (its `ts`, to the millisecond), as `time.time()` gives it."""
    return datetime.fromisoformat(entry["ts"]).timestamp()


class Group:
    """A real Redis and the members of replica `ha-bench`'s group; `members[0]` leads, `members[1]` follows."""

    def __init__(self, directory: Path, num_blocks: int) -> None:
        self.directory = directory
        self.num_blocks = num_blocks
        self.redis_port = free_port()
        self.redis = launch_redis(self.redis_port, directory / "redis.log")
        self.members: list[LaunchedProcess] = []
        self.member_ids: dict[str, str] = {}  # a standby's address -> its member id, once it followed

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def primary(self) -> LaunchedProcess:
        return self.members[0]

    def start_member(self) -> LaunchedProcess:
        log_path = self.directory / f"member-{len(self.members)}.log"
        member = start_manager(self.num_blocks, log_path, "ha-bench", self.url)
        self.members.append(member)
        return member

    def start(self) -> None:
        """The primary (SERVING after one lease), then one standby, in sync."""
        self.start_member()
        wait_serving(self.primary.address, timeout_s=30)
        _, synced, failure = self.join(self.start_member(), after=0)
        if synced is None:
            raise SystemExit(f"the standby did not get in sync: {failure}")

    def join(self, standby: LaunchedProcess, after: int) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
        """The primary's log entries (past its first `after`) saying `standby` follows, then that it is in
        sync (None, and why, when it never is)."""
        follows = wait_for_entry(self.primary, follows_from(standby), after, CATCH_UP_TIMEOUT_S,
                                 f"{standby.address} following the primary", standby)  # fmt: skip
        self.member_ids[standby.address] = follows["member_id"]
        return follows, *self.wait_in_sync(standby, follows["member_id"], after, 0)

    def wait_in_sync(self, standby: LaunchedProcess, member_id: str, after_primary: int,
                     after_standby: int) -> tuple[dict[str, Any] | None, str]:
        """The primary's 'is in sync' entry of `member_id` past its first `after_primary`; or None and why not:
        the standby's stream ended (a line past its first `after_standby`; it retries on, quietly, and a healthy
        catch-up ends none) and it was still not in sync a grace later, it exited, or time ran out."""
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        ended_at = None
        while True:
            for entry in log_entries(self.primary)[after_primary:]:
                if in_sync(member_id)(entry):
                    return entry, ""
            ends = [e["msg"] for e in log_entries(standby)[after_standby:] if STREAM_END.match(e.get("msg", ""))]
            if ends and ended_at is None:
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > STREAM_END_GRACE_S:
                return None, f"its stream to the primary ended ({ends[0]}); not in sync {STREAM_END_GRACE_S:g} s later"
            if not standby.running:
                return None, "it exited"
            if time.monotonic() > deadline:
                return None, f"not within {CATCH_UP_TIMEOUT_S:g} s"
            time.sleep(0.005)

    def close(self) -> None:
        for member in self.members:
            if member.running:
                os.kill(member.pid, signal.SIGCONT)
        for member in self.members:
            member.stop(timeout_s=15)
        self.redis.kill()


def probe_snapshot(redis_url: str) -> tuple[int, int, float]:
    """Follow the primary as a new member would, at the replication address its lease names, take the
    snapshot it sends first, and hang up: (the last record it holds, its size in bytes, seconds from the
    connection to its arrival)."""
    client = redis.Redis.from_url(redis_url)
    try:
        replication_address = client.get("kvcache:ha:{ha-bench}:lease").decode().split(" ")[3]
    finally:
        client.close()
    # A history no primary holds: it is sent a snapshot at once.
    hello = rpb.FollowRequest(member_id="ha-bench-probe", address="127.0.0.1:9", last_seq=1, last_token=1 << 62)
    start = now_ns()
    answer = rpb.FollowResponse.FromString(replication_link.ask(replication_address, hello.SerializeToString()))
    elapsed_s = (now_ns() - start) / 1e9
    (payload,) = answer.records
    record = jpb.JournalRecord.FromString(payload)
    assert record.WhichOneof("entry") == "snapshot", record.WhichOneof("entry")
    return record.seq, len(payload), elapsed_s


# -- the measurements ----------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    rounds: int
    warmup: int  # untimed Steps before each latency series
    steps: int  # timed Steps per latency series and round
    throughput_steps: int  # back-to-back Steps per configuration and round
    tail_steps: tuple[int, ...]  # decode Steps the primary applies while the standby is paused, per pause
    vllm: VllmBaseline | None

    @property
    def num_blocks(self) -> int:
        """Room for every live request: a round's (two callers'), or the catch-up's (and the few of `stuck_cost`). The pool's
        size sets much of a snapshot's (its free queue and cached blocks)."""
        decoded = max(self.warmup + self.steps + 2 * self.throughput_steps, sum(self.tail_steps))
        num_tokens = PROMPT_LEN + decoded + BLOCK_SIZE
        return 2 * NUM_REQUESTS * (-(-num_tokens // BLOCK_SIZE) + 1) + 1024  # two callers' requests


class Results(dict):
    """Per-round figures by name."""

    def series(self, key: str) -> Series:
        return self.setdefault(key, Series())

    def last(self, key: str) -> float:
        return self[key].p50[-1]


def measure(name: str, server: Server, work: Workload, work2: Workload, plan: Plan, results: Results) -> None:
    """One configuration's latency series, then its back-to-back Steps with each process's CPU, then
    back-to-back Steps from two callers at once (the second on `work2`): commits are grouped."""
    stub = server.client.stub
    samples = timed_calls(lambda i: stub.Step(work.decode_requests[i % NUM_PREBUILT], timeout=30),
                          lambda r: check_decode(r, NUM_REQUESTS), plan.warmup, plan.steps)  # fmt: skip
    results.series(f"{name}:step").add_samples(samples)
    results.series(f"{name}:step_p90").add_value(percentile(samples, 90) / 1e6)
    before = [cpu_s(pid) for pid in server.pids]
    rate, _ = throughput([server.client], [work], plan.throughput_steps)
    cpu_ms = [(cpu_s(pid) - b) / plan.throughput_steps * 1e3 for pid, b in zip(server.pids, before)]
    results.series(f"{name}:rate").add_value(rate)
    results.series(f"{name}:server_cpu").add_value(cpu_ms[0])
    if len(cpu_ms) > 1:
        results.series(f"{name}:standby_cpu").add_value(cpu_ms[1])
    results.series(f"{name}:all_cpu").add_value(sum(cpu_ms))
    rate2, _ = throughput([server.client, server.client2], [work, work2], plan.throughput_steps)
    results.series(f"{name}:rate2").add_value(rate2)


def run_round(index: int, plan: Plan, servers: dict[str, Server], results: Results) -> None:
    rng = random.Random(index)
    for name in alternating(CONFIGS, index):
        server = servers[name]
        work = Workload(f"r{index}-{name}", NUM_REQUESTS, rng)
        work2 = Workload(f"r{index}-{name}-2", NUM_REQUESTS, rng)
        results.series(f"{name}:admit").add_value(admit_rpc(server.client, work))
        admit_rpc(server.client2, work2)
        measure(name, server, work, work2, plan, results)
        server.client.free(work.request_ids)
        server.client2.free(work2.request_ids)
    # vLLM's own manager, in-process, right after the Steps it is compared with
    if plan.vllm is not None:
        vllm_ms, _ = plan.vllm.run(NUM_REQUESTS, PROMPT_LEN, plan.warmup + plan.steps)
        results.series("vllm").add_value(vllm_ms)
        for name in CONFIGS:
            results.series(f"{name}:step_vs_vllm").add_value(results.last(f"{name}:step") / vllm_ms)
    for key in ("step", "step_p90", "rate", "rate2", "server_cpu", "all_cpu", "admit"):
        results.series(f"ratio:{key}").add_value(results.last(f"group:{key}") / results.last(f"lone:{key}"))


@dataclass(frozen=True)
class CatchUp:
    """One standby's way (back) into the in-sync set."""

    how: str  # "tail": a paused standby, resumed; "snapshot": a fresh one
    num_records: int  # the records it lacked when it started catching up
    seconds: float  # from the start of its catch-up to the primary's "is in sync" line (or to giving up)
    cpu_s: float  # the standby's CPU over that time
    failure: str = ""  # why it never got in sync; "" when it did
    num_bytes: int = 0  # the snapshot's size
    num_tail_records: int = 0  # records after the snapshot, before it was in sync
    start_to_sync_s: float = 0.0  # a fresh standby: from its process's start
    probe_s: float = 0.0  # the snapshot's making and sending, as this script's own connection saw it


def pause_and_resume(group: Group, standby: LaunchedProcess, client: KVManagerClient, work: Workload,
                     num_steps: int) -> CatchUp:
    """`standby` paused while the primary applies `num_steps` decode Steps of `work`, then resumed."""
    primary = group.primary
    stub = client.stub
    os.kill(standby.pid, signal.SIGSTOP)
    try:
        # The first Step waits the sync timeout, then the primary drops the standby from the in-sync set.
        for i in range(num_steps):
            response = stub.Step(work.decode_requests[i % NUM_PREBUILT], timeout=30)
        check_decode(response, NUM_REQUESTS)
        after_primary, after_standby = len(log_entries(primary)), len(log_entries(standby))
        cpu_before = cpu_s(standby.pid)
        resumed = time.time()
    finally:
        os.kill(standby.pid, signal.SIGCONT)
    synced, failure = group.wait_in_sync(standby, group.member_ids[standby.address], after_primary, after_standby)
    seconds = (log_time(synced) if synced is not None else time.time()) - resumed
    return CatchUp("tail", num_steps, seconds, cpu_s(standby.pid) - cpu_before, failure)


def join_fresh(group: Group) -> tuple[LaunchedProcess, CatchUp]:
    """A fresh standby, started now: the snapshot, then the records after it."""
    primary = group.primary
    after = len(log_entries(primary))
    started = time.time()
    fresh = group.start_member()
    cpu_before = cpu_s(fresh.pid)  # from its ready line: interpreter start and imports are not counted
    follows, synced, failure = group.join(fresh, after)
    cpu = cpu_s(fresh.pid) - cpu_before
    assert "after a snapshot" in follows["msg"], follows["msg"]
    snapshot_seq = record_number(follows, "follows from record") - 1
    seq, num_bytes, probe_s = probe_snapshot(group.url)
    if synced is None:
        return fresh, CatchUp("snapshot", snapshot_seq, time.time() - log_time(follows), cpu, failure, num_bytes,
                              probe_s=probe_s)  # fmt: skip
    assert seq == record_number(synced, "at record"), (seq, synced["msg"])  # no record came in between
    return fresh, CatchUp(
        "snapshot", snapshot_seq, log_time(synced) - log_time(follows), cpu, num_bytes=num_bytes,
        num_tail_records=seq - snapshot_seq, start_to_sync_s=log_time(synced) - started, probe_s=probe_s,
    )  # fmt: skip


@dataclass(frozen=True)
class StuckCost:
    """The primary's decode Step while a fresh standby that cannot get in sync retries, and once it is stopped."""

    num_snapshots: int  # the snapshots the primary sent it meanwhile
    while_stuck: list[float]  # Step round trips, ms
    after_stop: list[float]


def stuck_cost(group: Group, standby: LaunchedProcess, client: KVManagerClient) -> StuckCost:
    """A Step of STUCK_NUM_REQUESTS decode entries every STUCK_INTERVAL_S for STUCK_SECONDS while `standby` retries,
    then as long again once it is stopped. Few requests, so the pool has room without growing (its size sets
    the snapshot's, which this is about) and the round trip is mostly the wait for the replica's lock."""
    work = Workload("stuck", STUCK_NUM_REQUESTS, random.Random(8))
    admit_rpc(client, work)

    def paced() -> list[float]:
        samples: list[float] = []
        deadline = time.monotonic() + STUCK_SECONDS
        while time.monotonic() < deadline:
            start = now_ns()
            response = client.stub.Step(work.decode_requests[len(samples) % NUM_PREBUILT], timeout=30)
            samples.append((now_ns() - start) / 1e6)
            check_decode(response, STUCK_NUM_REQUESTS)
            time.sleep(STUCK_INTERVAL_S)
        return samples

    after = len(log_entries(group.primary))
    while_stuck = paced()
    num_snapshots = sum("after a snapshot" in e.get("msg", "") for e in log_entries(group.primary)[after:])
    standby.stop(timeout_s=15)
    after_stop = paced()
    client.free(work.request_ids)
    return StuckCost(num_snapshots, while_stuck, after_stop)


def catch_up(plan: Plan, group: Group, client: KVManagerClient) -> tuple[list[CatchUp], StuckCost | None]:
    """For each pause, shortest first: the tail of the paused standby; then a fresh standby's snapshot, and the
    fresh one replaces the other (stopped: one that never got back in sync would go on trying). When a fresh
    standby does not get in sync, what its retries cost the primary's Step, and the end."""
    work = Workload("catch-up", NUM_REQUESTS, random.Random(7))
    admit_rpc(client, work)
    standby = group.members[1]
    catch_ups, stuck = [], None
    for num_steps in plan.tail_steps:
        catch_ups.append(pause_and_resume(group, standby, client, work, num_steps))
        standby.stop(timeout_s=15)
        standby, joined = join_fresh(group)
        catch_ups.append(joined)
        if joined.failure:
            stuck = stuck_cost(group, standby, client)
            break
    client.free(work.request_ids)
    return catch_ups, stuck


# -- report ------------------------------------------------------------------------


def cell(series: Series) -> str:
    return fmt(med(series)) if series.p50 else "n/a"


def ratio_cell(series: Series) -> str:
    return f"{med(series):.3f} ({spread(series.p50, '-')})" if series.p50 else ""


def verdict(target: str, met: bool) -> str:
    return f"{target} ({'met' if met else 'MISSED'})"


def render(results: Results, catch_ups: Sequence[CatchUp], stuck: StuckCost | None, plan: Plan, command: str,
           seconds: float, start_load: str) -> list[str]:
    r = results
    share = med(r["ratio:rate"])
    lines = [
        "# The cost of a synchronous standby",
        "",
        f"Command: `{command}`",
        "",
        f"Python {platform.python_version()}, {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; "
        f"grpcio {grpc.__version__}; every server `kv-manager serve --num-blocks {plan.num_blocks:,}` on loopback "
        f"(the group's members with `--ha-url`, one redis-server), the client in this process; {plan.rounds} "
        f"alternating rounds of {plan.steps} timed 256-request decode Steps after {plan.warmup} warm-up, then "
        f"{plan.throughput_steps} back-to-back; medians over rounds, ratios per round; total {seconds:.0f} s, "
        f"load average {start_load} at the start, {load_averages()} at the end.",
        "",
        "| # | metric | lone manager | primary + 1 in-sync standby | with / without, per round (rounds) | unit "
        "| target |",
        "|---|---|---:|---:|---|---|---|",
        f"| 1 | 256-request decode Step round trip, p50 | {cell(r['lone:step'])} | {cell(r['group:step'])} | "
        f"{ratio_cell(r['ratio:step'])} | ms | |",
        f"| 1 | the same, p90 | {cell(r['lone:step_p90'])} | {cell(r['group:step_p90'])} | "
        f"{ratio_cell(r['ratio:step_p90'])} | ms | |",
    ]
    if "vllm" in r:
        vs_vllm = med(r["group:step_vs_vllm"])
        lines += [
            f"| 1 | vLLM's own manager, in-process: 256-request decode step, p50 | {cell(r['vllm'])} | "
            f"{cell(r['vllm'])} | | ms | one run a round, right after the Steps |",
            f"| 1 | **Step round trip p50 / vLLM's in-process step p50** (same round) | "
            f"{ratio_cell(r['lone:step_vs_vllm'])} | {ratio_cell(r['group:step_vs_vllm'])} | | x | "
            f"{verdict(f'<= {TARGET_RATIO_TO_VLLM} with the standby', vs_vllm <= TARGET_RATIO_TO_VLLM)} |",
        ]
    lines += [
        f"| 2 | **throughput, back-to-back 256-request Steps, 1 client** | {cell(r['lone:rate'])} | "
        f"{cell(r['group:rate'])} | {ratio_cell(r['ratio:rate'])} | req-steps/s | "
        f"{verdict(f'>= {TARGET_THROUGHPUT_SHARE:.2f}', share >= TARGET_THROUGHPUT_SHARE)} |",
        f"| 2 | throughput, back-to-back 256-request Steps, 2 clients at once (commits grouped) | "
        f"{cell(r['lone:rate2'])} | {cell(r['group:rate2'])} | {ratio_cell(r['ratio:rate2'])} | req-steps/s | |",
        f"| 2 | server CPU per Step (the group's primary) | {cell(r['lone:server_cpu'])} | "
        f"{cell(r['group:server_cpu'])} | {ratio_cell(r['ratio:server_cpu'])} | ms | |",
        f"| 2 | the standby's CPU per Step | | {cell(r['group:standby_cpu'])} | | ms | |",
        f"| 2 | all the servers' CPU per Step | {cell(r['lone:all_cpu'])} | {cell(r['group:all_cpu'])} | "
        f"{ratio_cell(r['ratio:all_cpu'])} | ms | |",
        f"| - | admission Step: 256 random 1,000-token prompts (one a round) | {cell(r['lone:admit'])} | "
        f"{cell(r['group:admit'])} | {ratio_cell(r['ratio:admit'])} | ms | |",
        "",
        "| 3 | catch-up, no load meanwhile | records | snapshot | until in sync | rate | standby CPU |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in catch_ups:
        if c.how == "tail":
            what = f"a standby paused during {c.num_records:,} decode Steps, resumed: the tail"
            snapshot_cell, rate = "", f"{fmt(c.num_records / c.seconds)} records/s"
        else:
            mb = c.num_bytes / 1e6
            what, snapshot_cell, rate = (f"a fresh standby: the snapshot, then {c.num_tail_records:,} records",
                                         f"{fmt(mb)} MB", f"{fmt(mb / c.seconds)} MB/s")
        until = f"{fmt(c.seconds)} s" + (f" ({fmt(c.start_to_sync_s)} s from its start)" if c.start_to_sync_s else "")
        if c.failure:
            until, rate = f"**never** (gave up after {fmt(c.seconds)} s)", ""
        lines.append(f"| 3 | {what} | {c.num_records:,} | {snapshot_cell} | {until} | {rate} | {fmt(c.cpu_s)} s |")
    lines += [
        "",
        "Until in sync: from SIGCONT (the tail) or from the primary's 'follows' line (the snapshot) to its "
        "'is in sync' line, by their log times. The standby's CPU: from SIGCONT, or from the fresh one's ready "
        "line. The snapshot's making and sending alone, as a connection of this script's own saw it right after, "
        f"on the same state: {', '.join(f'{fmt(c.probe_s)} s' for c in catch_ups if c.how == 'snapshot')}.",
    ]
    lines += [f"FAILED: the {c.how} of {c.num_records:,} records: {c.failure}" for c in catch_ups if c.failure]
    if stuck is not None:
        figures = [(f"p50 {fmt(statistics.median(s))} ms, p99 {fmt(percentile(s, 99))} ms, max {fmt(max(s))} ms "
                    f"({len(s)} Steps)") for s in (stuck.while_stuck, stuck.after_stop)]  # fmt: skip
        lines += [
            "",
            f"While the fresh standby retried, the primary sent it {stuck.num_snapshots} snapshots in "
            f"{STUCK_SECONDS:g} s, and a Step of {STUCK_NUM_REQUESTS} decode entries every "
            f"{STUCK_INTERVAL_S * 1e3:g} ms took {figures[0]}; once that standby was stopped, {figures[1]}.",
        ]
    spreads = [(f"{name} {key}", med(r[f"{name}:{key}"]), min(r[f"{name}:{key}"].p50), max(r[f"{name}:{key}"].p50))
               for name in CONFIGS for key in ("step", "rate")]  # fmt: skip
    warning = busy_machine_warning(spreads, os.getloadavg()[0], os.cpu_count() or 1)
    return lines + (["", warning] if warning else [])


# -- command line ------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: fewer rounds and Steps")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 7, quick 2)")
    parser.add_argument("--steps", type=int, help="timed Steps per series and round (default 300, quick 40)")
    parser.add_argument("--catch-up-steps", type=int,
                        help="decode Steps the primary applies while its standby is paused; above 500, a pause of 500 "
                        "comes first (default 3000, quick 200)")
    vllm = parser.add_argument_group("vLLM's own manager, run in each round for same-run ratios (all three, or none)")
    vllm.add_argument("--vllm-python", type=Path, help="an interpreter with vLLM's Python dependencies")
    vllm.add_argument("--vllm-source", type=Path, help="the folder holding vLLM's source (vllm/), put on PYTHONPATH")
    vllm.add_argument("--vllm-baseline", type=Path, help="the baselines kit's vllm_step_baseline.py")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    vllm_paths = (args.vllm_python, args.vllm_source, args.vllm_baseline)
    if any(vllm_paths) and not all(vllm_paths):
        parser.error("--vllm-python, --vllm-source and --vllm-baseline go together")
    if any(p is not None and not p.exists() for p in vllm_paths):
        parser.error(f"no such file or folder: {', '.join(str(p) for p in vllm_paths if not p.exists())}")
    for flag, value in (("--rounds", args.rounds), ("--steps", args.steps), ("--catch-up-steps", args.catch_up_steps)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    quick = args.quick
    catch_up_steps = args.catch_up_steps or (200 if quick else 3000)
    plan = Plan(
        rounds=args.rounds or (2 if quick else 7),
        warmup=5 if quick else 32,
        steps=args.steps or (40 if quick else 300),
        throughput_steps=60 if quick else 500,
        tail_steps=tuple(sorted({min(500, catch_up_steps), catch_up_steps})),
        vllm=VllmBaseline(*vllm_paths) if all(vllm_paths) else None,
    )
    start_load = load_averages()
    started = now_ns()
    with tempfile.TemporaryDirectory(prefix="ha_bench_") as directory:
        lone = start_manager(plan.num_blocks, Path(directory) / "lone.log", "ha-bench-lone")
        group = None
        try:
            group = Group(Path(directory), plan.num_blocks)
            group.start()
            servers = {
                "lone": Server([lone], make_client(lone.address), make_client(lone.address, own_connection=True)),
                "group": Server(group.members[:2], make_client(group.primary.address),
                                make_client(group.primary.address, own_connection=True)),
            }
            results = Results()
            for index in range(plan.rounds):
                round_start = now_ns()
                run_round(index, plan, servers, results)
                vllm = f", vLLM {results.last('vllm'):.2f} ms" if plan.vllm else ""
                print_round(index, plan.rounds, f"{(now_ns() - round_start) / 1e9:.1f} s, Step p50 lone "
                            f"{results.last('lone:step'):.2f} ms, with a standby {results.last('group:step'):.2f} ms"
                            f"{vllm}; throughput ratio {results.last('ratio:rate'):.3f}")  # fmt: skip
            catch_ups, stuck = catch_up(plan, group, servers["group"].client)
            for server in servers.values():
                server.client.close()
        finally:
            lone.stop(timeout_s=15)
            if group is not None:
                group.close()
    print("\n".join(render(results, catch_ups, stuck, plan, command_line(__file__, argv), (now_ns() - started) / 1e9,
                           start_load)))  # fmt: skip
    return 1 if any(c.failure for c in catch_ups) else 0


if __name__ == "__main__":
    raise SystemExit(main())
