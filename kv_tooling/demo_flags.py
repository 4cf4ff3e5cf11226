"""The flags of `kv-manager demo`, kept free of torch so `kv-manager --help` stays light."""

from __future__ import annotations

import argparse
from pathlib import Path

from kv_manager_service.shared.arg_types import fraction, non_negative_int, positive_int

# The project's trace opens with requests that share little (5% of the first 120's prompt
# blocks repeat a prefix sent earlier in those 120); later, conversations and documents come
# back. Requests 3840..3959 are the window where they come back most: 54% of their prompt
# blocks continue a prefix that an earlier request of the same window sent.
DEFAULT_START = 3840
# A pool that keeps those prefixes until they come back: at 512 blocks the window's running
# requests evict most of them first (18% hits instead of 54%).
DEFAULT_NUM_BLOCKS = 2048


def _replica(text: str) -> tuple[str, str]:
    manager, sep, worker = text.partition("=")
    if not sep or ":" not in manager or ":" not in worker:
        raise argparse.ArgumentTypeError(f"expected MANAGER_HOST:PORT=WORKER_HOST:PORT, got {text!r}")
    return manager, worker


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--start", type=non_negative_int,
        help=f"replay from this trace request on (0-based line index; default {DEFAULT_START} for the project's "
        "trace, where its conversations continue and share prefixes; 0 with --trace)",
    )  # fmt: skip
    workload.add_argument("--requests", type=positive_int, default=120, help="replay N trace requests from --start on (default %(default)s)")
    workload.add_argument(
        "--scale", type=fraction, default=1 / 32,
        help="every 512-token trace block becomes round(512 * SCALE) prompt tokens (default 1/32: 16 tokens)",
    )  # fmt: skip
    workload.add_argument(
        "--output-scale", type=fraction, default=1 / 8,
        help="output lengths are the trace's times this (default 1/8)",
    )  # fmt: skip
    workload.add_argument("--trace", type=Path, help="Mooncake JSON-lines trace (default: the project's copy)")

    scheduler = parser.add_argument_group("scheduler")
    scheduler.add_argument("--token-budget", type=positive_int, default=1024, help="tokens per step; longer prompts are prefilled in chunks (default %(default)s)")
    scheduler.add_argument("--max-running", type=positive_int, default=32, help="requests running at once per replica (default %(default)s)")
    scheduler.add_argument(
        "--max-model-len", type=positive_int, default=2048,
        help="the contiguous reservation the report compares paging with: each request reserves this many "
        "token slots, or its own maximum length if longer (default %(default)s)",
    )  # fmt: skip

    local = parser.add_argument_group("local services (when no --replica is given)")
    local.add_argument("--model", default="small", help="the worker's model: a built-in name or a checkpoint directory (default %(default)s)")
    local.add_argument("--backend", choices=["torch", "triton"], default="torch", help="the worker's kernels (default %(default)s)")
    local.add_argument("--num-blocks", type=positive_int, default=DEFAULT_NUM_BLOCKS, help="the manager's pool, 16-token blocks (default %(default)s)")
    local.add_argument(
        "--num-host-blocks", type=non_negative_int, default=0,
        help="the manager's host-memory tier behind the pool, in blocks; the report then splits hits by tier "
        "and gives the tier's copy volume (default %(default)s: no tier)",
    )  # fmt: skip

    remote = parser.add_argument_group("running services")
    remote.add_argument(
        "--replica", type=_replica, action="append", default=[], metavar="MANAGER=WORKER",
        help="a running kv-manager and its gpu-worker, as HOST:PORT=HOST:PORT; repeat for several replicas: "
        "each request goes to the replica with the longest cached prefix",
    )  # fmt: skip

    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", type=Path, default=Path("demo-out"), help="where report.json and demo.png go (default %(default)s)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar (a line every few seconds instead)")
