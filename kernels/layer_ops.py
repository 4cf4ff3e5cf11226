"""The decoder layer's norms and rotations in plain torch: the dense pass's math and the kernels' references.

    rms_norm(x, w)           = (x32 * rsqrt(mean(x32^2) + eps)).to(dtype) * w     over the last dimension,
                               fp32 math, scaled in x's dtype (transformers' order)
    add_rms_norm(x, r, w)    = (s, rms_norm(s, w)) with s = x + r                  the residual add, then the norm
    rotary(q, k, cos, sin)   = each head of q and k with its halves (a, b) rotated:
                               (a cos - b sin, b cos + a sin), fp32 math, in the input's dtype

`cos` and `sin` are fp32 `[num_tokens, head_dim // 2]`, one row per token
(`gpu_worker.rope.RotaryEmbedding.cos_sin`).

These live apart from their Triton kernels (`kernels.rms_norm`,
`kernels.rotary`) because this module imports no Triton: the model and its
dense pass import it at once, while a kernel module may be imported only
after `kernels.load` has decided how Triton runs (TRITON_INTERPRET).
`LayerOps` is the set a model's forward pass takes; `kernels.load` hands out
the Triton or the torch one.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class LayerOps(NamedTuple):
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension, a new tensor of x's shape and dtype (see the module docstring)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm): the residual stream and the next sublayer's input. Mutates nothing."""
    total = x + residual
    return total, rms_norm_reference(total, weight, eps)


def rotary_reference(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`query` `[num_tokens, q_heads, head_dim]` and `key` `[num_tokens, kv_heads, head_dim]`, rotated: new tensors."""
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x.shape[-1] // 2
    first, second = x32[..., :half], x32[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)


TORCH_LAYER_OPS = LayerOps(rms_norm_reference, add_rms_norm_reference, rotary_reference)
