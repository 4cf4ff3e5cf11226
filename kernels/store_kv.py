"""store_kv: write the new tokens' keys and values into the paged KV cache.

For every token t with `slot = slot_mapping[t] >= 0`:

    block_id = slot // block_size
    offset   = slot %  block_size
    kv_cache[block_id, 0, offset] = key[t]      # [num_kv_heads, head_dim]
    kv_cache[block_id, 1, offset] = value[t]

Tokens with slot -1 (padding) write nothing. The copy is bit-exact for every
dtype: the launcher hands the kernel integer views of the tensors, so no
value is ever converted (NaN payloads survive, and the interpreter's bf16
handling never comes into play).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Integer dtype of each element size: the kernel moves bits, never values.
_BITS_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    key_stride_token,
    key_stride_head,
    key_stride_dim,
    value_stride_token,
    value_stride_head,
    value_stride_dim,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_offset,
    cache_stride_head,
    cache_stride_dim,
    block_size,
    num_kv_heads,
    head_dim,
    NUM_KV_HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    # One program per token: a [num_kv_heads, head_dim] tile of K and of V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block_id = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, NUM_KV_HEADS_P2).to(tl.int64)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2).to(tl.int64)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)

    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims * key_stride_dim, mask=mask)
    value = tl.load(
        value_ptr + token * value_stride_token + heads * value_stride_head + dims * value_stride_dim, mask=mask
    )
    dst = (
        cache_ptr
        + block_id * cache_stride_block
        + offset * cache_stride_offset
        + heads * cache_stride_head
        + dims * cache_stride_dim
    )
    tl.store(dst, key, mask=mask)
    tl.store(dst + cache_stride_kv, value, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key[t]` and `value[t]` into `kv_cache` at `slot_mapping[t]`, in place.

    key, value: `[num_tokens, num_kv_heads, head_dim]`, the dtype of kv_cache,
    any strides. kv_cache: `[num_blocks, 2, block_size, num_kv_heads,
    head_dim]`, any strides. slot_mapping: int64 `[num_tokens]`, each entry -1
    (write nothing) or a slot `block_id * block_size + offset` below
    `num_blocks * block_size`; the non-negative slots are distinct. Only the
    written slots of kv_cache change. Slot values are checked when
    slot_mapping is on the CPU (a check on a GPU would wait for the device).

    Grid: one program per token.
    """
    _check_args(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    bits = _BITS_DTYPES[kv_cache.element_size()]
    key_bits, value_bits, cache_bits = key.view(bits), value.view(bits), kv_cache.view(bits)
    _store_kv_kernel[(num_tokens,)](
        key_bits,
        value_bits,
        cache_bits,
        slot_mapping,
        *key_bits.stride(),
        *value_bits.stride(),
        *cache_bits.stride(),
        kv_cache.shape[2],
        num_kv_heads,
        head_dim,
        NUM_KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
    )


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch twin of `store_kv`: same arguments, same contract, same result bits."""
    _check_args(key, value, kv_cache, slot_mapping)
    block_size = kv_cache.shape[2]
    tokens = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[tokens]
    block_ids, offsets = slots // block_size, slots % block_size
    kv_cache[block_ids, 0, offsets] = key.index_select(0, tokens)
    kv_cache[block_ids, 1, offsets] = value.index_select(0, tokens)


def _check_args(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], got shape {tuple(kv_cache.shape)}"
        )
    num_blocks, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if key.dim() != 3 or tuple(key.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"key must be [num_tokens, {num_kv_heads}, {head_dim}] (num_tokens, num_kv_heads, head_dim of kv_cache), "
            f"got shape {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != kv_cache.dtype:
            raise ValueError(f"{name} must have kv_cache's dtype {kv_cache.dtype}, got {tensor.dtype}")
    if kv_cache.element_size() not in _BITS_DTYPES:
        raise ValueError(f"kv_cache has an unsupported dtype {kv_cache.dtype}")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be int64 [num_tokens] = [{key.shape[0]}], "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    for name, tensor in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if tensor.device != kv_cache.device:
            raise ValueError(f"{name} must be on kv_cache's device {kv_cache.device}, got {tensor.device}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        num_slots = num_blocks * block_size
        if int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= num_slots:
            raise ValueError(f"slot_mapping entries must be -1 or in [0, {num_slots}) (num_blocks * block_size)")
        slots = slot_mapping[slot_mapping >= 0]
        if slots.unique().numel() != slots.numel():
            raise ValueError("slot_mapping must not repeat a slot (two tokens written to one place)")
