"""Engine conventions as named layout options: how an engine's local tensors sit in a rank's buffer.

A :class:`~realloc.layout.Layout` takes three options besides its topology and
``vocab_pad_multiple`` (docs/conventions.md, "Engine conventions side by side"):

``vocab_pad_rule`` (:data:`~realloc.spec.VOCAB_PAD_RULES`; the rule itself is
:func:`~realloc.spec.vocab_units_per_rank`, kept with the spec since a parameter's tp range needs
it): how the vocabulary-parallel embedding and lm head are padded and split over tp ranks.

* ``"megatron"`` (default): Megatron-LM's ``make_vocab_size_divisible_by``: the vocabulary is
  padded to a multiple of ``vocab_pad_multiple * tp`` and every rank holds ``padded / tp`` rows
  (megatron/training/tokenizer/tokenizer.py ``_vocab_size_with_padding``;
  megatron/core/tensor_parallel/layers.py ``VocabParallelEmbedding``).
* ``"vllm"``: vLLM's ``VocabParallelEmbedding`` / ``ParallelLMHead``
  (vllm/model_executor/layers/vocab_parallel_embedding.py): ``pad_vocab_size`` rounds the
  vocabulary up to a multiple of ``padding_size`` (``DEFAULT_VOCAB_PADDING_SIZE = 64``: pass
  ``vocab_pad_multiple=64``), then ``divide(num_embeddings_padded, tp_size)`` gives every rank
  ``padded / tp`` rows. ``divide`` asserts exact divisibility (no ceil): a padded vocabulary tp
  does not divide is refused here with a ``ValueError``. Rank ``r`` holds padded rows
  ``[r*per, (r+1)*per)`` and real rows ``[min(r*per, V), min((r+1)*per, V))``
  (``VocabParallelEmbeddingShardIndices``: ``org_vocab_start/end_index``), so the last ranks
  can hold fewer real rows, or none. A tied or untied lm head is padded the same way.

``qkv_order`` (:data:`QKV_ORDERS`): how a tp rank's q/k/v shards of a layer sit in its buffer.

* ``"hf"`` (default): one shard per parameter in forward order, ``q, k, v``; the region is
  vLLM's ``qkv_proj`` (``[q; k; v]`` of the rank).
* ``"megatron"``: Megatron-core's ``linear_qkv`` (megatron/core/transformer/attention.py,
  ``SelfAttention.get_query_key_value_tensors``): the rank's fused output is viewed as
  ``[ng, (np/ng + 2) * hn]`` and split into ``[np/ng * hn, hn, hn]`` per query group, so for each
  local query group ``g`` the rows are: the q rows of the group's ``heads / kv_heads`` heads, then
  the group's k head, then its v head. Each such piece is its own shard (a box of the HF
  ``q_proj``/``k_proj``/``v_proj``), so one parameter has several shards on one rank and the
  weight region (and the bias region, when there are q/k/v biases) is exactly the local
  ``linear_qkv`` tensor of shape ``[local_groups * (q_per_group + 2) * head_dim, hidden]``.
  Megatron never replicates kv heads. It splits whole query groups when tp divides
  ``num_query_groups``; megatron-core 0.16 also accepts tp a multiple of ``num_query_groups``
  (``TransformerConfig.__post_init__``: "a multiple or divisor") and then cuts the global fused
  tensor into tp equal row ranges that split query groups (``Attention.__init__``;
  ``get_query_key_value_tensors`` all-gathers them): laid out by :func:`_megatron_row_pieces`
  (fsdp=1 only). Any other tp is refused. With ``fsdp > 1`` it means
  Megatron's *model* under sharded data parallelism (Megatron-FSDP, Megatron-DeepSpeed): the
  engine parameters are the fused ``linear_qkv`` and ``linear_fc1`` (gate; up) tensors, so FSDP2
  chunks and ZeRO-3 partitions are of those (:mod:`realloc.layout.sharded`); with
  ``qkv_order="hf"`` (HF-named FSDP models) q, k, v, gate and up are sharded one by one.

``expert_order`` (:data:`EXPERT_ORDERS`): how a rank's routed-expert shards of a layer sit in its
buffer (docs/conventions.md, "Expert parallelism").

* ``"hf"`` (default): forward order of the checkpoint names, per local expert its gate, up and
  down shards (``mlp.experts.{e}.gate_proj/up_proj/down_proj``; Mixtral ``w1``/``w3``/``w2``).
* ``"vllm"``: vLLM's ``FusedMoE`` buffers (vllm/model_executor/layers/fused_moe/routed_experts.py ``RoutedExperts``):
  ``w13_weight`` ``[local_experts, 2 * inter / etp, hidden]``, per local expert its gate rows then
  its up rows (``_load_w13`` narrows the expert's rows to ``[0, shard)`` for ``w1`` (gate) and
  ``[shard, 2 * shard)`` for ``w3`` (up), each the etp rank's slice), then ``w2_weight``
  ``[local_experts, hidden, inter / etp]`` (``_load_w2``: the down projection's columns of the etp
  rank). Both are one contiguous region of the rank's buffer, at the place of the layer's first
  expert tensor; :func:`realloc.shards.fused.fused_views` gives them as
  ``model.layers.N.mlp.experts.w13_weight`` / ``w2_weight`` views.
* ``"hf_stacked"``: transformers 5's stacked experts (``mlp.experts.gate_up_proj``
  ``[E, 2 * inter, hidden]``, per expert its gate rows then its up rows, and
  ``mlp.experts.down_proj`` ``[E, hidden, inter]``), as the engine holds them replicated, tensor
  parallel, FSDP2- or ZeRO-3-sharded: :mod:`realloc.layout.stacked`. Without fsdp the buffer
  order is vLLM's (the same memory, other names and no expert parallelism).
* ``"torchtitan"``: torchtitan's ``GroupedExperts`` stacks (torchtitan/models/common/moe.py:
  ``w1_EFD`` gate ``[E, F, D]``, ``w2_EDF`` down ``[E, D, F]``, ``w3_EFD`` up), each one region of the
  buffer, for its EP + FSDP composition (:mod:`realloc.layout.torchtitan`).

The MLP needs no option: Megatron's ``linear_fc1`` with ``gated_linear_unit`` holds
``[gate; up]`` of the rank (``glu`` in megatron/core/transformer/mlp.py chunks the local output in
two), which is also vLLM's ``gate_up_proj``: gate and up are adjacent in every layout. With MLP
biases (``mlp_bias``) both engines hold one fused bias too (vLLM's ``MergedColumnParallelLinear``
``gate_up_proj.bias``, Megatron's ``linear_fc1.bias``), so every layout places a layer's
``gate_proj.weight, up_proj.weight`` and then ``gate_proj.bias, up_proj.bias``
(:func:`fused_mlp_order`), not the HF forward order ``gate.weight, gate.bias, up.weight, up.bias``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from realloc._checks import check_choice
from realloc.spec import VOCAB_PAD_RULES, ModelSpec, ParamSpec, vocab_units_per_rank

if TYPE_CHECKING:
    from realloc.layout.topology import Topology

#: Names ``Layout(qkv_order=...)`` accepts; the first is the default.
QKV_ORDERS = ("hf", "megatron")
#: Names ``Layout(expert_order=...)`` accepts; the first is the default.
EXPERT_ORDERS = ("hf", "vllm", "hf_stacked", "torchtitan")

_QKV = re.compile(r"^(?P<prefix>.*)self_attn\.(?P<part>[qkv])_proj\.(?P<suffix>weight|bias)$")
#: A routed expert's projection: 0 gate (``w1``), 1 up (``w3``), 2 down (``w2``).
# (a block-FP8 layout's expert scales, ``...weight_scale_inv``, stack as their weights do)
_EXPERT_PROJ = re.compile(
    r"^(?P<prefix>.*)\.experts\.\d+\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight(_scale_inv)?$"
)
_PROJ_INDEX = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def check_options(
    spec: "ModelSpec",
    topology: "Topology",
    vocab_pad_multiple: int,
    vocab_pad_rule: str,
    qkv_order: str,
    expert_order: str = "hf",
) -> None:
    """``ValueError`` unless the options are known names and ``spec`` can be laid out with them."""
    check_choice("vocab_pad_rule", vocab_pad_rule, VOCAB_PAD_RULES)
    check_choice("qkv_order", qkv_order, QKV_ORDERS)
    check_choice("expert_order", expert_order, EXPERT_ORDERS)
    if expert_order == "vllm":
        _check_vllm_experts(spec, topology)
    elif expert_order == "hf_stacked":
        check_stacked_experts(spec, topology)
    elif expert_order == "torchtitan":
        check_torchtitan_experts(spec, topology)
    tp = topology.tp
    for p in spec.params:
        if p.pad_to_tp and p.tp_dim is not None:
            vocab_units_per_rank(p.units, tp, vocab_pad_multiple, vocab_pad_rule, p.name)
    if qkv_order == "hf":
        return
    if expert_order == "hf_stacked":
        raise ValueError(
            "qkv_order='megatron' with expert_order='hf_stacked': no engine holds Megatron's linear_qkv "
            "next to transformers 5's stacked experts; use qkv_order='hf' (transformers' q/k/v)"
        )
    for q, k, v in qkv_triples(spec):
        _megatron_groups(q, k, v, tp)
        if k.units < tp and topology.fsdp > 1:
            raise ValueError(
                f"qkv_order='megatron' with fsdp={topology.fsdp} and tp={tp} > {k.units} query groups: "
                "Megatron's linear_qkv rows that cut through query groups are laid out without sharded "
                "data parallelism only (fsdp=1), or use a tp that divides the query groups"
            )


def qkv_triples(spec: "ModelSpec", strict: bool = True) -> list[tuple["ParamSpec", "ParamSpec", "ParamSpec"]]:
    """``(q, k, v)`` parameter specs of every layer (weights and, separately, biases). A q
    without k and v (DeepSeek MLA without q LoRA: ``q_proj`` beside ``kv_a_proj_with_mqa``) is
    a ``ValueError`` when ``strict``, else no triple (there is no q/k/v to fuse)."""
    by_name = spec.by_name
    out = []
    for p in spec.params:
        m = _QKV.match(p.name)
        if not m or m["part"] != "q":
            continue
        names = [f"{m['prefix']}self_attn.{x}_proj.{m['suffix']}" for x in "kv"]
        missing = [n for n in names if n not in by_name]
        if missing and not strict and len(missing) == 2:
            continue
        if missing:
            raise ValueError(f"qkv_order='megatron': {p.name} has no {missing[0]} to fuse with")
        out.append((p, by_name[names[0]], by_name[names[1]]))
    return out


def _megatron_groups(q: "ParamSpec", k: "ParamSpec", v: "ParamSpec", tp: int) -> tuple[int, int]:
    """``(head_dim, q heads per group)`` of a q/k/v triple Megatron can fuse at ``tp``, else ``ValueError``."""
    where = f"qkv_order='megatron' ({q.name})"
    if not (q.tp_dim == k.tp_dim == v.tp_dim == 0) or not (q.tp_unit == k.tp_unit == v.tp_unit):
        raise ValueError(f"{where}: q/k/v must split by heads of one size along dim 0")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.shape[1:] != k.shape[1:] or k.shape != v.shape:
        raise ValueError(f"{where}: q/k/v differ in dtype or trailing dims; they cannot be one linear_qkv")
    groups = k.units
    if q.units % groups:
        raise ValueError(f"{where}: {q.units} heads are not a multiple of {groups} query groups")
    rows = (q.units + 2 * groups) * q.tp_unit
    if groups % tp and (tp % groups or rows % tp):
        raise ValueError(
            f"{where}: {groups} query groups (kv heads) cannot be split {tp} ways; Megatron-core needs "
            f"num_query_groups divisible by tp, or tp a multiple of them (TransformerConfig: 'a multiple or "
            f"divisor') that divides linear_qkv's {rows} rows (ColumnParallelLinear's divide)"
        )
    return q.tp_unit, q.units // groups


def _megatron_row_pieces(trio: list[tuple], per_group: int, head_dim: int, tp: int) -> list[tuple]:
    """Megatron-core's ``linear_qkv`` rows of a tp rank when tp is a multiple of the query groups
    (megatron-core 0.16, megatron/core/transformer/attention.py: ``Attention.__init__`` keeps the
    fused tensor a plain ``ColumnParallelLinear`` of ``(heads + 2 * groups) * head_dim`` rows, so
    rank ``r`` holds rows ``[r * n / tp, (r + 1) * n / tp)`` of the global fused tensor, which cut
    through query groups; ``get_query_key_value_tensors`` all-gathers them and takes its group):
    the pieces of q, k and v (boxes of the HF tensors) those rows are, in order. ``trio`` are the
    rank's tp entries of q, k and v (the q box says the rank)."""
    groups = trio[1][0].units
    rank = trio[0][3][0] // trio[0][4][0]  # q's tp box: heads / tp heads of the rank, in order
    per = (per_group + 2) * head_dim * groups // tp
    lo, hi, at, out = rank * per, (rank + 1) * per, 0, []
    for g in range(groups):
        for e, start, n in ((trio[0], g * per_group * head_dim, per_group * head_dim),) + tuple(
            (x, g * head_dim, head_dim) for x in trio[1:]
        ):
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                offsets, sizes = list(e[3]), list(e[4])
                offsets[0], sizes[0] = start + a - at, b - a
                out.append((e[0], e[1], e[2], offsets, sizes, list(sizes)))
            at += n
    return out


