"""Typed reads of Hugging Face ``config.json`` fields, shared by the dense and the
mixture-of-experts spec builders (:mod:`realloc.spec.hf_config`, :mod:`realloc.spec.moe`).

The module is private to the spec builders; its names are public to them. Every reader takes
``source`` (how the config is named in messages) and raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from realloc._checks import check_positive, is_int
from realloc.spec.model import ModelSpec, ParamSpec

__all__ = [
    "CONFIG_DEFAULTS",
    "is_positive",
    "positive_int",
    "optional_positive_int",
    "flag",
    "kv_heads_of",
    "head_dim_of",
    "with_biases",
]


#: transformers' (5.x) config class defaults for the fields that shape the weights, used when a
#: config leaves them out (models/*/configuration_*.py), one entry per model type the spec
#: builders read. ``None`` for ``num_key_value_heads`` means one per attention head (``LlamaConfig``
#: and DeepSeek-V2 default to it; an explicit ``null`` means it in every class: their
#: ``__post_init__``). A ``head_dim`` here is a fixed default (``Qwen3Config``: 128); without one the
#: modelling code takes ``hidden_size // num_attention_heads``.
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None},
    "mistral": {"num_key_value_heads": 8},
    "qwen2": {"num_key_value_heads": 32},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128},
    "mixtral": {"intermediate_size": 14336, "num_key_value_heads": 8, "num_local_experts": 8},
    "qwen2_moe": {
        "intermediate_size": 5632,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "decoder_sparse_step": 1,
        "qkv_bias": True,
    },
    "qwen3_moe": {
        "intermediate_size": 6144,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
    },
    "deepseek_v2": {
        "intermediate_size": 11008,
        "num_key_value_heads": None,
        "n_routed_experts": 64,
        "moe_intermediate_size": 1407,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    "deepseek_v3": {
        "intermediate_size": 18432,
        "num_key_value_heads": 128,
        "n_routed_experts": 256,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
}


def is_positive(value: Any) -> bool:
    return is_int(value) and value > 0


def positive_int(config: Mapping[str, Any], key: str, source: str) -> int:
    value = optional_positive_int(config, key, source)
    if value is None:
        raise ValueError(f"{source}: missing required field {key!r}")
    return value


def optional_positive_int(config: Mapping[str, Any], key: str, source: str) -> int | None:
    value = config.get(key)
    return None if value is None else check_positive(f"{source}: field {key!r}", value)


def flag(config: Mapping[str, Any], key: str, source: str, default: bool = False) -> bool:
    # Every supported config class defaults these flags to False but Qwen2-MoE's qkv_bias.
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{source}: field {key!r} must be true or false, got {value!r}")
    return value


def kv_heads_of(config: Mapping[str, Any], source: str, heads: int, model_type: str) -> int:
    """``num_key_value_heads`` (``model_type``'s transformers default when left out:
    :data:`CONFIG_DEFAULTS`; ``None``: multi-head, one per head)."""
    given = "num_key_value_heads" in config
    kv_heads = (
        optional_positive_int(config, "num_key_value_heads", source)
        if given
        else CONFIG_DEFAULTS[model_type]["num_key_value_heads"]
    )
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        said = "" if given else f" (transformers' default for {model_type}: the config leaves it out)"
        raise ValueError(
            f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}{said}"
        )
    return kv_heads


def head_dim_of(config: Mapping[str, Any], source: str, model_type: str, hidden: int, heads: int) -> int:
    """``head_dim``, or the default of ``model_type``'s transformers config class."""
    head_dim = optional_positive_int(config, "head_dim", source)
    if head_dim is not None:
        return head_dim
    default = CONFIG_DEFAULTS[model_type].get("head_dim")  # Qwen3Config's 128; the others derive it
    if default is not None:
        return default
    if hidden % heads:
        raise ValueError(
            f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads} and no head_dim is given"
        )
    return hidden // heads


# -- biases the shared decoder builder does not emit ----------------------------------------


def with_biases(spec: ModelSpec, *, attention: bool, mlp: bool) -> ModelSpec:
    """``spec`` plus o_proj bias (attention) and gate/up/down biases (mlp), in forward order.

    Row-parallel biases (o, down) are added once after the all-reduce, so they are replicated;
    column-parallel ones (gate, up) split with their weight's rows.
    """
    params: list[ParamSpec] = []
    for p in spec.params:
        params.append(p)
        if p.role != "layer" or not p.name.endswith(".weight"):
            continue
        module = p.name.removesuffix(".weight")
        kind = module.rsplit(".", 1)[1]
        split_dim = 0 if kind in ("gate_proj", "up_proj") else None
        if (attention and kind == "o_proj") or (mlp and kind in ("gate_proj", "up_proj", "down_proj")):
            params.append(ParamSpec(f"{module}.bias", (p.shape[0],), p.dtype, "layer", layer=p.layer, tp_dim=split_dim))
    return dataclasses.replace(spec, params=tuple(params))
