"""`kv-manager demo`: a manager, a worker and the reference scheduler on a scaled Mooncake trace.

Without `--replica`, the demo starts one `kv-manager serve` and one
`gpu-worker` (CPU, torch backend) as local processes; with `--replica
MANAGER=WORKER` (repeatable) it drives services already running, and sends
each request to the replica holding the longest cached prefix of it (one
cluster lookup through the Redis mirror when the replicas mirror, else one
lookup per replica). The workload is a window of the trace: `--requests`
requests from `--start` on; by default the window of the project's trace
where conversations continue (`demo_flags.DEFAULT_START`), so prefix hits
show. Every request of the window is waiting from the start, in trace order;
a replica takes new requests while its waiting queue is short, so routing
sees what earlier requests cached.

With a host tier (`--num-host-blocks N` for the local manager, or running
managers started with one), the report splits the hits by tier and gives the
tier's copy volume from the managers' GetStats, in blocks and, when the
worker's pool is all full attention (so every layer's block moves), in bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from typing import Callable

from kv_manager_service.client import KVManagerClient
from kv_tooling.launch import Interrupted, LaunchedProcess, launch, stopped_on_signals
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX, WORKER_READY_PREFIX, NotReadyError
from kv_tooling.workload import DEFAULT_TRACE, TokenExpander, TraceRecord, load_trace
from kvcache.v1 import kv_manager_pb2 as pb
from kvcache.v1 import worker_pb2
from kv_tooling.demo_flags import DEFAULT_START
from kv_tooling.demo_report import Sample, build_report, print_report, write_figure
from kv_tooling.progress import ProgressBar
from reference_scheduler.scheduler import ReferenceScheduler, SchedulerConfig
from reference_scheduler.worker_client import WorkerClient

# How long a replica's manager, then its worker, may take to answer (a local one is ready before it is asked).
REPLICA_READY_TIMEOUT_S = 10.0

@dataclasses.dataclass
class ReplicaStack:
    """One manager and the worker that follows it, with the scheduler that drives them."""

    replica_id: str
    manager: KVManagerClient
    worker: WorkerClient
    scheduler: ReferenceScheduler
    block_size: int
    num_blocks: int
    mirrored: bool
    stats_before: pb.GetStatsResponse
    num_host_blocks: int  # the manager's host tier; 0: none
    tier_block_bytes: int | None  # bytes one tier copy moves; None: unknown (not every group is full attention)
    num_routed: int = 0


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; on SIGTERM, SIGHUP or SIGINT, stop the manager and worker it started, say so in one
    line, and exit 128 + the signal's number."""
    try:
        with stopped_on_signals():
            return _run_demo(args)
    except Interrupted as stop:
        print(f"kv-manager demo: {stop}: stopped, with the manager and worker it started", file=sys.stderr)
        return 128 + stop.signum


def _run_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("matplotlib") is None:  # said now, not after the run, at the figure
        raise ValueError("the demo's figure needs matplotlib: install the demo extra (pip install '.[demo]')")
    trace = args.trace or DEFAULT_TRACE
    start = trace_start(args)
    if not trace.exists():
        raise ValueError(f"trace file {trace} not found; pass --trace PATH")
    records = load_trace(trace, limit=start + args.requests)
    if len(records) <= start:
        raise ValueError(
            f"--start {start} is past the end of {trace} ({len(records)} requests); pass a smaller --start"
        )
    records = records[start:]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    processes: list[LaunchedProcess] = []
    try:
        pairs = args.replica or [_start_local(args, processes)]
        replicas = [_connect(manager, worker, args) for manager, worker in pairs]
        ids = [r.replica_id for r in replicas]
        if len(set(ids)) != len(ids):
            raise ValueError(f"--replica: the managers' replica ids must differ, got {ids} (set serve --replica-id)")
        vocab_size = min(r.worker.info().vocab_size for r in replicas)
        expander = TokenExpander(vocab_size=vocab_size, scale=args.scale)
        workload = [(f"req-{start + i}", record) for i, record in enumerate(records)]  # named by trace index
        print(_banner(args, replicas, trace.name, start, len(workload)), file=sys.stderr)
        samples, wall_s = _drive(replicas, workload, expander, args)
        report = build_report(replicas, samples, wall_s, args, trace.name, start)
        print_report(report)
        (args.output_dir / "report.json").write_text(report.to_json())
        title = f"kv-manager demo: requests {start}..{start + len(workload) - 1} of {trace.name}, scaled"
        write_figure(samples, args.output_dir / "demo.png", title, host_tier=report.host_tier is not None)
        print(f"\nwrote {args.output_dir / 'report.json'} and {args.output_dir / 'demo.png'}")
    finally:
        for process in reversed(processes):
            process.stop()
    return 0


