"""The host tier's offload beside a matmul: how much of the copy hides behind compute, and at what rate.

Three timings at the worker model's shape (llama-3.2-1b, bf16, 16-token blocks, every layer),
each the median of `--repeats` runs, each run waited for:

- `matmul`: a chain of bf16 matrix products on the compute stream, sized to last about as
  long as the copy;
- `offload`: `HostKVBuffer.offload` of `--blocks` scattered blocks (on CUDA, queued on the
  tier's side stream, then waited for), and its rate in GB/s;
- `both`: the offload queued, then the matmul, then both waited for.

overlap = (matmul + offload - both) / min(matmul, offload): 1 when the shorter one hides
entirely behind the longer, 0 when they run one after the other. Without CUDA (`--dry-run`)
the figures are the CPU's and say nothing of a link or of overlap.

    python bench/tier_overlap.py
    python bench/tier_overlap.py --dry-run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.host_tier import HostKVBuffer
from gpu_worker.model_config import BUILTIN_MODELS

BLOCK_SIZE = 16


def median_seconds(call: Callable[[], None], finish: Callable[[], None], repeats: int) -> float:
    call()
    finish()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        finish()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--blocks", type=int, default=256, help="blocks per offload (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="(default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="tiny, on the CPU: checks this script")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.blocks, args.repeats = "tiny", 8, 2
        device, dtype, size = torch.device("cpu"), torch.float32, 64
    elif not torch.cuda.is_available():
        print("bench/tier_overlap.py needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    else:
        device, dtype, size = torch.device("cuda"), torch.bfloat16, 8192
    config = BUILTIN_MODELS[args.model]
    block_shape = (2, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    num_pool_blocks = 2 * args.blocks
    caches = [torch.randn((num_pool_blocks, *block_shape), device=device).to(dtype) for _ in range(config.num_layers)]
    buffer = HostKVBuffer(num_pool_blocks, config.num_layers, block_shape, dtype, device)
    generator = torch.Generator().manual_seed(0)
    device_ids = torch.randperm(num_pool_blocks, generator=generator)[: args.blocks].to(device)
    host_ids = sorted(torch.randperm(num_pool_blocks, generator=generator)[: args.blocks].tolist())
    num_bytes = args.blocks * config.num_layers * caches[0][0].numel() * caches[0].element_size()

    def finish() -> None:
        buffer.synchronize()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def offload() -> None:
        buffer.offload(caches, device_ids, host_ids)

    a = torch.randn((size, size), device=device).to(dtype)
    offload_s = median_seconds(offload, finish, args.repeats)
    one_matmul_s = median_seconds(lambda: a @ a, finish, args.repeats)
    num_matmuls = max(1, round(offload_s / max(one_matmul_s, 1e-9)))

    def matmuls() -> None:
        for _ in range(num_matmuls):
            a @ a

    matmul_s = median_seconds(matmuls, finish, args.repeats)
    both_s = median_seconds(lambda: (offload(), matmuls()), finish, args.repeats)
    overlap = (matmul_s + offload_s - both_s) / min(matmul_s, offload_s)
    print(f"model {args.model}, {dtype}, {args.blocks} blocks per offload ({num_bytes / 2**20:.1f} MiB), "
          f"{num_matmuls} x {size}x{size} matmuls; {device}; torch {torch.__version__}")  # fmt: skip
    print()
    print("| what | median ms | GB/s |")
    print("|---|---:|---:|")
    print(f"| offload | {offload_s * 1e3:.3f} | {num_bytes / offload_s / 1e9:.2f} |")
    print(f"| matmul | {matmul_s * 1e3:.3f} | |")
    print(f"| both | {both_s * 1e3:.3f} | |")
    print()
    print(f"overlap: {max(0.0, min(1.0, overlap)):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
