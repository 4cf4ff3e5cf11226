"""Load and soak: N concurrent schedulers against one `kv-manager serve` process for a bounded time.

Starts `python -m kv_manager_service.cli serve --port 0` as a user would,
then runs N schedulers, each in its own process with its own
`KVManagerClient` (processes, so the load generator shares no GIL). The
schedulers are `kv_tooling.soak`'s, the soak test's load: the
reference scheduler's loop on Mooncake prompts (scaled with `--scale`),
decoded for their output lengths in columnar `Step`s (`client.decode`),
admissions and frees as nested ops, forks, preemption on NO_SPACE, aborts,
and `AckSteps` from one fake worker id so copy-on-write sources are
released. At the deadline each scheduler frees
everything it holds; the bench then acknowledges every step and reads the
pool.

Every second it samples the server's resident memory (VmRSS in
/proc/PID/status), its CPU time, GetStats (usage, requests, pending copies,
last step and event), and the Step round trips that ended in that second.
It reports throughput, decode-Step latency p50 / p99 in the first and the
last third of the load (after the warm-up), RSS after the warm-up, at the
end of the load, its maximum and its growth per minute, usage after all
frees against the baseline before the load, and whether the invariants
hold at the end (no live request, no pending copy, every block free,
ResetPrefixCache accepted, exit 0 on SIGTERM with a clean log).

The service keeps the last 100,000 step deltas (WatchSteps) and cache
events (WatchEvents), so its RSS grows until both logs are full; the leak
figure is the growth after that, which the default 300 s run reaches.
`--check-invariants` serves with the server's check after every mutation
(O(pool) each: a correctness soak, slower than the figures' run).

    python bench/soak_bench.py                                  # 4 schedulers x 300 s, 20,000 blocks
    python bench/soak_bench.py --schedulers 2 --duration-s 20   # a short run
    python bench/soak_bench.py --json                           # figures, report and per-second samples
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import queue
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import grpc

from bench_stats import fmt, percentile
from process_cpu import cpu_s
from kv_manager_service.client import KVManagerClient
from kv_tooling.launch import LaunchedProcess, launch
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, NotReadyError
from kvcache.v1 import kv_manager_pb2 as pb
from kv_tooling.soak import (
    EndState,
    LatencyBucket,
    SoakConfig,
    SoakCounters,
    run_soak,
    settle,
    trace_requests,
)

ROOT = Path(__file__).resolve().parents[1]

WORKER_ID = "soak-worker"
# What the service retains for its streams (ServiceLimits): until these logs are full, their growth is
# part of the RSS growth; only after both are full does growth mean a leak.
STEP_RETENTION = 100_000  # step deltas, for WatchSteps
EVENT_RETENTION = 100_000  # cache events, for WatchEvents
SETTLE_S = 2.0  # after the frees, before the last RSS sample
PROGRESS_EVERY = 30  # samples between progress lines on stderr


@dataclass(frozen=True)
class Plan:
    schedulers: int
    duration_s: float
    warmup_s: float
    num_blocks: int
    block_size: int
    scale: float
    output_scale: float
    max_running: int
    seed: int

    def __post_init__(self) -> None:
        if self.schedulers < 1 or self.duration_s <= 0 or self.num_blocks < 2:
            raise ValueError(f"bad plan: {self}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s), got {self.warmup_s}")


@dataclass(frozen=True)
class Sample:
    """One second's look at the server."""

    t_s: float  # since the load started
    rss_kib: int
    cpu_s: float
    usage: float
    num_requests: int
    num_pending_copies: int
    num_evictions: int
    last_step_id: int
    last_event_sequence: int


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    decode_us: dict[int, list[int]] = field(default_factory=dict)  # second -> round trips
    ops_us: dict[int, list[int]] = field(default_factory=dict)
    counters: SoakCounters = field(default_factory=SoakCounters)
    per_scheduler: dict[int, SoakCounters] = field(default_factory=dict)
    baseline: EndState | None = None
    end: EndState | None = None
    peak_usage: float = 0.0
    rss_after_frees_kib: int = 0
    reset_prefix_cache_ok: bool = False
    exit_code: int | None = None
    log_problems: list[str] = field(default_factory=list)
    load_average: tuple[float, float] = (0.0, 0.0)
    wall_s: float = 0.0