def trace_start(args: argparse.Namespace) -> int:
    """The window's first trace index: `--start`, else `DEFAULT_START` for the project's trace and 0 for another."""
    if args.start is not None:
        return args.start
    return DEFAULT_START if args.trace is None else 0


def _start_local(args: argparse.Namespace, processes: list[LaunchedProcess]) -> tuple[str, str]:
    """A manager and a worker as child processes; their logs go to the output directory."""
    if importlib.util.find_spec("torch") is None:
        raise ValueError("the demo's local worker needs torch: install the worker extra (pip install '.[worker]') or use --replica")
    python = sys.executable
    logs = args.output_dir
    manager = launch(
        [python, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--replica-id", "demo",
         "--num-blocks", str(args.num_blocks), "--block-size", "16",
         "--num-host-blocks", str(args.num_host_blocks)],
        MANAGER_READY_PREFIX, logs / "manager.log",
    )  # fmt: skip
    processes.append(manager)
    try:
        worker = launch(
            [python, "-m", "gpu_worker.cli", "--manager", manager.address, "--model", args.model,
             "--backend", args.backend, "--device", "cpu", "--worker-id", "demo-worker"],
            WORKER_READY_PREFIX, logs / "worker.log", timeout_s=300,
        )  # fmt: skip
    except NotReadyError as error:
        raise ValueError(f"the worker did not start: {error}") from None
    processes.append(worker)
    return manager.address, worker.address


def _connect(manager_address: str, worker_address: str, args: argparse.Namespace) -> ReplicaStack:
    manager = KVManagerClient(manager_address)
    worker = WorkerClient(worker_address)
    for side, client, address in (("kv-manager", manager, manager_address), ("gpu-worker", worker, worker_address)):
        try:
            client.wait_ready(REPLICA_READY_TIMEOUT_S)
        except Exception:
            raise ValueError(
                f"replica {manager_address}={worker_address}: the {side} at {address} did not answer within "
                f"{REPLICA_READY_TIMEOUT_S:g} s; is it running, and is that its address?"
            ) from None
    config = manager.get_config()
    stats = manager.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    scheduler = ReferenceScheduler(manager, worker, SchedulerConfig(args.token_budget, args.max_running))
    return ReplicaStack(
        config.replica_id, manager, worker, scheduler, config.groups[0].block_size, config.num_blocks,
        stats.mirror_enabled, stats, config.num_host_blocks, tier_block_bytes(config, worker.info()),
    )  # fmt: skip


def tier_block_bytes(config: pb.GetConfigResponse, info: worker_pb2.GetWorkerInfoResponse) -> int | None:
    """Bytes of one tier copy (a block over every tier layer); None when the worker's cache does not tell them.

    The tier holds the full-attention layers' blocks. When every group is
    full attention, those are all of the worker's layers, so a block's bytes
    are the worker's KV cache bytes over its blocks (one tensor per layer,
    `num_blocks` blocks each).
    """
    if not config.num_host_blocks or not info.num_blocks:
        return None
    if any(group.kind != pb.GROUP_KIND_FULL_ATTENTION for group in config.groups):
        return None
    return info.kv_cache_bytes // info.num_blocks


