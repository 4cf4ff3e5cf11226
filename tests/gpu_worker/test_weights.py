"""The checkpoint path: small safetensors checkpoints in the transformers layout, written here, loaded and run.

Every tensor is placed or the load is refused naming it; `test_architectures.py` checks what the loaded
decoder computes against transformers itself. At the end: the generator of the seeded random weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from devices import DEVICE
from e2e_support import DenseOracle, start_stack, stop_stack
from safetensors.torch import save_file

from gpu_worker import weights as weights_module
from gpu_worker.model_config import BUILTIN_MODELS, ModelConfig, resolve_model
from gpu_worker.weights import checkpoint_shapes, load_safetensors, normal_draws, random_weights

CONFIG = ModelConfig("ckpt", vocab_size=320, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rope_theta=50000.0)  # fmt: skip


def checkpoint_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint of `config`, by its transformers name, with bf16 storage as real checkpoints have.

    Older checkpoints' RoPE buffers (`rotary_emb.inv_freq`) are there too: the loader accepts them unread.
    """
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        drawn = (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)
        scale = {"model.embed_tokens.weight": 8, "lm_head.weight": 4}.get(name, 1)  # peaked logits: no near-ties
        tensors[name] = 1 + drawn if name.endswith("norm.weight") else drawn * scale
    for layer in range(config.num_layers):
        tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.ones(config.head_dim // 2)
    return tensors


def write_checkpoint(directory, config: ModelConfig, tensors: dict[str, torch.Tensor], raw: dict | None = None) -> None:
    """config.json (`raw`, else `config.to_hf_dict()`) and two shards, split by name."""
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw or config.to_hf_dict()))
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
    assert "lm_head.weight" not in tensors
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


# Qwen3's layout: q, k, v and o biases (attention_bias) and a q and k norm per head; 2 layers.
QWEN3 = ModelConfig(**{**CONFIG.__dict__, "name": "qwen3", "qkv_bias": True, "o_proj_bias": True, "qk_norm": True,
                       "rms_norm_eps": 1e-6})  # fmt: skip
QWEN3_JSON = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 320, "hidden_size": 48,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rope_theta": 50000.0, "attention_bias": True, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_biases_and_head_norms_land_in_their_place(tmp_path):
    tensors = checkpoint_tensors(QWEN3, 5)
    write_checkpoint(tmp_path / "qwen3", QWEN3, tensors, QWEN3_JSON)
    config, directory = resolve_model(str(tmp_path / "qwen3"))
    assert config == ModelConfig(**{**QWEN3.__dict__, "name": "qwen3"})
    layer = load_safetensors(directory, config, torch.float32, torch.device("cpu")).layers[1]
    assert torch.equal(layer.k_bias, tensors["model.layers.1.self_attn.k_proj.bias"].float())
    assert torch.equal(layer.o_bias, tensors["model.layers.1.self_attn.o_proj.bias"].float())
    assert torch.equal(layer.q_norm, tensors["model.layers.1.self_attn.q_norm.weight"].float())
    assert layer.gate_bias is None and layer.up_bias is None


def test_mlp_biases_land_in_their_place(tmp_path):
    config = ModelConfig(**{**CONFIG.__dict__, "mlp_bias": True})
    tensors = checkpoint_tensors(config, 6)
    write_checkpoint(tmp_path / "mlp", config, tensors)
    layer = load_safetensors(tmp_path / "mlp", config, torch.float32, torch.device("cpu")).layers[0]
    assert torch.equal(layer.down_bias, tensors["model.layers.0.mlp.down_proj.bias"].float())
    assert layer.q_bias is None and layer.o_bias is None and layer.q_norm is None


def tied(tensors: dict[str, torch.Tensor], head: torch.Tensor) -> None:
    tensors["lm_head.weight"] = head


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"), "tensor 'model.layers.0.self_attn.k_proj.bias' is missing"),
        (lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"), "tensor 'model.layers.1.self_attn.k_norm.weight' is missing"),
        (lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(8)),
         "tensor 'model.layers.0.self_attn.q_norm.weight' has shape (8,), expected (16,)"),
        (lambda t: t.__setitem__("model.layers.1.self_attn.v_proj.bias", torch.ones(64)),
         "tensor 'model.layers.1.self_attn.v_proj.bias' has shape (64,), expected (32,)"),
        (lambda t: t.__setitem__("model.layers.0.mlp.up_proj.bias", torch.ones(96)),
         "tensor 'model.layers.0.mlp.up_proj.bias' is not one the config uses"),
        (lambda t: t.__setitem__("model.layers.0.mlp.experts.3.w1.weight", torch.ones(2, 2)),
         "tensor 'model.layers.0.mlp.experts.3.w1.weight' is not one the config uses"),
        (lambda t: t.__setitem__("model.layers.2.input_layernorm.weight", torch.ones(48)),
         "tensor 'model.layers.2.input_layernorm.weight' is not one the config uses"),
        (lambda t: tied(t, t["model.embed_tokens.weight"] + 1),
         "tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' while tie_word_embeddings is true"),
    ],
    ids=["missing-bias", "missing-norm", "norm-shape", "bias-shape", "mlp-bias-unasked", "unknown-module",
         "layer-past-the-last", "tied-head-differs"],
)  # fmt: skip
def test_a_tensor_the_config_does_not_place_is_refused_by_name(tmp_path, damage, message):
    config = ModelConfig(**{**QWEN3.__dict__, "tie_word_embeddings": True})
    tensors = checkpoint_tensors(config, 7)
    damage(tensors)
    write_checkpoint(tmp_path / "broken", config, tensors, {**QWEN3_JSON, "tie_word_embeddings": True})
    with pytest.raises(ValueError) as refused:
        load_safetensors(tmp_path / "broken", config, torch.float32, torch.device("cpu"))
    assert message in str(refused.value)


