"""A real manager, a real worker and the reference scheduler, against a dense pass with no cache.

Each configuration runs the same three scenarios: a batch of greedy
generations, a prefix-cache hit that computes only the uncached tail, and a
fork whose children copy-on-write their shared last block and then sample
differently. Every generated token must equal the dense model's choice for
the tokens before it. The worker runs in float32 on the tests' device (CUDA
when torch has one) and the dense pass on the CPU. Without CUDA the Triton
configuration runs the kernels in the CPU interpreter on a tiny model; the
`gpu` configuration, Triton on the small model, runs only on CUDA.
"""

from __future__ import annotations

import itertools
import random

import pytest
from devices import DEVICE
from e2e_support import DenseOracle, greedy, start_stack, stop_stack

from reference_scheduler import Sampling

BLOCK_SIZE = 16
FULL = {"num_blocks": 256, "groups": [{"kind": "full_attention", "block_size": BLOCK_SIZE}]}
HYBRID = {
    "num_blocks": 256,
    "groups": [
        {"kind": "sliding_window", "block_size": BLOCK_SIZE, "sliding_window": 24},
        {"kind": "full_attention", "block_size": BLOCK_SIZE},
    ],
}
CONFIGS = {
    "torch-small": ("torch", "small", FULL),
    "torch-tiny-swa": ("torch", "tiny-swa", HYBRID),
    "triton-tiny-swa": ("triton", "tiny-swa", HYBRID),
    "triton-small": ("triton", "small", FULL),
}
NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device: the small model is too slow in Triton's CPU interpreter"),
]
PARAMS = [pytest.param(name, marks=NEEDS_CUDA if name == "triton-small" else ()) for name in CONFIGS]


@pytest.fixture(scope="module", params=PARAMS)
def setup(request, tmp_path_factory, device):
    backend, model, pool = CONFIGS[request.param]
    stack, processes = start_stack(tmp_path_factory.mktemp(request.param), model, backend, pool, seed=7, device=device)
    oracle = DenseOracle(model, seed=7)
    try:
        yield stack, oracle
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)


def prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def test_a_batch_of_greedy_generations_matches_the_dense_pass(setup):
    stack, oracle = setup
    vocab = oracle.model.config.vocab_size
    scheduler = stack.scheduler()
    requests = [scheduler.add(f"batch-{n}", prompt(n, n, vocab), 20) for n in (7, 23, 41)]
    scheduler.run()
    for request in requests:
        assert len(request.output) == 20
        oracle.check(request)
    assert stack.manager_client.stats().num_requests == 0  # all freed


def test_the_same_prompt_again_hits_the_cache_and_computes_only_the_tail(setup):
    stack, oracle = setup
    tokens = prompt(100, 45, oracle.model.config.vocab_size)
    first = stack.scheduler()
    original = first.add("hit-first", tokens, 8)
    first.run()

    second = stack.scheduler()
    again = second.add("hit-second", tokens, 8)
    second.step()
    cached = again.num_cached_prompt_tokens
    assert cached == 32  # two full blocks; the last prompt token is always computed
    assert second.timings[0].num_tokens == len(tokens) - cached
    second.run()
    assert again.output == original.output
    oracle.check(again)


def test_forked_children_copy_the_shared_block_and_continue_on_their_own(setup):
    stack, oracle = setup
    num_groups = len(stack.manager_client.get_config().groups)
    scheduler = stack.scheduler()
    parent = scheduler.add("fork-parent", prompt(200, 37, oracle.model.config.vocab_size), 12)
    for _ in range(3):
        scheduler.step()
    # 39 tokens computed: the third block (positions 32..47) is partly filled and now shared by three.
    assert parent.num_computed_tokens == 39
    children = {"fork-a": Sampling(1.0, 11), "fork-b": Sampling(1.0, 22)}
    a, b = scheduler.fork("fork-parent", children, 12)
    scheduler.step()
    # Each child copies the block, in every group, before writing position 39.
    assert scheduler.timings[-1].num_copies == 2 * num_groups
    scheduler.run()

    assert a.output[:3] == b.output[:3] == parent.output[:3]
    assert a.output[3:] != b.output[3:]
    oracle.check(parent)
    for child in (a, b):
        oracle.check(child, itertools.chain([greedy()] * 3, itertools.repeat(child.sampling)))
    assert stack.manager_client.stats().num_pending_copies == 0  # the worker acknowledged the copies
