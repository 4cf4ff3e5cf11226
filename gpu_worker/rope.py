"""Rotary position embeddings: each token's rotation angles, by the frequency rule its config names.

The inverse frequencies of a head of `d` dimensions, in fp32 as transformers
computes them (`modeling_rope_utils.py`), for i = 0 .. d/2 - 1:

    default  inv_freq[i] = 1 / theta^(2i / d)
    linear   inv_freq[i] / factor                (the same as positions / factor)
    llama3   with w = 2 pi / inv_freq[i] (a wavelength), L0 the original context,
             low = L0 / low_freq_factor, high = L0 / high_freq_factor:
               w < high:  inv_freq[i]
               w > low:   inv_freq[i] / factor
               otherwise: (1 - s) inv_freq[i] / factor + s inv_freq[i],
                          s = (L0 / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
    dynamic  default with theta' = theta * (factor * L / L0 - (factor - 1))^(d / (d - 2)),
             L = max(sequence length, L0): the length of the token's sequence
             at the step that computes it (transformers: max position + 1 of a
             forward), so each request of a batch has frequencies of its own

A token at position p is rotated by p * inv_freq; the two halves of a head
are rotated as pairs (x[i], x[i + d/2]), the Llama convention
(`kernels.layer_ops.rotary_reference`, `kernels.rotary`).
"""

from __future__ import annotations

import math

import torch

from gpu_worker.model_config import ModelConfig, RopeScaling


def _exponents(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """2i / d for each pair i, in fp32."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """fp32 `[head_dim // 2]` on the CPU: the frequencies of every token, for all but dynamic scaling."""
    inv_freq = 1.0 / (theta ** _exponents(head_dim))
    if scaling is None or scaling.rope_type == "dynamic":  # dynamic: the same until a sequence outgrows L0
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    assert scaling.rope_type == "llama3", scaling
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelength >= original / scaling.high_freq_factor) & (wavelength <= original / scaling.low_freq_factor)
    return torch.where(in_band, smoothed, scaled)


def dynamic_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling, sequence_lengths: torch.Tensor
) -> torch.Tensor:
    """fp32 `[n, head_dim // 2]`: dynamic NTK frequencies for sequences of `sequence_lengths` (`[n]`, integers)."""
    original = scaling.original_max_position_embeddings
    lengths = sequence_lengths.to(torch.int64).clamp(min=original)
    base = theta * (scaling.factor * lengths / original - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base[:, None] ** _exponents(head_dim, lengths.device)[None, :])


class RotaryEmbedding:
    """The cos and sin of every token's angles, for one model on one device."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config = config
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).to(device)

    @property
    def needs_sequence_ends(self) -> bool:
        """Whether `cos_sin` must know each token's sequence length (dynamic scaling)."""
        return self.config.dynamic_rope

    def cos_sin(
        self, positions: torch.Tensor, sequence_ends: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin `[num_tokens, head_dim // 2]` of the tokens at `positions`.

        `sequence_ends[t]` (`[num_tokens]`) is the length of token t's sequence
        once this step's tokens are in, its request's last position + 1; only
        dynamic scaling reads it, and then it must be given.
        """
        if self.needs_sequence_ends:
            assert sequence_ends is not None, "dynamic RoPE needs each token's sequence end"
            head_dim, theta, scaling = self.config.head_dim, self.config.rope_theta, self.config.rope_scaling
            inv_freq = dynamic_inverse_frequencies(head_dim, theta, scaling, sequence_ends)
        else:
            inv_freq = self.inv_freq[None, :]
        angles = positions.float()[:, None] * inv_freq
        return angles.cos(), angles.sin()

