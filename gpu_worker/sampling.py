"""How the next token is chosen from logits: greedy, or reproducible Gumbel-max sampling.

Sampling with temperature T picks argmax(logits / T + g), where the Gumbel
noise g is drawn from a generator seeded by (seed, position of the new token).
The choice therefore depends only on the logits, the seed and the position:
the paged worker and the dense reference pick the same tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SamplingParams(NamedTuple):
    temperature: float = 0.0  # 0: greedy
    seed: int = 0


GREEDY = SamplingParams()


def choose(logits: torch.Tensor, params: SamplingParams, position: int) -> tuple[int, float]:
    """(token id, the model's log-probability of it) from one row of fp32 logits."""
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.temperature == 0:
        token_id = int(torch.argmax(logits))
    else:
        generator = torch.Generator().manual_seed((params.seed * 1_000_003 + position) % (1 << 63))
        uniform = torch.rand(logits.shape[-1], generator=generator, dtype=torch.float64).clamp_(1e-20, 1.0)
        gumbel = -torch.log(-torch.log(uniform))
        token_id = int(torch.argmax(logits.double().cpu() / params.temperature + gumbel))
    return token_id, float(logprobs[token_id])
