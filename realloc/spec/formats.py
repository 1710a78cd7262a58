"""Weight formats: the dtypes a layout holds a model in, when they are not the spec's own.

A trainer holds bf16 weights (often fp32 masters); a generation engine serves them cast or
quantized. A *weight format* names what a layout holds (docs/conventions.md "Weight formats"):

* a dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``): every floating tensor cast to it,
  element by element, bit-identical to ``tensor.to(dtype)``, except those the engines keep in
  float32 whatever they serve (DeepSeek-V3's router ``e_score_correction_bias``), kept as the
  spec holds them;
* ``"fp8_block128"``: DeepSeek-V3 / vLLM block FP8. Every quantized weight (:func:`quantized`)
  is held as ``float8_e4m3fn`` values beside a ``float32`` tensor ``<weight>_scale_inv`` of one
  scale per 128 x 128 block (``[ceil(rows / 128), ceil(cols / 128)]``); the other tensors keep
  the spec's dtype. ``"fp8_block128+bfloat16"`` casts those others to bf16 as well.

:func:`formatted` turns a spec into the spec of the tensors a layout of that format holds (its
scales are parameters of their own, split by tensor parallelism like their weights, block for
block), so layouts, plans and executors see ordinary tensors. Pure: no torch here; the
conversions themselves are :mod:`realloc.shards.convert`.
"""

from __future__ import annotations

import re
from dataclasses import replace

from realloc.spec.model import ModelSpec, ParamSpec

__all__ = [
    "BLOCK",
    "CASTS",
    "FP8",
    "WEIGHT_FORMATS",
    "check_weight_format",
    "formatted",
    "hf_weight_format",
    "quantized",
    "scale_name",
    "unformatted",
]

#: Dtypes a cast format may name (floating dtypes the executors move).
CASTS = ("bfloat16", "float16", "float32")
#: The quantized dtype of the block-FP8 format and its block edge (vLLM's ``weight_block_size``).
FP8 = "float8_e4m3fn"
BLOCK = 128
#: Every weight format a layout accepts (``None``: the spec's own dtypes).
WEIGHT_FORMATS = CASTS + ("fp8_block128",) + tuple(f"fp8_block128+{d}" for d in CASTS)

_FLOATING = ("float32", "bfloat16", "float16", "float64")
# Linear layers' weights: attention and MLP projections (HF ``*_proj``, Mixtral ``w1``/``w2``/``w3``),
# routed and shared experts alike, and DeepSeek MLA's ``kv_a_proj_with_mqa`` (vLLM quantizes it:
# a ReplicatedLinear, or part of ``fused_qkv_a_proj``, built with the quant_config in
# vllm/model_executor/models/deepseek_v2.py; DeepSeek-V3's published checkpoint holds it in e4m3
# with ``weight_scale_inv``). Routers (``mlp.gate``, ``shared_expert_gate``), norms, embeddings and
# the head are not linear layers vLLM's Fp8LinearMethod / Fp8MoEMethod quantize.
_LINEAR = re.compile(r"(_proj|_proj_with_mqa|\.w[123])\.weight$")
# Tensors the engines hold in float32 whatever dtype the rest is served in, so no cast format casts
# them: DeepSeek-V3's router bias (transformers' ``_keep_in_fp32_modules_strict =
# ["e_score_correction_bias"]`` in models/deepseek_v3/modeling_deepseek_v3.py; vLLM's
# ``nn.Parameter(torch.empty(n_routed_experts, dtype=torch.float32))`` in
# vllm/model_executor/models/deepseek_v2.py).
_KEEP_FP32 = re.compile(r"(^|\.)e_score_correction_bias$")


def check_weight_format(weight_format: object) -> str | None:
    """``weight_format`` if it names a format (or ``None``), else ``ValueError`` naming the allowed ones."""
    if weight_format is None or (isinstance(weight_format, str) and weight_format in WEIGHT_FORMATS):
        return weight_format
    raise ValueError(
        f"weight_format {weight_format!r} is not one of {list(WEIGHT_FORMATS)} (or None: the spec's dtypes)"
    )


def scale_name(weight: str) -> str:
    """The name of a quantized weight's block scales (DeepSeek-V3's and vLLM's ``weight_scale_inv``)."""
    return weight + "_scale_inv"


