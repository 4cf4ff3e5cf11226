"""The worker against Hugging Face transformers, on small random checkpoints, as a user would check it.

Each checkpoint is written by transformers itself (`hf_support.py`) and
served by a real `kv-manager serve` and `gpu-worker`, driven by the
reference scheduler; transformers decodes the same prompts greedily with its
own KV cache. The checkpoints, and what each one brings:

    llama2    Llama, untied head, the older config.json layout: a top-level
              `rope_theta` (50000), `rope_scaling: null`, no `rope_parameters`
    llama3    Llama, `rope_parameters` with rope_type llama3 (factor 8, low 1,
              high 4, original_max_position_embeddings 32, so the three
              frequency bands all occur with head_dim 24), tied embeddings,
              head_dim 24 != hidden/heads, attention_bias and mlp_bias
    linear    Llama, linear RoPE scaling (factor 2) in the older layout: a
              top-level `rope_theta` (20000) and `rope_scaling` with `type`
    dynamic   Llama, dynamic NTK RoPE scaling (factor 2, max_position_embeddings
              16, prompts that start or grow past 16); the manager runs with
              --no-prefix-caching, since a cached key was rotated for the
              sequence length of the step that computed it
    mistral   Mistral, sliding_window 8 (prompts longer than the window and than
              a block), rope_theta 1e6
    qwen2     Qwen2, q/k/v biases, use_sliding_window false while config.json
              still names a sliding_window (8) and max_window_layers (1) and no
              layer_types, as published Qwen2 checkpoints do: no layer slides
    qwen3     Qwen3, q_norm and k_norm, head_dim 32 != hidden/heads, tied

Each runs three greedy prompts of different lengths in one batch, then a
prompt that shares its first three blocks with an earlier one and must hit
the prefix cache (the dynamic checkpoint, with the cache off, must not). The
Triton backend (in the CPU interpreter without CUDA) runs one prompt on
llama3 (full attention) and mistral (sliding window).

Comparison: every greedy token equal to transformers', and every logprob
within LOGPROB_ATOL = 1e-4 (absolute) of log_softmax of transformers' logits
at that token; both sides compute in float32. Every choice of the oracle wins
over the runner-up by at least MIN_MARGIN, so a mismatch is never a near-tie.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Callable, Iterator

import pytest
from e2e_support import Stack, start_stack, stop_stack
from hf_support import REMOVE, TINY_SHAPE, CheckpointSpec, Generation, build_checkpoint, transformers_greedy

from reference_scheduler.scheduler import Request

BLOCK_SIZE = 4
NUM_NEW_TOKENS = 6
LOGPROB_ATOL = 1e-4
MIN_MARGIN = 1e-3  # in logits: ten times LOGPROB_ATOL, and far above the float32 noise between the two
VOCAB_SIZE = TINY_SHAPE["vocab_size"]


@dataclasses.dataclass(frozen=True)
class Case:
    """A checkpoint and how it is served and prompted."""

    spec: CheckpointSpec
    prompt_lengths: tuple[int, ...] = (5, 11, 18)  # with BLOCK_SIZE 4: inside one block, and across several
    prefix_caching: bool = True


CASES = {
    case.spec.name: case
    for case in (
        Case(CheckpointSpec(
            "llama2", "LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
            config_json_edits={"rope_parameters": REMOVE, "rope_theta": 50000.0, "rope_scaling": None},
        )),
        Case(CheckpointSpec(
            "llama3", "LlamaConfig",
            {
                "rope_parameters": {
                    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                },
                "tie_word_embeddings": True, "head_dim": 24, "attention_bias": True, "mlp_bias": True,
            },
            seed=1,
        )),
        Case(CheckpointSpec(
            "linear", "LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}},
            # the older layout of a scaled RoPE: a top-level rope_theta and rope_scaling with `type`
            config_json_edits={
                "rope_parameters": REMOVE, "rope_theta": 20000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
            },
            seed=2,
        )),
        Case(
            CheckpointSpec(
                "dynamic", "LlamaConfig",
                {
                    "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                    "max_position_embeddings": 16,
                },
                seed=3,
            ),
            prompt_lengths=(13, 18, 23),  # 13 crosses 16 while it decodes; the others start past it
            prefix_caching=False,
        ),
        Case(CheckpointSpec(
            "mistral", "MistralConfig",
            {"sliding_window": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
            sliding_window=8, seed=4,
        )),
        Case(CheckpointSpec(
            "qwen2", "Qwen2Config", {"use_sliding_window": False},
            config_json_edits={"sliding_window": 8, "max_window_layers": 1, "layer_types": REMOVE}, seed=5,
        )),
        Case(CheckpointSpec("qwen3", "Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, seed=6)),
    )
}  # fmt: skip
TRITON_CASES = ("llama3", "mistral")  # one full-attention model, one sliding-window model


def pool_for(case: Case) -> dict:
    """The manager's pool for a checkpoint: one group whose window is the checkpoint's."""
    window = case.spec.sliding_window
    if window:
        group = {"kind": "sliding_window", "block_size": BLOCK_SIZE, "sliding_window": window}
    else:
        group = {"kind": "full_attention", "block_size": BLOCK_SIZE}
    return {"num_blocks": 256, "max_model_len": 64, "max_num_requests": 8, "groups": [group]}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(length)]


@dataclasses.dataclass
class Served:
    """A checkpoint behind a running manager and worker."""

    case: Case
    stack: Stack


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory) -> Callable[[str], Path]:
    """The directory of a checkpoint by name, built on first use."""
    built: dict[str, Path] = {}

    def checkpoint(name: str) -> Path:
        if name not in built:
            built[name] = build_checkpoint(CASES[name].spec, tmp_path_factory.mktemp(f"hf-{name}"))
        return built[name]

    return checkpoint


@pytest.fixture(scope="module")
def transformers_generation(checkpoint_of) -> Callable[[str, list[int], int], Generation]:
    """transformers' greedy generation for (checkpoint name, prompt, number of new tokens), computed once."""
    generations: dict[tuple[str, tuple[int, ...], int], Generation] = {}

    def generation(name: str, prompt_ids: list[int], num_new_tokens: int) -> Generation:
        key = (name, tuple(prompt_ids), num_new_tokens)
        if key not in generations:
            generations[key] = transformers_greedy(checkpoint_of(name), prompt_ids, num_new_tokens)
        return generations[key]

    return generation


