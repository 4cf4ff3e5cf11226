"""Calibrate the replay's step cost model (`kv_tooling.cost_model`) with the worker's own forward passes.

Runs `ModelRunner` in-process (random weights, one full-attention group of 16-token blocks) and
measures, each the median of several timed calls after an untimed one:

- prefill: one request of `--prefill-tokens` tokens; `prefill_us_per_token` = time / tokens;
- decode: `--decode-batches` rows (smallest and largest), every row at `--context` tokens; the KV
  read term of the model (kv tokens x bytes per token / HBM rate) is taken off each, then
  `decode_us_per_row` is the slope between the two batch sizes and `decode_step_ms` what is left
  at zero rows.

It prints the `kv-manager replay` flags that put these figures in the replay. They describe the
model measured on this machine: with the built-in llama-3.2-1b, a 1B-class model with the shape
of the production one, not the 8B model the replay's defaults describe.

    python bench/cost_calibration.py                   # llama-3.2-1b, bf16, Triton, CUDA
    python bench/cost_calibration.py --cuda-graphs     # decode steps replayed from CUDA graphs
    python bench/cost_calibration.py --dry-run         # tiny, torch kernels, on the CPU: checks this script
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels
from gpu_worker.decode_graphs import bucket_sizes
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import BUILTIN_MODELS
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape, ScheduledRequest
from gpu_worker.sampling import GREEDY
from gpu_worker.weights import checkpoint_shapes, random_weights
from kv_tooling.cost_model import StepCostModel
from kvcache.v1 import kv_manager_pb2 as pb

BLOCK_SIZE = 16


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--decode-batches", type=int, nargs=2, default=[1, 32], metavar=("SMALL", "LARGE"))
    parser.add_argument("--context", type=int, default=1024, help="tokens of every decode row (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cuda-graphs", action="store_true", help="decode from CUDA graphs (use_decode_graphs)")
    parser.add_argument("--dry-run", action="store_true", help="tiny, torch kernels, on the CPU: checks this script")
    return parser


def median_seconds(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.dry_run:
        args.model, args.dtype, args.prefill_tokens, args.decode_batches, args.context, args.repeats = (
            "tiny", "float32", 32, [1, 2], 16, 2
        )  # fmt: skip
        device, backend = torch.device("cpu"), "torch"
    elif not torch.cuda.is_available():
        print("bench/cost_calibration.py needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    else:
        device, backend = torch.device("cuda"), "triton"
    config = BUILTIN_MODELS[args.model]
    dtype = getattr(torch, args.dtype)
    small, large = args.decode_batches
    rows = 1 + large + small  # the prefill request, then each decode batch's rows
    blocks_per_row = -(-(max(args.prefill_tokens, args.context) + args.repeats + 2) // BLOCK_SIZE)
    pool = PoolShape(rows * blocks_per_row + 1, (CacheGroup(0, BLOCK_SIZE, 0),),
                     max_model_len=blocks_per_row * BLOCK_SIZE, max_num_requests=rows)  # fmt: skip
    model = LlamaModel(config, random_weights(config, 0, dtype, device))
    runner = ModelRunner(model, pool, kernels.load(backend, device.type), device, dtype)
    if args.cuda_graphs:
        runner.use_decode_graphs(bucket_sizes(rows), capture=device.type == "cuda")
    delta = pb.StepDelta(step_id=1)
    for row in range(rows):
        first = 1 + row * blocks_per_row
        row_added = delta.rows_added.add(request_id=f"r{row}")
        row_added.groups.add(group_id=0, block_ids=range(first, first + blocks_per_row))
    runner.apply_step(delta)

    prompt = [7] * args.prefill_tokens
    runner.execute([ScheduledRequest("r0", prompt, 0, GREEDY)])  # compiles; then the same tokens again
    prefill_s = median_seconds(lambda: runner.execute([ScheduledRequest("r0", prompt, 0, GREEDY)]), device,
                               args.repeats)  # fmt: skip

    def decode_s(request_ids: list[str]) -> float:
        runner.execute([ScheduledRequest(rid, [3] * args.context, 0, GREEDY) for rid in request_ids])
        step = [ScheduledRequest(rid, [5], args.context, GREEDY) for rid in request_ids]
        runner.execute(step)
        return median_seconds(lambda: runner.execute(step), device, args.repeats)

    small_s = decode_s([f"r{1 + i}" for i in range(small)])
    large_s = decode_s([f"r{1 + small + i}" for i in range(large)])

    reference = StepCostModel()
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    kv_s_per_row = args.context * kv_bytes_per_token / (reference.hbm_gb_per_s * 1e9)
    per_row_s = max(0.0, ((large_s - large * kv_s_per_row) - (small_s - small * kv_s_per_row)) / (large - small))
    step_s = max(0.0, small_s - small * kv_s_per_row - small * per_row_s)
    prefill_us = prefill_s / args.prefill_tokens * 1e6
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"model {args.model} ({args.dtype}, random weights), {backend} kernels, "
          f"{'CUDA graphs' if args.cuda_graphs else 'eager'}; {where}; torch {torch.__version__}")  # fmt: skip
    print()
    print("| measured | median ms |")
    print("|---|---:|")
    print(f"| prefill, 1 x {args.prefill_tokens} tokens | {prefill_s * 1e3:.3f} |")
    print(f"| decode step, {small} rows x {args.context} tokens | {small_s * 1e3:.3f} |")
    print(f"| decode step, {large} rows x {args.context} tokens | {large_s * 1e3:.3f} |")
    print()
    print(f"replay flags: kv-manager replay --prefill-us-per-token {prefill_us:.2f} "
          f"--decode-step-ms {step_s * 1e3:.3f} --decode-us-per-row {per_row_s * 1e6:.2f} "
          f"--kv-bytes-per-token {kv_bytes_per_token}")  # fmt: skip
    num_params = sum(math.prod(shape) for shape in checkpoint_shapes(config).values())
    print(f"note: these measure the worker running {args.model} ({num_params / 1e9:.2f}B parameters), "
          "not the 8B model the replay's defaults describe")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
