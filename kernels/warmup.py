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

The first start has nothing to load, so on a GPU `warm_up` first compiles the paged-attention
variants (all but a few of them, and the slowest to compile) in parallel, into that cache
(`precompile`): in child processes, each compiling for the device's target exactly what a
launch would compile, with no GPU of its own. Processes, not threads: they compile in parallel
whatever parts of Triton's compile hold the GIL, and they need no CUDA context (a child with
one would take device memory the KV cache already holds). The launches that follow load those
variants from the cache. On a restart over a kept cache the children only find their variants
there (a few seconds, mostly their imports). The parallel compile only saves time: if it fails
(a Triton without the internals it binds arguments with, say), the launches compile serially
as before.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, NamedTuple

import torch

from kernels.copy_blocks import copy_blocks
from kernels.paged_attention import (
    INTERPRETED,
    Launch,
    PagedAttentionConfig,
    paged_attention_launches,
    paged_attention_variants,
)
from kernels.slot_mapping import slot_mapping
from kernels.store_kv import store_kv

PROGRESS_PREFIX = "warming up Triton kernels: "
MAX_COMPILE_WORKERS = 8  # each child imports torch and Triton: about 0.5 GB of host memory
log = logging.getLogger(__name__)


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
    for block_size, window, config in _attention_variants(shapes):
        description = (
            f"paged_attention block_size={block_size} window={window} block_m={config.block_m} "
            f"num_stages={config.num_stages} num_kv_splits={config.num_kv_splits}"
        )
        run = functools.partial(_paged_attention, shapes, device, block_size, window, config)
        launches.append(WarmupLaunch(description, run))
    return launches


def _attention_variants(shapes: KernelShapes) -> list[tuple[int, int, PagedAttentionConfig]]:
    """(block_size, sliding_window, config) of every paged-attention variant `shapes` can launch."""
    variants = []
    for block_size, window in sorted(set(shapes.groups)):
        max_kv_len = -(-shapes.max_model_len // block_size) * block_size
        for config in paged_attention_variants(
            shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim, max_kv_len, shapes.dtype
        ):
            variants.append((block_size, window, config))
    return variants


def precompile(shapes: KernelShapes, target: Any, num_workers: int) -> int:
    """Compile every paged-attention variant of `shapes` for the Triton `target` (a `GPUTarget`) into Triton's
    on-disk cache, in `num_workers` child processes at once; returns the number of variants.

    The children inherit this process's environment (TRITON_CACHE_DIR and the other variables Triton's
    cache keys read; TRITON_INTERPRET must be unset). Raises what a child raised.
    """
    variants = _attention_variants(shapes)
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds a CUDA context
    with ProcessPoolExecutor(min(num_workers, len(variants)), mp_context=context) as pool:
        list(pool.map(_compile_attention_variant, *zip(*[(shapes, target, *variant) for variant in variants])))
    return len(variants)


def _compile_attention_variant(
    shapes: KernelShapes, target: Any, block_size: int, window: int, config: PagedAttentionConfig
) -> None:
    """In a child: compile one variant's launches for `target` as `JITFunction.run` would, without a GPU."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    for launch in _attention_launches(shapes, torch.device("cpu"), block_size, window, config):
        kernel = launch.kernel
        # The options JITFunction.run adds before it binds the arguments.
        kwargs = dict(launch.kwargs, debug=launch.kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                      instrumentation_mode=knobs.compilation.instrumentation_mode)  # fmt: skip
        bound, specialization, options = create_function_from_signature(kernel.signature, kernel.params, backend)(
            *launch.args, **kwargs
        )
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def warm_up(shapes: KernelShapes, device: torch.device, progress: Callable[[str], None]) -> int:
    """Launch every variant of `warmup_launches` once (compiling it unless Triton's cache holds it).

    Calls `progress("warming up Triton kernels: i/n ...")` before launch i, waits for the device
    after the last one, and returns n. Writes only into tensors it allocates.
    """
    launches = warmup_launches(shapes, device)
    if device.type == "cuda" and not INTERPRETED:
        _precompile_on(shapes, device)
    for i, launch in enumerate(launches, start=1):
        progress(f"{PROGRESS_PREFIX}{i}/{len(launches)} {launch.description}")
        launch.run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(launches)


def _precompile_on(shapes: KernelShapes, device: torch.device) -> None:
    """`precompile` for `device`'s target, with as many workers as CPUs allow; a failure is logged, not raised."""
    from triton.runtime import driver

    num_workers = max(1, min(MAX_COMPILE_WORKERS, (os.cpu_count() or 2) - 1))
    try:
        with torch.cuda.device(device):
            target = driver.active.get_current_target()
        count = precompile(shapes, target, num_workers)
    except Exception as error:  # the serial launches compile what is missing
        log.warning("compiling the paged-attention variants in parallel failed (%s); compiling them one by one", error)
        return
    log.info("compiled %d paged-attention variants in %d processes", count, num_workers)


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
    for launch in _attention_launches(shapes, device, block_size, window, config):
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)


def _attention_launches(
    shapes: KernelShapes, device: torch.device, block_size: int, window: int, config: PagedAttentionConfig
) -> list[Launch]:
    query = torch.zeros((1, shapes.num_q_heads, shapes.head_dim), dtype=shapes.dtype, device=device)
    block_table, query_start_loc, _ = _one_token_batch(device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    kv_cache = _cache(shapes, device, block_size)
    return paged_attention_launches(
        torch.empty_like(query), query, kv_cache, block_table, query_start_loc, seq_lens, shapes.head_dim**-0.5,
        window, config, upcast=INTERPRETED,
    )  # fmt: skip
