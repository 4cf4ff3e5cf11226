"""What the worker's read guard (`gpu_worker/kv_presence.py`) costs per Execute, on the host.

Two shapes, each the median of `--rounds` rounds of `--steps` Executes:

- a decode step: every request continues where its last Execute left off,
  so the guard checks nothing block by block (`check`, then `record_written`);
- a first Execute: every request reads a context it got as a prefix hit, so
  the guard scans every block of it (the cost of the first step after an
  admission with a long hit).

    python bench/kv_presence_bench.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from gpu_worker.kv_presence import KVPresence, TokenSpan
from kvcache.v1 import kv_manager_pb2 as pb

BLOCK_SIZE = 16


def presence_with(batch: int, context: int, num_positions: int) -> KVPresence:
    """`batch` requests r0.. each with blocks for `num_positions` positions, the first `context` of them filled."""
    blocks_per_request = -(-num_positions // BLOCK_SIZE)
    presence = KVPresence(1 + batch * blocks_per_request, [BLOCK_SIZE], [0])
    delta = pb.StepDelta(step_id=1)
    for index in range(batch):
        first = 1 + index * blocks_per_request
        row = delta.rows_added.add(request_id=f"r{index}")
        row.groups.add(group_id=0, block_ids=range(first, first + blocks_per_request))
    presence.apply_step(delta)
    presence.record_written([TokenSpan(f"r{index}", 0, context) for index in range(batch)])
    return presence


def decode_ms(batch: int, context: int, steps: int) -> float:
    presence = presence_with(batch, context, context + steps)
    times = []
    for step in range(steps):
        spans = [TokenSpan(f"r{index}", context + step, 1) for index in range(batch)]
        started = time.perf_counter()
        assert presence.check(spans) is None
        presence.record_written(spans)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def first_execute_ms(batch: int, context: int, steps: int) -> float:
    times = []
    for _ in range(steps):
        presence = presence_with(batch, context, context + 1)
        presence.num_computed_here.clear()  # as after an admission: nothing executed here for them yet
        spans = [TokenSpan(f"r{index}", context, 1) for index in range(batch)]
        started = time.perf_counter()
        assert presence.check(spans) is None
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256], help="requests per Execute")
    parser.add_argument("--context", type=int, default=1000, help="tokens each request has computed")
    parser.add_argument("--steps", type=int, default=50, help="Executes per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median of their medians is reported")
    args = parser.parse_args()
    print(f"read guard per Execute, context {args.context} tokens, blocks of {BLOCK_SIZE}; median of {args.rounds} rounds")
    print("| requests | decode step (ms) | first Execute, full scan (ms) |")
    print("|---:|---:|---:|")
    for batch in args.batch:
        decode = statistics.median(decode_ms(batch, args.context, args.steps) for _ in range(args.rounds))
        first = statistics.median(first_execute_ms(batch, args.context, 5) for _ in range(args.rounds))
        print(f"| {batch} | {decode:.3f} | {first:.2f} |")


if __name__ == "__main__":
    main()
