"""A Llama-architecture decoder whose attention is supplied by the caller.

The same layers run two ways: over the paged KV cache (the worker's runner
stores K/V and runs paged attention) and densely over one whole sequence
(`dense_attention`, the reference with no cache at all). Nothing here
touches the network or the block tables.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from gpu_worker.model_config import ModelConfig
from gpu_worker.weights import Weights


class Attention(Protocol):
    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention output `[num_tokens, num_heads, head_dim]` of layer `layer` for this batch.

        `query` is `[num_tokens, num_heads, head_dim]`; `key`/`value` are the
        batch's new `[num_tokens, num_kv_heads, head_dim]`, RoPE applied to K.
        """


class LlamaModel:
    """RMSNorm -> attention (RoPE, GQA) -> residual -> RMSNorm -> SwiGLU -> residual, per layer."""

    def __init__(self, config: ModelConfig, weights: Weights) -> None:
        self.config = config
        self.weights = weights
        device = weights.embed_tokens.device
        half = config.head_dim // 2
        exponents = torch.arange(0, half, dtype=torch.float64, device=device) / half
        self.inv_freq = (1.0 / config.rope_theta**exponents).to(torch.float32)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]` of the tokens `token_ids` at `positions`."""
        config = self.config
        hidden = self.weights.embed_tokens[token_ids]
        cos, sin = self._rope(positions)
        num_tokens = token_ids.shape[0]
        for index, layer in enumerate(self.weights.layers):
            x = _rms_norm(hidden, layer.input_norm, config.rms_norm_eps)
            query = (x @ layer.q_proj.T).view(num_tokens, config.num_heads, config.head_dim)
            key = (x @ layer.k_proj.T).view(num_tokens, config.num_kv_heads, config.head_dim)
            value = (x @ layer.v_proj.T).view(num_tokens, config.num_kv_heads, config.head_dim)
            query, key = _apply_rope(query, cos, sin), _apply_rope(key, cos, sin)
            attended = attention(index, query, key, value)
            hidden = hidden + attended.reshape(num_tokens, -1) @ layer.o_proj.T
            x = _rms_norm(hidden, layer.post_attention_norm, config.rms_norm_eps)
            hidden = hidden + (F.silu(x @ layer.gate_proj.T) * (x @ layer.up_proj.T)) @ layer.down_proj.T
        return _rms_norm(hidden, self.weights.norm, config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[num_tokens, vocab]` of final hidden states."""
        return (hidden @ self.weights.lm_head.T).float()

    def dense_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last token of one sequence, recomputed from scratch: no cache at all."""
        positions = torch.arange(token_ids.shape[0], device=token_ids.device)
        hidden = self.forward(token_ids, positions, self._dense_attention)
        return self.logits(hidden[-1:])[0]

    def _dense_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return dense_attention(query, key, value, self.config.window_of(layer))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """Causal attention over one contiguous sequence (token i at position i), in fp32.

    With `sliding_window` W > 0, position p sees positions p-W+1..p.
    """
    num_tokens, num_heads, _ = query.shape
    group = num_heads // key.shape[1]
    q = query.float().transpose(0, 1)
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    position = torch.arange(num_tokens, device=query.device)
    visible = position[None, :] <= position[:, None]
    if sliding_window:
        visible &= position[None, :] > position[:, None] - sliding_window
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    return out.transpose(0, 1).to(query.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head by the token's angles (the Llama convention)."""
    x32 = x.float()
    half = x.shape[-1] // 2
    first, second = x32[..., :half], x32[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)
