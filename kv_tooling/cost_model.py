"""What a scheduler step costs on one GPU: the simulated clock of a time-driven trace replay.

A step's time is the sum of four terms, with no overlap assumed between them
(so it errs toward longer steps):

    step_s = num_prefill_tokens   * prefill_us_per_token * 1e-6         compute-bound prefill
           + [num_decode_rows > 0] * decode_step_ms * 1e-3               the weights, read once per step
           + num_decode_rows      * decode_us_per_row * 1e-6             each row's matmuls
           + num_decode_kv_tokens * kv_bytes_per_token / hbm_bytes_per_s  the KV each decode row reads
           + num_copied_tokens    * kv_bytes_per_token / link_bytes_per_s host tier copies, both directions

The defaults describe one model on one GPU, from public figures:

- Llama-3-8B (Meta's model card and config): 8.03e9 parameters, bf16 (16.06
  GB of weights); 32 layers, 8 KV heads of dimension 128, so K and V of one
  token in bf16 take 2 * 32 * 8 * 128 * 2 = 131,072 bytes.
- NVIDIA H200 SXM (NVIDIA's H200 Tensor Core GPU datasheet): 4.8 TB/s of HBM3e;
  1,979 bf16 Tensor Core TFLOPS with sparsity, so 989 dense.
- Host link: PCIe Gen5 x16 carries 32 GT/s x 16 lanes with 128b/130b encoding,
  63 GB/s per direction; 55 GB/s is assumed to be what copies reach.

Prefill: a token costs 2 FLOPs per parameter, 16.06 GFLOPs. Attention over
the context is left out: 4 * 32 layers * 4,096 * L FLOPs for a token at position
L, 4.3 GFLOPs (a quarter more) at L = 8k, so long prompts cost more than this.
At an assumed 40% model FLOPs utilisation of 989 TFLOPS that is 40.6 us a token,
about 24,600 prompt tokens/s: the order of what one such GPU prefills, 20-30k
tokens/s. A decode row's matmuls cost the same FLOPs at the same utilisation.
Decode: the step reads the weights once, 16.06 GB / 4.8 TB/s = 3.35 ms, and
each row reads its context's K and V at the full HBM rate (131,072 bytes a
token: 27 us per 1,000 tokens of context).

Pure arithmetic: no I/O, no clock. Every parameter is a `kv-manager replay` flag.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

# The public figures the defaults come from (see the module docstring).
LLAMA3_8B_NUM_PARAMS = 8.03e9
LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head dim x bf16
BF16_BYTES = 2
H200_BF16_DENSE_FLOPS = 989e12
H200_HBM_GB_PER_S = 4800.0
PCIE5_X16_EFFECTIVE_GB_PER_S = 55.0
ASSUMED_MFU = 0.40  # model FLOPs utilisation of a prefill pass

_FLOPS_PER_TOKEN = 2 * LLAMA3_8B_NUM_PARAMS
_US_PER_TOKEN = _FLOPS_PER_TOKEN / (ASSUMED_MFU * H200_BF16_DENSE_FLOPS) * 1e6
_WEIGHT_READ_MS = LLAMA3_8B_NUM_PARAMS * BF16_BYTES / (H200_HBM_GB_PER_S * 1e9) * 1e3


class StepWork(NamedTuple):
    """What one scheduler step computed and copied: the input of `StepCostModel.step_s`."""

    num_prefill_tokens: int = 0  # tokens computed by prefill passes: every token not computed by a decode row
    num_decode_rows: int = 0  # requests that computed exactly their one pending output token
    num_decode_kv_tokens: int = 0  # tokens of K and V those rows attend to (each row's position + 1)
    num_copied_tokens: int = 0  # tokens in the host tier's copies, offloads and onloads together


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """The step time of the module docstring; the defaults are Llama-3-8B in bf16 on one H200."""

    prefill_us_per_token: float = _US_PER_TOKEN
    decode_step_ms: float = _WEIGHT_READ_MS
    decode_us_per_row: float = _US_PER_TOKEN
    hbm_gb_per_s: float = H200_HBM_GB_PER_S
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN
    link_gb_per_s: float = PCIE5_X16_EFFECTIVE_GB_PER_S

    def __post_init__(self) -> None:
        for name in ("prefill_us_per_token", "decode_step_ms", "decode_us_per_row", "kv_bytes_per_token"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        for name in ("hbm_gb_per_s", "link_gb_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")

    def step_s(self, work: StepWork) -> float:
        """Seconds the step takes; 0 for a step that computed and copied nothing."""
        seconds = work.num_prefill_tokens * self.prefill_us_per_token * 1e-6
        if work.num_decode_rows:
            seconds += self.decode_step_ms * 1e-3 + work.num_decode_rows * self.decode_us_per_row * 1e-6
        seconds += work.num_decode_kv_tokens * self.kv_bytes_per_token / (self.hbm_gb_per_s * 1e9)
        seconds += work.num_copied_tokens * self.kv_bytes_per_token / (self.link_gb_per_s * 1e9)
        return seconds

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens one second of prefill computes (inf at a zero cost)."""
        return 1e6 / self.prefill_us_per_token if self.prefill_us_per_token else float("inf")
