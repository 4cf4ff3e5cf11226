"""The checkpoint path: a small Llama-layout safetensors checkpoint, written here, loaded and run."""

from __future__ import annotations

import json

import pytest
import torch
from e2e_support import DenseOracle, start_stack, stop_stack
from safetensors.torch import save_file

from gpu_worker.model_config import ModelConfig, resolve_model
from gpu_worker.weights import load_safetensors

CONFIG = ModelConfig("ckpt", vocab_size=320, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rope_theta=50000.0)  # fmt: skip


def checkpoint_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of a Llama checkpoint, by its name in that layout, with bf16 storage as real checkpoints have."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv, i = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(config.vocab_size, h) * 8, "model.norm.weight": 1 + w(h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": 1 + w(h),
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "post_attention_layernorm.weight": 1 + w(h),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "self_attn.rotary_emb.inv_freq": torch.ones(config.head_dim // 2),  # unused: ignored
        }
    tensors["lm_head.weight"] = w(config.vocab_size, h) * 4
    return tensors


def write_checkpoint(directory, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """config.json and two shards, split by name."""
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(directory / "model-00002-of-00002.safetensors"))


def test_every_tensor_lands_in_its_place(tmp_path):
    tensors = checkpoint_tensors(CONFIG, 1)
    write_checkpoint(tmp_path / "ckpt", CONFIG, tensors)
    config, directory = resolve_model(str(tmp_path / "ckpt"))
    assert config == CONFIG
    weights = load_safetensors(directory, config, torch.float32, torch.device("cpu"))
    assert torch.equal(weights.embed_tokens, tensors["model.embed_tokens.weight"].float())
    assert torch.equal(weights.lm_head, tensors["lm_head.weight"].float())
    assert torch.equal(weights.norm, tensors["model.norm.weight"].float())
    layer = weights.layers[1]
    assert torch.equal(layer.k_proj, tensors["model.layers.1.self_attn.k_proj.weight"].float())
    assert torch.equal(layer.down_proj, tensors["model.layers.1.mlp.down_proj.weight"].float())
    assert torch.equal(layer.post_attention_norm, tensors["model.layers.1.post_attention_layernorm.weight"].float())


def test_tied_embeddings_need_no_lm_head(tmp_path):
    tied = ModelConfig(**{**CONFIG.__dict__, "tie_word_embeddings": True})
    tensors = checkpoint_tensors(tied, 2)
    del tensors["lm_head.weight"]
    write_checkpoint(tmp_path / "tied", tied, tensors)
    weights = load_safetensors(tmp_path / "tied", tied, torch.float32, torch.device("cpu"))
    assert weights.lm_head is weights.embed_tokens


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "'model.layers.1.mlp.up_proj.weight' is missing"),
        (lambda t: t.pop("lm_head.weight"), "'lm_head.weight' is missing and tie_word_embeddings is false"),
        (
            lambda t: t.__setitem__("model.norm.weight", torch.ones(7)),
            "'model.norm.weight' has shape (7,), expected (48,)",
        ),
    ],
)
def test_a_broken_checkpoint_is_refused_naming_the_tensor(tmp_path, damage, message):
    tensors = checkpoint_tensors(CONFIG, 3)
    damage(tensors)
    write_checkpoint(tmp_path / "broken", CONFIG, tensors)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_safetensors(tmp_path / "broken", CONFIG, torch.float32, torch.device("cpu"))


def test_a_checkpoint_directory_must_have_config_and_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match="lacks the field 'num_attention_heads'"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"no \*.safetensors file"):
        load_safetensors(tmp_path, CONFIG, torch.float32, torch.device("cpu"))


def test_a_worker_serving_the_checkpoint_matches_the_dense_pass(tmp_path):
    write_checkpoint(tmp_path / "ckpt", CONFIG, checkpoint_tensors(CONFIG, 4))
    pool = {"num_blocks": 32, "groups": [{"kind": "full_attention", "block_size": 16}]}
    stack, processes = start_stack(tmp_path, str(tmp_path / "ckpt"), "torch", pool)
    try:
        scheduler = stack.scheduler()
        requests = [scheduler.add(f"ckpt-{n}", list(range(3, 3 + n)), 10) for n in (5, 19)]
        scheduler.run()
        oracle = DenseOracle(str(tmp_path / "ckpt"))
        for request in requests:
            oracle.check(request)
    finally:
        failures = stop_stack(stack, processes)
        assert not failures, "\n\n".join(failures)
