"""rotary: RoPE of a batch's queries and keys together, in one launch.

For token t, every head h of the query and of the key, and i < d/2 (d the head dimension):

    a, b          = x[t, h, i], x[t, h, i + d/2]          upcast to fp32
    out[t, h, i]        = a cos[t, i] - b sin[t, i]      rounded to x's dtype
    out[t, h, i + d/2]  = b cos[t, i] + a sin[t, i]

the math of `kernels.layer_ops.rotary_reference` (the Llama convention: the
halves of a head rotate as pairs). `cos` and `sin` are computed once per
step (`gpu_worker.rope`), so a layer pays one launch for both tensors
instead of about nine operations for each. Two programs per token: its
query heads, its key heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layer_ops import rotary_reference

__all__ = ["rotary", "rotary_reference"]


@triton.jit
def _rotary_kernel(
    query_ptr,
    key_ptr,
    query_out_ptr,
    key_out_ptr,
    cos_ptr,
    sin_ptr,
    query_stride_token,
    query_stride_head,
    key_stride_token,
    key_stride_head,
    query_out_stride_token,
    query_out_stride_head,
    key_out_stride_token,
    key_out_stride_head,
    cos_stride_token,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    HEADS_P2: tl.constexpr,
):
    # Program (t, 0) rotates token t's query heads, (t, 1) its key heads.
    token = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        src = query_ptr + token * query_stride_token
        dst = query_out_ptr + token * query_out_stride_token
        src_stride_head = query_stride_head
        dst_stride_head = query_out_stride_head
        num_heads = num_q_heads
    else:
        src = key_ptr + token * key_stride_token
        dst = key_out_ptr + token * key_out_stride_token
        src_stride_head = key_stride_head
        dst_stride_head = key_out_stride_head
        num_heads = num_kv_heads
    dims = tl.arange(0, HALF_P2)
    heads = tl.arange(0, HEADS_P2).to(tl.int64)[:, None]
    mask = (heads < num_heads) & (dims[None, :] < HALF)
    cos = tl.load(cos_ptr + token * cos_stride_token + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * cos_stride_token + dims, mask=dims < HALF, other=0.0)[None, :]
    src = src + heads * src_stride_head + dims[None, :]
    dst = dst + heads * dst_stride_head + dims[None, :]
    first = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (first * cos - second * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (second * cos + first * sin).to(dst.dtype.element_ty), mask=mask)


def rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`query` `[num_tokens, q_heads, d]` and `key` `[num_tokens, kv_heads, d]` rotated: new contiguous tensors.

    cos, sin: fp32 `[num_tokens, d // 2]`, equal strides. Inputs of any strides with a unit stride along
    the head dimension; nothing is mutated. Grid: two programs per token.
    """
    _check_args(query, key, cos, sin)
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens == 0:
        return query_out, key_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens, 2)](
        query, key, query_out, key_out, cos, sin,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
        cos.stride(0), num_q_heads, key.shape[1],
        HALF=half,
        HALF_P2=triton.next_power_of_2(half),
        HEADS_P2=triton.next_power_of_2(max(num_q_heads, key.shape[1])),
    )  # fmt: skip
    return query_out, key_out


def _check_args(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(
            f"query and key must be [num_tokens, heads, head_dim] with equal num_tokens and head_dim, "
            f"got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    num_tokens, _, head_dim = query.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if key.dtype != query.dtype or key.device != query.device:
        raise ValueError(f"key must have query's dtype and device, got {key.dtype} on {key.device}")
    for name, tensor in (("query", query), ("key", key)):
        if tensor.shape[2] > 1 and tensor.stride(2) != 1:
            raise ValueError(f"{name} needs a unit stride along head_dim, got strides {tuple(tensor.stride())}")
    for name, tensor in (("cos", cos), ("sin", sin)):
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != (num_tokens, head_dim // 2):
            raise ValueError(
                f"{name} must be float32 [{num_tokens}, {head_dim // 2}], got {tensor.dtype} {tuple(tensor.shape)}"
            )
        if tensor.device != query.device or (tensor.shape[1] > 1 and tensor.stride(1) != 1):
            raise ValueError(f"{name} must be on query's device with a unit stride along its last dimension")
    if cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos and sin must have equal row strides, got {cos.stride(0)} and {sin.stride(0)}")
