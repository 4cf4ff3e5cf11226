"""The worker's host-tier copy throughput: offloads and onloads of one step's blocks, in GB/s.

Runs `gpu_worker.host_tier.HostKVBuffer.offload` and `.onload`, the
functions the worker applies a step's tier copies with, on KV caches of a
model's shape (every layer full attention, 16-token blocks): a step's copies
of 16, 64 and 256 blocks, to and from random distinct block ids on both
sides, as the manager hands them out. A direction's figure is the bytes the
step moved (blocks x layers x K and V x block_size x kv heads x head_dim x
dtype size) over the call's wall time; each round times `--repeats` calls
and keeps their median, and the table gives the median over `--rounds`
rounds with the lowest and highest round.

Without CUDA the caches live in host memory too, so both directions are a
gather and a scatter in RAM, through the buffer's fixed-size staging slots
(`gpu_worker.host_tier`): the figure is the worker's CPU copy
throughput, not a link's. Beside it, "contiguous copy" is one `copy_` of
the same number of bytes between two contiguous tensors (memory bandwidth
on CPU; on CUDA, the pinned host-to-device and device-to-host transfer rate
of the link), the ceiling the batched copies are compared with. On CUDA the
caches are on the device, the buffer pinned, and every timed call ends with
a synchronize.

    python bench/tier_copy_bench.py                       # small and llama-3.2-1b, fp32 and bf16
    python bench/tier_copy_bench.py --models small --dtypes float32 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from bench_stats import command_line, load_averages

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.host_tier import HostKVBuffer
from gpu_worker.model_config import BUILTIN_MODELS

BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Row:
    model: str
    dtype: str
    num_blocks: int  # blocks copied per call (one step's copies)
    direction: str
    num_bytes: int  # per call
    gb_per_s: list[float]  # per round: the median call's rate


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(call: Callable[[], None], device: torch.device, repeats: int) -> float:
    """One untimed call, then the median wall time of `repeats` calls, each waited for."""
    call()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_shape(
    model_name: str, dtype_name: str, sizes: Sequence[int], rounds: int, repeats: int, device: torch.device
) -> list[Row]:
    """Every size's offload, onload and contiguous copies at one model shape and dtype, `rounds` times over."""
    config = BUILTIN_MODELS[model_name]
    dtype = DTYPES[dtype_name]
    block_shape = (2, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    # Pools twice the largest step's copies, so the ids of a step are a sample, not the whole pool.
    num_pool_blocks = 2 * max(sizes)
    caches = [torch.randn((num_pool_blocks, *block_shape), device=device).to(dtype) for _ in range(config.num_layers)]
    buffer = HostKVBuffer(num_pool_blocks, config.num_layers, block_shape, dtype, device)
    buffer.blocks.copy_(torch.randn(buffer.blocks.shape).to(dtype))
    block_bytes = config.num_layers * caches[0][0].numel() * caches[0].element_size()
    generator = torch.Generator().manual_seed(0)
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for num_blocks in sizes:
            device_ids = torch.randperm(num_pool_blocks, generator=generator)[:num_blocks].to(device)
            host_ids = torch.randperm(num_pool_blocks, generator=generator)[:num_blocks].tolist()
            num_bytes = num_blocks * block_bytes
            flat = buffer.blocks.view(-1)[: num_bytes // buffer.blocks.element_size()]
            device_flat = caches[0].new_empty(flat.shape) if device.type != "cpu" else flat.clone()
            calls = {
                "offload": lambda: buffer.offload(caches, device_ids, host_ids),
                "onload": lambda: buffer.onload(caches, device_ids, host_ids),
                "contiguous copy, to host": lambda: flat.copy_(device_flat),
                "contiguous copy, to device": lambda: device_flat.copy_(flat, non_blocking=True),
            }
            for direction, call in calls.items():
                seconds = median_seconds(call, device, repeats)
                rates.setdefault((num_blocks, direction), []).append(num_bytes / seconds / 1e9)
    return [
        Row(model_name, dtype_name, num_blocks, direction, num_blocks * block_bytes, values)
        for (num_blocks, direction), values in rates.items()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "llama-3.2-1b"], choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--blocks", nargs="+", type=int, default=[16, 64, 256], help="blocks per step's copies")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; figures are their median (default %(default)s)")
    parser.add_argument(
        "--repeats", type=int, default=9, help="timed calls per round, median kept (default %(default)s)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the caches live (default: cuda if available, else cpu)")  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("rounds", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.blocks):
        parser.error(f"--blocks must all be >= 1, got {args.blocks}")
    device = torch.device(args.device)
    torch.manual_seed(0)
    started = time.perf_counter()
    rows = [
        row
        for model in args.models
        for dtype in args.dtypes
        for row in measure_shape(model, dtype, args.blocks, args.rounds, args.repeats, device)
    ]
    where = (
        f"CUDA ({torch.cuda.get_device_name(device)}): device caches, pinned host buffer"
        if device.type == "cuda"
        else f"CPU only ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}): caches and host "
        "buffer both in RAM, so these are CPU copy rates, not a link's"
    )
    command = command_line(__file__, argv)
    print("# Host-tier copy throughput (HostKVBuffer.offload / onload)")
    print()
    print(f"Command: `{command}`; {where}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.rounds} rounds of {args.repeats} timed calls each; {time.perf_counter() - started:.0f} s; "
          f"load average at the end {load_averages()}.")  # fmt: skip
    print()
    print("| model | dtype | blocks per step | MiB per step | direction | GB/s (median) | rounds' range |")
    print("|---|---|---:|---:|---|---:|---|")
    for row in rows:
        print(f"| {row.model} | {row.dtype} | {row.num_blocks} | {row.num_bytes / 2**20:.2f} | {row.direction} | "
              f"{statistics.median(row.gb_per_s):.2f} | {min(row.gb_per_s):.2f}-{max(row.gb_per_s):.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
