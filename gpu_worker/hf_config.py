"""A checkpoint's `config.json`, as transformers writes it, read into a `ModelConfig`: implemented exactly, or refused.

Never half-read. Support is decided by the architecture (`architectures[0]`,
or `model_type`), never guessed from tensor names; each supported one is the
Llama block plus a few declared differences, computed as transformers (v5)
computes them:

    LlamaForCausalLM    attention_bias (q, k, v and o), mlp_bias, head_dim, tied
                        embeddings, RoPE default / linear / dynamic / llama3
    MistralForCausalLM  every layer slides over `sliding_window` (null: none)
    Qwen2ForCausalLM    q, k, v biases (no o bias); sliding layers only with
                        use_sliding_window (per layer_types, else the layers
                        from max_window_layers on)
    Qwen3ForCausalLM    RMSNorm over head_dim of each q and k head before RoPE,
                        attention_bias, head_dim (default 128), Qwen2's windows

A config.json with neither `architectures` nor `model_type` is the worker's
own layout: Llama's fields plus `sliding_window` and `layer_types`, as
`ModelConfig.to_hf_dict` writes for a model with sliding layers.

Every other field is refused by name, except bookkeeping that cannot change
the logits (token ids, dtype, versions, generation defaults, fields of other
heads; see `_BOOKKEEPING_FIELDS`). A value that transformers would compute
differently from this worker (`hidden_act` other than silu, RoPE types yarn
or longrope, `partial_rotary_factor` other than 1, an encoder-decoder) is
refused with the value and what runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from gpu_worker.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling

_NO_DEFAULT = object()


@dataclasses.dataclass(frozen=True)
class _Architecture:
    """One architecture this worker runs: the config.json fields it reads, and transformers' defaults for them."""

    name: str  # as in `architectures`
    model_type: str
    fields: frozenset[str]  # model fields read (beyond `_BOOKKEEPING_FIELDS`)
    defaults: Mapping[str, Any]  # the config class's value of an absent field; None as transformers' own None


