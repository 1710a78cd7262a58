"""Mixture-of-experts specs from Hugging Face ``config.json`` files, without ``transformers``.

Supported: ``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``deepseek_v2`` and ``deepseek_v3``. The
spec lists every tensor of the published safetensors checkpoints under its published name, one
tensor per routed expert (``mlp.experts.{e}.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``), which is also what ``save_pretrained`` writes.
transformers 5 holds the experts of a layer stacked in memory (``mlp.experts.gate_up_proj``
``[E, 2 * inter, hidden]`` and ``mlp.experts.down_proj`` ``[E, hidden, inter]``):
:func:`checkpoint_state_dict` turns such a state dict into the checkpoint names.

Tensor parallelism follows Megatron and vLLM: routed and shared experts split their
intermediate dimension (gate/up column parallel on dim 0, down row parallel on dim 1: expert
tensor parallelism); routers, Qwen2-MoE's ``shared_expert_gate`` and DeepSeek-V3's
``e_score_correction_bias`` are replicated. DeepSeek's multi-head latent attention holds
``q_a_proj`` and ``kv_a_proj_with_mqa`` replicated (vLLM's ``ReplicatedLinear``) and splits
``q_b_proj``/``q_proj``/``kv_b_proj`` by heads (column parallel) and ``o_proj`` by heads (row
parallel); its norms are replicated. DeepSeek-V3's multi-token-prediction layer
(``num_nextn_predict_layers``) is not part of the model transformers builds and is left out; a
``quantization_config`` is ignored (the spec describes the unquantized weights in ``torch_dtype``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, TypeVar

from realloc._checks import check_nonneg, is_int
from realloc.spec._hf_fields import (
    CONFIG_DEFAULTS,
    flag,
    head_dim_of,
    kv_heads_of,
    optional_positive_int,
    positive_int,
    with_biases,
)
from realloc.spec.model import ModelSpec, ParamSpec, decoder_spec

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")

#: The key naming the routed expert count, then the aliases transformers' ``attribute_map`` accepts.
EXPERT_KEYS = {
    "mixtral": ("num_local_experts", "num_experts"),
    "qwen2_moe": ("num_experts",),
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "deepseek_v2": ("n_routed_experts", "num_experts"),
    "deepseek_v3": ("n_routed_experts", "num_local_experts"),
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

#: Checkpoint names of an expert's gate, up and down projections.
_QWEN_PROJ = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_PROJ = ("w1", "w3", "w2")


def moe_spec(
    config: Mapping[str, Any], source: str, model_type: str, *, name: str, dtype: str, norm_dtype: str | None
) -> ModelSpec:
    """The spec of the MoE decoder ``config`` describes (``model_type`` one of :data:`MOE_MODEL_TYPES`).

    ``source`` names the config in error messages; ``dtype``/``norm_dtype`` are the weights' and
    the norms' dtypes (``None``: the weights').

    Example:
        >>> spec = moe_spec({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        ...     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        ...     "num_local_experts": 4}, "HF config", "mixtral", name="m", dtype="bfloat16", norm_dtype=None)
        >>> spec.param("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape
        (64, 96)
    """
    get = _Reader(config, source, CONFIG_DEFAULTS[model_type])
    sizes = {key: positive_int(config, key, source) for key in _REQUIRED}
    hidden, layers, heads = sizes["hidden_size"], sizes["num_hidden_layers"], sizes["num_attention_heads"]
    norms = norm_dtype or dtype
    experts = get.positive(*EXPERT_KEYS[model_type])
    deepseek = model_type.startswith("deepseek")
    if deepseek:  # MLA gives every head its own k and v; decoder_spec's attention is replaced below
        kv_heads, head_dim = heads, get.positive("v_head_dim")
        qkv_bias = attention_bias = False
    else:
        kv_heads = kv_heads_of(config, source, heads, model_type)
        head_dim = head_dim_of(config, source, model_type, hidden, heads)
        attention_bias = model_type == "qwen3_moe" and get.flag("attention_bias")
        qkv_bias = attention_bias or (model_type == "qwen2_moe" and get.flag("qkv_bias"))
    base = decoder_spec(
        name,
        hidden=hidden,
        intermediate=get.positive("intermediate_size"),
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        vocab=sizes["vocab_size"],
        head_dim=head_dim,
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3_moe",
        tied=get.flag("tie_word_embeddings"),
        dtype=dtype,
        norm_dtype=norm_dtype,
    )
    moe_layers = _moe_layers(get, model_type, layers)
    block = _ExpertBlocks(hidden, experts, dtype)
    if model_type == "mixtral":
        mlp = block.mixtral(get.positive("intermediate_size"))
    elif model_type == "qwen2_moe":
        mlp = block.qwen(get.positive("moe_intermediate_size"), get.positive("shared_expert_intermediate_size"))
    elif model_type == "qwen3_moe":
        mlp = block.qwen(get.positive("moe_intermediate_size"), None)
    else:
        if get.flag("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported for {model_type}")
        inter = get.positive("moe_intermediate_size")
        mlp = block.deepseek(inter, inter * get.positive("n_shared_experts"), bias=model_type == "deepseek_v3")
    attention = _mla(get, hidden, heads, dtype, norms, get.flag("attention_bias")) if deepseek else None
    spec = _swap_blocks(base, attention, mlp, moe_layers)
    if attention_bias:
        spec = with_biases(spec, attention=True, mlp=False)
    return spec


# -- transformers' in-memory (stacked) experts -> checkpoint names ---------------------------

T = TypeVar("T")
_STACKED = re.compile(r"^(?P<layer>.*)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")


def checkpoint_state_dict(state_dict: Mapping[str, T], model_type: str) -> dict[str, T]:
    """``state_dict`` of a transformers 5 MoE model (experts stacked per layer) under the
    published checkpoint names, one tensor per expert; other entries keep their names.

    ``mlp.experts.gate_up_proj`` ``[E, 2 * inter, hidden]`` holds each expert's gate rows then
    its up rows (transformers concatenates ``gate_proj`` then ``up_proj``; Mixtral's ``w1`` then
    ``w3``) and becomes ``mlp.experts.{e}.gate_proj.weight`` and ``.up_proj.weight``;
    ``mlp.experts.down_proj`` ``[E, hidden, inter]`` becomes ``mlp.experts.{e}.down_proj.weight``.
    Mixtral's ``mlp.`` is ``block_sparse_moe.`` in its checkpoints (``w1``/``w3``/``w2``). Values
    are indexing views of the stacked tensors (torch or numpy), not copies. The same conversion as
    transformers' ``revert_weight_conversion`` (what ``save_pretrained`` writes).

    Example:
        >>> import numpy as np
        >>> sd = {"model.layers.0.mlp.experts.gate_up_proj": np.zeros((2, 6, 4)),
        ...       "model.layers.0.mlp.experts.down_proj": np.zeros((2, 4, 3))}
        >>> out = checkpoint_state_dict(sd, "qwen3_moe")
        >>> out["model.layers.0.mlp.experts.1.up_proj.weight"].shape, len(out)
        ((3, 4), 6)
    """
    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(MOE_MODEL_TYPES)}")
    mixtral = model_type == "mixtral"
    gate, up, down = _MIXTRAL_PROJ if mixtral else _QWEN_PROJ
    out: dict[str, T] = {}
    for key, tensor in state_dict.items():
        found = _STACKED.match(key)
        if found is None:
            out[key.replace(".mlp.", ".block_sparse_moe.") if mixtral else key] = tensor
            continue
        prefix = f"{found['layer']}.{'block_sparse_moe' if mixtral else 'mlp'}.experts"
        shape = tuple(tensor.shape)
        if len(shape) != 3:
            raise ValueError(f"{key}: stacked experts must be 3-D [experts, rows, columns], got shape {shape}")
        if found["kind"] == "down_proj":
            for e in range(shape[0]):
                out[f"{prefix}.{e}.{down}.weight"] = tensor[e]
            continue
        if shape[1] % 2:
            raise ValueError(f"{key}: gate_up_proj rows {shape[1]} are not gate and up rows of equal count")
        inter = shape[1] // 2
        for e in range(shape[0]):
            out[f"{prefix}.{e}.{gate}.weight"] = tensor[e, :inter]
            out[f"{prefix}.{e}.{up}.weight"] = tensor[e, inter:]
    return out


# -- building blocks ------------------------------------------------------------------------

#: One layer's parameters, given the layer index.
Block = Callable[[int], list[ParamSpec]]


def _param(
    layer: int,
    suffix: str,
    shape: tuple[int, ...],
    dtype: str,
    tp_dim: int | None = None,
    unit: int = 1,
    buffer: bool = False,
    expert: int | None = None,
) -> ParamSpec:
    return ParamSpec(
        f"model.layers.{layer}.{suffix}",
        shape,
        dtype,
        "layer",
        layer=layer,
        tp_dim=tp_dim,
        tp_unit=unit,
        buffer=buffer,
        expert=expert,
    )


def _swiglu(
    layer: int,
    prefix: str,
    inter: int,
    hidden: int,
    dtype: str,
    names: tuple[str, str, str] = _QWEN_PROJ,
    expert: int | None = None,
) -> list[ParamSpec]:
    """Gate and up column parallel (dim 0), down row parallel (dim 1); ``expert``: the routed
    expert's index (``ParamSpec.expert``), ``None`` for dense and shared MLPs."""
    gate, up, down = names
    return [
        _param(layer, f"{prefix}.{gate}.weight", (inter, hidden), dtype, 0, expert=expert),
        _param(layer, f"{prefix}.{up}.weight", (inter, hidden), dtype, 0, expert=expert),
        _param(layer, f"{prefix}.{down}.weight", (hidden, inter), dtype, 1, expert=expert),
    ]


@dataclasses.dataclass(frozen=True)
class _ExpertBlocks:
    """The MoE MLP block of each supported family."""

    hidden: int
    experts: int
    dtype: str

    def _routed(self, layer: int, block: str, inter: int, names: tuple[str, str, str]) -> list[ParamSpec]:
        params = [_param(layer, f"{block}.gate.weight", (self.experts, self.hidden), self.dtype)]
        for e in range(self.experts):
            params += _swiglu(layer, f"{block}.experts.{e}", inter, self.hidden, self.dtype, names, expert=e)
        return params

    def mixtral(self, inter: int) -> Block:
        return lambda layer: self._routed(layer, "block_sparse_moe", inter, _MIXTRAL_PROJ)

    def qwen(self, inter: int, shared: int | None) -> Block:
        def block(layer: int) -> list[ParamSpec]:
            params = self._routed(layer, "mlp", inter, _QWEN_PROJ)
            if shared is not None:  # Qwen2-MoE: one shared expert behind a sigmoid gate
                params += _swiglu(layer, "mlp.shared_expert", shared, self.hidden, self.dtype)
                params.append(_param(layer, "mlp.shared_expert_gate.weight", (1, self.hidden), self.dtype))
            return params

        return block

    def deepseek(self, inter: int, shared: int, *, bias: bool) -> Block:
        def block(layer: int) -> list[ParamSpec]:
            params = self._routed(layer, "mlp", inter, _QWEN_PROJ)
            if bias:  # DeepSeek-V3's aux-loss-free balancing bias: a float32 buffer of the router
                params.insert(
                    1, _param(layer, "mlp.gate.e_score_correction_bias", (self.experts,), "float32", buffer=True)
                )
            return params + _swiglu(layer, "mlp.shared_experts", shared, self.hidden, self.dtype)

        return block


def _mla(get: "_Reader", hidden: int, heads: int, dtype: str, norms: str, bias: bool) -> Block:
    """DeepSeek's multi-head latent attention, as transformers' ``DeepseekV2Attention``/``V3``."""
    nope, rope, v_dim = get.positive("qk_nope_head_dim"), get.positive("qk_rope_head_dim"), get.positive("v_head_dim")
    q_lora, kv_lora = get.optional_positive("q_lora_rank"), get.positive("kv_lora_rank")
    qk = nope + rope

    def block(layer: int) -> list[ParamSpec]:
        a = "self_attn."
        params: list[ParamSpec] = []
        if q_lora is None:
            params.append(_param(layer, a + "q_proj.weight", (heads * qk, hidden), dtype, 0, qk))
        else:
            params.append(_param(layer, a + "q_a_proj.weight", (q_lora, hidden), dtype))
            if bias:
                params.append(_param(layer, a + "q_a_proj.bias", (q_lora,), dtype))
            params += [
                _param(layer, a + "q_a_layernorm.weight", (q_lora,), norms),
                _param(layer, a + "q_b_proj.weight", (heads * qk, q_lora), dtype, 0, qk),
            ]
        params.append(_param(layer, a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), dtype))
        if bias:
            params.append(_param(layer, a + "kv_a_proj_with_mqa.bias", (kv_lora + rope,), dtype))
        params += [
            _param(layer, a + "kv_a_layernorm.weight", (kv_lora,), norms),
            _param(layer, a + "kv_b_proj.weight", (heads * (nope + v_dim), kv_lora), dtype, 0, nope + v_dim),
            _param(layer, a + "o_proj.weight", (hidden, heads * v_dim), dtype, 1, v_dim),
        ]
        if bias:  # row parallel: added once after the all-reduce, so whole on every rank
            params.append(_param(layer, a + "o_proj.bias", (hidden,), dtype))
        return params

    return block