def test_a_bias_the_config_does_not_ask_for_is_refused_and_its_count_given(tmp_path):
    tensors = checkpoint_tensors(CONFIG, 8)  # Llama without attention_bias
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.q_proj.bias"] = torch.zeros(64)
    write_checkpoint(tmp_path / "llama", CONFIG, tensors)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.q_proj.bias' \(and 1 more\) is not one"):
        load_safetensors(tmp_path / "llama", CONFIG, torch.float32, torch.device("cpu"))


def test_a_tied_checkpoint_may_store_its_head_equal_to_the_embedding(tmp_path):
    config = ModelConfig(**{**CONFIG.__dict__, "tie_word_embeddings": True})
    tensors = checkpoint_tensors(config, 9)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    write_checkpoint(tmp_path / "tied", config, tensors)
    weights = load_safetensors(tmp_path / "tied", config, torch.float32, torch.device("cpu"))
    assert weights.lm_head is weights.embed_tokens


def test_a_tensor_in_two_files_is_refused_by_name(tmp_path):
    tensors = checkpoint_tensors(CONFIG, 10)
    write_checkpoint(tmp_path / "twice", CONFIG, tensors)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(tmp_path / "twice" / "extra.safetensors"))
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' is in both"):
        load_safetensors(tmp_path / "twice", CONFIG, torch.float32, torch.device("cpu"))


def test_a_checkpoint_directory_must_have_config_and_weights(tmp_path):
    with pytest.raises(ValueError, match="config.json is missing"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match="lacks the field 'hidden_size'"):
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


CPU = torch.device("cpu")


def test_random_draws_are_standard_normal_and_a_function_of_seed_stream_and_index(monkeypatch):
    drawn = normal_draws((999, 1001), 5, 0, CPU)  # an odd count: the last Box-Muller pair is cut
    assert drawn.shape == (999, 1001) and drawn.dtype == torch.float32
    assert abs(float(drawn.mean())) < 0.005 and abs(float(drawn.std()) - 1) < 0.005
    assert float((drawn.abs() < 1).float().mean()) == pytest.approx(0.6827, abs=0.003)
    assert torch.equal(drawn, normal_draws((999, 1001), 5, 0, CPU))
    monkeypatch.setitem(weights_module.DRAW_CHUNKS, "cpu", 777)  # chunks change nothing
    assert torch.equal(drawn, normal_draws((999, 1001), 5, 0, CPU))
    assert torch.equal(drawn.view(-1)[:5000], normal_draws((5000,), 5, 0, CPU))  # nor does the shape
    for other in (normal_draws((999, 1001), 6, 0, CPU), normal_draws((999, 1001), 5, 1, CPU),
                  normal_draws((999, 1001), 5 + (1 << 32), 0, CPU)):  # fmt: skip
        assert abs(float(torch.corrcoef(torch.stack([drawn.view(-1), other.view(-1)]))[0, 1])) < 0.005


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_a_gpu_draws_the_weights_a_cpu_draws():
    config = BUILTIN_MODELS["small"]
    on_cpu = random_weights(config, 3, torch.float32, CPU)
    on_gpu = random_weights(config, 3, torch.float32, torch.device("cuda"))
    assert on_gpu.embed_tokens.device.type == "cuda"
    pairs = [(on_cpu.embed_tokens, on_gpu.embed_tokens), (on_cpu.norm, on_gpu.norm)]
    for cpu_layer, gpu_layer in zip(on_cpu.layers, on_gpu.layers):
        pairs += [(getattr(cpu_layer, name), getattr(gpu_layer, name)) for name in ("q_proj", "down_proj")]
    for cpu_tensor, gpu_tensor in pairs:
        torch.testing.assert_close(gpu_tensor.cpu(), cpu_tensor, rtol=1e-5, atol=1e-6)
