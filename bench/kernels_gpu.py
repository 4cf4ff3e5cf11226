"""Decode paged attention on a GPU: achieved KV bandwidth against the HBM peak and the measured copy rate.

One decode step (one query token per request) over a bf16 paged cache with a shuffled block
table, for each head dimension asked for: 128 (the usual 8B-class shape) and 64 (the worker's
built-in llama-3.2-1b, 32 query / 8 KV heads). The figure is the KV bytes the step must read
(K and V of every context token of every request) divided by the median kernel time (CUDA
events, after warmup), in TB/s and as a share of two ceilings:

- 4.8 TB/s, the H200's HBM3e bandwidth by NVIDIA's datasheet;
- the device-to-device copy rate measured here first (bytes read plus bytes written of one
  large `copy_`, 4.3 TB/s on an H200), what a streaming kernel can reach in practice.

The Triton output is checked against the torch reference first. torch SDPA over contiguous
K/V (no paging) is timed beside it for scale, when this torch supports it with grouped heads.

    python bench/kernels_gpu.py                       # batch 64, context 4096, 32 q / 8 kv heads, d 128 and 64
    python bench/kernels_gpu.py --sweep               # also other tile sizes, stages and KV splits
    python bench/kernels_gpu.py --dry-run             # the same steps on a CPU, tiny, interpreted

Exits with status 2 when no CUDA device is present (without --dry-run).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_stats import command_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DATASHEET_TB_S = 4.8  # H200 HBM3e, NVIDIA's datasheet
ATOL = RTOL = 2e-2  # bf16
COPY_BYTES = 2 << 30  # the measured copy: 2 GiB read, 2 GiB written


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="requests, one query token each")
    parser.add_argument("--context", type=int, default=4096, help="KV length of every request")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64], help="(default %(default)s)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=100, help="timed runs (after 10 warmup runs)")
    parser.add_argument("--sweep", action="store_true", help="also time other block_n / num_stages / split choices")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="on the CPU with Triton's interpreter and tiny shapes (batch 2, context 32, 1 run): checks this script",
    )  # fmt: skip
    return parser


def time_device(fn: Callable[[], object], iters: int, device: torch.device, warmup: int = 10) -> float:
    """Median seconds of `fn`: CUDA events on a GPU, runs queued back to back so launch cost stays hidden;
    wall time on a CPU."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def copy_tb_s(device: torch.device, num_bytes: int, iters: int) -> float:
    """Bytes read plus bytes written per second of one `copy_` of `num_bytes` between two device buffers."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = time_device(lambda: target.copy_(source), iters, device, warmup=3)
    return 2 * num_bytes / seconds / 1e12


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        args.batch, args.context, args.iters, args.sweep = 2, 32, 1, False
        device, warmup, copy_bytes = torch.device("cpu"), 0, 1 << 20
    elif not torch.cuda.is_available():
        print("bench/kernels_gpu.py needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    else:
        device, warmup, copy_bytes = torch.device("cuda"), 10, COPY_BYTES
    import kernels

    torch.manual_seed(0)
    copy_rate = copy_tb_s(device, copy_bytes, max(args.iters // 4, 2))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()}), interpreted"
    print(f"decode: batch {args.batch}, context {args.context}, {args.q_heads} q / {args.kv_heads} kv heads, bf16, "
          f"block_size {args.block_size}, shuffled block table")  # fmt: skip
    print(f"{name}; torch {torch.__version__}; python {platform.python_version()}")
    print(f"measured device copy: {copy_rate:.2f} TB/s (read + written); datasheet HBM peak {DATASHEET_TB_S} TB/s")
    print(f"command: {command_line(__file__, argv)}")
    print()
    ceilings = f"of {DATASHEET_TB_S} TB/s | of {copy_rate:.2f} TB/s copy"
    print(f"| kernel | head_dim | config | median us | TB/s | {ceilings} |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for head_dim in args.head_dims:
        rows = measure(args, head_dim, device, warmup, kernels.interpreting())
        if rows is None:
            return 1
        for label, desc, seconds, kv_bytes in rows:
            if seconds is None:
                print(f"| {label} | {head_dim} | {desc} | failed | | | |")
                continue
            tb_s = kv_bytes / seconds / 1e12
            print(f"| {label} | {head_dim} | {desc} | {seconds * 1e6:,.1f} | {tb_s:.2f} | "
                  f"{100 * tb_s / DATASHEET_TB_S:.0f}% | {100 * tb_s / copy_rate:.0f}% |")  # fmt: skip
    return 0


def measure(
    args: argparse.Namespace, head_dim: int, device: torch.device, warmup: int, upcast: bool
) -> list[tuple[str, str, float | None, int]] | None:
    """(kernel, config, median seconds or None when it failed, KV bytes read) per variant; None when the
    Triton output differs from the reference (reported on stderr)."""
    from triton.runtime.errors import OutOfResources

    from kernels.paged_attention import (
        PagedAttentionConfig,
        paged_attention,
        paged_attention_config,
        paged_attention_launches,
        paged_attention_reference,
    )

    batch, context, block_size = args.batch, args.context, args.block_size
    num_kv_heads, num_q_heads = args.kv_heads, args.q_heads
    dtype = torch.bfloat16
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req + 1  # block 0: the null block
    kv_cache = torch.randn((num_blocks, 2, block_size, num_kv_heads, head_dim), device=device).to(dtype)
    block_table = (torch.randperm(num_blocks - 1, device=device) + 1).to(torch.int32).view(batch, blocks_per_req)
    query = torch.randn((batch, num_q_heads, head_dim), device=device).to(dtype)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    attn_args = (query, kv_cache, block_table, query_start_loc, seq_lens, scale)
    kv_bytes = batch * context * 2 * num_kv_heads * head_dim * kv_cache.element_size()

    expected = paged_attention_reference(*attn_args)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    config = paged_attention_config(batch, batch, num_q_heads, num_kv_heads, head_dim,
                                    max_kv_len=blocks_per_req * block_size, num_sms=num_sms, dtype=dtype)  # fmt: skip

    def run_config(cfg: PagedAttentionConfig) -> Callable[[], torch.Tensor]:
        out = torch.empty_like(query)

        def run() -> torch.Tensor:
            for launch in paged_attention_launches(out, *attn_args, 0, cfg, upcast=upcast):
                launch.kernel[launch.grid](*launch.args, **launch.kwargs)
            return out

        return run

    variants: list[tuple[str, str, Callable[[], object]]] = [
        ("triton paged_attention", _describe(config), lambda: paged_attention(*attn_args)),
    ]
    if args.sweep:
        for block_n in (32, 64, 128):
            for num_stages in (2, 3, 5):
                for splits in sorted({1, max(1, config.num_kv_splits // 2), config.num_kv_splits,
                                      2 * config.num_kv_splits}):  # fmt: skip
                    cfg = config._replace(block_n=block_n, num_stages=num_stages, num_kv_splits=splits)
                    if cfg != config:
                        variants.append(("  sweep", _describe(cfg), run_config(cfg)))

    rows: list[tuple[str, str, float | None, int]] = []
    for label, desc, fn in variants:
        try:
            out = fn()
        except OutOfResources:  # a sweep point that does not fit: report it, keep going
            rows.append((label, desc, None, kv_bytes))
            continue
        if not torch.allclose(out.float(), expected.float(), atol=ATOL, rtol=RTOL):
            err = (out.float() - expected.float()).abs().max().item()
            print(f"{label} ({desc}, head_dim {head_dim}) differs from the reference: max abs error {err:.3g}",
                  file=sys.stderr)  # fmt: skip
            return None
        rows.append((label, desc, time_device(fn, args.iters, device, warmup), kv_bytes))

    sdpa = _sdpa_baseline(query, kv_cache, block_table, context, scale, expected)
    if sdpa is not None:
        seconds = time_device(sdpa, args.iters, device, warmup)
        rows.append(("torch SDPA, contiguous K/V", "no paging, enable_gqa", seconds, kv_bytes))
    return rows


def _describe(cfg) -> str:
    return (f"block_m {cfg.block_m}, block_n {cfg.block_n}, warps {cfg.num_warps}, stages {cfg.num_stages}, "
            f"splits {cfg.num_kv_splits}")  # fmt: skip


def _sdpa_baseline(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context: int, scale: float,
    expected: torch.Tensor,
) -> Callable[[], object] | None:  # fmt: skip
    """SDPA over the same K/V laid out contiguously, or None if this torch cannot run it with grouped heads."""
    batch = query.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    kv = kv_cache[block_table.long()]  # [batch, blocks, 2, block_size, kv_heads, head_dim]
    kv = kv.transpose(1, 2).reshape(batch, 2, -1, num_kv_heads, head_dim)[:, :, :context]
    k, v = (kv[:, i].transpose(1, 2).contiguous() for i in range(2))  # [batch, kv_heads, context, head_dim]
    del kv
    q = query.unsqueeze(2)  # [batch, q_heads, 1, head_dim]
    try:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    except (RuntimeError, TypeError) as exc:
        print(f"SDPA baseline skipped: {exc}", file=sys.stderr)
        return None
    if not torch.allclose(out.squeeze(2).float(), expected.float(), atol=ATOL, rtol=RTOL):
        print("SDPA baseline skipped: its output differs from the reference", file=sys.stderr)
        return None
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


if __name__ == "__main__":
    sys.exit(main())
