"""The worker's host-side cost per decode step: preparing the inputs, and sampling.

Runs the `ModelRunner` in-process on the CPU with the torch kernels and a
small decoder (2 layers, hidden 64) whose vocabulary has a realistic size, so
that the lm_head and the sampler see the logits of a real model while the
layers cost little. Every request decodes one token per step from a context
of `--context` tokens whose blocks are all in its table.

Each step is split at the model's calls:

- prepare: from `execute` to the start of the forward pass (checks, the
  batch's tensors, block tables, slot mappings);
- sampling: from the end of the logits matmul to the return of `execute`
  (log-softmax, the choice of each token, moving the results to the host);
- execute: the whole call.

Figures are the p50 over `--steps` steps (after `--warmup` steps), in ms.

With `--read-guard`, it times the worker's read guard alone (the host-side
`check` and `record_written` of `gpu_worker/kv_presence.py`), the median of
`--rounds` rounds, in two shapes: a decode step, where every request
continues where its last Execute left off, so nothing is checked block by
block; and a first Execute, where every request reads a context it got as a
prefix hit, so every block of it is scanned (the first step after an
admission with a long hit).

    python bench/worker_step_bench.py                              # vocab 32000 and 128256, batch 1/32/256
    python bench/worker_step_bench.py --vocab 128256 --batch 256 --temperature 1
    python bench/worker_step_bench.py --read-guard                 # context 1000, batch 1/32/256
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels
from gpu_worker.kv_presence import KVPresence, TokenSpan
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape, ScheduledRequest
from gpu_worker.sampling import SamplingParams
from gpu_worker.weights import random_weights
from kvcache.v1 import kv_manager_pb2 as pb

BLOCK_SIZE = 16


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256], help="vocabulary sizes")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256], help="decode rows per step")
    parser.add_argument(
        "--temperature", type=float, nargs="+", default=[0.0, 1.0], help="sampling temperatures (0: greedy)"
    )
    parser.add_argument(
        "--context", type=int, default=None, help="tokens already in each request's cache (default 128; 1000 with --read-guard)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per configuration (default 10; 50 with --read-guard)"
    )
    parser.add_argument("--read-guard", action="store_true", help="time the read guard alone (see above)")
    parser.add_argument("--rounds", type=int, default=5, help="--read-guard: rounds, the median of their medians")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser


class StepClock:
    """Wraps a model's `forward` and `logits` to stamp when they start and end."""

    def __init__(self, model: LlamaModel) -> None:
        self.forward_start = self.logits_end = 0.0
        model.forward = self._stamp_start(model.forward)
        model.logits = self._stamp_end(model.logits)

    def _stamp_start(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: object) -> torch.Tensor:
            self.forward_start = time.perf_counter()
            return fn(*args)

        return wrapped

    def _stamp_end(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: object) -> torch.Tensor:
            out = fn(*args)
            self.logits_end = time.perf_counter()
            return out

        return wrapped


def build_runner(vocab_size: int, batch: int, num_positions: int, context: int) -> ModelRunner:
    """A CPU runner whose `batch` requests `r0..` each hold blocks for `num_positions` positions, the first
    `context` of which count as computed (their KV is the cache's zeros: the bench times decoding, not prefill)."""
    config = ModelConfig(
        f"bench-{vocab_size}", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    blocks_per_request = -(-num_positions // BLOCK_SIZE)
    pool = PoolShape(batch * blocks_per_request, (CacheGroup(0, BLOCK_SIZE),), num_positions, max(batch, 1))
    cpu = torch.device("cpu")
    model = LlamaModel(config, random_weights(config, 0, torch.float32, cpu))
    runner = ModelRunner(model, pool, kernels.load("torch", "cpu"), cpu, torch.float32)
    delta = pb.StepDelta(step_id=1)
    for index in range(batch):
        first = index * blocks_per_request
        row = delta.rows_added.add(request_id=f"r{index}")
        row.groups.add(group_id=0, block_ids=range(first, first + blocks_per_request))
    runner.apply_step(delta)
    runner.presence.record_written([TokenSpan(f"r{index}", 0, context) for index in range(batch)])
    return runner


def bench_one(vocab_size: int, batch: int, temperature: float, args: argparse.Namespace) -> dict[str, float]:
    """p50 ms of prepare, sampling and the whole execute over decode steps of one configuration."""
    num_steps = args.warmup + args.steps
    runner = build_runner(vocab_size, batch, args.context + num_steps, args.context)
    clock = StepClock(runner.model)
    prepare, sampling, execute = [], [], []
    for step in range(num_steps):
        position = args.context + step
        requests = [
            ScheduledRequest(f"r{i}", [(7 * i + step) % vocab_size], position, SamplingParams(temperature, i))
            for i in range(batch)
        ]
        started = time.perf_counter()
        runner.execute(requests)
        ended = time.perf_counter()
        if step >= args.warmup:
            prepare.append(clock.forward_start - started)
            sampling.append(ended - clock.logits_end)
            execute.append(ended - started)
    return {name: statistics.median(samples) * 1e3 for name, samples in
            (("prepare", prepare), ("sampling", sampling), ("execute", execute))}  # fmt: skip


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


def read_guard_report(args: argparse.Namespace) -> None:
    print(f"read guard per Execute, context {args.context} tokens, blocks of {BLOCK_SIZE}; median of {args.rounds} rounds")
    print("| requests | decode step (ms) | first Execute, full scan (ms) |")
    print("|---:|---:|---:|")
    for batch in args.batch:
        decode = statistics.median(decode_ms(batch, args.context, args.steps) for _ in range(args.rounds))
        first = statistics.median(first_execute_ms(batch, args.context, 5) for _ in range(args.rounds))
        print(f"| {batch} | {decode:.3f} | {first:.2f} |")


def main() -> None:
    args = make_parser().parse_args()
    if args.read_guard:
        args.context = 1000 if args.context is None else args.context
        args.steps = 50 if args.steps is None else args.steps
        read_guard_report(args)
        return
    args.context = 128 if args.context is None else args.context
    args.steps = 10 if args.steps is None else args.steps
    torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"context {args.context}, p50 of {args.steps} steps (ms)")  # fmt: skip
    print(f"{'vocab':>7} {'batch':>5} {'temp':>4} {'prepare':>9} {'sampling':>9} {'execute':>9}")
    for vocab_size, batch, temperature in itertools.product(args.vocab, args.batch, args.temperature):
        figures = bench_one(vocab_size, batch, temperature, args)
        print(
            f"{vocab_size:>7} {batch:>5} {temperature:>4g} {figures['prepare']:>9.3f} {figures['sampling']:>9.3f} "
            f"{figures['execute']:>9.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
