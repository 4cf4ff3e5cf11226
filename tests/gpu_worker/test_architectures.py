"""Every architecture and option the worker runs computes what transformers computes; anything else is refused.

Checkpoints here are written by transformers itself: its config class for the
architecture, then `save_pretrained`, with every parameter re-drawn from a
seeded generator so that each option shows in the logits (norm weights
1 + 0.3 N(0,1), biases 0.5 N(0,1), matrices N(0,1) / sqrt(fan_in), the
embedding N(0,1)). The worker reads them with its own loader, and its dense
pass must give transformers' logits (fp32, eager attention) at every position
of a 24-token prompt within LOGITS_ATOL. Each option moves those logits by
at least 0.1 for these shapes, so the tolerance cannot hide a missing one.

Dynamic RoPE is also run through the paged runner, two requests of different
lengths in one batch, against transformers' `generate`: a fresh model per
prompt, since transformers' rotary module keeps the longest length it saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from e2e_support import start_stack, stop_stack
from processes import ROOT, launch, stop_all

import kernels
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling, resolve_model
from gpu_worker.runner import CacheGroup, ModelRunner, PoolShape, ScheduledRequest
from gpu_worker.sampling import GREEDY
from gpu_worker.weights import load_safetensors
from kv_manager_service.shared.ready_line import MANAGER_READY_PREFIX
from kvcache.v1 import kv_manager_pb2 as pb

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

CPU = torch.device("cpu")
LOGITS_ATOL = 1e-4  # fp32 on both sides: the differences seen are below 2e-5, on logits up to ~40
LOGPROB_ATOL = 1e-4
PROMPT = [(7 * i + 3) % 256 for i in range(24)]
SHAPE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": None, "eos_token_id": None,
    "pad_token_id": None,
}  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # with head_dim 24, the three frequency bands all occur
}  # fmt: skip
CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}
# (model_type, options): what each checkpoint of the decoder comparison brings.
CHECKPOINTS = {
    "llama": ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}),
    "llama3-biases-head_dim-tied": (
        "llama",
        {"rope_parameters": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True, "head_dim": 24,
         "tie_word_embeddings": True},
    ),  # fmt: skip
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "dynamic": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "max_position_embeddings": 16},
    ),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 32, "attention_bias": True, "tie_word_embeddings": True}),
}


def build_checkpoint(directory: Path, model_type: str, options: dict[str, Any], seed: int = 0) -> Path:
    """A transformers checkpoint of the tiny shape, every parameter re-drawn (see the module docstring)."""
    config = CONFIG_CLASSES[model_type](**SHAPE, **options)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # a tied head is the embedding's parameter: drawn once
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.3 * noise)
            elif name.endswith(".bias"):
                parameter.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            else:
                parameter.copy_(noise / parameter.shape[1] ** 0.5)
    model.save_pretrained(directory)
    return directory


def transformers_model(directory: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)


def worker_model(directory: Path) -> LlamaModel:
    config, checkpoint = resolve_model(str(directory))
    return LlamaModel(config, load_safetensors(checkpoint, config, torch.float32, CPU))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: build_checkpoint(root / name, *spec) for name, spec in CHECKPOINTS.items()}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_dense_pass_gives_the_logits_transformers_gives(checkpoints, name):
    model = worker_model(checkpoints[name])
    tokens = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = transformers_model(checkpoints[name])(tokens[None]).logits[0]
    positions = torch.arange(len(PROMPT))
    ends = torch.full((len(PROMPT),), len(PROMPT))
    every_position = model.logits(model.forward(tokens, positions, model._dense_attention, ends))
    torch.testing.assert_close(every_position, expected, atol=LOGITS_ATOL, rtol=1e-5)
    torch.testing.assert_close(model.dense_logits(tokens), expected[-1], atol=LOGITS_ATOL, rtol=1e-5)


def test_dynamic_rope_per_request_of_a_paged_batch_matches_transformers_generate(checkpoints):
    """Two requests in one batch, one past max_position_embeddings (16) from its prompt, one crossing it while it decodes."""
    directory, num_new_tokens = checkpoints["dynamic"], 8
    prompts = {"long": PROMPT[:20], "short": PROMPT[4:14]}
    expected = {}
    for request_id, prompt in prompts.items():
        generated = transformers_model(directory).generate(  # fresh: the rotary module remembers lengths
            torch.tensor([prompt]), do_sample=False, max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
        tokens = generated.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in zip(generated.logits, tokens)]
        expected[request_id] = (tokens, logprobs)

    model = worker_model(directory)
    pool = PoolShape(num_blocks=32, groups=(CacheGroup(0, 4),), max_model_len=64, max_num_requests=2)
    runner = ModelRunner(model, pool, kernels.load("torch", "cpu"), CPU, torch.float32)
    delta = pb.StepDelta(step_id=1)
    for index, request_id in enumerate(prompts):
        delta.rows_added.add(request_id=request_id).groups.add(group_id=0, block_ids=range(index * 16, index * 16 + 16))
    runner.apply_step(delta)
    tokens = {request_id: list(prompt) for request_id, prompt in prompts.items()}
    computed = {request_id: 0 for request_id in prompts}
    outputs: dict[str, list[tuple[int, float]]] = {request_id: [] for request_id in prompts}
    for _ in range(num_new_tokens):
        scheduled = [
            ScheduledRequest(request_id, tokens[request_id][computed[request_id] :], computed[request_id], GREEDY)
            for request_id in prompts
        ]
        for output in runner.execute(scheduled):
            computed[output.request_id] = len(tokens[output.request_id])
            tokens[output.request_id].append(output.token_id)
            outputs[output.request_id].append((output.token_id, output.logprob))
    for request_id, (expected_tokens, expected_logprobs) in expected.items():
        assert [token for token, _ in outputs[request_id]] == expected_tokens, request_id
        got = [logprob for _, logprob in outputs[request_id]]
        assert got == pytest.approx(expected_logprobs, abs=LOGPROB_ATOL), request_id


# --- config.json as transformers writes it, and older layouts -----------------------------------------------------

BASE = ModelConfig(
    "c", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-6,
)  # fmt: skip
SLIDE, FULL = SLIDING_ATTENTION, FULL_ATTENTION


def saved_config(tmp_path: Path, model_type: str, options: dict[str, Any]) -> dict[str, Any]:
    """config.json as `save_pretrained` of a model of that config class writes it (with `architectures`)."""
    config = CONFIG_CLASSES[model_type](**SHAPE, **options)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize(
    "model_type, options, expected",
    [
        ("llama", {}, {}),
        (
            "llama",
            {"rope_parameters": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True, "head_dim": 24,
             "tie_word_embeddings": True},
            {"rope_theta": 500000.0, "rope_scaling": RopeScaling("llama3", 8.0, 32, 1.0, 4.0), "head_dim": 24,
             "qkv_bias": True, "o_proj_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        ),
        ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}},
         {"rope_theta": 50000.0, "rope_scaling": RopeScaling("linear", 2.0)}),
        # The older keyword layout: transformers writes rope_parameters with both `type` and `rope_type`.
        ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 50000.0, "max_position_embeddings": 16},
         {"rope_theta": 50000.0, "rope_scaling": RopeScaling("dynamic", 2.0, 16)}),
        ("mistral", {"sliding_window": 8}, {"sliding_window": 8, "layer_types": (SLIDE, SLIDE)}),
        ("mistral", {"sliding_window": None}, {}),
        ("qwen2", {}, {"qkv_bias": True}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}, {"qkv_bias": True}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
         {"qkv_bias": True, "sliding_window": 8, "layer_types": (FULL, SLIDE)}),
        ("qwen3", {"head_dim": 32, "attention_bias": True, "tie_word_embeddings": True},
         {"head_dim": 32, "qk_norm": True, "qkv_bias": True, "o_proj_bias": True, "tie_word_embeddings": True}),
        ("qwen3", {"head_dim": 16, "use_sliding_window": True, "sliding_window": 8, "layer_types": [SLIDE, FULL]},
         {"qk_norm": True, "sliding_window": 8, "layer_types": (SLIDE, FULL)}),
    ],
    ids=["llama", "llama3-biases", "linear", "dynamic-legacy-kwargs", "mistral", "mistral-no-window", "qwen2",
         "qwen2-window-off", "qwen2-window", "qwen3", "qwen3-layer-types"],
)  # fmt: skip
def test_configs_that_transformers_saves_read_as_they_compute(tmp_path, model_type, options, expected):
    raw = saved_config(tmp_path, model_type, options)
    config = ModelConfig.from_hf_dict("c", raw)
    assert config == ModelConfig(**{**BASE.__dict__, "layer_types": (), **expected})
    assert_transformers_reads(raw, config)


# Published configs in the layout of transformers 4 (trimmed to the tiny shape): top-level rope_theta and
# rope_scaling, torch_dtype, and Qwen's sliding_window next to use_sliding_window false.
OLDER_LAYOUTS = {
    "llama-2": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": "meta-llama/Llama-2-7b-hf",
         "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
         "max_position_embeddings": 4096, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
         "rope_theta": 50000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
         "transformers_version": "4.31.0.dev0", "use_cache": True},
        {"rms_norm_eps": 1e-5, "rope_theta": 50000.0},
    ),
    "llama-3.2": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
         "head_dim": 24, "mlp_bias": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
         "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
         "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
        {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": RopeScaling("llama3", 32.0, 8192, 1.0, 4.0),
         "head_dim": 24, "tie_word_embeddings": True},
    ),
    "mistral-7b-v0.1": (
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "max_position_embeddings": 32768,
         "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "bfloat16"},
        {"rms_norm_eps": 1e-5, "sliding_window": 4096, "layer_types": (SLIDE, SLIDE)},
    ),
    "mistral-without-window-field": (  # MistralConfig's default window is 4096
        {"model_type": "mistral"}, {"sliding_window": 4096, "layer_types": (SLIDE, SLIDE)},
    ),
    "qwen2.5": (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_window_layers": 21,
         "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True},
        {"rope_theta": 1000000.0, "qkv_bias": True, "tie_word_embeddings": True},
    ),
    "qwen2-sliding-by-max_window_layers": (
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_window_layers": 1,
         "sliding_window": 8, "use_sliding_window": True},
        {"qkv_bias": True, "sliding_window": 8, "layer_types": (FULL, SLIDE)},
    ),
    "qwen3-without-head_dim": (  # Qwen3Config's default head_dim is 128, not hidden / heads
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_scaling": None,
         "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28},
        {"rope_theta": 1000000.0, "head_dim": 128, "qk_norm": True},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OLDER_LAYOUTS))
def test_older_layouts_read_as_transformers_reads_them(name):
    fields, expected = OLDER_LAYOUTS[name]
    raw = {**{k: v for k, v in SHAPE.items() if not k.endswith("token_id")}, **fields}
    config = ModelConfig.from_hf_dict("c", raw)
    assert config == ModelConfig(**{**BASE.__dict__, "layer_types": (), **expected})
    assert_transformers_reads(raw, config)


def assert_transformers_reads(raw: dict[str, Any], config: ModelConfig) -> None:
    """What transformers derives from the same config.json (on the meta device: no weights) is what `config` says."""
    hf_config = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    attention = model.model.layers[0].self_attn
    mlp = model.model.layers[0].mlp
    assert attention.head_dim == config.head_dim
    assert hf_config.num_key_value_heads == config.num_kv_heads
    assert (attention.q_proj.bias is not None, attention.o_proj.bias is not None) == (config.qkv_bias, config.o_proj_bias)
    assert (mlp.down_proj.bias is not None, hasattr(attention, "q_norm")) == (config.mlp_bias, config.qk_norm)
    assert bool(hf_config.tie_word_embeddings) == config.tie_word_embeddings
    rope = hf_config.rope_parameters
    assert rope["rope_theta"] == config.rope_theta
    scaling = config.rope_scaling
    assert rope["rope_type"] == ("default" if scaling is None else scaling.rope_type)
    if scaling is not None:
        assert rope["factor"] == scaling.factor
    if scaling is not None and scaling.rope_type == "llama3":
        assert (rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]) == (
            scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor,
        )  # fmt: skip
    if scaling is not None and scaling.rope_type == "dynamic":
        assert hf_config.max_position_embeddings == scaling.original_max_position_embeddings
    window = hf_config.sliding_window if raw["model_type"] != "llama" else None
    if raw["model_type"] == "mistral":
        windows = [window or 0] * config.num_layers
    else:
        layer_types = getattr(hf_config, "layer_types", None) or [FULL] * config.num_layers
        windows = [(window or 0) if kind == SLIDE else 0 for kind in layer_types]
    assert windows == [config.window_of(layer) for layer in range(config.num_layers)]


# --- Refusals: one line, naming the field, its value and what runs ------------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE}
RUNS = "this worker runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, f"architectures[0] = 'GemmaForCausalLM' is not supported: {RUNS}"),
        ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, f"architectures[0] = 'MixtralForCausalLM' is not supported: {RUNS}"),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, f"architectures[0] = 'DeepseekV3ForCausalLM' is not supported: {RUNS}"),
        ({"architectures": ["LlamaModel"]}, f"architectures[0] = 'LlamaModel' is not supported: {RUNS}"),
        ({"architectures": None, "model_type": "phi3"},
         "model_type = 'phi3' is not supported: this worker runs model types llama, mistral, qwen2, qwen3"),
        ({"model_type": "mistral"}, "model_type = 'mistral' is not supported: 'llama', the type of LlamaForCausalLM"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act = 'gelu_pytorch_tanh' is not supported: this worker runs 'silu' (SwiGLU)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
         "rope_parameters.rope_type = 'yarn' is not supported: this worker runs RoPE types default, linear, dynamic, llama3"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
         "rope_scaling.rope_type = 'longrope' is not supported: this worker runs RoPE types default, linear, dynamic, llama3"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "attention_factor": 1.2}},
         "rope_parameters.attention_factor = 1.2 is not supported: RoPE type 'linear' reads factor, partial_rotary_factor, rope_theta"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}},
         "rope_parameters.original_max_position_embeddings = 8 is not supported: RoPE type 'dynamic' reads factor"),
        ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters lacks 'factor', which RoPE type 'linear' needs"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0.5}}, "RoPE scaling factor must be >= 1, got 0.5"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
         "needs 0 < low_freq_factor < high_freq_factor, got 4.0 and 1.0"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
         "rope_parameters.partial_rotary_factor = 0.5 is not supported: this worker rotates whole heads (partial_rotary_factor 1)"),
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor = 0.25 is not supported: this worker rotates whole heads"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"}},
         "rope_scaling = {'type': 'linear', 'factor': 2.0} is not supported: one RoPE description"),
        ({"rope_scaling": {"type": "linear", "rope_type": "dynamic", "factor": 2.0}},
         "rope_scaling.type = 'linear' is not supported: the value of rope_scaling.rope_type ('dynamic')"),
        ({"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
         "rope_theta = 10000.0 is not supported: one value, and rope_parameters.rope_theta is 500000.0"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}},
         "quantization_config = {'quant_method': 'awq', 'bits': 4} is not supported: the worker loads unquantized"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0 is not supported: final logit softcapping is not implemented"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0 is not supported: attention logit softcapping"),
        ({"auto_map": {"AutoModelForCausalLM": "modeling.Mine"}}, "auto_map = {'AutoModelForCausalLM': 'modeling.Mine'} is not supported: custom modeling code is not run"),
        ({"is_encoder_decoder": True}, "is_encoder_decoder = True is not supported: this worker runs a decoder-only model"),
        ({"pruned_heads": {"0": [1]}}, "pruned_heads = {'0': [1]} is not supported: this worker runs a decoder-only model"),
        ({"sliding_window": 8}, "sliding_window = 8 is not supported: LlamaForCausalLM here reads no such field"),
        ({"num_experts": 8}, "num_experts = 8 is not supported: LlamaForCausalLM here reads no such field, and a field the worker does not implement is refused"),
        ({"attention_bias": "yes"}, "attention_bias = 'yes' is not supported: true or false"),
        ({"num_key_value_heads": 0}, "num_key_value_heads = 0 is not supported: a positive integer"),
    ],
)  # fmt: skip
def test_every_refusal_names_the_field_its_value_and_what_runs(change, message):
    raw = {key: value for key, value in {**LLAMA, **change}.items() if value is not None}
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_hf_dict("c", raw)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model_type": "mistral", "layer_types": [SLIDE, SLIDE]}, "layer_types = ['sliding_attention', 'sliding_attention'] is not supported: MistralForCausalLM here reads no such field"),
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8, "layer_types": [FULL, SLIDE]},
         "layer_types = ['full_attention', 'sliding_attention'] is not supported: sliding layers need a sliding_window"),
        ({"model_type": "qwen2", "attention_bias": True}, "attention_bias = True is not supported: Qwen2ForCausalLM here reads no such field"),
        ({"model_type": "mistral", "mlp_bias": True}, "mlp_bias = True is not supported: MistralForCausalLM here reads no such field"),
        ({"model_type": "qwen3", "use_sliding_window": "no"}, "use_sliding_window = 'no' is not supported: true or false"),
    ],
)  # fmt: skip
def test_fields_are_refused_per_architecture(raw, message):
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_hf_dict("c", {**SHAPE, **raw})
    assert message in str(refused.value)


def test_a_config_without_architecture_is_the_worker_own_llama_layout():
    config = ModelConfig.from_hf_dict("c", {**SHAPE, "sliding_window": 8, "layer_types": [SLIDE, FULL]})
    assert config == ModelConfig(**{**BASE.__dict__, "sliding_window": 8, "layer_types": (SLIDE, FULL)})
    with pytest.raises(ValueError, match="hidden_act = 'relu' is not supported"):
        ModelConfig.from_hf_dict("c", {**SHAPE, "hidden_act": "relu"})


def test_to_hf_dict_round_trips_every_option_it_can_write():
    options = [
        {"rope_scaling": RopeScaling("llama3", 8.0, 32, 1.0, 4.0), "qkv_bias": True, "o_proj_bias": True, "mlp_bias": True},
        {"rope_scaling": RopeScaling("dynamic", 2.0, 16), "tie_word_embeddings": True},
        {"rope_scaling": RopeScaling("linear", 4.0), "sliding_window": 8, "layer_types": (FULL, SLIDE)},
    ]
    for change in options:
        config = ModelConfig(**{**BASE.__dict__, **change})
        assert ModelConfig.from_hf_dict("c", config.to_hf_dict()) == config
    with pytest.raises(ValueError, match="to_hf_dict writes Llama-layout configs"):
        ModelConfig(**{**BASE.__dict__, "qk_norm": True}).to_hf_dict()


# --- The refusals as a user meets them: a gpu-worker process ------------------------------------------------------

GPU_WORKER = [sys.executable, "-m", "gpu_worker.cli"]


def run_worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GPU_WORKER, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def test_a_worker_given_an_architecture_it_does_not_run_exits_2_saying_which_run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["GemmaForCausalLM"], "model_type": "gemma"}))
    done = run_worker("--manager", "127.0.0.1:1", "--model", str(tmp_path))
    assert (done.returncode, done.stderr) == (
        2, f"gpu-worker: error: --model '{tmp_path}': config.json architectures[0] = 'GemmaForCausalLM' is not supported: {RUNS}\n"
    )  # fmt: skip


def test_dynamic_rope_needs_a_manager_without_prefix_caching(checkpoints, tmp_path):
    pool = {"num_blocks": 32, "groups": [{"kind": "full_attention", "block_size": 4}]}
    (tmp_path / "pool.json").write_text(json.dumps(pool))
    manager = launch(
        [sys.executable, "-m", "kv_manager_service.cli", "serve", "--port", "0", "--config", str(tmp_path / "pool.json")],
        MANAGER_READY_PREFIX, tmp_path / "manager.log",
    )  # fmt: skip
    try:
        done = run_worker("--manager", manager.address, "--model", str(checkpoints["dynamic"]), "--dtype", "float32")
    finally:
        failures = stop_all([manager])
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "gpu-worker: error: model 'dynamic' uses dynamic RoPE scaling, whose cached keys depend on the sequence length "
        "they were computed at, and the manager reuses cached prefixes: start the manager with --no-prefix-caching"
    )
    assert not failures, failures
    served = tmp_path / "served"
    served.mkdir()
    stack, processes = start_stack(served, str(checkpoints["dynamic"]), "torch", pool, manager_args=["--no-prefix-caching"])
    failures = stop_stack(stack, processes)
    assert not failures, "\n\n".join(failures)
