"""The tooling subcommands of `kv-manager`: `replay` (the trace through the in-process core) and
`demo` (a manager, a worker and the reference scheduler on the trace). The command line adds them with
`add_tool_commands` and hands them to `run_tool_command`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kv_manager_service.cli.flags import add_pool_flags, build_config
from kv_manager_service.core import KVCacheManager
from kv_manager_service.shared.arg_types import fraction, positive_int
from kv_tooling.cost_model import StepCostModel
from kv_tooling import conversations
from kv_tooling.demo_flags import add_demo_flags
from kv_tooling.eviction_oracle import REFERENCE_ORDERS, NextUseOracle
from kv_tooling.replay import ARRIVALS, ReplayConfig, ReplayProgress, ReplayResult, arrival_times_s, replay
from kv_tooling.workload import DEFAULT_TRACE, TokenExpander, load_trace


def add_tool_commands(commands: argparse._SubParsersAction) -> None:
    replay = commands.add_parser(
        "replay",
        help="replay the Mooncake trace through the block manager and report prefill computed, hits and TTFT",
        description="Replays a Mooncake trace through the core with the reference scheduler's loop "
        "(continuous batching, chunked prefill, preemption on NO_SPACE). No model runs: only the block "
        "manager works, and a simulated clock advances by a cost model of each step (defaults: Llama-3-8B "
        "in bf16 on one H200). Reports the prefill tokens computed, prefix hits on first admission (by "
        "tier), preemptions, the host tier's copies, and TTFT/TPOT on the simulated clock.",
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
    replay.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="trace",
        help="trace: release each request at its trace timestamp (relative to the first); asap: every "
        "request waits from the start, so concurrency is what the pool allows (default %(default)s)",
    )
    replay.add_argument(
        "--time-scale",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="multiply the gaps between trace timestamps by S (2: arrivals half as dense; default %(default)s)",
    )
    replay.add_argument(
        "--no-expect-waiting",
        dest="expect_waiting",
        action="store_false",
        help="do not tell the manager the waiting requests' prompts (expect ops): their cached blocks are then "
        "evicted in the policy's order like any other (default: told, as the reference scheduler does)",
    )
    replay.add_argument(
        "--splice-turns",
        action="store_true",
        help="start a conversation's next turn with its previous turn's prompt and generated tokens, so the "
        "blocks a turn generates are what the next one hits; a turn whose predecessor still runs waits for it "
        "(for multi-turn traces; kv_tooling/turn_splicing.py says how turns are matched)",
    )
    replay.add_argument(
        "--report-json", type=Path, metavar="PATH", help="also write the figures to PATH as one JSON object"
    )
    add_cost_model_flags(replay)
    add_pool_flags(replay, default_num_blocks=100_000, reference_orders=REFERENCE_ORDERS)

    generator = commands.add_parser(
        "conversations",
        help="write a multi-turn conversation trace in the Mooncake format, for replay",
        description="Generates a seeded trace of conversations whose turns extend the previous prompt with the "
        "previous output and a new message (kv_tooling/conversations.py says how, and what it assumes), in the "
        "Mooncake JSON-lines format that `kv-manager replay --trace` reads.",
    )
    conversations.add_arguments(generator)

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


def add_cost_model_flags(parser: argparse.ArgumentParser) -> None:
    """The step cost model's parameters (`cost_model.StepCostModel`); the defaults are its own."""
    defaults = StepCostModel()
    group = parser.add_argument_group(
        "step cost model (the simulated clock; defaults: Llama-3-8B, bf16, on one H200, see kv_tooling/cost_model.py)"
    )
    for flag, value_type, help_text in (
        ("--prefill-us-per-token", non_negative_float, "microseconds of compute per prefill token (default: "
         "2 x 8.03e9 FLOPs at 40%% of 989 TFLOPS, %(default).1f)"),
        ("--decode-step-ms", non_negative_float, "milliseconds per step with decode rows: the weights read once "
         "(default: 16.06 GB at 4.8 TB/s, %(default).2f)"),
        ("--decode-us-per-row", non_negative_float, "microseconds of compute per decode row (default: as a "
         "prefill token, %(default).1f)"),
        ("--hbm-gb-per-s", positive_float, "HBM bandwidth at which decode rows read their context's K and V, "
         "in GB/s (default %(default).0f)"),
        ("--link-gb-per-s", positive_float, "host link rate of the host tier's copies, offloads and onloads "
         "together, in GB/s (default: PCIe Gen5 x16 effective, %(default).0f)"),
    ):  # fmt: skip
        name = flag[2:].replace("-", "_")
        group.add_argument(flag, type=value_type, default=getattr(defaults, name), metavar="X", help=help_text)
    group.add_argument(
        "--kv-bytes-per-token", type=positive_int, default=defaults.kv_bytes_per_token, metavar="N",
        help="bytes of K and V per token, all layers: decode reads and copy sizes (default: 2 x 32 layers x 8 KV "
        "heads x 128 x 2 bytes, %(default)s)",
    )  # fmt: skip


def non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def run_tool_command(args: argparse.Namespace) -> int:
    if args.command == "replay":
        return run_replay(args)
    if args.command == "conversations":
        return conversations.run(args)
    from kv_tooling.demo import run_demo  # torch and the worker: only when the demo runs

    return run_demo(args)


