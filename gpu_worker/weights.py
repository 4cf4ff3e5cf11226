"""The decoder's weights: seeded random ones, or a safetensors checkpoint in the transformers layout.

A checkpoint's tensors are all placed or the checkpoint is refused: a tensor
the config asks for that is missing or mis-shaped, one that two files hold,
and one the config does not ask for (a bias with attention_bias false, a
q_norm outside Qwen3, an unknown module) each stop the load, by name. The
only tensors accepted unread are the `rotary_emb.inv_freq` buffers of older
checkpoints, which the worker derives from the config instead. With tied
embeddings the output head is the embedding, so an `lm_head.weight` stored
too must equal it: transformers, given a different one, unties them against
the config (with a warning), a contradiction this worker refuses instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re
from pathlib import Path
from typing import TypeVar

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
    # Present only when the config declares them (None otherwise); shapes are the rows of their projection.
    q_bias: torch.Tensor | None = None  # qkv_bias
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None  # o_proj_bias
    gate_bias: torch.Tensor | None = None  # mlp_bias
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # qk_norm: [head_dim]
    k_norm: torch.Tensor | None = None


@dataclasses.dataclass
class Weights:
    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


# Checkpoint tensor names (the transformers layout) of one layer's fields.
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
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
    "gate_bias": "mlp.gate_proj.bias",
    "up_bias": "mlp.up_proj.bias",
    "down_bias": "mlp.down_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
_NORMS = frozenset({"input_norm", "post_attention_norm", "q_norm", "k_norm"})
_BIASES = frozenset({"q_bias", "k_bias", "v_bias", "o_bias", "gate_bias", "up_bias", "down_bias"})
# Older checkpoints store RoPE's inverse frequencies; the worker derives them from the config.
_DERIVED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor)


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each field of `LayerWeights` that `config` has (its optional biases and norms included)."""
    hidden, q_dim, kv_dim = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    intermediate = config.intermediate_size
    shapes = {
        "input_norm": (hidden,),
        "q_proj": (q_dim, hidden),
        "k_proj": (kv_dim, hidden),
        "v_proj": (kv_dim, hidden),
        "o_proj": (hidden, q_dim),
        "post_attention_norm": (hidden,),
        "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }
    if config.qkv_bias:
        shapes |= {"q_bias": (q_dim,), "k_bias": (kv_dim,), "v_bias": (kv_dim,)}
    if config.o_proj_bias:
        shapes["o_bias"] = (hidden,)
    if config.mlp_bias:
        shapes |= {"gate_bias": (intermediate,), "up_bias": (intermediate,), "down_bias": (hidden,)}
    if config.qk_norm:
        shapes |= {"q_norm": (config.head_dim,), "k_norm": (config.head_dim,)}
    return shapes


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` holds, by name, with its shape; `lm_head.weight` only when untied."""
    vocab_shape = (config.vocab_size, config.hidden_size)
    tensors = {"model.embed_tokens.weight": vocab_shape}
    shapes = layer_shapes(config)
    for layer in range(config.num_layers):
        tensors |= {f"model.layers.{layer}.{_LAYER_TENSORS[field]}": shape for field, shape in shapes.items()}
    tensors["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = vocab_shape
    return tensors


def random_weights(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> Weights:
    """Deterministic weights for `seed`, drawn on `device` in fp32 (`normal_draws`: the same on every device).

    Matrices are scaled by 1/sqrt(fan_in) so activations stay of order one and
    the logits are peaked enough that greedy choices are not near-ties; norms
    are near 1 and biases near 0.
    """
    streams = itertools.count()  # each tensor its own stream of draws, in this order

    def draw(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (normal_draws(shape, seed, next(streams), device) * std).to(dtype)

    def norm_weight(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * normal_draws((size,), seed, next(streams), device)).to(dtype)

    layers = []
    for _ in range(config.num_layers):
        fields = {}
        for field, shape in layer_shapes(config).items():
            if field in _NORMS:
                fields[field] = norm_weight(shape[0])
            else:
                fields[field] = draw(shape, 0.1 if field in _BIASES else 1.0 / math.sqrt(shape[1]))
        layers.append(LayerWeights(**fields))
    embed = draw((config.vocab_size, config.hidden_size), 1.0)
    lm_head = embed if config.tie_word_embeddings else draw((config.vocab_size, config.hidden_size), 2.0 / math.sqrt(config.hidden_size))
    return Weights(embed, layers, norm_weight(config.hidden_size), lm_head)


_MASK32 = 0xFFFFFFFF
# Pairs of elements drawn at once: on a CPU few enough for each op to stay in its caches and on one thread,
# on a GPU enough for each launch to fill it.
DRAW_CHUNKS = {"cpu": 1 << 14, "cuda": 1 << 24}


def normal_draws(shape: tuple[int, ...], seed: int, stream: int, device: torch.device) -> torch.Tensor:
    """float32 standard normal draws of `shape`, computed on `device`; element i depends on (seed, stream, i) alone.

    A counter-based generator: each element's uniform variate is an integer
    hash of its index, exact on every device, and each pair of elements is
    a Box-Muller pair. So a CPU and a GPU draw the same weights (up to the
    last bit of log, cos and sin), and a GPU draws its own, in parallel,
    instead of one CPU generator drawing them all before a copy.
    """
    numel = math.prod(shape)
    assert numel < 1 << 32, f"{shape}: one stream draws fewer than 2^32 elements"
    seed &= (1 << 64) - 1
    key = _mix32(_mix32(_mix32(seed & _MASK32) ^ (seed >> 32)) ^ (stream & _MASK32))
    num_pairs = -(-numel // 2)
    chunk = DRAW_CHUNKS.get(device.type, DRAW_CHUNKS["cuda"])
    out = torch.empty((num_pairs, 2), dtype=torch.float32, device=device)
    for start in range(0, num_pairs, chunk):
        stop = min(start + chunk, num_pairs)
        bits = _mix32(torch.arange(2 * start, 2 * stop, dtype=torch.int64, device=device) ^ key).view(-1, 2) >> 8
        radius = torch.sqrt(-2.0 * torch.log((bits[:, 0] + 1).float() * 2.0**-24))  # of a variate in (0, 1]
        angle = bits[:, 1].float() * (2 * math.pi * 2.0**-24)
        torch.mul(radius, torch.cos(angle), out=out[start:stop, 0])
        torch.mul(radius, torch.sin(angle), out=out[start:stop, 1])
    return out.view(-1)[:numel].view(shape)


def _mix32(x: IntOrTensor) -> IntOrTensor:
    """A bijection of [0, 2^32) that scatters every input bit over the output (the lowbias32 constants).

    On Python ints and on int64 tensors alike: no intermediate leaves int64.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: IntOrTensor, factor: int) -> IntOrTensor:
    """x * factor mod 2^32 for x in [0, 2^32), from two products below 2^48."""
    return (x * (factor & 0xFFFF) + (((x * (factor >> 16)) & 0xFFFF) << 16)) & _MASK32


def load_safetensors(directory: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> Weights:
    """Weights from every `*.safetensors` file in `directory`, transformers tensor names.

    Raises ValueError naming the tensor when one is missing, has the wrong
    shape, appears in two files, or is not one `config` uses (see the module
    docstring for the one kind accepted unread), and when a tied checkpoint's
    `lm_head.weight` differs from its embedding.
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

    expected = checkpoint_shapes(config)
    for name in expected:
        if name not in location:
            tied = "" if name != "lm_head.weight" else " and tie_word_embeddings is false"
            raise ValueError(f"--model {directory}: tensor {name!r} is missing{tied}")
    tied_head = config.tie_word_embeddings and "lm_head.weight" in location
    unexpected = sorted(
        name for name in location
        if name not in expected and not _DERIVED_TENSOR.fullmatch(name) and not (tied_head and name == "lm_head.weight")
    )  # fmt: skip
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(
            f"--model {directory}: tensor {unexpected[0]!r}{more} is not one the config uses "
            "(a bias without attention_bias or mlp_bias, a q/k norm outside Qwen3, another architecture's module?): "
            "refused rather than ignored"
        )

    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in files}

        def stored(name: str) -> torch.Tensor:
            value = handles[location[name]].get_tensor(name)
            shape = expected.get(name, expected["model.embed_tokens.weight"])  # not expected: a tied lm_head
            if tuple(value.shape) != shape:
                raise ValueError(f"--model {directory}: tensor {name!r} has shape {tuple(value.shape)}, expected {shape}")
            return value

        def tensor(name: str) -> torch.Tensor:
            return stored(name).to(device=device, dtype=dtype)

        layers = [
            LayerWeights(**{field: tensor(f"model.layers.{i}.{_LAYER_TENSORS[field]}") for field in layer_shapes(config)})
            for i in range(config.num_layers)
        ]
        if tied_head and not torch.equal(stored("lm_head.weight"), stored("model.embed_tokens.weight")):
            raise ValueError(
                f"--model {directory}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' while "
                "tie_word_embeddings is true: set tie_word_embeddings false to use it, or remove it"
            )
        embed = tensor("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else tensor("lm_head.weight")
        return Weights(embed, layers, tensor("model.norm.weight"), lm_head)
