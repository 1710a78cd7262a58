"""Model specs: the parameters of a model and how each one splits under tensor parallelism.

A spec knows nothing about ranks. It says, per parameter, its global shape and dtype, the
dimension tensor parallelism cuts (or none: replicated), the granularity of that cut (a head for
attention projections, one row otherwise) and which pipeline "slot" the parameter lives in
(embedding, a transformer layer, or the head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from realloc._checks import check_choice, is_int

DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,  # block-FP8 weights (realloc.spec.formats)
}

#: Where a parameter lives in the pipeline.
ROLES = ("embed", "layer", "final", "head")
#: Names ``Layout(vocab_pad_rule=...)`` accepts; the first is the default (docs/conventions.md
#: and :mod:`realloc.layout.conventions` describe each engine's rule).
VOCAB_PAD_RULES = ("megatron", "vllm")


def vocab_units_per_rank(units: int, tp: int, pad_multiple: int, rule: str, name: str = "vocabulary") -> int:
    """Padded units (vocabulary rows) every tp rank holds under ``rule``.

    Example:
        >>> vocab_units_per_rank(50257, 8, 64, "megatron"), vocab_units_per_rank(50257, 8, 64, "vllm")
        (6336, 6288)
    """
    if rule == "megatron":
        step = pad_multiple * tp
        return -(-units // step) * step // tp
    check_choice("vocab_pad_rule", rule, VOCAB_PAD_RULES)
    padded = -(-units // pad_multiple) * pad_multiple
    if padded % tp:
        raise ValueError(
            f"vocab_pad_rule='vllm': {name} of {units} rows padded to a multiple of {pad_multiple} is "
            f"{padded} rows, which tp={tp} does not divide (vLLM's VocabParallelEmbedding splits the "
            f"padded vocabulary with divide(), exactly); choose vocab_pad_multiple so that tp divides it"
        )
    return padded // tp


@dataclass(frozen=True)
class ParamSpec:
    """One parameter (one storage tensor) of a model.

    ``tp_dim`` is the dimension tensor parallelism splits (``None``: every tp rank holds it whole).
    The split dimension is made of ``shape[tp_dim] // tp_unit`` units (attention heads, rows); tp
    ranks get whole units. ``replicate_units`` allows tp larger than the unit count when tp is a
    multiple of it (GQA k/v heads: each head is then held by ``tp // units`` ranks).
    ``pad_to_tp`` lets the unit count be padded up to a multiple of tp (vocabulary padding): the
    padding is local zeros, never part of the global tensor.
    ``buffer`` marks a tensor the checkpoint stores that is not a trainable parameter (a persistent
    buffer such as DeepSeek-V3's router ``e_score_correction_bias``): it moves like any other but is
    left out of parameter counts.
    ``expert`` is the index of the routed expert the tensor belongs to (``None``: not a routed
    expert; shared experts, routers and dense layers are ``None``). Expert parallelism
    (``Topology.ep``/``etp``, docs/conventions.md "Expert parallelism") places routed experts
    by it and cuts them by ``etp`` instead of ``tp``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    layer: int | None = None
    tp_dim: int | None = None
    tp_unit: int = 1
    replicate_units: bool = False
    pad_to_tp: bool = False
    buffer: bool = False
    expert: int | None = None

    def __post_init__(self) -> None:
        if self.expert is not None and (not is_int(self.expert) or self.expert < 0 or self.role != "layer"):
            raise ValueError(
                f"parameter {self.name!r}: expert {self.expert!r} must be a non-negative integer on a layer parameter"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"parameter {self.name!r}: dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if self.role not in ROLES:
            raise ValueError(f"parameter {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if (self.role == "layer") != (self.layer is not None):
            raise ValueError(f"parameter {self.name!r}: a layer index goes with role 'layer' and only with it")
        if not self.shape or any(int(s) <= 0 for s in self.shape):
            raise ValueError(f"parameter {self.name!r}: shape {self.shape} must be non-empty with positive sizes")
        if self.tp_dim is not None:
            if not 0 <= self.tp_dim < len(self.shape):
                raise ValueError(f"parameter {self.name!r}: tp_dim {self.tp_dim} outside shape {self.shape}")
            if self.tp_unit <= 0 or self.shape[self.tp_dim] % self.tp_unit:
                raise ValueError(
                    f"parameter {self.name!r}: dim {self.tp_dim} of size {self.shape[self.tp_dim]} "
                    f"is not a whole number of units of {self.tp_unit}"
                )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def units(self) -> int:
        return self.shape[self.tp_dim] // self.tp_unit if self.tp_dim is not None else 1

    def tp_problem(self, tp: int) -> str | None:
        """Why this parameter cannot be split ``tp`` ways, or ``None`` when it can."""
        if self.tp_dim is None or tp == 1 or self.pad_to_tp:
            return None
        units = self.units
        if units % tp == 0:
            return None
        if self.replicate_units and tp % units == 0:
            return None
        allowed = "a divisor" + (" or a multiple" if self.replicate_units else "")
        return f"{self.name}: {units} units along dim {self.tp_dim} cannot be split {tp} ways (tp must be {allowed} of {units})"

    def tp_range(
        self, tp: int, tp_rank: int, pad_multiple: int = 1, pad_rule: str = "megatron"
    ) -> tuple[int, int, int]:
        """``(start, stop, local_size)`` along ``tp_dim`` of tp rank ``tp_rank``.

        ``stop - start`` is the global extent held; ``local_size`` can be larger (vocab padding to
        a multiple of ``pad_multiple * tp`` units, as Megatron's ``make_vocab_size_divisible_by``;
        ``pad_rule="vllm"``: to a multiple of ``pad_multiple``, then split over tp, see
        :mod:`realloc.layout.conventions`).
        """
        if self.tp_dim is None:
            raise ValueError(f"parameter {self.name!r} is replicated; it has no tp range")
        unit, units = self.tp_unit, self.units
        if self.pad_to_tp:
            per = vocab_units_per_rank(units, tp, pad_multiple, pad_rule, self.name)
            start = min(tp_rank * per, units)
            stop = min((tp_rank + 1) * per, units)
            return start * unit, stop * unit, per * unit
        if units % tp == 0:
            per = units // tp
            return tp_rank * per * unit, (tp_rank + 1) * per * unit, per * unit
        if self.replicate_units and tp % units == 0:
            u = tp_rank // (tp // units)
            return u * unit, (u + 1) * unit, unit
        raise ValueError(self.tp_problem(tp))


#: ModelSpec attributes computed on first use and never pickled.
_CACHED = ("_by_name", "_hash")


@dataclass(frozen=True)
class ModelSpec:
    """All parameters of a model, in forward order, plus tied aliases.

    ``aliases`` maps an alias name (``lm_head.weight``) to the storage parameter it shares
    (``model.embed_tokens.weight``). The alias is not a parameter of its own; a pipeline stage that
    holds the head but not the embedding keeps its own copy of the storage parameter.

    ``hf_config_json`` is the Hugging Face ``config.json`` the spec was made from
    (:func:`~realloc.spec.hf_config.spec_from_hf_config`), as canonical JSON text (sorted keys, no
    spaces), or ``None`` (presets, :func:`decoder_spec`). HF export writes it back; it takes no
    part in equality or hashing (two specs with the same parameters are the same model).

    Example:
        >>> spec = ModelSpec.preset("tiny")
        >>> spec.num_layers, spec.total_bytes() > 0
        (4, True)
    """

    name: str
    params: tuple[ParamSpec, ...]
    num_layers: int
    aliases: dict[str, str] = field(default_factory=dict)
    num_heads: int | None = None
    num_kv_heads: int | None = None
    hf_config_json: str | None = field(default=None, compare=False, repr=False)
    #: The weight format the tensors are in (:mod:`realloc.spec.formats`), ``None`` for a model's
    #: own dtypes: a formatted spec holds e.g. float8 weights and their block scales.
    weight_format: str | None = None

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"model {self.name!r}: duplicate parameter names {dup}")
        if self.num_layers <= 0:
            raise ValueError(f"model {self.name!r}: num_layers must be positive, got {self.num_layers}")
        for p in self.params:
            if p.layer is not None and not 0 <= p.layer < self.num_layers:
                raise ValueError(f"parameter {p.name!r}: layer {p.layer} outside 0..{self.num_layers - 1}")
        by_name = set(names)
        for alias, target in self.aliases.items():
            if target not in by_name:
                raise ValueError(f"model {self.name!r}: alias {alias!r} points at unknown parameter {target!r}")
            if alias in by_name:
                raise ValueError(f"model {self.name!r}: alias {alias!r} is also a parameter")

    def __hash__(self) -> int:
        # Computed once per object (it hashes every parameter): a layout's hash includes its
        # spec's, and workers hash layouts on every move (kept layouts, mapped peer buffers).
        # Never pickled (__getstate__): string hashes differ between processes.
        value = self.__dict__.get("_hash")
        if value is None:
            value = hash((self.name, self.params, self.num_layers, tuple(sorted(self.aliases.items()))))
            object.__setattr__(self, "_hash", value)
        return value

    @property
    def by_name(self) -> dict[str, ParamSpec]:
        """Name -> parameter (built once per spec; do not mutate)."""
        table = self.__dict__.get("_by_name")
        if table is None:
            table = {p.name: p for p in self.params}
            object.__setattr__(self, "_by_name", table)
        return table

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in _CACHED}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def dtypes(self) -> list[str]:
        return sorted({p.dtype for p in self.params})

    def tied_head_of(self, storage: str) -> str | None:
        """The alias (head) that shares ``storage``, if any."""
        for alias, target in self.aliases.items():
            if target == storage:
                return alias
        return None

    def tp_problems(self, tp: int) -> list[str]:
        return [msg for p in self.params if (msg := p.tp_problem(tp))]

    def check_same_as(self, other: "ModelSpec") -> None:
        """Raise ``ValueError`` unless ``other`` has the same parameters (names, shapes, dtypes)."""
        difference = describe_difference(
            {p.name: (tuple(p.shape), p.dtype) for p in self.params},
            {p.name: (tuple(p.shape), p.dtype) for p in other.params},
            "first",
            "second",
        )
        if difference:
            raise ValueError(f"model specs {self.name!r} and {other.name!r} differ: {difference}")

    @staticmethod
    def preset(name: str) -> "ModelSpec":
        """The spec of a named model: :func:`preset`."""
        return preset(name)


def describe_difference(a: dict, b: dict, a_name: str, b_name: str) -> str | None:
    """What differs between two ``name -> (shape, dtype)`` tables (a few examples), or ``None``."""
    if a == b:
        return None
    only_a = sorted(set(a) - set(b))[:3]
    only_b = sorted(set(b) - set(a))[:3]
    differ = sorted(n for n in set(a) & set(b) if a[n] != b[n])[:3]
    return (
        f"only in {a_name} {only_a}, only in {b_name} {only_b}, "
        f"different shape/dtype {[(n, a[n], b[n]) for n in differ]}"
    )


def decoder_spec(
    name: str,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int | None = None,
    vocab: int,
    head_dim: int | None = None,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    tied: bool = False,
    dtype: str = "bfloat16",
    norm_dtype: str | None = None,
) -> ModelSpec:
    """A Llama-style decoder with Megatron tensor-parallel rules.

    Embedding and head split on vocab (dim 0, padded to tp); q/k/v/gate/up column-parallel (dim 0);
    o/down row-parallel (dim 1); norms replicated; k/v heads replicated when tp > kv heads.
    ``qk_norm`` adds Qwen3's per-head RMSNorm weights (``self_attn.q_norm``/``k_norm``, replicated).
    """
    kv_heads = kv_heads or heads
    head_dim = head_dim or hidden // heads
    if heads % kv_heads:
        raise ValueError(f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    norm_dtype = norm_dtype or dtype
    embed = "model.embed_tokens.weight"
    params: list[ParamSpec] = [ParamSpec(embed, (vocab, hidden), dtype, "embed", tp_dim=0, pad_to_tp=True)]
    for i in range(layers):
        pre = f"model.layers.{i}."

        def add(
            suffix: str,
            shape: Iterable[int],
            tp_dim: int | None,
            unit: int = 1,
            replicate: bool = False,
            dt: str = dtype,
        ) -> None:
            params.append(
                ParamSpec(
                    pre + suffix,
                    tuple(shape),
                    dt,
                    "layer",
                    layer=i,
                    tp_dim=tp_dim,
                    tp_unit=unit,
                    replicate_units=replicate,
                )
            )

        add("input_layernorm.weight", (hidden,), None, dt=norm_dtype)
        add("self_attn.q_proj.weight", (heads * head_dim, hidden), 0, head_dim)
        add("self_attn.k_proj.weight", (kv_heads * head_dim, hidden), 0, head_dim, True)
        add("self_attn.v_proj.weight", (kv_heads * head_dim, hidden), 0, head_dim, True)
        if qkv_bias:
            add("self_attn.q_proj.bias", (heads * head_dim,), 0, head_dim)
            add("self_attn.k_proj.bias", (kv_heads * head_dim,), 0, head_dim, True)
            add("self_attn.v_proj.bias", (kv_heads * head_dim,), 0, head_dim, True)
        add("self_attn.o_proj.weight", (hidden, heads * head_dim), 1, head_dim)
        if qk_norm:
            add("self_attn.q_norm.weight", (head_dim,), None, dt=norm_dtype)
            add("self_attn.k_norm.weight", (head_dim,), None, dt=norm_dtype)
        add("post_attention_layernorm.weight", (hidden,), None, dt=norm_dtype)
        add("mlp.gate_proj.weight", (intermediate, hidden), 0)
        add("mlp.up_proj.weight", (intermediate, hidden), 0)
        add("mlp.down_proj.weight", (hidden, intermediate), 1)
    params.append(ParamSpec("model.norm.weight", (hidden,), norm_dtype, "final"))
    aliases: dict[str, str] = {}
    if tied:
        aliases["lm_head.weight"] = embed
    else:
        params.append(ParamSpec("lm_head.weight", (vocab, hidden), dtype, "head", tp_dim=0, pad_to_tp=True))
    return ModelSpec(name, tuple(params), layers, aliases, num_heads=heads, num_kv_heads=kv_heads)


# -- named models -------------------------------------------------------------------------------

_PRESETS = {
    # tiny: GQA (12 heads, 2 kv heads: tp 4 -> 6 works, tp 4+ replicates kv), tied embeddings, odd vocab, fp32 norms; for tests and demos.
    "tiny": dict(
        hidden=96, intermediate=192, layers=4, heads=12, kv_heads=2, vocab=1001, tied=True, norm_dtype="float32"
    ),
    # small: ~56M parameters (112 MB bf16), the default model of `realloc demo`.
    "small": dict(hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=4, vocab=32000),
    # bench-1gb: ~542M parameters, 1.08 GB bf16, the model of `realloc bench`.
    "bench-1gb": dict(hidden=2048, intermediate=5632, layers=8, heads=16, kv_heads=8, vocab=32000),
    "llama-7b": dict(hidden=4096, intermediate=11008, layers=32, heads=32, vocab=32000),
    "llama-13b": dict(hidden=5120, intermediate=13824, layers=40, heads=40, vocab=32000),
    "llama-70b": dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000),
    "qwen2.5-7b": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, qkv_bias=True),
    "qwen2.5-72b": dict(hidden=8192, intermediate=29568, layers=80, heads=64, kv_heads=8, vocab=152064, qkv_bias=True),
}


def preset_names() -> list[str]:
    """The names :func:`preset` knows (shapes as published in the models' HF configs)."""
    return sorted(_PRESETS)


def preset(name: str) -> ModelSpec:
    """The spec of a named model (:func:`preset_names` lists them)."""
    if not isinstance(name, str) or name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(preset_names())}")
    return decoder_spec(name, **_PRESETS[name])
