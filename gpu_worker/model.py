"""A Llama-architecture decoder whose attention is supplied by the caller.

The same layers run two ways: over the paged KV cache (the worker's runner
stores K/V and runs paged attention) and densely over one whole sequence
(`dense_attention`, the reference with no cache at all). Nothing here
touches the network or the block tables.

The architectures it runs differ from the Llama block only in what the
config declares: optional biases on the projections (`LayerWeights` holds
None where there is none), an optional RMSNorm of each query and key head
before RoPE (Qwen3), a window per layer, and the RoPE frequency rule
(`gpu_worker.rope`).

The norms and rotations come from a `LayerOps` (`kernels.layer_ops`): the
torch references by default (the dense pass), the fused Triton kernels when
the runner passes its kernel set's. A layer normalises once per sublayer,
the residual add folded into the norm that follows it:

    x = norm(h)                                    before the first layer
    h, x = h + attention(x), norm(h + attention(x))
    h, x = h + mlp(x), norm_next(h + mlp(x))       norm_next: the next layer's input norm, or the final one
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from gpu_worker.model_config import ModelConfig
from gpu_worker.rope import RotaryEmbedding
from gpu_worker.weights import Weights
from kernels.layer_ops import TORCH_LAYER_OPS, LayerOps


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
        self.rotary = RotaryEmbedding(config, weights.embed_tokens.device)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        sequence_ends: torch.Tensor | None = None,
        layer_ops: LayerOps = TORCH_LAYER_OPS,
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]` of the tokens `token_ids` at `positions`.

        `sequence_ends[t]` is the length of token t's sequence with this
        batch's tokens in (its request's last position + 1); it is read, and
        needed, only when `self.rotary.needs_sequence_ends` (dynamic RoPE).
        """
        config = self.config
        eps = config.rms_norm_eps
        layers = self.weights.layers
        hidden = self.weights.embed_tokens[token_ids]
        cos, sin = self.rotary.cos_sin(positions, sequence_ends)
        num_tokens = token_ids.shape[0]
        x = layer_ops.rms_norm(hidden, layers[0].input_norm, eps)
        for index, layer in enumerate(layers):
            query = F.linear(x, layer.q_proj, layer.q_bias).view(num_tokens, config.num_heads, config.head_dim)
            key = F.linear(x, layer.k_proj, layer.k_bias).view(num_tokens, config.num_kv_heads, config.head_dim)
            value = F.linear(x, layer.v_proj, layer.v_bias).view(num_tokens, config.num_kv_heads, config.head_dim)
            if layer.q_norm is not None:
                query, key = layer_ops.rms_norm(query, layer.q_norm, eps), layer_ops.rms_norm(key, layer.k_norm, eps)
            query, key = layer_ops.rotary(query, key, cos, sin)
            attended = attention(index, query, key, value)
            attended = F.linear(attended.reshape(num_tokens, -1), layer.o_proj, layer.o_bias)
            hidden, x = layer_ops.add_rms_norm(hidden, attended, layer.post_attention_norm, eps)
            gate, up = F.linear(x, layer.gate_proj, layer.gate_bias), F.linear(x, layer.up_proj, layer.up_bias)
            mlp = F.linear(F.silu(gate) * up, layer.down_proj, layer.down_bias)
            next_norm = layers[index + 1].input_norm if index + 1 < len(layers) else self.weights.norm
            hidden, x = layer_ops.add_rms_norm(hidden, mlp, next_norm, eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[num_tokens, vocab]` of final hidden states."""
        return (hidden @ self.weights.lm_head.T).float()

    def dense_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last token of one sequence, recomputed from scratch: no cache at all."""
        num_tokens = token_ids.shape[0]
        positions = torch.arange(num_tokens, device=token_ids.device)
        sequence_ends = torch.full((num_tokens,), num_tokens, device=token_ids.device)
        hidden = self.forward(token_ids, positions, self._dense_attention, sequence_ends)
        return self.logits(hidden[-1:])[0]

    def _dense_attention(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return dense_attention(query, key, value, self.config.window_of(layer))


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

