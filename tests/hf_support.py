"""Small random Hugging Face checkpoints, and transformers' own decoder as the oracle the worker must match.

A checkpoint is built the way a user's arrives: transformers' config class
for its architecture, `save_pretrained` (which writes `config.json` with its
`architectures`, and `model.safetensors`), then, where a checkpoint in the
wild is laid out differently from what this transformers writes, `config.json`
edited to that layout. Every parameter is re-drawn from a seeded generator so
that the checkpoint is the same on every machine and every option shows in
the logits: norm weights 1 + 0.3*N(0,1), biases 0.5*N(0,1), projections
N(0,1)/sqrt(fan_in), the embedding and the output head 2*N(0,1)/sqrt(hidden).
That head scale makes the logits peaked enough that greedy choices are not
near-ties (the oracle reports its smallest margin, for the tests to check).

The oracle is the same checkpoint loaded by transformers in float32 with
eager attention, decoding greedily with its KV cache (`generate`). It is
loaded afresh for every prompt: dynamic RoPE keeps state between calls (the
longest sequence it has seen), so a model reused across prompts would not
answer as a fresh one does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import transformers

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(
        f"transformers {transformers.__version__} is installed; the oracle needs >= 5 (it reads `rope_parameters`)"
    )
transformers.utils.logging.disable_progress_bar()  # no bar per load in the tests' output

# The shape every checkpoint shares unless its spec says otherwise: tiny, so the
# Triton interpreter stays quick, with grouped-query attention (4 heads, 2 KV heads).
TINY_SHAPE: Mapping[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    # No special tokens: `generate` must never stop early on an end-of-sequence token.
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

REMOVE = object()  # a `config_json_edits` value: delete the key from config.json


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """One checkpoint to build: its architecture's config class, what it sets, and how its config.json is edited.

    `sliding_window` is the window every layer attends with as transformers
    reads the checkpoint (0: full attention), which is what the manager's pool
    must be configured for.
    """

    name: str
    config_class: str  # a transformers config class: LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config_json_edits: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # REMOVE deletes the key
    sliding_window: int = 0
    seed: int = 0


def build_checkpoint(spec: CheckpointSpec, directory: Path) -> Path:
    """Write `spec`'s checkpoint into `directory` (created); returns the directory."""
    config_class = getattr(transformers, spec.config_class)
    config = config_class(**{**TINY_SHAPE, **spec.config})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw_parameters(model, spec.seed)
    model.save_pretrained(directory, safe_serialization=True)
    if spec.config_json_edits:
        config_path = directory / "config.json"
        raw = json.loads(config_path.read_text())
        for key, value in spec.config_json_edits.items():
            if value is REMOVE:
                raw.pop(key, None)
            else:
                raw[key] = value
        config_path.write_text(json.dumps(raw, indent=2, sort_keys=True))
    return directory


@torch.no_grad()
def _redraw_parameters(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from one seeded generator, in `named_parameters` order (a tied head is drawn once)."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        shape = tuple(parameter.shape)
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):  # every RMSNorm, q_norm and k_norm included
            value = 1.0 + 0.3 * noise
        elif name.endswith(".bias"):
            value = 0.5 * noise
        elif name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            value = noise * 2.0 / math.sqrt(shape[1])
        else:
            assert len(shape) == 2, f"{name}: a parameter of shape {shape} has no drawing rule"
            value = noise / math.sqrt(shape[1])
        parameter.copy_(value)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What transformers decodes greedily from a prompt."""

    token_ids: list[int]
    logprobs: list[float]  # log_softmax of the step's logits, at the chosen token
    min_margin: float  # the smallest gap, over the steps, between the chosen logit and the runner-up


def transformers_greedy(checkpoint: Path, prompt: Sequence[int], num_new_tokens: int) -> Generation:
    """Greedy decoding of `prompt` by a freshly loaded transformers model (fp32, eager attention, KV cache)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    input_ids = torch.tensor([list(prompt)], dtype=torch.int64)
    with torch.no_grad():
        result = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=num_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
    token_ids = result.sequences[0, len(prompt) :].tolist()
    assert len(token_ids) == num_new_tokens, f"transformers stopped after {len(token_ids)} of {num_new_tokens} tokens"
    logprobs, margins = [], []
    for token_id, logits in zip(token_ids, result.logits):
        step_logits = logits[0].float()
        top_two = step_logits.topk(2).values
        assert int(step_logits.argmax()) == token_id, "generate chose a token that is not the argmax of its logits"
        logprobs.append(float(torch.log_softmax(step_logits, dim=-1)[token_id]))
        margins.append(float(top_two[0] - top_two[1]))
    return Generation(token_ids, logprobs, min(margins))