def megatron_qkv_order(entries: list[tuple], tp: int) -> list[tuple]:
    """A stage's tp boxes in forward order -> the same boxes with every layer's q/k/v (weights,
    and biases) replaced by Megatron's per-group pieces, in ``linear_qkv`` order.

    ``entries`` are ``(param_spec, name, slot, offsets, sizes, local_shape)`` with list-valued
    boxes (as :class:`~realloc.layout.Layout` builds them); the pieces are new such tuples whose
    local shape is their box (q/k/v carry no padding).
    """
    by_slot = {e[2]: e for e in entries}
    out, done = [], set()
    for entry in entries:
        slot = entry[2]
        if slot in done:
            continue
        m = _QKV.match(slot)
        if not m:
            out.append(entry)
            continue
        if m["part"] != "q":
            raise ValueError(f"qkv_order='megatron': {slot} comes before its q_proj")
        trio = [by_slot.get(f"{m['prefix']}self_attn.{x}_proj.{m['suffix']}") for x in "qkv"]
        if any(e is None for e in trio):
            raise ValueError(f"qkv_order='megatron': the stage holds {slot} but not all of its k/v")
        head_dim, per_group = _megatron_groups(trio[0][0], trio[1][0], trio[2][0], tp)
        done.update(e[2] for e in trio)
        if trio[1][0].units < tp:  # tp a multiple of the query groups: rows that cut through groups
            out += _megatron_row_pieces(trio, per_group, head_dim, tp)
            continue
        q_rows, kv_rows = per_group * head_dim, head_dim
        local_groups = trio[1][4][0] // kv_rows
        for g in range(local_groups):
            for e, rows in zip(trio, (q_rows, kv_rows, kv_rows)):
                offsets, sizes = list(e[3]), list(e[4])
                offsets[0] += g * rows
                sizes[0] = rows
                out.append((e[0], e[1], e[2], offsets, sizes, list(sizes)))
    return out


