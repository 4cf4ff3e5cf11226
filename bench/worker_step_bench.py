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

With `--step-cost`, it measures the CPU side of a decode step as a GPU
worker pays it, per configuration: the ms of prepare (checks, staging, block
tables), sampling and the whole execute, and the ops the step dispatches
(torch ops that are not views, each a launch or a host op on a GPU; a call
of a kernel counted once, whatever its torch reference runs inside); then a
step of block moves (`--moves` offloads and onloads between scattered
device and host blocks of a 16-layer model, and a few copy-on-write copies):
the ms and ops of `apply_step`; and the ms the CUDA path's host-tier code
spends issuing one chunk's transfers of 64 scattered blocks (timed on host
tensors: the issuing, not the copies). With `--baseline DIR` (a tree holding
another version's `gpu_worker` and `kernels`, for example
`git archive HEAD gpu_worker kernels | tar -x -C DIR`; repeatable), each of
`--rounds` rounds runs the measurement once for each DIR and once for this
tree, in child processes, in alternating order; the table gives the medians
over rounds, and each tree's ratio to the first.

    python bench/worker_step_bench.py                              # vocab 32000 and 128256, batch 1/32/256
    python bench/worker_step_bench.py --vocab 128256 --batch 256 --temperature 1
    python bench/worker_step_bench.py --read-guard                 # context 1000, batch 1/32/256
    python bench/worker_step_bench.py --step-cost --vocab 32000 --batch 32 256 --baseline ../base --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench_stats import alternating, command_line, fmt, load_averages, print_round

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SOURCE_ENV = "WORKER_STEP_BENCH_SOURCE"  # a child's `gpu_worker` and `kernels` come from there (see --baseline)
if os.environ.get(SOURCE_ENV):
    sys.path.insert(0, os.environ[SOURCE_ENV])

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
    parser.add_argument(
        "--rounds", type=int, default=5, help="--read-guard, --baseline: rounds, the median of their medians"
    )
    parser.add_argument("--step-cost", action="store_true", help="the CPU side of a decode step (see above)")
    parser.add_argument("--moves", type=int, default=64, help="--step-cost: offloads and onloads of the moves step")
    parser.add_argument(
        "--baseline", type=Path, action="append",
        help="--step-cost: a tree with another gpu_worker and kernels to compare (repeatable)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a --baseline child's report
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


def build_runner(
    vocab_size: int, batch: int, num_positions: int, context: int, num_layers: int = 2, num_host_blocks: int = 0,
    kernel_set: kernels.KernelSet | None = None,
) -> ModelRunner:
    """A CPU runner whose `batch` requests `r0..` each hold blocks for `num_positions` positions, the first
    `context` of which count as computed (their KV is the cache's zeros: the bench times decoding, not prefill)."""
    config = ModelConfig(
        f"bench-{vocab_size}", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    blocks_per_request = -(-num_positions // BLOCK_SIZE)
    pool = PoolShape(batch * blocks_per_request, (CacheGroup(0, BLOCK_SIZE),), num_positions, max(batch, 1),
                     num_host_blocks=num_host_blocks)  # fmt: skip
    cpu = torch.device("cpu")
    model = LlamaModel(config, random_weights(config, 0, torch.float32, cpu))
    runner = ModelRunner(model, pool, kernel_set or kernels.load("torch", "cpu"), cpu, torch.float32)
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


class OpCounter(TorchDispatchMode):
    """Counts the torch ops dispatched that are not views; inside a kernel of `counting` only the call counts
    (a Triton kernel set launches one kernel per call, or two for a split decode's attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_ops = 0
        self.inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_kernel and not func.is_view:
            self.num_ops += 1
        return func(*args, **(kwargs or {}))

    def counting(self, kernel_set: kernels.KernelSet) -> kernels.KernelSet:
        """`kernel_set` with each call counted as one op (one launch on a GPU)."""

        def counted(kernel: Callable[..., object]) -> Callable[..., object]:
            if isinstance(kernel, tuple):  # a group of kernels (the layer ops of a kernel set that has them)
                return type(kernel)(*(counted(member) for member in kernel))

            def run(*args: object, **kwargs: object) -> object:
                self.num_ops += 1
                self.inside_kernel += 1
                try:
                    return kernel(*args, **kwargs)
                finally:
                    self.inside_kernel -= 1

            return run

        return type(kernel_set)(*(counted(kernel) for kernel in kernel_set))


def decode_cost(vocab_size: int, batch: int, temperature: float, args: argparse.Namespace) -> dict[str, float]:
    """p50 ms of prepare, sampling and execute over decode steps, and the ops one step dispatches."""
    counter = OpCounter()
    num_steps = args.warmup + args.steps + 1
    runner = build_runner(vocab_size, batch, args.context + num_steps, args.context,
                          kernel_set=counter.counting(kernels.load("torch", "cpu")))  # fmt: skip
    clock = StepClock(runner.model)
    times: dict[str, list[float]] = {"prepare": [], "sampling": [], "execute": []}
    for step in range(num_steps):
        requests = [
            ScheduledRequest(f"r{i}", [(7 * i + step) % vocab_size], args.context + step,
                             SamplingParams(temperature, i))
            for i in range(batch)
        ]  # fmt: skip
        if step == num_steps - 1:  # the last step, untimed: its ops
            with counter:
                runner.execute(requests)
            break
        started = time.perf_counter()
        runner.execute(requests)
        ended = time.perf_counter()
        if step >= args.warmup:
            times["prepare"].append(clock.forward_start - started)
            times["sampling"].append(ended - clock.logits_end)
            times["execute"].append(ended - started)
    return {**{name: statistics.median(samples) * 1e3 for name, samples in times.items()}, "ops": counter.num_ops}


def moves_cost(args: argparse.Namespace) -> dict[str, float]:
    """p50 ms and the ops of a step of `--moves` offloads and onloads (16 layers, scattered blocks) and 4 copies."""
    num_blocks_per_side = 4 * args.moves
    counter = OpCounter()
    kernel_set = counter.counting(kernels.load("torch", "cpu"))
    runner = build_runner(1000, 1, BLOCK_SIZE * num_blocks_per_side, 0, num_layers=16,
                          num_host_blocks=num_blocks_per_side, kernel_set=kernel_set)  # fmt: skip
    rng = random.Random(0)
    num_steps = args.warmup + args.steps + 1
    times = []
    for step in range(num_steps):
        delta = pb.StepDelta(step_id=runner.last_applied_step_id + 1)
        device_ids = rng.sample(range(num_blocks_per_side), 2 * args.moves + 8)
        for device_block_id, host_block_id in zip(device_ids, rng.sample(range(num_blocks_per_side), args.moves)):
            delta.offloads.add(device_block_id=device_block_id, host_block_id=host_block_id)
        onload_hosts = rng.sample(range(num_blocks_per_side), args.moves)
        for device_block_id, host_block_id in zip(device_ids[args.moves :], onload_hosts):
            delta.onloads.add(device_block_id=device_block_id, host_block_id=host_block_id)
        for src, dst in zip(device_ids[-8:-4], device_ids[-4:]):
            delta.copies.add(src_block_id=src, dst_block_id=dst)
        if step == num_steps - 1:
            with counter:
                runner.apply_step(delta)
            break
        started = time.perf_counter()
        runner.apply_step(delta)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    return {"moves": statistics.median(times) * 1e3, "moves ops": counter.num_ops}


def transfer_issue_cost(args: argparse.Namespace, num_runs: int = 64) -> float:
    """p50 ms to issue the CUDA path's host-block transfers of a chunk of `num_runs` scattered blocks, as the tree
    issues them (`copy_runs` where it has one, else one `copy_` per run from Python), between host tensors of
    64-byte blocks: the copies cost next to nothing, the issuing is what is timed."""
    from gpu_worker import host_tier

    host_blocks, rows = torch.zeros((4 * num_runs, 16)), torch.ones((num_runs, 16))
    runs = [(row, 3 * row, 1) for row in range(num_runs)]
    times = []
    for _ in range(args.warmup + 10 * args.steps):
        started = time.perf_counter()
        if hasattr(host_tier, "copy_runs"):
            host_tier.copy_runs(host_blocks, rows, runs, to_host=True)
        else:
            for row, first, count in runs:
                host_blocks[first : first + count].copy_(rows[row : row + count], non_blocking=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times[args.warmup :]) * 1e3


def step_cost(args: argparse.Namespace) -> dict[str, float]:
    """Every figure of --step-cost, by name."""
    figures: dict[str, float] = {}
    for vocab_size, batch, temperature in itertools.product(args.vocab, args.batch, args.temperature):
        label = f"batch {batch}, {'greedy' if temperature == 0 else f'temperature {temperature:g}'}"
        for name, value in decode_cost(vocab_size, batch, temperature, args).items():
            figures[f"{label}: {name}"] = value
    for name, value in moves_cost(args).items():
        figures[f"{args.moves} offloads + {args.moves} onloads + 4 copies: {name}"] = value
    figures["CUDA path: issuing a chunk's 64 scattered transfers"] = transfer_issue_cost(args)
    return figures


def step_cost_report(args: argparse.Namespace, argv: list[str]) -> None:
    """Run --step-cost in children, alternating the baselines' trees and this one; print the medians."""
    trees = {path.name: str(path.resolve()) for path in args.baseline} | {"this tree": ""}
    child_argv = [arg for arg in argv if arg != "--baseline" and arg not in {str(path) for path in args.baseline}]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for index in range(args.rounds):
        for name in alternating(list(trees), index):
            env = {**os.environ, SOURCE_ENV: trees[name]}
            child = subprocess.run([sys.executable, __file__, *child_argv, "--json"], env=env, capture_output=True,
                                   text=True, check=True)  # fmt: skip
            rounds[name].append(json.loads(child.stdout.splitlines()[-1]))
        print_round(index, args.rounds)
    print(f"# {command_line(__file__, argv)}")
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads, "
          f"context {args.context}, vocab {args.vocab}; p50 of {args.steps} steps per round, median of "
          f"{args.rounds} rounds; load average {load_averages()}")  # fmt: skip
    names = list(trees)
    print("| step | " + " | ".join(names) + " | " + " | ".join(f"{name} / {names[0]}" for name in names[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    for metric in rounds[names[0]][0]:
        medians = [statistics.median(figures[metric] for figures in rounds[name]) for name in names]
        unit = "" if metric.endswith("ops") else " ms"
        cells = [f"{fmt(value)}{unit}" for value in medians] + [f"{value / medians[0]:.2f}" for value in medians[1:]]
        print(f"| {metric} | " + " | ".join(cells) + " |")


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
    if args.step_cost:
        if args.baseline is not None:
            step_cost_report(args, sys.argv[1:])
        else:
            print(json.dumps(step_cost(args)))
        return
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