# -- the server process ------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sample(server: LaunchedProcess, stub: Any, t_s: float) -> Sample:
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    pid = server.pid
    return Sample(t_s, rss_kib(pid), cpu_s(pid), stats.usage, stats.num_requests, stats.num_pending_copies,
                  stats.num_evictions, stats.last_step_id, stats.last_event_sequence)  # fmt: skip


# -- the schedulers ------------------------------------------------------------------


def scheduler_process(
    address: str, config: SoakConfig, plan: Plan, index: int, start: Any, go: Any, messages: Any
) -> None:
    """One scheduler in its own process: load its share of the trace, wait for `go`, run, report."""
    try:
        max_num_tokens = (plan.num_blocks - 1) // (4 * plan.schedulers) * plan.block_size
        specs = trace_requests(plan.scale, plan.output_scale, max_num_tokens, index, plan.schedulers)
        with KVManagerClient(address) as client:
            client.wait_ready()
            messages.put(("ready", index, len(specs)))
            go.wait()
            counters = run_soak(client, config, specs, start.value, lambda b: messages.put(("bucket", index, b)))
        messages.put(("done", index, counters))
    except BaseException:
        messages.put(("error", index, traceback.format_exc()))
        raise SystemExit(1)


def run_load(plan: Plan, server: LaunchedProcess, client: KVManagerClient, run: Run) -> None:
    """Start the schedulers, sample every second until they have all freed everything."""
    context = multiprocessing.get_context("spawn")  # no gRPC state crosses a fork
    messages = context.Queue()
    go = context.Event()
    start = context.Value("d", 0.0)
    processes = []
    for i in range(plan.schedulers):
        config = SoakConfig(f"s{i}", plan.duration_s, max_running=plan.max_running, worker_id=WORKER_ID,
                                 seed=plan.seed * 1000 + i)  # fmt: skip
        process = context.Process(target=scheduler_process, args=(server.address, config, plan, i, start, go, messages),
                                  name=f"soak-scheduler-{i}", daemon=True)  # fmt: skip
        process.start()
        processes.append(process)
    try:
        ready = 0
        while ready < plan.schedulers:
            kind, index, payload = messages.get(timeout=120)
            if kind == "error":
                raise SystemExit(f"scheduler {index} failed to start:\n{payload}")
            ready += kind == "ready"
        start.value = time.monotonic() + 0.2
        go.set()
        next_sample = start.value
        done = 0
        died: dict[int, float] = {}
        while done < plan.schedulers:
            now = time.monotonic()
            if now >= next_sample:
                run.samples.append(sample(server, client.stub, now - start.value))
                run.peak_usage = max(run.peak_usage, run.samples[-1].usage)
                next_sample += 1.0
                if len(run.samples) % PROGRESS_EVERY == 0:
                    last = run.samples[-1]
                    decode = run.decode_us.get(int(last.t_s) - 2, [])
                    p50 = f"{statistics.median(decode) / 1e3:.2f} ms" if decode else "-"
                    print(f"{last.t_s:4.0f} s: usage {last.usage:.2f}, {last.num_requests} requests, RSS "
                          f"{last.rss_kib / 1024:.0f} MiB, step {last.last_step_id:,}, decode Step p50 {p50}",
                          file=sys.stderr, flush=True)  # fmt: skip
                for i, process in enumerate(processes):
                    if process.exitcode not in (None, 0) and i not in run.per_scheduler:
                        died.setdefault(i, now)
                        if now - died[i] > 5:  # its error report, if any, would have arrived by now
                            raise SystemExit(f"{process.name} exited {process.exitcode} without a report")
                continue
            try:
                kind, index, payload = messages.get(timeout=next_sample - now)
            except queue.Empty:
                continue
            if kind == "bucket":
                bucket: LatencyBucket = payload
                run.decode_us.setdefault(bucket.second, []).extend(bucket.decode_us)
                run.ops_us.setdefault(bucket.second, []).extend(bucket.ops_us)
            elif kind == "done":
                run.per_scheduler[index] = payload
                run.counters.add(payload)
                done += 1
            elif kind == "error":
                raise SystemExit(f"scheduler {index} failed:\n{payload}")
        run.samples.append(sample(server, client.stub, time.monotonic() - start.value))
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


# -- figures -------------------------------------------------------------------------