def _drive(
    replicas: list[ReplicaStack], workload: list[tuple[str, TraceRecord]], expander: TokenExpander, args: argparse.Namespace
) -> tuple[list[Sample], float]:
    """Run every request to completion; a sample of the replicas' state after every round of steps."""
    pending = list(reversed(workload))  # pop() takes them in trace order
    total = len(workload)
    samples: list[Sample] = []
    progress = ProgressBar(total, enabled=not args.no_progress)
    started = time.perf_counter()
    while pending or any(r.scheduler.has_work for r in replicas):
        for replica in replicas:
            while pending and len(replica.scheduler.waiting) < max(2, args.max_running // 4):
                request_id, record = pending.pop()
                prompt = expander.prompt_token_ids(record)
                target = _route(replicas, prompt) if len(replicas) > 1 else replica
                target.scheduler.add(request_id, prompt, max(1, round(record.output_length * args.output_scale)))
                target.num_routed += 1
        for replica in replicas:
            if replica.scheduler.has_work:
                replica.scheduler.step()
        sample = _sample(replicas, time.perf_counter() - started, args.max_model_len)
        samples.append(sample)
        progress.update(sample.num_completed, sample.hit_rate, sample.usage, sample.num_preemptions)
    for replica in replicas:
        replica.scheduler.flush()
    progress.close()
    return samples, time.perf_counter() - started


def _route(replicas: list[ReplicaStack], prompt: list[int]) -> ReplicaStack:
    """The replica with the longest cached prefix of `prompt`; ties go to the one with less work."""
    by_id = {r.replica_id: r for r in replicas}
    cached: dict[str, int] = {}
    if all(r.mirrored for r in replicas):
        _, answers = replicas[0].manager.find_cache_hit(prompt, cluster=True)
        cached = {a.replica_id: a.num_cached_tokens for a in answers if a.replica_id in by_id}
    else:
        for replica in replicas:
            hit, _ = replica.manager.find_cache_hit(prompt)
            cached[replica.replica_id] = hit.num_cached_tokens
    load: Callable[[ReplicaStack], int] = lambda r: len(r.scheduler.waiting) + len(r.scheduler.running)  # noqa: E731
    return max(replicas, key=lambda r: (cached.get(r.replica_id, 0), -load(r)))


def _sample(replicas: list[ReplicaStack], t_s: float, max_model_len: int) -> Sample:
    queries = hits = host_hits = used = total = 0
    offloaded = onloaded = 0
    offloaded_bytes: int | None = 0
    onloaded_bytes: int | None = 0
    real = paged = own_max = contiguous = 0
    cached = admitted = 0
    for replica in replicas:
        counters = replica.scheduler.counters
        cached += counters.num_cached_tokens
        admitted += counters.num_admitted_tokens
        stats = replica.manager.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        queries += stats.prefix_cache_queries - replica.stats_before.prefix_cache_queries
        hits += stats.prefix_cache_hits - replica.stats_before.prefix_cache_hits
        host_hits += stats.prefix_cache_host_hits - replica.stats_before.prefix_cache_host_hits
        num_offloaded = stats.num_offloaded_blocks - replica.stats_before.num_offloaded_blocks
        num_onloaded = stats.num_onloaded_blocks - replica.stats_before.num_onloaded_blocks
        offloaded += num_offloaded
        onloaded += num_onloaded
        if replica.num_host_blocks:
            offloaded_bytes = _add_bytes(offloaded_bytes, num_offloaded, replica.tier_block_bytes)
            onloaded_bytes = _add_bytes(onloaded_bytes, num_onloaded, replica.tier_block_bytes)
        used += round(stats.usage * (stats.num_blocks - 1))
        total += stats.num_blocks - 1
        block_size = replica.block_size
        for request in replica.scheduler.running:
            tokens = request.num_computed_tokens
            real += tokens
            paged += -(-tokens // block_size) * block_size
            longest = request.num_prompt_tokens + request.max_new_tokens
            own_max += longest
            contiguous += max(max_model_len, longest)
    schedulers = [r.scheduler for r in replicas]
    return Sample(
        t_s=t_s,
        usage=used / total if total else 0.0,
        hit_rate=hits / queries if queries else 0.0,
        host_hit_rate=host_hits / queries if queries else 0.0,
        num_running=sum(len(s.running) for s in schedulers),
        num_waiting=sum(len(s.waiting) for s in schedulers),
        num_completed=sum(1 for s in schedulers for r in s.sequences.values() if r.finished),
        num_preemptions=sum(s.num_preemptions for s in schedulers),
        real_tokens=real,
        paged_slots=paged,
        own_max_slots=own_max,
        contiguous_slots=contiguous,
        num_prefix_hit_tokens=cached,
        prefill_tokens_computed=admitted - cached,
        num_offloaded_blocks=offloaded,
        num_onloaded_blocks=onloaded,
        offloaded_bytes=offloaded_bytes,
        onloaded_bytes=onloaded_bytes,
    )


def _add_bytes(total: int | None, num_blocks: int, block_bytes: int | None) -> int | None:
    """`total` plus `num_blocks` copies of `block_bytes` each; None once any replica's block bytes are unknown."""
    return None if total is None or block_bytes is None else total + num_blocks * block_bytes


def _banner(args: argparse.Namespace, replicas: list[ReplicaStack], trace_name: str, start: int, num_requests: int) -> str:
    where = (
        f"{len(replicas)} replica{'' if len(replicas) == 1 else 's'} ({', '.join(r.replica_id for r in replicas)})"
        if args.replica
        else f"a local manager ({replicas[0].num_blocks} blocks x {replicas[0].block_size} tokens"
        + (f", host tier of {replicas[0].num_host_blocks} blocks" if replicas[0].num_host_blocks else "")
        + f") and worker ({args.model}, {args.backend} backend, CPU)"
    )
    window = (
        f"the first {num_requests} requests" if start == 0 else f"requests {start}..{start + num_requests - 1}"
    )
    return (
        f"Replaying {window} of {trace_name} (prompts x {args.scale:g}, outputs x "
        f"{args.output_scale:g}) on {where}; token budget {args.token_budget}, up to {args.max_running} running"
    )