# Read by every architecture; `rope_theta`, `rope_scaling` and a top-level
# `partial_rotary_factor` are the layout before `rope_parameters`.
_COMMON_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor",
    "attention_dropout",  # dropout: a no-op at inference
})  # fmt: skip
_QWEN_WINDOW_FIELDS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
_COMMON_DEFAULTS = {
    "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}  # fmt: skip
_QWEN_DEFAULTS = _COMMON_DEFAULTS | {
    "num_key_value_heads": 32, "max_position_embeddings": 32768, "use_sliding_window": False,
    "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
}  # fmt: skip

_LLAMA = _Architecture(
    "LlamaForCausalLM", "llama",
    _COMMON_FIELDS | {"attention_bias", "mlp_bias", "pretraining_tp"},  # pretraining_tp: the same products, sliced
    _COMMON_DEFAULTS | {"max_position_embeddings": 2048},
)  # fmt: skip
_ARCHITECTURES = {
    arch.model_type: arch
    for arch in (
        _LLAMA,
        _Architecture(
            "MistralForCausalLM", "mistral", _COMMON_FIELDS | {"sliding_window"},
            _COMMON_DEFAULTS | {"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
        ),
        _Architecture("Qwen2ForCausalLM", "qwen2", _COMMON_FIELDS | _QWEN_WINDOW_FIELDS, _QWEN_DEFAULTS),
        _Architecture(
            "Qwen3ForCausalLM", "qwen3", _COMMON_FIELDS | _QWEN_WINDOW_FIELDS | {"attention_bias"},
            _QWEN_DEFAULTS | {"head_dim": 128},
        ),
    )
}  # fmt: skip
# The worker's own layout: a config.json that names no architecture.
_OWN_LAYOUT = dataclasses.replace(
    _LLAMA, name="the worker's own layout (no architectures)", model_type="",
    fields=_LLAMA.fields | {"sliding_window", "layer_types"}, defaults=_LLAMA.defaults | {"sliding_window": None},
)  # fmt: skip
_SUPPORTED = ", ".join(arch.name for arch in _ARCHITECTURES.values())

# Fields that cannot change the logits: what the checkpoint is and was saved
# with, token ids, generation defaults (sampling is chosen per request), the
# fields of classification heads, switches of outputs the worker never returns.
_BOOKKEEPING_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "name_or_path", "_commit_hash",
    "dtype", "torch_dtype", "use_bfloat16", "_attn_implementation_autoset", "initializer_range", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class",
    "prefix", "task_specific_params", "finetuning_task", "id2label", "label2id", "num_labels", "problem_type",
    "output_hidden_states", "output_attentions", "return_dict", "torchscript", "tf_legacy_loss", "is_decoder",
    "tie_encoder_decoder", "chunk_size_feed_forward",
    # transformers' generation defaults
    "assistant_confidence_threshold", "assistant_lookbehind", "bad_words_ids", "begin_suppress_tokens",
    "diversity_penalty", "do_sample", "early_stopping", "encoder_no_repeat_ngram_size", "encoder_repetition_penalty",
    "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty", "forced_bos_token_id", "forced_eos_token_id",
    "length_penalty", "max_length", "min_length", "no_repeat_ngram_size", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "num_beam_groups", "num_beams", "num_return_sequences", "output_scores",
    "remove_invalid_values", "repetition_penalty", "return_dict_in_generate", "suppress_tokens", "target_lookbehind",
    "temperature", "top_k", "top_p", "typical_p",
})  # fmt: skip
# Generic fields that are harmless only at their off value.
_OFF_VALUES = {
    "is_encoder_decoder": False, "add_cross_attention": False, "cross_attention_hidden_size": None, "pruned_heads": {},
}  # fmt: skip
# Why some fields met in published configs are refused, beyond "not implemented".
_REFUSAL_REASONS = {
    "quantization_config": "the worker loads unquantized floating-point weights only",
    "attn_logit_softcapping": "attention logit softcapping is not implemented",
    "final_logit_softcapping": "final logit softcapping is not implemented",
    "auto_map": "custom modeling code is not run: the worker implements the architectures " + _SUPPORTED,
}
_ROPE_KEYS = {  # beyond rope_type / type, rope_theta and partial_rotary_factor
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(field: str, value: Any, supported: str) -> ValueError:
    """The one-line refusal: the field, its value, what this worker runs instead."""
    return ValueError(f"config.json {field} = {_shown(value)} is not supported: {supported}")


def _architecture(raw: Mapping[str, Any]) -> _Architecture:
    architectures, model_type = raw.get("architectures"), raw.get("model_type")
    named = None
    if architectures is not None:
        if not isinstance(architectures, list) or not architectures:
            raise _refuse("architectures", architectures, f"a list whose first entry is one of {_SUPPORTED}")
        named = next((arch for arch in _ARCHITECTURES.values() if arch.name == architectures[0]), None)
        if named is None:
            raise _refuse("architectures[0]", architectures[0], f"this worker runs {_SUPPORTED}")
    if model_type is not None:
        typed = _ARCHITECTURES.get(model_type)
        if typed is None:
            raise _refuse("model_type", model_type, f"this worker runs model types {', '.join(_ARCHITECTURES)}")
        if named is not None and named is not typed:
            raise _refuse("model_type", model_type, f"{named.model_type!r}, the type of {named.name}")
        named = typed
    return named or _OWN_LAYOUT


def _check_fields(raw: Mapping[str, Any], arch: _Architecture) -> None:
    """Refuses the first field the architecture does not read that is not bookkeeping, or is not off."""
    for field, value in raw.items():
        if field in arch.fields or field in _BOOKKEEPING_FIELDS:
            continue
        if field in _OFF_VALUES:
            if value is None or value == _OFF_VALUES[field]:
                continue
            raise _refuse(field, value, f"this worker runs a decoder-only model ({field} = {_OFF_VALUES[field]!r})")
        if field in _REFUSAL_REASONS:
            raise _refuse(field, value, _REFUSAL_REASONS[field])
        raise _refuse(
            field, value,
            f"{arch.name} here reads no such field, and a field the worker does not implement is refused, "
            f"not ignored (it reads {', '.join(sorted(arch.fields))}, and bookkeeping such as token ids)",
        )  # fmt: skip


class _Fields:
    """The fields of one config.json, absent ones at the architecture's transformers default."""

    def __init__(self, raw: Mapping[str, Any], arch: _Architecture) -> None:
        self.raw = raw
        self.arch = arch

    def __getitem__(self, field: str) -> Any:
        if field in self.raw:
            return self.raw[field]
        default = self.arch.defaults.get(field, _NO_DEFAULT)
        if default is _NO_DEFAULT:
            raise ValueError(f"config.json lacks the field {field!r}, which {self.arch.name} needs")
        return default


def _positive_int(field: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(field, value, "a positive integer")
    return value


def _positive_number(field: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise _refuse(field, value, "a positive number")
    return float(value)


def _flag(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _refuse(field, value, "true or false")
    return value


def read_hf_config(name: str, raw: Mapping[str, Any]) -> ModelConfig:
    """The `ModelConfig` of a checkpoint's config.json; ValueError, one line, at the first thing it cannot run."""
    arch = _architecture(raw)
    _check_fields(raw, arch)
    fields = _Fields(raw, arch)
    if fields["hidden_act"] != "silu":
        raise _refuse("hidden_act", fields["hidden_act"], "this worker runs 'silu' (SwiGLU)")
    hidden_size = _positive_int("hidden_size", fields["hidden_size"])
    num_heads = _positive_int("num_attention_heads", fields["num_attention_heads"])
    num_layers = _positive_int("num_hidden_layers", fields["num_hidden_layers"])
    num_kv_heads, head_dim = fields["num_key_value_heads"], fields["head_dim"]
    rope_theta, rope_scaling = _rope(fields)
    sliding_window, layer_types = _windows(fields, num_layers)
    # Llama and Qwen3: attention_bias puts a bias on q, k, v and o; Qwen2 always has q, k, v biases, never o's.
    attention_bias = "attention_bias" in arch.fields and _flag("attention_bias", fields["attention_bias"])
    return ModelConfig(
        name=name,
        vocab_size=_positive_int("vocab_size", fields["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=_positive_int("intermediate_size", fields["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads if num_kv_heads is None else _positive_int("num_key_value_heads", num_kv_heads),
        head_dim=hidden_size // num_heads if head_dim is None else _positive_int("head_dim", head_dim),
        rms_norm_eps=_positive_number("rms_norm_eps", fields["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        sliding_window=sliding_window,
        layer_types=layer_types,
        tie_word_embeddings=_flag("tie_word_embeddings", fields["tie_word_embeddings"]),
        qkv_bias=attention_bias or arch.model_type == "qwen2",
        o_proj_bias=attention_bias,
        mlp_bias="mlp_bias" in arch.fields and _flag("mlp_bias", fields["mlp_bias"]),
        qk_norm=arch.model_type == "qwen3",
    )


def _rope(fields: _Fields) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling, from `rope_parameters` or the older top-level `rope_theta` + `rope_scaling`.

    As transformers reads them: a non-empty `rope_scaling` stands for
    `rope_parameters`, `type` for `rope_type`, a theta missing there is the
    top-level one, else 10000; two of these that disagree are refused here.
    Every key a RoPE type does not read is refused (`attention_factor`
    included: these types scale no attention, transformers' 1.0).
    """
    raw = fields.raw
    for field in ("rope_parameters", "rope_scaling"):
        if raw.get(field) is not None and not isinstance(raw[field], dict):
            raise _refuse(field, raw[field], "a JSON object, or null")
    legacy, current = raw.get("rope_scaling") or {}, raw.get("rope_parameters") or {}
    if legacy and current and legacy != current:
        raise _refuse("rope_scaling", legacy, f"one RoPE description, and rope_parameters is {_shown(current)}")
    where = "rope_scaling" if legacy else "rope_parameters"
    params = legacy or current
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("type", rope_type) != rope_type:
        raise _refuse(f"{where}.type", params["type"], f"the value of {where}.rope_type ({rope_type!r})")
    if rope_type not in _ROPE_KEYS:
        raise _refuse(f"{where}.rope_type", rope_type, f"this worker runs RoPE types {', '.join(_ROPE_KEYS)}")
    read_keys = _ROPE_KEYS[rope_type] | {"rope_theta", "partial_rotary_factor"}
    for key, value in params.items():
        if key not in read_keys | {"rope_type", "type"}:
            raise _refuse(f"{where}.{key}", value, f"RoPE type {rope_type!r} reads {', '.join(sorted(read_keys))}")
    for field, value in (("partial_rotary_factor", raw.get("partial_rotary_factor")),
                         (f"{where}.partial_rotary_factor", params.get("partial_rotary_factor"))):  # fmt: skip
        if value is not None and value != 1:
            raise _refuse(field, value, "this worker rotates whole heads (partial_rotary_factor 1)")
    theta, top_theta = params.get("rope_theta"), raw.get("rope_theta")
    if theta is not None and top_theta is not None and theta != top_theta:
        raise _refuse("rope_theta", top_theta, f"one value, and {where}.rope_theta is {theta!r}")
    theta = _positive_number("rope_theta", next((t for t in (theta, top_theta) if t is not None), 10000.0))
    if rope_type == "default":
        return theta, None

    def param(key: str, default: Any = _NO_DEFAULT) -> Any:
        if key in params:
            return params[key]
        if default is _NO_DEFAULT:
            raise ValueError(f"config.json {where} lacks {key!r}, which RoPE type {rope_type!r} needs")
        return default

    factor = _positive_number(f"{where}.factor", param("factor"))
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    max_positions = _positive_int("max_position_embeddings", fields["max_position_embeddings"])
    if rope_type == "dynamic":  # transformers' dynamic scaling starts past max_position_embeddings
        return theta, RopeScaling("dynamic", factor, original_max_position_embeddings=max_positions)
    original = param("original_max_position_embeddings", max_positions)
    return theta, RopeScaling(
        "llama3",
        factor,
        original_max_position_embeddings=_positive_int(f"{where}.original_max_position_embeddings", original),
        low_freq_factor=_positive_number(f"{where}.low_freq_factor", param("low_freq_factor")),
        high_freq_factor=_positive_number(f"{where}.high_freq_factor", param("high_freq_factor")),
    )


def _windows(fields: _Fields, num_layers: int) -> tuple[int, tuple[str, ...]]:
    """(sliding_window, layer_types) as the architecture's transformers config class derives them; 0: no window."""
    arch = fields.arch
    if "sliding_window" not in arch.fields:
        return 0, ()
    window = fields["sliding_window"]
    if "use_sliding_window" in arch.fields and not _flag("use_sliding_window", fields["use_sliding_window"]):
        window = None  # Qwen: the window counts only with use_sliding_window
    window = 0 if window is None else _positive_int("sliding_window", window)
    layer_types = fields["layer_types"] if "layer_types" in arch.fields else None
    if layer_types is not None:
        if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
            raise _refuse("layer_types", layer_types, f"a list of {FULL_ATTENTION!r} and {SLIDING_ATTENTION!r}")
        if SLIDING_ATTENTION in layer_types and not window:
            raise _refuse("layer_types", layer_types, "sliding layers need a sliding_window (Qwen: use_sliding_window)")
        kinds = list(layer_types)
    elif arch.model_type in ("qwen2", "qwen3"):  # no layer_types: the layers from max_window_layers on slide
        first_sliding = fields["max_window_layers"]
        if not isinstance(first_sliding, int) or isinstance(first_sliding, bool):
            raise _refuse("max_window_layers", first_sliding, "an integer")
        kinds = [SLIDING_ATTENTION if window and i >= first_sliding else FULL_ATTENTION for i in range(num_layers)]
    else:  # Mistral, and the worker's own layout without layer_types: every layer alike
        kinds = [SLIDING_ATTENTION if window else FULL_ATTENTION] * num_layers
    return (window if SLIDING_ATTENTION in kinds else 0), tuple(kinds)
