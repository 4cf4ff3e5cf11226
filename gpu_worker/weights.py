"""The decoder's weights: seeded random ones, or a safetensors checkpoint in the Llama layout."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import torch

from gpu_worker.model_config import ModelConfig


@dataclasses.dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    q_proj: torch.Tensor  # [num_heads * head_dim, hidden]
    k_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    v_proj: torch.Tensor  # [num_kv_heads * head_dim, hidden]
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_proj: torch.Tensor  # [intermediate, hidden]
    up_proj: torch.Tensor  # [intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]


@dataclasses.dataclass
class Weights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


# Checkpoint tensor names (the Llama layout) of one layer's fields.
_LAYER_TENSORS = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each field of `LayerWeights`."""
    hidden, q_dim, kv_dim = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "input_norm": (hidden,),
        "q_proj": (q_dim, hidden),
        "k_proj": (kv_dim, hidden),
        "v_proj": (kv_dim, hidden),
        "o_proj": (hidden, q_dim),
        "post_attention_norm": (hidden,),
        "gate_proj": (config.intermediate_size, hidden),
        "up_proj": (config.intermediate_size, hidden),
        "down_proj": (hidden, config.intermediate_size),
    }


def random_weights(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> Weights:
    """Deterministic weights for `seed`, drawn on the CPU in fp32 (the same on every device).

    Matrices are scaled by 1/sqrt(fan_in) so activations stay of order one and
    the logits are peaked enough that greedy choices are not near-ties.
    """
    generator = torch.Generator().manual_seed(seed)

    def draw(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * std).to(device=device, dtype=dtype)

    def norm_weight(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn((size,), generator=generator)).to(device=device, dtype=dtype)

    layers = []
    for _ in range(config.num_layers):
        fields = {}
        for field, shape in layer_shapes(config).items():
            fields[field] = norm_weight(shape[0]) if len(shape) == 1 else draw(shape, 1.0 / math.sqrt(shape[1]))
        layers.append(LayerWeights(**fields))
    embed = draw((config.vocab_size, config.hidden_size), 1.0)
    lm_head = embed if config.tie_word_embeddings else draw((config.vocab_size, config.hidden_size), 2.0 / math.sqrt(config.hidden_size))
    return Weights(embed, layers, norm_weight(config.hidden_size), lm_head)


def load_safetensors(directory: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> Weights:
    """Weights from every `*.safetensors` file in `directory`, Llama tensor names.

    Raises ValueError naming the tensor when one is missing, has the wrong
    shape, or appears in two files; tensors the decoder does not use (rotary
    caches, for instance) are ignored.
    """
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model {directory}: no *.safetensors file")
    location: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in location:
                    raise ValueError(f"tensor {name!r} is in both {location[name].name} and {path.name}")
                location[name] = path

    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in files}

        def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in location:
                raise ValueError(f"--model {directory}: tensor {name!r} is missing")
            value = handles[location[name]].get_tensor(name)
            if tuple(value.shape) != shape:
                raise ValueError(f"--model {directory}: tensor {name!r} has shape {tuple(value.shape)}, expected {shape}")
            return value.to(device=device, dtype=dtype)

        shapes = layer_shapes(config)
        layers = [
            LayerWeights(**{field: tensor(f"model.layers.{i}.{name}", shapes[field]) for field, name in _LAYER_TENSORS.items()})
            for i in range(config.num_layers)
        ]
        vocab_shape = (config.vocab_size, config.hidden_size)
        embed = tensor("model.embed_tokens.weight", vocab_shape)
        if "lm_head.weight" in location:
            lm_head = tensor("lm_head.weight", vocab_shape)
        elif config.tie_word_embeddings:
            lm_head = embed
        else:
            raise ValueError(f"--model {directory}: tensor 'lm_head.weight' is missing and tie_word_embeddings is false")
        return Weights(embed, layers, tensor("model.norm.weight", (config.hidden_size,)), lm_head)
