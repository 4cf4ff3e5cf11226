"""Compile, before a worker serves, every Triton kernel variant its model and pool can launch.

Triton compiles a kernel on its first launch with each new combination of constexprs, launch
options (warps, stages) and argument specialisations, 1-3 s each on a GPU. The launchers leave
every size that changes from step to step unspecialised, so the variants follow from the model,
the dtype and the pool alone:

- `store_kv`, `slot_mapping`, `copy_blocks`: one per block size;
- `paged_attention`: per KV-cache group (block size, sliding window), one per config of
  `paged_attention_variants` (tile shape x split class).

`warm_up` launches each variant once, on tiny inputs laid out as the worker's are (contiguous
query, key and value; caches of the pool's block shape; contiguous block tables), so that no
compile happens inside a step. Triton keeps what it compiles in `TRITON_CACHE_DIR` (default
`~/.triton/cache`): on a directory that outlives the process, a restart loads the kernels
instead of compiling them again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import torch

from kernels.copy_blocks import copy_blocks
from kernels.paged_attention import (
    INTERPRETED,
    PagedAttentionConfig,
    paged_attention_launches,
    paged_attention_variants,
)
from kernels.slot_mapping import slot_mapping
from kernels.store_kv import store_kv

PROGRESS_PREFIX = "warming up Triton kernels: "


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """What a worker's kernel launches depend on besides the batch: its model, dtype and pool."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    groups: tuple[tuple[int, int], ...]  # (block_size, sliding_window) of each KV-cache group; window 0: none
    max_model_len: int  # the longest request: bounds every block table

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not self.groups or any(block_size < 1 or window < 0 for block_size, window in self.groups):
            raise ValueError(f"groups must be (block_size >= 1, sliding_window >= 0) pairs, got {self.groups}")


class WarmupLaunch(NamedTuple):
    """One kernel variant: `run()` launches it once on tiny inputs."""

    description: str
    run: Callable[[], None]


def warmup_launches(shapes: KernelShapes, device: torch.device) -> list[WarmupLaunch]:
    """One entry per kernel variant `shapes` can launch, in order; nothing is allocated or run yet."""
    block_sizes = sorted({block_size for block_size, _ in shapes.groups})
    launches = []
    for block_size in block_sizes:
        for name, run in (("store_kv", _store_kv), ("slot_mapping", _slot_mapping), ("copy_blocks", _copy_blocks)):
            launches.append(
                WarmupLaunch(f"{name} block_size={block_size}", functools.partial(run, shapes, device, block_size))
            )
    for block_size, window in sorted(set(shapes.groups)):
        max_kv_len = -(-shapes.max_model_len // block_size) * block_size
        for config in paged_attention_variants(
            shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim, max_kv_len, shapes.dtype
        ):
            description = (
                f"paged_attention block_size={block_size} window={window} block_m={config.block_m} "
                f"num_stages={config.num_stages} num_kv_splits={config.num_kv_splits}"
            )
            run = functools.partial(_paged_attention, shapes, device, block_size, window, config)
            launches.append(WarmupLaunch(description, run))
    return launches


def warm_up(shapes: KernelShapes, device: torch.device, progress: Callable[[str], None]) -> int:
    """Launch every variant of `warmup_launches` once (compiling it unless Triton's cache holds it).

    Calls `progress("warming up Triton kernels: i/n ...")` before launch i, waits for the device
    after the last one, and returns n. Writes only into tensors it allocates.
    """
    launches = warmup_launches(shapes, device)
    for i, launch in enumerate(launches, start=1):
        progress(f"{PROGRESS_PREFIX}{i}/{len(launches)} {launch.description}")
        launch.run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(launches)


def _cache(shapes: KernelShapes, device: torch.device, block_size: int) -> torch.Tensor:
    """A two-block cache with the strides of the worker's (they do not depend on the number of blocks)."""
    shape = (2, 2, block_size, shapes.num_kv_heads, shapes.head_dim)
    return torch.zeros(shape, dtype=shapes.dtype, device=device)


def _one_token_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request of one token at position 0, in block 0: block table, query_start_loc, positions."""
    block_table = torch.zeros((1, 1), dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    positions = torch.zeros(1, dtype=torch.int64, device=device)
    return block_table, query_start_loc, positions


def _store_kv(shapes: KernelShapes, device: torch.device, block_size: int) -> None:
    key = torch.zeros((1, shapes.num_kv_heads, shapes.head_dim), dtype=shapes.dtype, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    store_kv(key, torch.zeros_like(key), _cache(shapes, device, block_size), slots)


def _slot_mapping(shapes: KernelShapes, device: torch.device, block_size: int) -> None:
    slot_mapping(*_one_token_batch(device), block_size)


def _copy_blocks(shapes: KernelShapes, device: torch.device, block_size: int) -> None:
    copy_blocks([_cache(shapes, device, block_size)], torch.tensor([[0, 1]], dtype=torch.int64, device=device))


def _paged_attention(
    shapes: KernelShapes, device: torch.device, block_size: int, window: int, config: PagedAttentionConfig
) -> None:
    query = torch.zeros((1, shapes.num_q_heads, shapes.head_dim), dtype=shapes.dtype, device=device)
    block_table, query_start_loc, _ = _one_token_batch(device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    kv_cache = _cache(shapes, device, block_size)
    launches = paged_attention_launches(
        torch.empty_like(query), query, kv_cache, block_table, query_start_loc, seq_lens, shapes.head_dim**-0.5,
        window, config, upcast=INTERPRETED,
    )  # fmt: skip
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
