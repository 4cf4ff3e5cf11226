"""The tooling subcommands of `kv-manager`: `replay` (the trace through the in-process core) and
`demo` (a manager, a worker and the reference scheduler on the trace). The command line adds them with
`add_tool_commands` and hands them to `run_tool_command`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kv_manager_service.cli.flags import add_pool_flags, build_config
from kv_manager_service.core import KVCacheManager
from kv_manager_service.shared.arg_types import fraction, positive_int
from kv_tooling.demo_flags import add_demo_flags
from kv_tooling.replay import ReplayConfig, ReplayProgress, replay
from kv_tooling.workload import DEFAULT_TRACE, TokenExpander, load_trace


def add_tool_commands(commands: argparse._SubParsersAction) -> None:
    replay = commands.add_parser(
        "replay",
        help="replay the Mooncake trace through the block manager and report hits, usage and speed",
        description="Replays a Mooncake trace through the core with the reference scheduler's loop "
        "(continuous batching, chunked prefill, preemption on NO_SPACE). No model runs: only the block "
        "manager works.",
    )
    replay.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSON-lines trace (default: %(default)s)")
    replay.add_argument("--requests", type=positive_int, default=400, help="replay the first N requests (default %(default)s)")
    replay.add_argument(
        "--scale",
        type=fraction,
        default=1.0,
        help="shrink every 512-token trace block to round(512 * SCALE) tokens, outputs likewise (default %(default)s)",
    )
    replay.add_argument("--token-budget", type=positive_int, default=8192, help="tokens per scheduler step (default %(default)s)")
    replay.add_argument("--max-running", type=positive_int, default=256, help="requests running at once (default %(default)s)")
    add_pool_flags(replay, default_num_blocks=100_000)

    demo = commands.add_parser(
        "demo",
        help="run a manager, a worker and a scheduler on a scaled Mooncake trace, and report",
        description="Starts a kv-manager and a gpu-worker (CPU, torch backend) as local processes, or "
        "connects to running ones (--replica), and replays a window of the Mooncake trace (by default one "
        "where conversations continue and share prefixes) through the reference scheduler (continuous "
        "batching, chunked prefill, preemption on NO_SPACE). "
        "Prints a report and writes report.json and demo.png. Needs the worker extra.",
    )
    add_demo_flags(demo)


def run_tool_command(args: argparse.Namespace) -> int:
    if args.command == "replay":
        return run_replay(args)
    from kv_tooling.demo import run_demo  # torch and the worker: only when the demo runs

    return run_demo(args)


def run_replay(args: argparse.Namespace) -> int:
    config = build_config(args)
    if not args.trace.exists():
        raise ValueError(f"trace file {args.trace} not found; pass --trace PATH")
    records = load_trace(args.trace, limit=args.requests)
    manager = KVCacheManager(config)
    expander = TokenExpander(scale=args.scale)
    replay_config = ReplayConfig(token_budget=args.token_budget, max_num_running=args.max_running, progress_every_steps=200)
    block_size = config.groups[0].block_size
    print(
        f"Replaying {len(records)} requests of {args.trace.name} (scale {args.scale}) through a pool of "
        f"{config.num_blocks} blocks x {block_size} tokens, prefix caching "
        f"{'on' if config.enable_prefix_caching else 'off'}"
        + (f", host tier of {config.num_host_blocks} blocks" if config.num_host_blocks else ""),
        file=sys.stderr,
    )

    def show(p: ReplayProgress) -> None:
        stats = manager.stats()
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        print(
            f"  step {p.num_steps:>6}: {p.num_completed:>5}/{len(records)} done, {p.num_running:>3} running, "
            f"usage {p.usage:6.1%}, prefix hits {hit_rate:6.1%}",
            file=sys.stderr,
        )

    result = replay(manager, records, expander, replay_config, progress=show)
    rows = [
        ("requests completed", f"{result.num_completed} / {result.num_requests}"),
        ("prompt tokens", f"{result.num_prompt_tokens:,}"),
        ("output tokens", f"{result.num_output_tokens:,}"),
        ("scheduler steps", f"{result.num_steps:,}"),
        ("prefix-hit rate (tokens)", f"{result.prefix_hit_rate:.1%}"),
        ("peak KV usage", f"{result.peak_usage:.1%}"),
        ("preemptions", f"{result.num_preemptions}"),
        ("evictions", f"{manager.stats().num_evictions:,}"),
    ]
    if config.num_host_blocks:
        generated = max(result.num_output_tokens, 1)
        offloaded, onloaded = result.num_offloaded_blocks, result.num_onloaded_blocks
        rows += [
            ("device hit rate (tokens)", f"{result.device_hit_rate:.1%}"),
            ("host hit rate (tokens)", f"{result.host_hit_rate:.1%}"),
            ("offloaded blocks", f"{offloaded:,} ({offloaded / generated:.2f} per output token)"),
            ("onloaded blocks", f"{onloaded:,} ({onloaded / generated:.2f} per output token)"),
            ("host evictions", f"{result.num_host_evictions:,}"),
            ("offloads dropped (host pinned)", f"{result.num_dropped_offloads:,}"),
        ]
    rows += [
        ("wall time", f"{result.wall_s:.2f} s"),
        ("requests per second", f"{result.requests_per_s:,.1f}"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nReplay report")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0