_GATE_UP = re.compile(r"^(?P<prefix>.*)\.(?P<part>gate_proj|up_proj)\.(?P<suffix>weight|bias)$")


def fused_mlp_order(entries: list[tuple]) -> list[tuple]:
    """A stage's entries (``(param_spec, name, slot, ...)``, forward order) with every
    ``gate_proj.bias`` moved to just after its ``up_proj.weight``: the weights ``[gate; up]`` and the
    biases ``[gate; up]`` adjacent, as vLLM's ``gate_up_proj.weight`` / ``.bias`` and Megatron's
    ``linear_fc1.weight`` / ``.bias`` (a gate bias without an up weight after it stays in place).
    In a block-FP8 layout the gate bias follows the up weight's scales (``..._scale_inv``, right
    after the up weight): float32 biases and scales share a buffer, and the scales ``[gate; up]``
    and the biases ``[gate; up]`` stay adjacent each.

    Example:
        >>> e = [(None, n, n) for n in ("m.gate_proj.weight", "m.gate_proj.bias", "m.up_proj.weight", "m.up_proj.bias")]
        >>> [x[2] for x in fused_mlp_order(e)]
        ['m.gate_proj.weight', 'm.up_proj.weight', 'm.gate_proj.bias', 'm.up_proj.bias']
    """
    # the entry each gate bias follows: the up weight, or its block-FP8 scales right after it (a
    # float32 bias must not sit between the gate's and the up's scales, nor split from the up bias)
    anchors: dict[str, str] = {}
    for e in entries:
        m = _GATE_UP.match(e[2].removesuffix("_scale_inv"))
        if m and m["part"] == "up_proj" and m["suffix"] == "weight":
            anchors[m["prefix"]] = e[2]
    out, held = [], {}
    for entry in entries:
        m = _GATE_UP.match(entry[2])
        if m and m["part"] == "gate_proj" and m["suffix"] == "bias" and m["prefix"] in anchors:
            held.setdefault(m["prefix"], []).append(entry)
            continue
        out.append(entry)
        a = _GATE_UP.match(entry[2].removesuffix("_scale_inv"))
        if a and anchors.get(a["prefix"]) == entry[2]:
            out += held.pop(a["prefix"], [])
    return out + [e for rest in held.values() for e in rest]


