"""The decoder's shape and options: built in, or read from a checkpoint's `config.json` (`gpu_worker.hf_config`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
ROPE_SCALING_TYPES = ("linear", "dynamic", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies derive from `rope_theta` (transformers' rope types; math in `gpu_worker.rope`).

    linear   every frequency divided by `factor` (positions divided by it).
    dynamic  NTK: the base grows with the sequence's length L once L exceeds
             `original_max_position_embeddings` (transformers reads its
             `max_position_embeddings` there), recomputed at every step.
    llama3   frequencies whose wavelength exceeds original / low_freq_factor
             divided by `factor`, those under original / high_freq_factor
             kept, the band between smoothly interpolated.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 0  # dynamic and llama3 only
    low_freq_factor: float = 0.0  # llama3 only
    high_freq_factor: float = 0.0  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"RoPE scaling rope_type {self.rope_type!r} is not supported; "
                f"this worker runs {', '.join(ROPE_SCALING_TYPES)}"
            )
        if not self.factor >= 1:
            raise ValueError(f"RoPE scaling factor must be >= 1, got {self.factor!r}")
        if self.rope_type != "linear" and self.original_max_position_embeddings < 1:
            raise ValueError(
                f"RoPE scaling {self.rope_type!r} needs a positive original_max_position_embeddings, "
                f"got {self.original_max_position_embeddings!r}"
            )
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "RoPE scaling 'llama3' needs 0 < low_freq_factor < high_freq_factor, "
                f"got {self.low_freq_factor!r} and {self.high_freq_factor!r}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) and its declared variations.

    `layer_types[i]` is FULL_ATTENTION or SLIDING_ATTENTION; sliding layers
    attend to the `sliding_window` most recent positions, their own included.
    `qkv_bias`, `o_proj_bias` and `mlp_bias` add a bias to those projections;
    `qk_norm` RMS-normalises each query and key head (weights `[head_dim]`)
    before RoPE.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model config {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.dynamic_rope and self.head_dim < 4:
            raise ValueError(f"model config head_dim must be at least 4 for dynamic RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("model config rms_norm_eps and rope_theta must be positive")
        if not self.layer_types:
            kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"model config layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}"
            )
        unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ValueError(
                f"model config layer_types: unsupported {sorted(unknown)}; "
                f"this worker runs {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r}"
            )
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window < 1:
            raise ValueError("model config has sliding_attention layers but no positive sliding_window")

    @property
    def dynamic_rope(self) -> bool:
        """Whether a token's RoPE angles depend on its sequence's length at the step that computes it."""
        return self.rope_scaling is not None and self.rope_scaling.rope_type == "dynamic"

    def window_of(self, layer: int) -> int:
        """Positions layer `layer` attends to; 0 means all of them."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else 0

    @classmethod
    def from_hf_dict(cls, name: str, raw: Mapping[str, Any]) -> "ModelConfig":
        """The config a checkpoint's `config.json` describes; ValueError naming the first field it cannot run."""
        from gpu_worker.hf_config import read_hf_config  # here, not at the top: hf_config builds ModelConfig

        return read_hf_config(name, raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` that `from_hf_dict` reads back as this config.

        LlamaForCausalLM's layout, unless a layer slides: then the worker's own
        layout (no `architectures`), since no transformers architecture mixes
        Llama's block with per-layer windows.
        """
        if self.qk_norm or self.qkv_bias != self.o_proj_bias:
            raise ValueError(
                f"model {self.name!r}: to_hf_dict writes Llama-layout configs, without q/k norms or q/k/v-only biases"
            )
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        raw: dict[str, Any] = {}
        scaling = self.rope_scaling
        if scaling is not None:
            rope |= {"rope_type": scaling.rope_type, "factor": scaling.factor}
            if scaling.rope_type == "llama3":
                rope |= {
                    "original_max_position_embeddings": scaling.original_max_position_embeddings,
                    "low_freq_factor": scaling.low_freq_factor,
                    "high_freq_factor": scaling.high_freq_factor,
                }
            if scaling.rope_type == "dynamic":
                raw["max_position_embeddings"] = scaling.original_max_position_embeddings
        if SLIDING_ATTENTION in self.layer_types:
            raw |= {"sliding_window": self.sliding_window, "layer_types": list(self.layer_types)}
        else:
            raw |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
        return raw | {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
        }


# Seeded-random models that need no download. `tiny` keeps the Triton
# interpreter fast; `small` is the CPU default; `llama-3.2-1b` has the shape
# of the production model the GPU configurations are tuned for.
BUILTIN_MODELS = {
    config.name: config
    for config in (
        ModelConfig("tiny", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16),
        ModelConfig("tiny-swa", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=24,
                    layer_types=(SLIDING_ATTENTION, FULL_ATTENTION)),
        ModelConfig("small", vocab_size=2048, hidden_size=256, intermediate_size=688, num_layers=4,
                    num_heads=8, num_kv_heads=2, head_dim=32),
        ModelConfig("llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                    num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True),
    )
}  # fmt: skip


def resolve_model(spec: str) -> tuple[ModelConfig, Path | None]:
    """A built-in name, or a directory holding `config.json` (and weights): (config, weights dir or None)."""
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec], None
    path = Path(spec)
    if not path.is_dir():
        raise ValueError(
            f"--model {spec!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a directory"
        )
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"--model {spec!r}: {config_path} is missing")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"--model {spec!r}: {config_path} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model {spec!r}: {config_path} holds a JSON {type(raw).__name__}, not an object")
    try:
        return ModelConfig.from_hf_dict(path.name, raw), path
    except ValueError as error:
        raise ValueError(f"--model {spec!r}: {error}") from None