def _moe_layers(get: "_Reader", model_type: str, layers: int) -> set[int]:
    """The layers whose MLP is a mixture of experts (the rest are dense, ``intermediate_size``)."""
    if model_type == "mixtral":
        return set(range(layers))
    if model_type.startswith("deepseek"):
        freq = get.optional_positive("moe_layer_freq")
        if freq not in (None, 1):
            raise ValueError(
                f"{get.source}: moe_layer_freq={freq} is not supported (transformers builds "
                "every layer from first_k_dense_replace on as MoE; only 1 means that)"
            )
        first = get.non_negative("first_k_dense_replace")
        return set(range(first, layers))
    step = get.positive("decoder_sparse_step")
    dense = get.int_list("mlp_only_layers")
    return {i for i in range(layers) if i not in dense and (i + 1) % step == 0}


def _swap_blocks(spec: ModelSpec, attention: Block | None, mlp: Block, moe_layers: set[int]) -> ModelSpec:
    """``spec`` with each layer's ``self_attn.*`` replaced by ``attention`` (when given) and, in
    ``moe_layers``, its ``mlp.*`` replaced by ``mlp``; forward order is kept."""
    params: list[ParamSpec] = []
    done: set[tuple[int, str]] = set()
    for p in spec.params:
        module = p.name.split(".")[3] if p.layer is not None else None
        new = attention if module == "self_attn" else mlp if module == "mlp" and p.layer in moe_layers else None
        if new is None:
            params.append(p)
        elif (p.layer, module) not in done:
            done.add((p.layer, module))
            params += new(p.layer)
    return dataclasses.replace(spec, params=tuple(params))


