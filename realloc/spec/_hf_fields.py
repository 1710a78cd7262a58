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

__all__ = ["is_positive", "positive_int", "optional_positive_int", "flag", "kv_heads_of", "head_dim_of", "with_biases"]


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


def kv_heads_of(config: Mapping[str, Any], source: str, heads: int, default: int | None) -> int:
    """``num_key_value_heads`` (``default`` when left out; ``None``: multi-head, one per head)."""
    kv_heads = (
        optional_positive_int(config, "num_key_value_heads", source) if "num_key_value_heads" in config else default
    )
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    return kv_heads


def head_dim_of(config: Mapping[str, Any], source: str, model_type: str, hidden: int, heads: int) -> int:
    """``head_dim``, or the default of ``model_type``'s transformers config class."""
    head_dim = optional_positive_int(config, "head_dim", source)
    if head_dim is not None:
        return head_dim
    # transformers' Qwen3Config defaults head_dim to 128; the others derive it from hidden size.
    if model_type == "qwen3":
        return 128
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
