"""The decoder's shape: a Llama-architecture config, built in or read from `config.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

    `layer_types[i]` is FULL_ATTENTION or SLIDING_ATTENTION; sliding layers
    attend to the `sliding_window` most recent positions, their own included.
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
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
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

    def window_of(self, layer: int) -> int:
        """Positions layer `layer` attends to; 0 means all of them."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else 0

    @classmethod
    def from_hf_dict(cls, name: str, raw: dict[str, Any]) -> "ModelConfig":
        """A config from the fields of a Llama-style `config.json`."""
        try:
            num_heads = raw["num_attention_heads"]
            hidden_size = raw["hidden_size"]
            return cls(
                name=name,
                vocab_size=raw["vocab_size"],
                hidden_size=hidden_size,
                intermediate_size=raw["intermediate_size"],
                num_layers=raw["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=raw.get("num_key_value_heads") or num_heads,
                head_dim=raw.get("head_dim") or hidden_size // num_heads,
                rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
                rope_theta=raw.get("rope_theta", 10000.0),
                sliding_window=raw.get("sliding_window") or 0,
                layer_types=tuple(raw.get("layer_types") or ()),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            )
        except KeyError as missing:
            raise ValueError(f"model config.json lacks the field {missing.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` fields `from_hf_dict` reads."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window or None,
            "layer_types": list(self.layer_types),
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
    return ModelConfig.from_hf_dict(path.name, raw), path