class _Reader:
    """Typed reads of a config's fields, with transformers' defaults for missing ones."""

    def __init__(self, config: Mapping[str, Any], source: str, defaults: Mapping[str, Any]) -> None:
        self.config, self.source, self.defaults = config, source, defaults

    def _value(self, *keys: str) -> tuple[str, Any]:
        for key in keys:
            if key in self.config:
                return key, self.config[key]
        return keys[0], self.defaults.get(keys[0])

    def optional_positive(self, *keys: str) -> int | None:
        key, value = self._value(*keys)
        return optional_positive_int({key: value}, key, self.source)

    def positive(self, *keys: str) -> int:
        value = self.optional_positive(*keys)
        if value is None:
            raise ValueError(f"{self.source}: field {keys[0]!r} must be a positive integer, got None")
        return value

    def non_negative(self, key: str) -> int:
        _, value = self._value(key)
        return check_nonneg(f"{self.source}: field {key!r}", value)

    def int_list(self, key: str) -> set[int]:
        _, value = self._value(key)
        value = [] if value is None else value
        if not isinstance(value, list) or any(not is_int(v) for v in value):
            raise ValueError(f"{self.source}: field {key!r} must be a list of layer indices, got {value!r}")
        return set(value)

    def flag(self, key: str) -> bool:
        return flag(self.config, key, self.source, default=self.defaults.get(key, False))