def slope_per_min(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per minute; 0 with fewer than 3 points."""
    if len(points) < 3:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx * 60 if sxx else 0.0


def window(per_second: dict[int, list[int]], first: float, last: float) -> list[int]:
    return [v for second, values in per_second.items() if first <= second < last for v in values]


def cpu_ms_per_step(samples: Sequence[Sample], first: float, last: float) -> float:
    """Server CPU per Step between the first and the last sample of [first, last] s: what the server itself
    spends, which other work on the machine moves less than it moves round trips."""
    inside = [s for s in samples if first <= s.t_s <= last]
    a, b = inside[0], inside[-1]
    return (b.cpu_s - a.cpu_s) / max(1, b.last_step_id - a.last_step_id) * 1e3


def figures(plan: Plan, run: Run) -> dict[str, Any]:
    """Every reported figure, by name."""
    c = run.counters
    load = [s for s in run.samples if plan.warmup_s <= s.t_s <= plan.duration_s]
    if not load:
        raise SystemExit("no sample after the warm-up: lengthen --duration-s")
    third = (plan.duration_s - plan.warmup_s) / 3
    first = window(run.decode_us, plan.warmup_s, plan.warmup_s + third)
    last = window(run.decode_us, plan.duration_s - third, plan.duration_s)
    first_ops = window(run.ops_us, plan.warmup_s, plan.warmup_s + third)
    last_ops = window(run.ops_us, plan.duration_s - third, plan.duration_s)
    mib = lambda kib: kib / 1024  # noqa: E731
    rss_points = [(s.t_s, mib(s.rss_kib)) for s in load]
    half = plan.warmup_s + (plan.duration_s - plan.warmup_s) / 2
    during = [s for s in run.samples if s.t_s <= plan.duration_s]
    end_of_load = during[-1]
    f: dict[str, Any] = {
        "request_steps_per_s": c.num_request_steps / plan.duration_s,
        "steps_per_s": c.num_steps / plan.duration_s,
        "decode_p50_first_ms": statistics.median(first) / 1e3,
        "decode_p99_first_ms": percentile(first, 99) / 1e3,
        "decode_p50_last_ms": statistics.median(last) / 1e3,
        "decode_p99_last_ms": percentile(last, 99) / 1e3,
        "ops_p50_first_ms": statistics.median(first_ops) / 1e3,
        "ops_p99_first_ms": percentile(first_ops, 99) / 1e3,
        "ops_p50_last_ms": statistics.median(last_ops) / 1e3,
        "ops_p99_last_ms": percentile(last_ops, 99) / 1e3,
        "decode_batch_mean": c.num_request_steps / max(1, c.num_decode_steps),
        "server_cpu_per_step_first_ms": cpu_ms_per_step(run.samples, plan.warmup_s, plan.warmup_s + third),
        "server_cpu_per_step_last_ms": cpu_ms_per_step(run.samples, plan.duration_s - third, plan.duration_s),
        "rss_start_mib": mib(load[0].rss_kib),
        "rss_end_of_load_mib": mib(end_of_load.rss_kib),
        "rss_max_mib": mib(max(s.rss_kib for s in run.samples)),
        "rss_after_frees_mib": mib(run.rss_after_frees_kib),
        "rss_growth_mib_per_min": slope_per_min(rss_points),
        "rss_growth_second_half_mib_per_min": slope_per_min([p for p in rss_points if p[0] >= half]),
        "server_cpu_share": (end_of_load.cpu_s - during[0].cpu_s) / max(1e-9, end_of_load.t_s - during[0].t_s),
        "peak_usage": run.peak_usage,
        "max_pending_copies": max(s.num_pending_copies for s in run.samples),
        "num_evictions": run.samples[-1].num_evictions,
        "last_step_id": run.end.last_step_id if run.end else 0,
        "step_log_full_at_s": next((s.t_s for s in run.samples if s.last_step_id >= STEP_RETENTION), None),
        "event_log_full_at_s": next((s.t_s for s in run.samples if s.last_event_sequence >= EVENT_RETENTION), None),
        "hit_rate": c.num_hit_tokens / max(1, c.num_prompt_tokens),
    }
    full_at = max(f["step_log_full_at_s"] or plan.duration_s, f["event_log_full_at_s"] or plan.duration_s)
    f["logs_full_at_s"] = full_at if full_at < plan.duration_s else None
    steady = [p for p in rss_points if p[0] >= full_at]
    f["rss_steady_s"] = steady[-1][0] - steady[0][0] if len(steady) > 1 else 0.0
    f["rss_growth_logs_full_mib_per_min"] = slope_per_min(steady) if f["rss_steady_s"] >= 20 else None
    for key, (a, b) in {"decode_p50_ratio": ("decode_p50_last_ms", "decode_p50_first_ms"),
                        "decode_p99_ratio": ("decode_p99_last_ms", "decode_p99_first_ms")}.items():  # fmt: skip
        f[key] = f[a] / f[b]
    return f


def row(number: str, metric: str, value: str, unit: str = "", note: str = "") -> str:
    return f"| {number} | {metric} | {value} | {unit} | {note} |"


def render(plan: Plan, run: Run, f: dict[str, Any], command: str, server_argv: Sequence[str],
           check_flag: bool, server_env: str) -> list[str]:  # fmt: skip
    c = run.counters
    base, end = run.baseline, run.end
    violations = end.violations()
    if check_flag:
        invariants = "checked by the server after every mutation (`--check-invariants`), and the end state here"
    else:
        invariants = ("the end state, through the service (GetStats, GetBlockTables, ResetPrefixCache); "
                      "`--check-invariants` checks after every mutation too")  # fmt: skip
    third = (plan.duration_s - plan.warmup_s) / 3
    first_window = f"{plan.warmup_s:.0f}-{plan.warmup_s + third:.0f} s"
    last_window = f"{plan.duration_s - third:.0f}-{plan.duration_s:.0f} s"
    never = "never full"
    step_log = f"full from {f['step_log_full_at_s']:.0f} s" if f["step_log_full_at_s"] is not None else never
    event_log = f"full from {f['event_log_full_at_s']:.0f} s" if f["event_log_full_at_s"] is not None else never
    if f["rss_growth_logs_full_mib_per_min"] is not None:
        leak = row("3", "**RSS growth once the step and event logs are full**",
                   fmt(f["rss_growth_logs_full_mib_per_min"]), "MiB/min",
                   f"{f['logs_full_at_s']:.0f}-{plan.duration_s:.0f} s: the leak figure")  # fmt: skip
    else:
        leak = row("3", "RSS growth once the step and event logs are full", "n/a", "",
                   "the logs were not full for 20 s: run longer")  # fmt: skip
    ops = lambda p50, p99: f"{fmt(f[p50])} / {fmt(f[p99])}"  # noqa: E731
    return [
        "# Load and soak",
        "",
        f"Command: `{command}`",
        "",
        f"Python {platform.python_version()} ({platform.python_implementation()}), {platform.system()} "
        f"{platform.machine()}, {os.cpu_count()} CPUs; grpcio {grpc.__version__}. Server "
        f"`{server_env}{shlex.join(['python', *server_argv[1:]])}` on loopback; {plan.schedulers} scheduler "
        f"process(es), one KVManagerClient each, on the same cores; {plan.duration_s:.0f} s of load, the first "
        f"{plan.warmup_s:g} s warm-up; Mooncake prompts scaled by {plan.scale:g} "
        f"({round(512 * plan.scale)} tokens per trace block), outputs by {plan.output_scale:g}; up to "
        f"{plan.max_running} running requests per scheduler; seed {plan.seed}. 1-minute load average "
        f"{run.load_average[0]:.2f} at the start, {run.load_average[1]:.2f} at the end; wall {run.wall_s:.0f} s.",
        "",
        "| # | metric | value | unit | note |",
        "|---|---|---:|---|---|",
        row("1", "throughput", fmt(f["request_steps_per_s"]), "req-steps/s", "decode entries that got OK"),
        row("1", "  Steps", fmt(f["steps_per_s"]), "Steps/s", "decode Steps + Steps of nested ops"),
        row("1", "  mean decode batch", fmt(f["decode_batch_mean"]), "requests"),
        row("1", "  server CPU", f"{f['server_cpu_share']:.0%}", "of one core", "/proc/PID/stat"),
        row("2", "decode Step p50, first third", fmt(f["decode_p50_first_ms"]), "ms", first_window),
        row("2", "decode Step p50, last third", fmt(f["decode_p50_last_ms"]), "ms",
            f"{last_window}; last / first {f['decode_p50_ratio']:.2f}"),
        row("2", "decode Step p99, first third", fmt(f["decode_p99_first_ms"]), "ms"),
        row("2", "decode Step p99, last third", fmt(f["decode_p99_last_ms"]), "ms",
            f"last / first {f['decode_p99_ratio']:.2f}"),
        row("2", "nested-ops Step p50 / p99, first third", ops("ops_p50_first_ms", "ops_p99_first_ms"), "ms",
            "admissions (prompt hashing), frees, forks"),
        row("2", "nested-ops Step p50 / p99, last third", ops("ops_p50_last_ms", "ops_p99_last_ms"), "ms"),
        row("2", "server CPU per Step, first / last third",
            ops("server_cpu_per_step_first_ms", "server_cpu_per_step_last_ms"), "ms",
            "all threads, both kinds of Step"),
        row("3", "server RSS after the warm-up", fmt(f["rss_start_mib"]), "MiB", "VmRSS, /proc/PID/status"),
        row("3", "server RSS at the end of the load", fmt(f["rss_end_of_load_mib"]), "MiB"),
        row("3", "server RSS, max", fmt(f["rss_max_mib"]), "MiB"),
        row("3", "server RSS after all frees", fmt(f["rss_after_frees_mib"]), "MiB",
            f"{SETTLE_S:.0f} s after the last free"),
        row("3", "RSS growth, whole load after the warm-up", fmt(f["rss_growth_mib_per_min"]), "MiB/min",
            "least squares"),
        row("3", "RSS growth, second half of the load", fmt(f["rss_growth_second_half_mib_per_min"]), "MiB/min"),
        leak,
        row("3", f"steps issued (the step log keeps the last {STEP_RETENTION:,})", f"{f['last_step_id']:,}", "",
            step_log),
        row("3", f"cache events (the event log keeps the last {EVENT_RETENTION:,})",
            f"{run.samples[-1].last_event_sequence:,}", "", event_log),
        row("4", "usage before the load", f"{base.usage:.4f}", "",
            f"{base.num_free_blocks:,} of {base.num_blocks:,} blocks free"),
        row("4", "usage, peak during the load", f"{f['peak_usage']:.3f}"),
        row("4", "usage after all frees", f"{end.usage:.4f}", "",
            f"{end.num_free_blocks:,} of {end.num_blocks:,} blocks free (cached ones count as free)"),
        row("4", "live requests / pending copies at the end", f"{end.num_requests} / {end.num_pending_copies}", "",
            f"GetBlockTables: {end.num_tables} tables, {end.num_listed_pending_copies} copies"),
        row("4", "pending copies, max during the load", f"{f['max_pending_copies']:,}", "",
            "one fake worker acks every 8 Execute calls of each scheduler"),
        row("4", "ResetPrefixCache after the frees", "ok" if run.reset_prefix_cache_ok else "REFUSED", "",
            "refused while any block is held"),
        row("4", "invariants at the end", "hold" if not violations else "VIOLATED: " + "; ".join(violations), "",
            invariants),
        row("4", "server exit on SIGTERM", str(run.exit_code), "",
            "log clean" if not run.log_problems else "log: " + ", ".join(run.log_problems)),
        row("5", "requests started", f"{c.num_requests:,}", "", "trace requests and fork children"),
        row("5", "admissions (re-admissions after preemption)", f"{c.num_admitted:,} ({c.num_readmitted:,})", "",
            f"prefix-hit rate {f['hit_rate']:.1%} of admitted prompt tokens"),
        row("5", "finished / aborted / freed at the deadline",
            f"{c.num_finished:,} / {c.num_aborted:,} / {c.num_freed_at_end:,}"),
        row("5", "preemptions", f"{c.num_preempted:,}", "",
            f"NO_SPACE: {c.num_no_space_admit:,} admissions, {c.num_no_space_decode:,} decode entries"),
        row("5", "forks (children)", f"{c.num_forks:,} ({c.num_fork_children:,})", "",
            f"{c.num_copies:,} copy-on-write copies"),
        row("5", "evictions from the prefix cache", f"{f['num_evictions']:,}", "blocks"),
    ]


def per_second(run: Run) -> list[dict[str, Any]]:
    rows = []
    for s in run.samples:
        second = int(s.t_s) - 1  # the round trips that ended in the second before this sample
        decode = run.decode_us.get(second, [])
        rows.append(asdict(s) | {
            "decode_steps": len(decode),
            "decode_p50_ms": statistics.median(decode) / 1e3 if decode else None,
            "decode_p99_ms": percentile(decode, 99) / 1e3 if decode else None,
            "ops_steps": len(run.ops_us.get(second, [])),
        })  # fmt: skip
    return rows


# -- main ----------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedulers", type=int, default=4, help="scheduler processes (default %(default)s)")
    parser.add_argument("--duration-s", type=float, default=300.0,
                        help="seconds of load; long enough to fill the service's step log (default %(default)s)")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="seconds left out of the start figures (default: a tenth of the run, at most 10)")
    parser.add_argument("--num-blocks", type=int, default=20_000, help="the server's pool (default %(default)s)")
    parser.add_argument("--scale", type=float, default=1 / 32,
                        help="prompt scale: tokens per 512-token trace block / 512 (default %(default)s)")
    parser.add_argument("--output-scale", type=float, default=1.0,
                        help="output-length scale; 1 keeps the trace's (default %(default)s)")
    parser.add_argument("--max-running", type=int, default=192,
                        help="running requests per scheduler (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the schedulers' sampling seed (default %(default)s)")
    parser.add_argument("--check-invariants", action="store_true",
                        help="serve with --check-invariants: the core's invariants are checked after every mutation "
                        "(O(pool) each, so Steps are slower; for a correctness soak, not for the figures)")
    parser.add_argument("--malloc-arena-max", type=int, default=None,
                        help="run the server with MALLOC_ARENA_MAX=N (glibc: fewer per-thread heaps, less "
                        "fragmentation across the RPC threads; default: unset)")
    parser.add_argument("--json", action="store_true", help="print the figures and per-second samples as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    plan = Plan(
        schedulers=args.schedulers,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s if args.warmup_s is not None else min(10.0, args.duration_s / 10),
        num_blocks=args.num_blocks,
        block_size=16,  # `serve`'s default single full-attention group
        scale=args.scale,
        output_scale=args.output_scale,
        max_running=args.max_running,
        seed=args.seed,
    )
    check_flags = ["--check-invariants"] if args.check_invariants else []
    argv_server = [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0",
                   "--num-blocks", str(plan.num_blocks), "--replica-id", "soak-bench", "--log-level", "WARNING",
                   *check_flags]  # fmt: skip
    env = dict(os.environ)
    if args.malloc_arena_max is not None:
        env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    run = Run()
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="soak_bench_") as directory:
        try:
            server = launch(argv_server, MANAGER_READY_PREFIX, Path(directory) / "server.log", cwd=ROOT, env=env)
        except NotReadyError as error:
            raise SystemExit(f"the server did not start: {error}")
        try:
            with KVManagerClient(server.address) as client:
                client.wait_ready()
                assert client.get_config().groups[0].block_size == plan.block_size
                run.baseline = settle(client, WORKER_ID)
                run_load(plan, server, client, run)
                run.end = settle(client, WORKER_ID)
                time.sleep(SETTLE_S)
                run.rss_after_frees_kib = rss_kib(server.pid)
                run.reset_prefix_cache_ok = client.reset_prefix_cache()
        finally:
            run.exit_code = server.stop()
            log = server.log()
            run.log_problems = [word for word in ("Traceback", "bug in") if word in log]
            if run.log_problems:
                print(log[-4000:], file=sys.stderr)
    run.wall_s = time.monotonic() - started
    run.load_average = (load_start, os.getloadavg()[0])
    f = figures(plan, run)
    command = shlex.join(["python", *sys.argv])
    server_env = f"MALLOC_ARENA_MAX={args.malloc_arena_max} " if args.malloc_arena_max is not None else ""
    report = render(plan, run, f, command, argv_server, bool(check_flags), server_env)
    if args.json:
        print(json.dumps({
            "command": command, "plan": asdict(plan), "check_invariants_flag": bool(check_flags),
            "figures": f, "counters": asdict(run.counters), "baseline": run.baseline._asdict(),
            "end": run.end._asdict(), "end_violations": run.end.violations(),
            "reset_prefix_cache_ok": run.reset_prefix_cache_ok, "exit_code": run.exit_code,
            "log_problems": run.log_problems, "load_average": run.load_average, "report": report,
            "per_second": per_second(run),
        }, indent=1))  # fmt: skip
    else:
        print("\n".join(report))
    clean = not run.end.violations() and run.reset_prefix_cache_ok and run.exit_code == 0 and not run.log_problems
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