def serve(name: str, backend: str, checkpoint: Path, directory: Path, device: str) -> Iterator[Served]:
    case = CASES[name]
    manager_args = () if case.prefix_caching else ("--no-prefix-caching",)
    stack, processes = start_stack(
        directory, str(checkpoint), backend, pool_for(case), manager_args=manager_args, device=device
    )
    try:
        yield Served(case, stack)
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="module", params=list(CASES))
def served(request, checkpoint_of, tmp_path_factory, device) -> Iterator[Served]:
    name = request.param
    yield from serve(name, "torch", checkpoint_of(name), tmp_path_factory.mktemp(f"torch-{name}"), device)


@pytest.fixture(scope="module", params=TRITON_CASES)
def served_by_triton(request, checkpoint_of, tmp_path_factory, device) -> Iterator[Served]:
    name = request.param
    yield from serve(name, "triton", checkpoint_of(name), tmp_path_factory.mktemp(f"triton-{name}"), device)


def assert_matches(request: Request, expected: Generation) -> None:
    """The worker's tokens are transformers' and its logprobs are within LOGPROB_ATOL of them."""
    assert expected.min_margin >= MIN_MARGIN, (
        f"{request.request_id}: transformers' choices win by only {expected.min_margin:.2e}: "
        "pick another prompt or seed"
    )
    assert request.output == expected.token_ids, (
        f"{request.request_id} (prompt of {len(request.prompt)} tokens): the worker chose {request.output}, "
        f"transformers {expected.token_ids}"
    )
    errors = [abs(ours - theirs) for ours, theirs in zip(request.logprobs, expected.logprobs, strict=True)]
    assert max(errors) <= LOGPROB_ATOL, (
        f"{request.request_id}: logprobs {request.logprobs} differ from transformers' {expected.logprobs} "
        f"by up to {max(errors):.2e} (tolerance {LOGPROB_ATOL:g})"
    )


def test_a_batch_of_greedy_generations_matches_transformers(served, transformers_generation):
    name = served.case.spec.name
    scheduler = served.stack.scheduler()
    prompts = {f"{name}-batch-{length}": prompt(length, length) for length in served.case.prompt_lengths}
    requests = [scheduler.add(request_id, tokens, NUM_NEW_TOKENS) for request_id, tokens in prompts.items()]
    scheduler.run()
    for request in requests:
        assert_matches(request, transformers_generation(name, request.prompt, NUM_NEW_TOKENS))


def test_a_prompt_sharing_cached_blocks_hits_the_cache_and_still_matches(served, transformers_generation):
    name = served.case.spec.name
    shared_length = 3 * BLOCK_SIZE
    first_prompt = prompt(100, max(served.case.prompt_lengths))
    second_prompt = first_prompt[:shared_length] + prompt(101, 5)
    first = served.stack.scheduler()
    earlier = first.add(f"{name}-earlier", first_prompt, NUM_NEW_TOKENS)
    first.run()

    second = served.stack.scheduler()
    later = second.add(f"{name}-later", second_prompt, NUM_NEW_TOKENS)
    second.run()
    # With the cache on, the later prompt adopts the blocks the earlier one filled with their shared
    # tokens, and its first step computes only the rest: the shared K/V is read from the cache.
    cached = shared_length if served.case.prefix_caching else 0
    assert later.num_cached_prompt_tokens == cached
    assert second.timings[0].num_tokens == len(second_prompt) - cached
    assert_matches(earlier, transformers_generation(name, first_prompt, NUM_NEW_TOKENS))
    assert_matches(later, transformers_generation(name, second_prompt, NUM_NEW_TOKENS))


def test_the_triton_backend_matches_transformers(served_by_triton, transformers_generation):
    """One prompt, longer than a block and than mistral's window: the interpreter is slow."""
    name = served_by_triton.case.spec.name
    num_new_tokens = 4
    scheduler = served_by_triton.stack.scheduler()
    request = scheduler.add(f"{name}-triton", prompt(11, 11), num_new_tokens)
    scheduler.run()
    assert_matches(request, transformers_generation(name, request.prompt, num_new_tokens))
