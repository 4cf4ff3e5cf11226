"""Model configs, and how layers map onto the manager's groups."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.model_config import BUILTIN_MODELS, ModelConfig, RopeScaling
from gpu_worker.runner import CacheGroup, assign_layers
from gpu_worker.sampling import SamplingParams, choose


def test_hf_round_trip_of_every_builtin():
    for config in BUILTIN_MODELS.values():
        assert ModelConfig.from_hf_dict(config.name, config.to_hf_dict()) == config


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "must be a multiple of num_kv_heads"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"layer_types": ("full_attention",)}, "layer_types has 1 entries, num_layers is 2"),
        ({"layer_types": ("full_attention", "mamba")}, "unsupported"),
        ({"layer_types": ("sliding_attention", "full_attention")}, "no positive sliding_window"),
    ],
)
def test_bad_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**BUILTIN_MODELS["tiny"].__dict__, **change})


@pytest.mark.parametrize(
    "scaling, message",
    [
        (dict(rope_type="yarn", factor=4.0), "rope_type 'yarn' is not supported; this worker runs linear, dynamic, llama3"),
        (dict(rope_type="linear", factor=0.5), "factor must be >= 1, got 0.5"),
        (dict(rope_type="dynamic", factor=2.0), "'dynamic' needs a positive original_max_position_embeddings, got 0"),
        (dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=32, low_freq_factor=1.0,
              high_freq_factor=1.0), "needs 0 < low_freq_factor < high_freq_factor, got 1.0 and 1.0"),
    ],
)  # fmt: skip
def test_bad_rope_scalings_name_the_field(scaling, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RopeScaling(**scaling)


def test_dynamic_rope_needs_room_for_its_exponent():
    with pytest.raises(ValueError, match="head_dim must be at least 4 for dynamic RoPE, got 2"):
        ModelConfig(**{**BUILTIN_MODELS["tiny"].__dict__, "head_dim": 2, "rope_scaling": RopeScaling("dynamic", 2.0, 16)})


def test_layers_map_to_the_group_with_their_window():
    swa = BUILTIN_MODELS["tiny-swa"]  # layer 0 slides over 24 positions, layer 1 sees all
    assert assign_layers(swa, [CacheGroup(0, 16, 0), CacheGroup(1, 16, 24)]) == [1, 0]
    with pytest.raises(ValueError, match="layer 0 attends with window 24, and the manager's pool has no group"):
        assign_layers(swa, [CacheGroup(0, 16, 0)])
    with pytest.raises(ValueError, match=r"groups \[1\] that no layer"):
        assign_layers(BUILTIN_MODELS["tiny"], [CacheGroup(0, 16, 0), CacheGroup(1, 16, 32)])


def test_sampling_is_greedy_at_zero_and_reproducible_otherwise():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert choose(logits, SamplingParams(), 5)[0] == int(logits.argmax())
    sampled = [choose(logits, SamplingParams(1.0, seed), 5)[0] for seed in range(20)]
    assert sampled == [choose(logits, SamplingParams(1.0, seed), 5)[0] for seed in range(20)]
    assert len(set(sampled)) > 1
    token, logprob = choose(logits, SamplingParams(1.0, 3), 5)
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]))
