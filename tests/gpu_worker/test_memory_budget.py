"""The start-up memory check: the arithmetic on given (free, total) figures, and the worker's refusal."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from processes import launch, stop_all

import kernels
from gpu_worker.memory_budget import (
    MemoryBudget,
    check_device_memory,
    headroom_bytes,
    kv_block_bytes,
    memory_budget,
    weight_bytes,
)
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import BUILTIN_MODELS, FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape
from gpu_worker.weights import random_weights
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX

GiB = 2**30
LLAMA_1B = BUILTIN_MODELS["llama-3.2-1b"]
ONE_GROUP = PoolShape(num_blocks=32768, groups=(CacheGroup(0, 16),), max_model_len=4096, max_num_requests=256)
# Two groups of different block sizes: each layer's cache takes its own group's size.
HYBRID = PoolShape(
    num_blocks=20,
    groups=(CacheGroup(0, 8, sliding_window=24), CacheGroup(1, 32)),
    max_model_len=256,
    max_num_requests=4,
)
HYBRID_MODELS = [
    ModelConfig("untied-swa", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=12, sliding_window=24,
                layer_types=(SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION)),
    ModelConfig("tied-swa", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=12, sliding_window=24, tie_word_embeddings=True,
                layer_types=(FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)),
    ModelConfig("biased-swa", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=12, sliding_window=24, qkv_bias=True, o_proj_bias=True, mlp_bias=True,
                qk_norm=True, layer_types=(FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)),
]  # fmt: skip


@pytest.mark.parametrize("config", HYBRID_MODELS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_budget_counts_what_the_worker_allocates(config: ModelConfig, dtype: torch.dtype) -> None:
    weights = random_weights(config, 0, dtype, torch.device("cpu"))
    runner = ModelRunner(LlamaModel(config, weights), HYBRID, kernels.load("torch", "cpu"), torch.device("cpu"), dtype)
    tensors = {t.data_ptr(): t for layer in weights.layers for t in vars(layer).values() if t is not None}
    tensors.update({t.data_ptr(): t for t in (weights.embed_tokens, weights.norm, weights.lm_head)})  # tied: one tensor

    budget = memory_budget(config, HYBRID, dtype, free_bytes=64 * GiB, total_bytes=80 * GiB)
    assert budget.kv_cache_bytes == runner.kv_cache_bytes
    assert budget.weight_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_llama_1b_in_bfloat16() -> None:
    # 1,235,814,400 parameters (the embedding tied to the lm_head), 2 bytes each.
    assert weight_bytes(LLAMA_1B, 2) == 2 * 1_235_814_400
    # 16 layers x (K, V) x 16 slots x 8 KV heads x 64 dims x 2 bytes: 0.5 MiB per block.
    assert kv_block_bytes(LLAMA_1B, ONE_GROUP, 2) == 16 * 2 * 16 * 8 * 64 * 2 == 2**19


def test_the_headroom_is_a_tenth_of_the_device_and_at_least_a_gib() -> None:
    assert headroom_bytes(80 * GiB) == 8 * GiB
    assert headroom_bytes(141 * GiB) == int(14.1 * GiB)
    assert headroom_bytes(4 * GiB) == GiB


def test_a_second_worker_on_a_shared_gpu_is_told_the_num_blocks_that_fit() -> None:
    # An 80 GiB GPU with 20 GiB left by another worker; the manager asks for 32,768 blocks (16 GiB).
    budget = memory_budget(LLAMA_1B, ONE_GROUP, torch.bfloat16, free_bytes=20 * GiB, total_bytes=80 * GiB)
    assert budget.needed_bytes == 16 * GiB + 2 * 1_235_814_400 + 8 * GiB
    assert not budget.fits
    # (20 GiB - 2,471,628,800 bytes of weights - 8 GiB of headroom) // 0.5 MiB
    assert budget.max_num_blocks == 19_861
    message = budget.refusal("cuda:0")
    assert "\n" not in message
    # 16 GiB of KV + 2,471,628,800 bytes of weights + 8 GiB of headroom
    needed = "needed 28241432576 bytes (26.30 GiB) = KV cache 17179869184 + weights 2471628800 + headroom 8589934592 "
    assert needed in message
    assert "free 21474836480 bytes (20.00 GiB) of 85899345920 bytes" in message
    assert message.endswith("start the manager with --num-blocks 19861 or fewer")


def test_when_not_even_the_weights_fit_no_num_blocks_is_offered() -> None:
    budget = memory_budget(LLAMA_1B, ONE_GROUP, torch.bfloat16, free_bytes=9 * GiB, total_bytes=80 * GiB)
    assert not budget.fits and budget.max_num_blocks == 0
    message = budget.refusal("cuda:0")
    assert "\n" not in message and "no --num-blocks fits" in message and "--num-blocks 0" not in message


@given(
    num_blocks=st.integers(2, 1 << 20),
    block_bytes=st.integers(1, 1 << 24),
    weights=st.integers(0, 1 << 36),
    free=st.integers(0, 1 << 38),
    total=st.integers(1, 1 << 38),
)
def test_a_budget_fits_exactly_when_its_blocks_are_at_most_the_max(num_blocks, block_bytes, weights, free, total):
    budget = MemoryBudget(num_blocks, block_bytes, weights, headroom_bytes(total), free, total)
    assert budget.fits == (num_blocks <= budget.max_num_blocks)
    largest = MemoryBudget(budget.max_num_blocks, block_bytes, weights, budget.headroom_bytes, free, total)
    assert largest.needed_bytes <= free or budget.max_num_blocks == 0
    assert largest.needed_bytes + block_bytes > free


def test_a_cpu_worker_asks_no_device_for_its_memory(monkeypatch) -> None:
    def no_query(*args):
        raise AssertionError("mem_get_info called for a CPU worker")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_query)
    assert check_device_memory(LLAMA_1B, ONE_GROUP, torch.float32, torch.device("cpu")) is None


# A worker process on a CUDA device that torch reports with the given free and total memory. This torch
# has no CUDA: allocating anything there would fail with a traceback, so a clean refusal shows that the
# check runs before the worker allocates.
FAKE_CUDA_WORKER = textwrap.dedent(
    """
    import sys
    import torch

    free, total = int(sys.argv[1]), int(sys.argv[2])
    torch.cuda.is_available = lambda: True
    torch.cuda.mem_get_info = lambda device=None: (free, total)
    from gpu_worker.cli import main

    sys.exit(main(sys.argv[3:]))
    """
)


def test_the_worker_refuses_a_cache_too_large_in_one_line_with_exit_code_2(tmp_path) -> None:
    manager = launch(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--num-blocks", "64"],
        MANAGER_READY_PREFIX,
        tmp_path / "manager.log",
    )
    try:
        # The tiny model in bfloat16: 213,632 bytes of weights, 4,096 bytes per block; room for 10 blocks
        # beside them and the 1 GiB headroom of a 4 GiB device.
        free = GiB + 213_632 + 10 * 4096 + 100
        done = subprocess.run(
            [sys.executable, "-c", FAKE_CUDA_WORKER, str(free), str(4 * GiB),
             "--manager", manager.address, "--device", "cuda", "--backend", "torch", "--model", "tiny"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        assert not stop_all([manager])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("gpu-worker: error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("gpu-worker: error: cuda has too little free memory for 64 KV blocks: "), done.stderr
    assert f"free {free} bytes" in errors[0]
    assert errors[0].endswith("start the manager with --num-blocks 10 or fewer"), errors[0]