def expert_projection(p: "ParamSpec", order: str = "vllm") -> int:
    """0 (gate), 1 (up) or 2 (down) for a routed expert's weight; ``ValueError`` for anything else."""
    m = _EXPERT_PROJ.match(p.name)
    if p.expert is None or not m:
        held = {
            "vllm": "vLLM's FusedMoE holds only w13_weight and w2_weight",
            "hf_stacked": "transformers 5 stacks only gate_up_proj and down_proj",
        }.get(order, "torchtitan's GroupedExperts holds only w1, w2 and w3")
        raise ValueError(f"expert_order={order!r}: {p.name} is not a routed expert's gate/up/down weight ({held})")
    return _PROJ_INDEX[m["proj"]]


def _check_vllm_experts(spec: "ModelSpec", topology: "Topology") -> None:
    experts = [p for p in spec.params if p.expert is not None]
    if not experts:
        raise ValueError(f"expert_order='vllm': {spec.name} has no routed experts; use expert_order='hf'")
    if topology.fsdp > 1:
        raise ValueError(
            f"expert_order='vllm' with fsdp={topology.fsdp}: vLLM's fused expert buffers are not "
            "FSDP shards; use expert_order='hf'"
        )
    for p in experts:
        expert_projection(p)


def check_stacked_experts(spec: "ModelSpec", topology: "Topology") -> None:
    """``ValueError`` unless transformers 5's stacked experts (``expert_order="hf_stacked"``) can
    be laid out: a model with routed experts, every one a gate/up/down weight, without expert
    parallelism (replicated, tp, FSDP2 or ZeRO-3; see :mod:`realloc.layout.stacked`)."""
    experts = [p for p in spec.params if p.expert is not None]
    if not experts:
        raise ValueError(
            f"expert_order='hf_stacked': {spec.name} has no routed experts to stack (allowed: a MoE "
            "spec with ParamSpec.expert set); use expert_order='hf'"
        )
    if topology.expert_parallel:
        raise ValueError(
            f"expert_order='hf_stacked' with ep={topology.ep}, etp={topology.expert_tp} (tp={topology.tp}): "
            "transformers 5's stacked experts are laid out here replicated, tensor parallel (etp = tp), "
            "FSDP2 or ZeRO-3, not expert parallel; for expert-parallel stacked buffers use "
            "expert_order='vllm' (vLLM's w13_weight/w2_weight, the same memory order)"
        )
    for p in experts:
        expert_projection(p, "hf_stacked")