def quantized(p: ParamSpec, excluded: tuple[str, ...] = ()) -> bool:
    """Whether block FP8 quantizes parameter ``p``: a 2-D floating weight of a linear layer inside a
    transformer layer, not under a module a checkpoint's ``quantization_config`` leaves unconverted
    (``excluded``: module name prefixes, e.g. ``modules_to_not_convert``)."""
    return (
        p.role == "layer"
        and len(p.shape) == 2
        and p.dtype in _FLOATING
        and bool(_LINEAR.search(p.name))
        and not any(p.name == m or p.name.startswith(m.rstrip(".") + ".") for m in excluded)
    )


def _scale_param(p: ParamSpec) -> ParamSpec:
    """The block scales of quantized weight ``p``: one per 128 x 128 block, split by tensor
    parallelism along the weight's dimension, block for block (a tp unit of the weight that is a
    whole number of blocks is that many scale rows; otherwise one scale row per unit of 128)."""
    shape = tuple(-(-n // BLOCK) for n in p.shape)
    unit = p.tp_unit // BLOCK if p.tp_dim is not None and p.tp_unit % BLOCK == 0 else 1
    return replace(p, name=scale_name(p.name), shape=shape, dtype="float32", tp_unit=unit)


def formatted(spec: ModelSpec, weight_format: str | None, excluded: tuple[str, ...] = ()) -> ModelSpec:
    """The spec of the tensors a layout of ``weight_format`` holds (``spec`` itself for ``None``).

    Quantized weights keep their names with dtype ``float8_e4m3fn``; each one's scales follow it
    (:func:`scale_name`). Equal formats of equal specs give equal specs; a formatted spec remembers
    the spec it was made from (:func:`unformatted`).

    Example:
        >>> spec = ModelSpec.preset("tiny")
        >>> fp8 = formatted(spec, "fp8_block128")
        >>> q = fp8.by_name["model.layers.0.self_attn.q_proj.weight"]
        >>> q.dtype, fp8.by_name[scale_name(q.name)].shape, unformatted(fp8) == spec
        ('float8_e4m3fn', (1, 1), True)
    """
    check_weight_format(weight_format)
    base = unformatted(spec)
    if weight_format is None:
        return base
    fp8, _, cast = weight_format.partition("+")
    if fp8 in CASTS:
        fp8, cast = "", fp8
    params: list[ParamSpec] = []
    for p in base.params:
        if fp8 and quantized(p, excluded):
            params += [replace(p, dtype=FP8), _scale_param(p)]
        elif cast and p.dtype in _FLOATING and not _KEEP_FP32.search(p.name):
            params.append(replace(p, dtype=cast))
        else:
            params.append(p)
    out = replace(base, params=tuple(params), weight_format=weight_format)
    object.__setattr__(out, "_unformatted", base)
    return out


def unformatted(spec: ModelSpec) -> ModelSpec:
    """The spec a :func:`formatted` spec was made from (``spec`` itself when it has no format)."""
    return spec.__dict__.get("_unformatted", spec) if spec.weight_format is not None else spec


def hf_weight_format(config: dict) -> tuple[str | None, tuple[str, ...]]:
    """The weight format a HF ``config.json``'s ``quantization_config`` declares, and the modules it
    leaves unconverted: ``("fp8_block128", modules_to_not_convert)`` for DeepSeek-V3-style block FP8
    (``quant_method`` ``"fp8"``, ``weight_block_size`` ``[128, 128]``), ``(None, ())`` without one;
    ``ValueError`` for a quantization this project does not read.

    Example:
        >>> hf_weight_format({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}})
        ('fp8_block128', ())
    """
    q = config.get("quantization_config")
    if q is None:
        return None, ()
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if (
        not isinstance(q, dict)
        or q.get("quant_method") != "fp8"
        or q.get("fmt", "e4m3") != "e4m3"
        or block != [BLOCK, BLOCK]
    ):
        raise ValueError(
            f"quantization_config {q!r} is not block FP8 (quant_method 'fp8', fmt 'e4m3', weight_block_size "
            f"[{BLOCK}, {BLOCK}]): the only quantized checkpoint format read here"
        )
    excluded = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    return "fp8_block128", tuple(str(m) for m in excluded)
