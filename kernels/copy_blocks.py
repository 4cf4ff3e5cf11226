"""copy_blocks: copy whole KV blocks (K and V) from source to destination, in every layer.

For every pair `(src, dst)` of `copies` and every layer cache `c`:

    c[dst] = c[src]        # [2, block_size, num_kv_heads, head_dim]

This is how the worker applies the manager's copy-on-write `BlockCopy`s
before the step that needs them. Precondition: within one call the
destinations are distinct and no destination is also a source, so the copies
are independent of their order and may run in parallel.

The copy is bit-exact for every dtype: the kernel moves integer views of the
caches. One launch covers every layer: the launcher passes a table of the
layers' base addresses, and each program turns its layer's entry back into a
pointer. The table is built on the caches' device once per set of layers
(a worker's caches never move) and reused, so a call copies nothing from the
host. A pointer loaded from memory carries no alignment Triton can see: the
launcher requires every layer to start on a 16-byte boundary (any allocator's
tensor does) and the kernel says so (`tl.multiple_of`), so a block whose
stride and size are multiples of 16 bytes moves in 16-byte loads and stores.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.copy_checks import check_copies

# Integer dtype of each element size: the kernel moves bits, never values.
_BITS_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_CHUNK = 4096
LAYER_ALIGN_BYTES = 16


@triton.jit
def _copy_blocks_kernel(
    layer_ptrs_ptr,
    first_layer_ptr,
    copies_ptr,
    block_stride,
    block_numel,
    CHUNK: tl.constexpr,
):
    # One program per (copy, layer); a block's [2, block_size, num_kv_heads,
    # head_dim] elements are contiguous, block_numel of them from
    # block_id * block_stride, moved CHUNK at a time.
    copy = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    cache = tl.load(layer_ptrs_ptr + layer).to(tl.pointer_type(first_layer_ptr.dtype.element_ty))
    cache = tl.multiple_of(cache, 16)  # LAYER_ALIGN_BYTES, checked by the launcher
    src = cache + tl.load(copies_ptr + 2 * copy) * block_stride
    dst = cache + tl.load(copies_ptr + 2 * copy + 1) * block_stride
    for start in range(0, block_numel, CHUNK):
        offsets = start + tl.arange(0, CHUNK).to(tl.int64)
        mask = offsets < block_numel
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


def copy_blocks(kv_caches: Sequence[torch.Tensor], copies: torch.Tensor) -> None:
    """Copy block `src` onto block `dst` in every layer of `kv_caches`, in place.

    kv_caches: one `[num_blocks, 2, block_size, num_kv_heads, head_dim]` tensor
    per layer (at least one), all of one shape, dtype, device and strides,
    each block's elements contiguous (any stride between blocks), each layer
    starting on a 16-byte boundary.
    copies: int64 `[num_copies, 2]` of (src_block_id, dst_block_id), on the
    CPU or on the caches' device, ids in [0, num_blocks), destinations
    distinct and never a source of the same call. Only the destination
    blocks change. Ids and the precondition are checked when copies is on
    the CPU (a check on a GPU would wait for the device; a caller that holds
    the pairs on the host checks them first, with `kernels.copy_checks`).
    No copies: no-op.

    Grid: (num_copies, num_layers).
    """
    layers = _check_args(kv_caches, copies)
    num_copies = copies.shape[0]
    if num_copies == 0:
        return
    first = layers[0]
    device = first.device
    bits = _BITS_DTYPES[first.element_size()]
    layer_ptrs = _layer_table(device, tuple(layer.data_ptr() for layer in layers))
    block_numel = first[0].numel()
    _copy_blocks_kernel[(num_copies, len(layers))](
        layer_ptrs,
        first.view(bits),
        copies.to(device).contiguous(),
        first.stride(0),
        block_numel,
        CHUNK=min(triton.next_power_of_2(block_numel), _MAX_CHUNK),
    )


@functools.lru_cache(maxsize=16)
def _layer_table(device: torch.device, layer_ptrs: tuple[int, ...]) -> torch.Tensor:
    """int64 `[num_layers]` of base addresses on `device`, built once per set of addresses.

    The table holds addresses only, so it is right for any tensors at them: no stale entry can mislead.
    """
    return torch.tensor(layer_ptrs, dtype=torch.int64).to(device)


def copy_blocks_reference(kv_caches: Sequence[torch.Tensor], copies: torch.Tensor) -> None:
    """Torch twin of `copy_blocks`: same arguments, same contract, same result bits."""
    layers = _check_args(kv_caches, copies)
    if copies.shape[0] == 0:
        return
    copies = copies.to(layers[0].device)
    src, dst = copies[:, 0], copies[:, 1]
    for layer in layers:
        layer[dst] = layer[src]


def _check_args(kv_caches: Sequence[torch.Tensor], copies: torch.Tensor) -> list[torch.Tensor]:
    """Raise ValueError on a malformed call; return the layers as a list."""
    layers = list(kv_caches)
    if not layers:
        raise ValueError("kv_caches must hold at least one layer")
    first = layers[0]
    if first.dim() != 5 or first.shape[1] != 2:
        raise ValueError(
            f"kv_caches[0] must be [num_blocks, 2, block_size, num_kv_heads, head_dim], got shape {tuple(first.shape)}"
        )
    if first.element_size() not in _BITS_DTYPES:
        raise ValueError(f"kv_caches[0] has an unsupported dtype {first.dtype}")
    misaligned = [i for i, layer in enumerate(layers) if layer.data_ptr() % LAYER_ALIGN_BYTES]
    if misaligned:
        raise ValueError(
            f"kv_caches[{misaligned[0]}] must start on a {LAYER_ALIGN_BYTES}-byte boundary, "
            f"its address is {layers[misaligned[0]].data_ptr():#x}"
        )
    if first[0].numel() and not first[0].is_contiguous():
        raise ValueError(
            f"each block of kv_caches[0] must be contiguous (strides of dims 1..4 of a contiguous tensor), "
            f"got strides {first.stride()}"
        )
    for i, layer in enumerate(layers[1:], start=1):
        if (layer.shape, layer.dtype, layer.device, layer.stride()) != (
            first.shape,
            first.dtype,
            first.device,
            first.stride(),
        ):
            raise ValueError(
                f"kv_caches[{i}] must match kv_caches[0] in shape, dtype, device and strides: "
                f"{tuple(first.shape)} {first.dtype} {first.device} {first.stride()}, got "
                f"{tuple(layer.shape)} {layer.dtype} {layer.device} {layer.stride()}"
            )
    if copies.dtype != torch.int64 or copies.dim() != 2 or copies.shape[1] != 2:
        raise ValueError(
            f"copies must be int64 [num_copies, 2] of (src_block_id, dst_block_id), "
            f"got {copies.dtype} {tuple(copies.shape)}"
        )
    if copies.device.type != "cpu" and copies.device != first.device:
        raise ValueError(f"copies must be on the CPU or on the caches' device {first.device}, got {copies.device}")
    if copies.device.type == "cpu":
        check_copies(copies.tolist(), first.shape[0])
    return layers
