"""bfloat16 end to end: a real manager, a bf16 worker and the reference scheduler, against a bf16 dense pass.

bf16 keeps 8 bits of mantissa, so the paged worker and the dense pass (another order of
summation, other kernels, another device) round differently, and a greedy choice between two
nearly equal logits may go either way. The stated tolerance, per generated token:

- the worker's token is the dense pass's choice, or a token whose logit is at most
  LOGIT_MARGIN below it (on the score a sampled choice maximises, scaled back to logits);
- the worker's log-probability of its token is within LOGPROB_ATOL of the dense one;
- and at least MIN_EXACT of all tokens are exactly the dense choice, so that a worker whose
  every token is merely near cannot pass.

The dense pass runs in bf16 on the CPU with the worker's bf16 weights (`DenseOracle`). The
torch configuration runs on the tests' device; Triton on the small model needs CUDA, and on
a CPU the tiny model runs the kernels in the interpreter.
"""

from __future__ import annotations

import random

import pytest
import torch
from devices import DEVICE
from e2e_support import DenseOracle, start_stack, stop_stack

from reference_scheduler import Sampling

LOGIT_MARGIN = 0.25
LOGPROB_ATOL = 0.1
MIN_EXACT = 0.9
POOL = {"num_blocks": 256, "groups": [{"kind": "full_attention", "block_size": 16}]}
CONFIGS = {"torch-small": ("torch", "small"), "triton-tiny": ("triton", "tiny"), "triton-small": ("triton", "small")}
NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device: too slow interpreted")]
# Without CUDA the other two take 25-55 s each on the CPU: `thorough` only there (conftest.py).
ON_CPU_THOROUGH = pytest.mark.thorough if DEVICE != "cuda" else ()
PARAMS = [pytest.param(name, marks=NEEDS_CUDA if name == "triton-small" else ON_CPU_THOROUGH) for name in CONFIGS]


@pytest.mark.parametrize("config", PARAMS)
def test_bf16_generations_stay_within_the_stated_tolerance_of_the_dense_pass(config, tmp_path, device):
    backend, model = CONFIGS[config]
    stack, processes = start_stack(tmp_path, model, backend, POOL, seed=7, device=device, dtype="bfloat16")
    try:
        oracle = DenseOracle(model, seed=7, dtype=torch.bfloat16)
        vocab = oracle.model.config.vocab_size
        rng = random.Random(3)
        scheduler = stack.scheduler()
        samplings = [Sampling(0.0, 0), Sampling(0.0, 0), Sampling(0.0, 0), Sampling(0.8, 99)]
        requests = [
            scheduler.add(f"bf16-{n}", [rng.randrange(vocab) for _ in range(length)], 16, sampling)
            for n, (length, sampling) in enumerate(zip((9, 23, 40, 17), samplings))
        ]
        scheduler.run()
        exact = sum(oracle.check_near(request, LOGIT_MARGIN, LOGPROB_ATOL) for request in requests)
        total = sum(len(request.output) for request in requests)
        assert total == 64 and exact >= MIN_EXACT * total, f"{exact} of {total} tokens are the dense choice"
    finally:
        failures = stop_stack(stack, processes)
    assert not failures, "\n\n".join(failures)
