"""Model specs from Hugging Face ``config.json`` files, without depending on ``transformers``.

Supported: dense decoder LLMs whose weights follow the Llama naming (``llama``, ``mistral``,
``qwen2`` and ``qwen3``) and the mixture-of-experts decoders of :mod:`realloc.spec.moe`
(``mixtral``, ``qwen2_moe``, ``qwen3_moe``, ``deepseek_v2``, ``deepseek_v3``; Kimi-K2's ``kimi_k2``
is read as ``deepseek_v3``, :data:`ARCHITECTURE_OF`). Defaults for fields
a config leaves out are the ones the matching ``transformers`` config class uses, so the spec
matches the checkpoint's tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

from realloc.spec._hf_fields import flag, head_dim_of, is_positive, kv_heads_of, positive_int, with_biases
from realloc.spec.model import ModelSpec, decoder_spec, describe_difference, preset, preset_names
from realloc.spec.moe import MOE_MODEL_TYPES, moe_spec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: Weight dtypes a config may ask for (``torch_dtype``, or ``dtype`` in newer configs).
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")
#: Mixture-of-experts model types with no spec builder (refused with a clear message).
_UNSUPPORTED_MOE_MODEL_TYPES = {
    "dbrx",
    "olmoe",
    "jamba",
    "granitemoe",
    "phimoe",
    "jetmoe",
    "llama4",
    "minimax",
}
#: Model types that are another model type's architecture under a name of their own, read as it:
#: ``{model_type: (the model type it is read as, the architecture its config must declare)}``.
#: Kimi-K2's ``config.json`` (moonshotai/Kimi-K2-Instruct; tests/data/configs/Kimi-K2-Instruct.json)
#: has ``model_type`` ``kimi_k2`` and ``architectures`` ``["DeepseekV3ForCausalLM"]``: DeepSeek-V3's
#: layers with 384 routed experts.
ARCHITECTURE_OF = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}
#: Keys whose positive value marks a mixture-of-experts model even under a dense model_type.
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def spec_from_hf_config(
    path_or_dict: "str | os.PathLike | Mapping[str, Any]",
    *,
    dtype: str | None = None,
    name: str | None = None,
    norm_dtype: str | None = None,
) -> ModelSpec:
    """The :class:`ModelSpec` of the decoder LLM (dense or mixture-of-experts) a HF config describes.

    ``path_or_dict`` is the parsed config, a ``config.json`` path or a directory holding one.
    ``dtype`` overrides the config's ``torch_dtype`` (default ``bfloat16``); ``norm_dtype`` gives
    the norm weights their own dtype (default: the weights' dtype); ``name`` overrides the name
    (default: the config's ``_name_or_path``, the directory name, or the model type).

    Example:
        >>> spec = spec_from_hf_config({"model_type": "qwen2", "hidden_size": 64,
        ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...     "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": True})
        >>> spec.param("model.layers.0.self_attn.k_proj.bias").shape, spec.aliases
        ((32,), {'lm_head.weight': 'model.embed_tokens.weight'})
    """
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    config, path = _load(path_or_dict)
    source = "HF config" if path is None else f"HF config {str(path)!r}"
    model_type = _model_type(config, source)
    weights_dtype = _dtype(dtype, "dtype argument") if dtype is not None else _config_dtype(config, source)
    norms = _dtype(norm_dtype, "norm_dtype argument") if norm_dtype is not None else None
    spec_name = name or _default_name(config, path, model_type)
    if model_type in MOE_MODEL_TYPES:
        spec = moe_spec(config, source, model_type, name=spec_name, dtype=weights_dtype, norm_dtype=norms)
    else:
        spec = _dense_spec(config, source, model_type, name=spec_name, dtype=weights_dtype, norm_dtype=norms)
    return dataclasses.replace(spec, hf_config_json=canonical_json(config, source))


def _dense_spec(
    config: Mapping[str, Any], source: str, model_type: str, *, name: str, dtype: str, norm_dtype: str | None
) -> ModelSpec:
    sizes = {key: positive_int(config, key, source) for key in _REQUIRED}
    heads = sizes["num_attention_heads"]
    # Qwen2 always has q/k/v biases; llama and qwen3 put a bias on q/k/v *and* o when asked.
    attention_bias = flag(config, "attention_bias", source) and model_type in ("llama", "qwen3")
    mlp_bias = flag(config, "mlp_bias", source) and model_type == "llama"
    spec = decoder_spec(
        name,
        hidden=sizes["hidden_size"],
        intermediate=sizes["intermediate_size"],
        layers=sizes["num_hidden_layers"],
        heads=heads,
        kv_heads=kv_heads_of(config, source, heads, model_type),
        vocab=sizes["vocab_size"],
        head_dim=head_dim_of(config, source, model_type, sizes["hidden_size"], heads),
        qkv_bias=model_type == "qwen2" or attention_bias,
        qk_norm=model_type == "qwen3",
        tied=flag(config, "tie_word_embeddings", source),
        dtype=dtype,
        norm_dtype=norm_dtype,
    )
    if attention_bias or mlp_bias:
        spec = with_biases(spec, attention=attention_bias, mlp=mlp_bias)
    return spec


def load_spec(text: str) -> ModelSpec:
    """A preset by name, or the spec of a HF ``config.json`` (file or directory).

    Example:
        >>> load_spec("tiny").num_layers
        4
    """
    if text in preset_names():
        return preset(text)
    if os.path.exists(text) or os.sep in text or text.endswith(".json"):
        return spec_from_hf_config(text)
    raise ValueError(
        f"unknown model {text!r}: not a preset (known: {', '.join(preset_names())}) "
        "and not an existing config.json or directory"
    )


# -- writing: the config of a spec ----------------------------------------------------------

#: What a config derived from a spec (no HF config remembered) uses for what the parameters do not
#: say. These are transformers' own defaults for Llama, Qwen2 and Qwen3 (``LlamaConfig()`` etc.),
#: except ``max_position_embeddings``: Llama's class default (2048) applies to llama, 32768 to Qwen.
DERIVED_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "initializer_range": 0.02}
MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: Config keys copied into generation_config.json (transformers' ``GenerationConfig.from_model_config``).
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def canonical_json(config: Mapping[str, Any], source: str = "HF config") -> str:
    """``config`` as canonical JSON text: sorted keys, no spaces (what a spec remembers)."""
    try:
        return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source} is not plain JSON data: {exc}") from None


def hf_config_of(spec: ModelSpec) -> dict[str, Any]:
    """The HF ``config.json`` of ``spec``, for an export that ``from_pretrained`` loads as it is.

    A spec made from a HF config returns that config, with ``torch_dtype`` set to the dtype the
    weights are written in (the spec's, which ``dtype=`` may have overridden), and without its
    ``quantization_config`` when the spec holds the model's dtypes (a bf16 spec of a block-FP8
    checkpoint: its export is bf16). Other specs
    (presets, :func:`~realloc.spec.decoder_spec`) get a ``llama``, ``qwen2`` (q/k/v biases without
    an o bias) or ``qwen3`` (q/k norms) config derived from their parameters, with
    :data:`DERIVED_DEFAULTS` for what parameters do not tell. ``ValueError`` when the spec is not
    one of these decoders (then pass the config explicitly to the export).

    Example:
        >>> from realloc.spec import decoder_spec
        >>> c = hf_config_of(decoder_spec("m", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
        ...                                vocab=100, tied=True))
        >>> c["model_type"], c["num_key_value_heads"], c["head_dim"], c["tie_word_embeddings"]
        ('llama', 2, 16, True)
    """
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"hf_config_of needs a realloc.ModelSpec, got {type(spec).__name__}")
    if spec.hf_config_json is not None:
        config = json.loads(spec.hf_config_json)
        config.pop("dtype", None)  # newer transformers write "dtype"; one key says it
        config["torch_dtype"] = _weights_dtype(spec)
        if spec.weight_format is None:  # the weights are the model's dtypes: a block-FP8 source's
            config.pop("quantization_config", None)  # config would make them read as quantized
        return config
    config = _derived_config(spec)
    check_config_fits(config, spec)  # the derivation describes exactly these parameters
    return config


def check_config_fits(config: Mapping[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """``config`` as a plain dict if it describes ``spec``'s parameters (names and shapes; dtypes
    may differ), else ``ValueError`` saying what differs."""
    if not isinstance(config, Mapping):
        raise ValueError(f"HF config must be a dict, got {type(config).__name__}")
    described = spec_from_hf_config(config)
    ours = {p.name: tuple(p.shape) for p in spec.params}
    theirs = {p.name: tuple(p.shape) for p in described.params}
    if ours != theirs or described.aliases != spec.aliases:
        detail = (
            describe_difference(ours, theirs, f"model {spec.name!r}", "the config")
            or f"tied aliases {spec.aliases} vs {described.aliases}"
        )
        raise ValueError(f"HF config does not describe model {spec.name!r}: {detail}")
    return json.loads(canonical_json(config))


def generation_config_of(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """``generation_config.json`` for ``config``: its token ids, as transformers'
    ``GenerationConfig.from_model_config`` takes them; ``None`` when it has none.

    Example:
        >>> generation_config_of({"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": None})
        {'_from_model_config': True, 'bos_token_id': 1, 'eos_token_id': [2, 3]}
    """
    found = {k: config[k] for k in GENERATION_KEYS if config.get(k) is not None}
    return {"_from_model_config": True, **found} if found else None


def _weights_dtype(spec: ModelSpec) -> str:
    """The dtype of the embedding (norms may be kept in another dtype)."""
    embed = [p for p in spec.params if p.role == "embed"]
    if embed:
        return embed[0].dtype
    by_bytes: dict[str, int] = {}
    for p in spec.params:
        by_bytes[p.dtype] = by_bytes.get(p.dtype, 0) + p.nbytes
    return max(sorted(by_bytes), key=by_bytes.__getitem__)


def _derived_config(spec: ModelSpec) -> dict[str, Any]:
    names = spec.by_name

    def shape(name: str) -> tuple[int, ...]:
        p = names.get(name)
        if p is None:
            raise ValueError(
                f"model {spec.name!r} has no {name!r}: it is not a Llama/Qwen2/Qwen3 decoder, "
                "so no HF config can be derived from it (pass config= to the export)"
            )
        return tuple(p.shape)

    vocab, hidden = shape("model.embed_tokens.weight")
    heads = spec.num_heads
    if heads is None:
        raise ValueError(f"model {spec.name!r} does not record its attention heads: pass config= to the export")
    kv_heads = spec.num_kv_heads or heads
    layer = "model.layers.0."
    q_rows = shape(layer + "self_attn.q_proj.weight")[0]
    has = lambda suffix: (layer + suffix) in names  # noqa: E731
    if has("self_attn.q_norm.weight"):
        model_type = "qwen3"
    elif has("self_attn.q_proj.bias") and not has("self_attn.o_proj.bias"):
        model_type = "qwen2"
    else:
        model_type = "llama"
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": shape(layer + "mlp.gate_proj.weight")[0],
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": q_rows // heads,
        "vocab_size": vocab,
        "tie_word_embeddings": "lm_head.weight" in spec.aliases,
        "torch_dtype": _weights_dtype(spec),
        "max_position_embeddings": MAX_POSITIONS[model_type],
        **DERIVED_DEFAULTS,
    }
    if model_type != "qwen2":
        config["attention_bias"] = has("self_attn.q_proj.bias")
    if model_type == "llama":
        config["mlp_bias"] = has("mlp.gate_proj.bias")
    return config


# -- reading --------------------------------------------------------------------------------


def _load(path_or_dict: "str | os.PathLike | Mapping[str, Any]") -> tuple[Mapping[str, Any], Path | None]:
    """The config mapping and the file it was read from (``None`` for a mapping)."""
    if isinstance(path_or_dict, Mapping):
        return path_or_dict, None
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ValueError(
            f"HF config must be a dict, a config.json path or a directory, got {type(path_or_dict).__name__}"
        )
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"cannot read HF config {str(path)!r}: {reason}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"HF config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"HF config {str(path)!r} must hold a JSON object, got {type(config).__name__}")
    return config, path


def _model_type(config: Mapping[str, Any], source: str) -> str:
    model_type = config.get("model_type")
    supported = (
        f"{', '.join(SUPPORTED_MODEL_TYPES)}; supported mixture-of-experts: "
        f"{', '.join((*MOE_MODEL_TYPES, *ARCHITECTURE_OF))}"
    )
    if model_type is None:
        raise ValueError(f"{source}: missing required field 'model_type' (one of {supported})")
    if not isinstance(model_type, str):
        raise ValueError(f"{source}: model_type must be a string (one of {supported}), got {model_type!r}")
    if model_type in MOE_MODEL_TYPES:
        return model_type
    if model_type in ARCHITECTURE_OF:
        read_as, architecture = ARCHITECTURE_OF[model_type]
        declared = config.get("architectures")
        if not isinstance(declared, list) or architecture not in declared:
            raise ValueError(
                f"{source}: model_type {model_type!r} is read as {read_as!r} only when its architectures "
                f"name {architecture!r}, got architectures {declared!r}"
            )
        return read_as
    if model_type in _UNSUPPORTED_MOE_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is a mixture-of-experts model, which is not supported; "
            f"supported dense decoders: {supported}"
        )
    experts = [f"{k}={config[k]}" for k in _EXPERT_KEYS if is_positive(config.get(k))]
    if experts:
        raise ValueError(
            f"{source}: {', '.join(experts)} makes this a mixture-of-experts model, but model_type {model_type!r} "
            f"has no experts; supported dense decoders: {supported}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported dense decoders: {supported}")
    return model_type


def _dtype(value: Any, what: str) -> str:
    text = value.removeprefix("torch.") if isinstance(value, str) else value
    if text not in WEIGHT_DTYPES:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    return text


def _config_dtype(config: Mapping[str, Any], source: str) -> str:
    value = config.get("torch_dtype") or config.get("dtype")
    return "bfloat16" if value is None else _dtype(value, f"{source}: torch_dtype")


def _default_name(config: Mapping[str, Any], path: Path | None, model_type: str) -> str:
    given = config.get("_name_or_path")
    if isinstance(given, str) and given:
        return given
    if path is not None and path.name != "config.json":  # a saved config of its own: Mixtral-8x7B.json
        return path.stem
    if path is not None:  # checkpoints are directories named after the model
        return path.resolve().parent.name or model_type
    return model_type
