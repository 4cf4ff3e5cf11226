"""Decode paged attention on a GPU: achieved KV bandwidth against the HBM peak.

One decode step (one query token per request) over a bf16 paged cache with a shuffled block
table. The figure is the KV bytes the step must read (K and V of every context token of every
request) divided by the median kernel time (CUDA events, after warmup), in TB/s and as a
share of 4.3 TB/s, the H200 HBM figure we target (goal: >= 80%). The Triton output is
checked against the torch reference first. torch SDPA over contiguous K/V (no paging) is
timed beside it for scale, when this torch supports it with grouped heads.

    python bench/kernels_gpu.py                       # batch 64, context 4096, 32 q / 8 kv heads, d 128
    python bench/kernels_gpu.py --sweep               # also other tile sizes, stages and KV splits

Exits with status 2 when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from bench_stats import command_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels
from kernels.paged_attention import (
    PagedAttentionConfig,
    paged_attention,
    paged_attention_config,
    paged_attention_launches,
    paged_attention_reference,
)

PEAK_TB_S = 4.3
ATOL = RTOL = 2e-2  # bf16


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="requests, one query token each")
    parser.add_argument("--context", type=int, default=4096, help="KV length of every request")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=100, help="timed runs (after 10 warmup runs)")
    parser.add_argument("--sweep", action="store_true", help="also time other block_n / num_stages / split choices")
    return parser


def time_cuda(fn: Callable[[], object], iters: int, warmup: int = 10) -> float:
    """Median seconds of `fn` on the GPU; runs are queued back to back so launch cost stays hidden."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels_gpu.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    batch, context, block_size = args.batch, args.context, args.block_size
    num_kv_heads, num_q_heads, head_dim = args.kv_heads, args.q_heads, args.head_dim
    dtype = torch.bfloat16
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req + 1  # block 0: the null block
    kv_cache = torch.randn((num_blocks, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    block_table = (torch.randperm(num_blocks - 1, device=device) + 1).to(torch.int32).view(batch, blocks_per_req)
    query = torch.randn((batch, num_q_heads, head_dim), dtype=dtype, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    attn_args = (query, kv_cache, block_table, query_start_loc, seq_lens, scale)
    kv_bytes = batch * context * 2 * num_kv_heads * head_dim * kv_cache.element_size()

    expected = paged_attention_reference(*attn_args)
    config = paged_attention_config(batch, batch, num_q_heads, num_kv_heads, head_dim,
                                    max_kv_len=blocks_per_req * block_size,
                                    num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
                                    dtype=dtype)

    def run_config(cfg: PagedAttentionConfig) -> Callable[[], torch.Tensor]:
        out = torch.empty_like(query)

        def run() -> torch.Tensor:
            for launch in paged_attention_launches(out, *attn_args, 0, cfg, upcast=kernels.interpreting()):
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
                                      2 * config.num_kv_splits}):
                    cfg = config._replace(block_n=block_n, num_stages=num_stages, num_kv_splits=splits)
                    if cfg != config:
                        variants.append(("  sweep", _describe(cfg), run_config(cfg)))

    rows = []
    for name, desc, fn in variants:
        try:
            out = fn()
            torch.cuda.synchronize()
        except OutOfResources as exc:  # a sweep point that does not fit: report it, keep going
            rows.append((name, desc, f"failed: {type(exc).__name__}", "", ""))
            continue
        if not torch.allclose(out.float(), expected.float(), atol=ATOL, rtol=RTOL):
            err = (out.float() - expected.float()).abs().max().item()
            print(f"{name} ({desc}) differs from the reference: max abs error {err:.3g}", file=sys.stderr)
            return 1
        seconds = time_cuda(fn, args.iters)
        rows.append((name, desc, f"{seconds * 1e6:,.1f}", f"{kv_bytes / seconds / 1e12:.2f}",
                     f"{100 * kv_bytes / seconds / 1e12 / PEAK_TB_S:.0f}%"))

    baseline = _sdpa_baseline(query, kv_cache, block_table, context, num_kv_heads, head_dim, scale, args.iters,
                              expected)
    if baseline is not None:
        rows.append(("torch SDPA, contiguous K/V", "no paging, enable_gqa", f"{baseline * 1e6:,.1f}",
                     f"{kv_bytes / baseline / 1e12:.2f}", f"{100 * kv_bytes / baseline / 1e12 / PEAK_TB_S:.0f}%"))

    print(f"decode: batch {batch}, context {context}, {num_q_heads} q / {num_kv_heads} kv heads, head_dim {head_dim}, "
          f"bf16, block_size {block_size}, shuffled block table; KV read per step {kv_bytes / 2**30:.3f} GiB")
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}; python {platform.python_version()}")
    print(f"command: {command_line(__file__, argv)}")
    print()
    print(f"| kernel | config | median us | TB/s | of {PEAK_TB_S} TB/s |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


def _describe(cfg: PagedAttentionConfig) -> str:
    return (f"block_m {cfg.block_m}, block_n {cfg.block_n}, warps {cfg.num_warps}, stages {cfg.num_stages}, "
            f"splits {cfg.num_kv_splits}")


def _sdpa_baseline(
    query, kv_cache, block_table, context, num_kv_heads, head_dim, scale, iters, expected
) -> float | None:
    """Median seconds of SDPA over the same K/V laid out contiguously, or None if unsupported."""
    batch = query.shape[0]
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
    return time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), iters)


if __name__ == "__main__":
    sys.exit(main())