#: The stacks of each expert order: projection (0 gate, 1 up, 2 down) -> stack index.
EXPERT_STACKS = {"vllm": (0, 0, 1), "hf_stacked": (0, 0, 1), "torchtitan": (0, 2, 1)}


def stacked_expert_order(entries: list[tuple], order: str = "vllm") -> list[tuple]:
    """A stage's boxes in forward order -> the same boxes with every layer's routed experts as the
    stacks of ``order`` (:data:`EXPERT_STACKS`), at the place of the layer's first expert box, each
    stack per held expert in expert order (and gate before up inside a stack):

    * ``"vllm"`` / ``"hf_stacked"``: per expert its gate then its up box (vLLM's ``w13_weight``,
      transformers' ``gate_up_proj``), then every expert's down box (``w2_weight``, ``down_proj``);
    * ``"torchtitan"``: every expert's gate (``w1_EFD``), then down (``w2_EDF``), then up (``w3_EFD``).

    ``entries`` are ``(param_spec, name, slot, offsets, sizes, local_shape)`` as
    :class:`~realloc.layout.Layout` builds them.
    """
    stacks_of = EXPERT_STACKS[order]
    layers: dict[int, tuple[list, list, list]] = {}
    for entry in entries:
        p = entry[0]
        if p.expert is not None:
            proj = expert_projection(p, order)
            layers.setdefault(p.layer, ([], [], []))[stacks_of[proj]].append(((p.expert, proj), entry))
    out, done = [], set()
    for entry in entries:
        p = entry[0]
        if p.expert is None:
            out.append(entry)
        elif p.layer not in done:
            done.add(p.layer)
            out += [e for stack in layers[p.layer] for _, e in sorted(stack, key=lambda x: x[0])]
    return out


