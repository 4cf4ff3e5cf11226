"""rms_norm and add_rms_norm: a decoder's RMSNorm, with the residual add before it, in one launch.

For each row x of length d (the last dimension), with s = x + residual when
there is one (rounded to x's dtype, as torch adds):

    y = (s32 * rsqrt(sum(s32^2) / d + eps)).to(dtype).to(fp32) * w.to(fp32), rounded to dtype

the math of `kernels.layer_ops.rms_norm_reference`: fp32 arithmetic, one
rounding to the input's dtype before the weight and one after. Every value
is upcast to fp32 before any arithmetic, which also keeps the interpreter
away from bf16 arithmetic (it computes that wrongly). One program per row,
the row in one tile: d up to 65,536.

The torch references sit in `kernels.layer_ops` (they must import no
Triton); they are re-exported here beside their kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layer_ops import add_rms_norm_reference, rms_norm_reference

__all__ = ["rms_norm", "add_rms_norm", "rms_norm_reference", "add_rms_norm_reference"]

_MAX_COLUMNS = 1 << 16


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    total_ptr,
    x_stride_row,
    residual_stride_row,
    out_stride_row,
    total_stride_row,
    num_columns,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < num_columns
    x = tl.load(x_ptr + row * x_stride_row + columns, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride_row + columns, mask=mask, other=0.0)
        total = (x + residual.to(tl.float32)).to(total_ptr.dtype.element_ty)
        tl.store(total_ptr + row * total_stride_row + columns, total, mask=mask)
        x = total.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / num_columns
    normed = (x * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride_row + columns, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` (any leading dimensions) over its last dimension: a new tensor like `x`. Mutates nothing.

    weight: `[x.shape[-1]]`, x's dtype and device. Grid: one program per row.
    """
    rows = _rows(x, weight)
    out = torch.empty_like(rows)
    _launch(rows, None, weight, out, None, eps)
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm), both new tensors like `x`, from one launch. Mutates nothing.

    residual: x's shape, dtype and device. weight as for `rms_norm`.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x ({x.dtype} {tuple(x.shape)} on {x.device}), "
            f"got {residual.dtype} {tuple(residual.shape)} on {residual.device}"
        )
    rows = _rows(x, weight)
    residual_rows = residual.reshape(rows.shape)
    out, total = torch.empty_like(rows), torch.empty_like(rows)
    _launch(rows, residual_rows, weight, out, total, eps)
    return total.view(x.shape), out.view(x.shape)


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` as a 2-D tensor of rows with unit column stride (a view where one exists); ValueError on bad arguments."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x needs a non-empty last dimension, got shape {tuple(x.shape)}")
    if x.shape[-1] > _MAX_COLUMNS:
        raise ValueError(f"rows longer than {_MAX_COLUMNS} are not supported, got {x.shape[-1]}")
    if tuple(weight.shape) != (x.shape[-1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"weight must be [{x.shape[-1]}] of x's dtype {x.dtype} on {x.device}, "
            f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.shape[1] == 1 or rows.stride(1) == 1 else rows.contiguous()


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    total: torch.Tensor | None,
    eps: float,
) -> None:
    num_rows, num_columns = x.shape
    if num_rows == 0:
        return
    block = triton.next_power_of_2(num_columns)
    has_residual = residual is not None
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if has_residual else x,
        weight,
        out,
        total if has_residual else out,
        x.stride(0),
        residual.stride(0) if has_residual else 0,
        out.stride(0),
        total.stride(0) if has_residual else 0,
        num_columns,
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK=block,
        num_warps=max(1, min(16, block // 256)),
    )