def run_replay(args: argparse.Namespace) -> int:
    config = build_config(args)
    if not args.trace.exists():
        raise ValueError(f"trace file {args.trace} not found; pass --trace PATH")
    records = load_trace(args.trace, limit=args.requests)
    manager = KVCacheManager(config)
    expander = TokenExpander(scale=args.scale)
    oracle = None
    if args.eviction_policy in REFERENCE_ORDERS:
        print(f"Hashing every prompt ahead for the {args.eviction_policy} order ...", file=sys.stderr)
        queued = args.eviction_policy == "belady-queued"
        oracle = NextUseOracle(
            records, expander, manager.hasher,
            arrival_times_s(records, args.arrivals, args.time_scale) if queued else None,
        )  # fmt: skip
        manager.pool.set_ranker(oracle.key)
    # Each parameter's flag is its name: --prefill-us-per-token sets prefill_us_per_token.
    cost_model = StepCostModel(**{f.name: getattr(args, f.name) for f in dataclasses.fields(StepCostModel)})
    replay_config = ReplayConfig(
        token_budget=args.token_budget,
        max_num_running=args.max_running,
        progress_every_steps=200,
        arrivals=args.arrivals,
        time_scale=args.time_scale,
        cost_model=cost_model,
        expect_waiting=args.expect_waiting,
        splice_turns=args.splice_turns,
    )
    block_size = config.groups[0].block_size
    print(
        f"Replaying {len(records)} requests of {args.trace.name} (scale {args.scale}, arrivals {args.arrivals}"
        + (f", time scale {args.time_scale:g}" if args.arrivals == "trace" else "")
        + f") through a pool of {config.num_blocks} blocks x {block_size} tokens, prefix caching "
        f"{'on' if config.enable_prefix_caching else 'off'}"
        + (f", host tier of {config.num_host_blocks} blocks" if config.num_host_blocks else ""),
        file=sys.stderr,
    )

    def show(p: ReplayProgress) -> None:
        print(
            f"  step {p.num_steps:>6}: {p.num_completed:>5}/{len(records)} done, {p.num_running:>3} running, "
            f"{p.num_waiting:>5} waiting, usage {p.usage:6.1%}, clock {p.clock_s:8.1f} s",
            file=sys.stderr,
        )

    result = replay(manager, records, expander, replay_config, progress=show, oracle=oracle)
    print_replay_report(
        result, manager.stats().num_evictions, with_tier=bool(config.num_host_blocks), spliced=args.splice_turns
    )
    if args.report_json is not None:
        report = {
            "trace": args.trace.name,
            "scale": args.scale,
            "arrivals": args.arrivals,
            "time_scale": args.time_scale,
            "num_blocks": config.num_blocks,
            "num_host_blocks": config.num_host_blocks,
            "eviction_policy": args.eviction_policy or config.eviction_policy.value,
            "expect_waiting": args.expect_waiting,
            "splice_turns": args.splice_turns,
            "block_size": block_size,
            "token_budget": args.token_budget,
            "max_running": args.max_running,
            **result.figures(),
            "cost_model": dataclasses.asdict(cost_model),
        }
        args.report_json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def print_replay_report(result: ReplayResult, num_evictions: int, with_tier: bool, spliced: bool = False) -> None:
    """The console report: the figures of `ReplayResult.figures`, with rates and the wall time.

    Hit rates are hits on first admission over the prompt tokens; re-admissions' hits are their own row.
    """
    prompt = max(result.num_prompt_tokens, 1)
    computed = result.num_prefill_tokens_computed

    def share(num_tokens: int) -> str:
        return f"{num_tokens / prompt:.1%} ({num_tokens:,} tokens)"

    rows = [
        ("requests completed", f"{result.num_completed} / {result.num_requests}"),
        ("prompt tokens", f"{result.num_prompt_tokens:,}"),
        ("output tokens", f"{result.num_output_tokens:,}"),
        ("scheduler steps", f"{result.num_steps:,}"),
        ("prefix-hit rate (tokens)", share(result.num_prefix_hit_tokens) + ", on first admission"),
    ]
    if with_tier:
        rows += [
            ("device hit rate (tokens)", share(result.num_prefix_hit_tokens - result.num_host_hit_tokens)),
            ("host hit rate (tokens)", share(result.num_host_hit_tokens)),
        ]
    rows += [
        ("re-admission hits", f"{result.num_readmission_hit_tokens:,} tokens (after preemption, not counted above)"),
        ("prefill tokens computed", f"{computed:,} ({computed / prompt:.1%} of prompt tokens)"),
        ("decode rows", f"{result.num_decode_rows:,}"),
        ("peak KV usage", f"{result.peak_usage:.1%}"),
        ("preemptions", f"{result.num_preemptions}"),
        ("evictions", f"{num_evictions:,}"),
    ]
    if spliced:
        rows += [
            ("spliced turns", f"{result.num_spliced_turns:,} (prompts that start with their previous turn's tokens)"),
            ("held turns", f"{result.num_held_turns:,} (released when their previous turn finished)"),
        ]
    if with_tier:
        generated = max(result.num_output_tokens, 1)
        offloaded, onloaded = result.num_offloaded_blocks, result.num_onloaded_blocks
        rows += [
            ("offloaded blocks", f"{offloaded:,} ({offloaded / generated:.2f} per output token)"),
            ("onloaded blocks", f"{onloaded:,} ({onloaded / generated:.2f} per output token)"),
            ("host evictions", f"{result.num_host_evictions:,}"),
            ("offloads dropped (host pinned)", f"{result.num_dropped_offloads:,}"),
        ]
    rows += [
        ("TTFT p50 / p99", f"{result.ttft_ms_p50:,.1f} / {result.ttft_ms_p99:,.1f} ms (simulated)"),
        ("TPOT p50", f"{result.tpot_ms_p50:,.2f} ms (simulated)"),
        ("makespan", f"{result.makespan_s:,.1f} s (simulated)"),
        ("wall time", f"{result.wall_s:.2f} s"),
        ("requests per second", f"{result.requests_per_s:,.1f} (wall time)"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nReplay report")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