def check_torchtitan_experts(spec: "ModelSpec", topology: "Topology") -> None:
    """``ValueError`` unless torchtitan's expert stacks (``expert_order="torchtitan"``) fit: routed
    gate/up/down experts laid out by torchtitan's EP + FSDP (``Topology.torchtitan_experts``)."""
    if not any(p.expert is not None for p in spec.params):
        raise ValueError(f"expert_order='torchtitan': {spec.name} has no routed experts; use expert_order='hf'")
    if not topology.torchtitan_experts:
        raise ValueError(
            f"expert_order='torchtitan' with {topology}: torchtitan's w1/w2/w3 stacks are laid out here "
            "for its EP + FSDP composition only (fsdp > 1, ep > 1, etp=1); use expert_order='hf'"
        )
    for p in spec.params:
        if p.expert is not None:
            expert_projection(p, "torchtitan")


def megatron_vocab_pad_multiple(spec: "ModelSpec", padded: int | None, tp: int) -> int:
    """The ``vocab_pad_multiple`` of a Megatron-core model whose ``GPTModel`` was given a vocabulary
    of ``padded`` rows (``GPTModel.vocab_size``; Megatron-LM pads the tokenizer's vocabulary to a
    multiple of ``make_vocab_size_divisible_by * tp``, 128 * tp by default:
    ``_vocab_size_with_padding`` in megatron/training/tokenizer/tokenizer.py): the smallest multiple
    whose ``vocab_pad_rule="megatron"`` pads ``spec``'s vocabulary to exactly ``padded`` rows at
    ``tp``, so the layout's local tensors are the model's ``VocabParallelEmbedding`` /
    output-layer tensors (``padded / tp`` rows each). 1 when ``padded`` is ``None`` or the spec has
    no vocabulary; ``ValueError`` when no multiple gives ``padded`` (fewer rows than the spec's
    vocabulary, or a count tp does not divide: Megatron's ``divide`` refuses it too).

    Example:
        >>> from realloc.spec import decoder_spec
        >>> spec = decoder_spec("m", hidden=16, intermediate=32, layers=1, heads=4, vocab=32000)
        >>> megatron_vocab_pad_multiple(spec, 32768, 8), megatron_vocab_pad_multiple(spec, 32000, 8)
        (128, 1)
    """
    vocab = [p for p in spec.params if p.pad_to_tp and p.tp_dim is not None]
    if padded is None or not vocab:
        return 1
    units = vocab[0].units
    if padded >= units and padded % tp == 0:
        per = padded // tp
        for m in range(1, per + 1):
            if per % m == 0 and vocab_units_per_rank(units, tp, m, "megatron") == per:
                return m
    raise ValueError(
        f"Megatron-core's vocabulary of {padded} rows (GPTModel vocab_size) at tp={tp} is not {spec.name}'s "
        f"{units} rows padded to a multiple of make_vocab_size_divisible_by * tp for any "
        "make_vocab_size_divisible_by: the model is not the spec's"
    )


def check_megatron_tied(spec: "ModelSpec", share: bool | None) -> None:
    """``ValueError`` unless a Megatron-core model's ``share_embeddings_and_output_weights``
    (``None``: not known) is what ``spec`` says (``tie_word_embeddings``: the lm head an alias of the
    embedding). On a last pipeline stage that is not the first, Megatron's ``output_layer.weight``
    is read as that stage's copy of the embedding when the spec ties them (Megatron keeps the two
    equal only when it ties them too: ``setup_embeddings_and_output_layer`` in
    megatron/core/models/common/language_module/language_module.py), so an untied output layer
    would be sent as embedding rows."""
    if share is None:
        return
    tied = any(spec.tied_head_of(p.name) for p in spec.params if p.role == "embed")
    if bool(share) != tied:
        raise ValueError(
            f"the Megatron-core model has share_embeddings_and_output_weights={bool(share)}, but "
            f"{spec.name} {'ties' if tied else 'does not tie'} its lm head to the embedding "
            f"(tie_word_embeddings={tied}): build the model with "
            f"share_embeddings_and_output_weights={tied} (untie_embeddings_and_output_weights="
            f"{not tied}), or give the spec of the model it trains"
        )
