"""Engines' fused tensors of a rank as views of its flat buffers: :func:`fused_views`.

Per layer ``N`` of the rank, zero-copy, next to the rank's :func:`~realloc.shards.views.shard_views`:

* ``convention="vllm"``: vLLM's ``qkv_proj`` (``[q; k; v]``), ``gate_up_proj`` (``[gate; up]``)
  and, for a layout with ``expert_order="vllm"``, its ``FusedMoE`` buffers ``w13_weight`` and
  ``w2_weight``.
* ``convention="megatron"`` (:func:`megatron_fused_views`): Megatron-core's module names, under
  the global layer prefix ``model.layers.N.`` that :func:`realloc.shards.bind.layer_name_map` maps
  from local numbering:

  * ``model.layers.N.self_attention.linear_qkv.weight`` (and ``.bias`` with q/k/v biases):
    Megatron-core's ``SelfAttention.linear_qkv`` local tensor (megatron/core/transformer/attention.py):
    for each local query group, the q rows of its heads, then its k head, then its v head. One
    view of the buffer, which exists when the layout was built with ``qkv_order="megatron"``
    (:mod:`realloc.layout.conventions`), or when the rank holds a single query group (then it is
    ``[q; k; v]`` in any order).
  * ``model.layers.N.mlp.linear_fc1.weight`` (and ``.bias`` with MLP biases): ``linear_fc1`` with
    ``gated_linear_unit`` (megatron/core/transformer/mlp.py: ``glu`` chunks the local output into
    gate and up): ``[gate; up]`` of the rank, adjacent in every layout (vLLM's ``gate_up_proj`` is
    the same rows; the biases sit after both weights, :func:`realloc.layout.conventions.fused_mlp_order`).
    The same for every ``MLP`` of a MoE layer, named by
    :func:`~realloc.layout.sharded.megatron_fused_name`: the shared experts'
    ``model.layers.N.mlp.shared_experts.linear_fc1.weight`` (``SharedExpertMLP``,
    megatron/core/transformer/moe/shared_experts.py; Qwen2-MoE's ``mlp.shared_expert``, DeepSeek's
    ``mlp.shared_experts``) and routed expert ``E``'s
    ``model.layers.N.mlp.experts.local_experts.E.linear_fc1.weight`` (``[gate; up]``; Mixtral's
    ``[w1; w3]``).

Each fused tensor is one :func:`~realloc.shards.views.fused_view` of the buffer: nothing is copied,
and a layout whose shards are not in that order gives a ``ValueError``.

Example:
    >>> from realloc import Layout, ModelSpec, Topology
    >>> from realloc.shards import allocate_buffers
    >>> rank = Layout(ModelSpec.preset("tiny"), Topology(tp=2)).at(0)
    >>> views = fused_views(rank, allocate_buffers(rank.layout, rank.rank))
    >>> qkv = views["model.layers.0.self_attn.qkv_proj.weight"]
    >>> q = views["model.layers.0.self_attn.q_proj.weight"]
    >>> qkv.data_ptr() == q.data_ptr(), qkv.shape[0] > q.shape[0]
    (True, True)
"""

from __future__ import annotations

from collections import Counter
from typing import Container, Mapping

import torch

from realloc._checks import check_choice
from realloc.layout import RankLayout
from realloc.layout.conventions import expert_projection, megatron_qkv_order, qkv_triples
from realloc.layout.sharded import megatron_fused_name
from realloc.layout.stacked import stacked_name
from realloc.layout.torchtitan import torchtitan_local_shape, torchtitan_name
from realloc.shards.store import TORCH_DTYPES
from realloc.shards.views import flat_spans, fused_view, shard_views

__all__ = [
    "FUSED_CONVENTIONS",
    "FUSED_PARTS",
    "MEGATRON_CORE_NAMES",
    "fused_views",
    "megatron_core_view",
    "megatron_fused_views",
]

#: vLLM's fused parameters of a Llama-style layer: fused suffix -> its parts, in order.
#: (``stacked_params_mapping`` of vllm/model_executor/models/llama.py.)
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.gate_up_proj.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),  # mlp_bias: MergedColumnParallelLinear's
}
#: Names ``fused_views(convention=...)`` accepts; the first is the default.
FUSED_CONVENTIONS = ("vllm", "megatron")


def fused_views(
    rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor], *, padding: bool = False, convention: str = "vllm"
) -> dict[str, torch.Tensor]:
    """:func:`shard_views` plus an engine's fused tensors of every layer the rank holds, zero-copy.

    ``convention`` (:data:`FUSED_CONVENTIONS`): ``"vllm"`` (below) or ``"megatron"``:
    Megatron-core's ``model.layers.N.self_attention.linear_qkv.weight`` (and ``.bias``) and
    ``model.layers.N.mlp.linear_fc1.weight`` (:func:`megatron_fused_views`;
    ``linear_qkv`` needs a ``Layout(qkv_order="megatron")`` unless the rank holds one query group).

    Added per layer ``N`` on the rank (vLLM keeps global layer indices):

    * ``model.layers.N.self_attn.qkv_proj.weight`` = ``[q; k; v]`` of the rank along dim 0, and
      ``...qkv_proj.bias`` when the model has q/k/v biases. vLLM's ``QKVParallelLinear``
      (vllm/model_executor/layers/linear.py) holds per tp rank its ``heads / tp`` q heads, then
      ``kv_heads / tp`` k heads and as many v heads; when ``tp >= kv_heads`` one kv head,
      ``tp_rank // (tp // kv_heads)``, replicated on ``tp / kv_heads`` ranks. Those are exactly
      the column-parallel shards of the layout (:func:`realloc.spec.decoder_spec`).
    * ``model.layers.N.mlp.gate_up_proj.weight`` = ``[gate; up]``: vLLM's
      ``MergedColumnParallelLinear`` holds the rank's gate shard then its up shard; with MLP
      biases ``...gate_up_proj.bias`` = ``[gate bias; up bias]`` likewise.

    * ``model.layers.N.mlp.experts.w13_weight`` ``[local_experts, 2 * inter / etp, hidden]`` and
      ``...experts.w2_weight`` ``[local_experts, hidden, inter / etp]`` (Mixtral:
      ``block_sparse_moe.experts.*``): vLLM's ``FusedMoE`` buffers of the rank's routed experts,
      when the layout was built with ``expert_order="vllm"`` (:mod:`realloc.layout.conventions`); a
      layout in ``"hf"`` order has no such views (its expert tensors are per expert).
    * ``model.layers.N.mlp.experts.gate_up_proj`` ``[local experts, 2 * inter / tp, hidden]`` and
      ``...experts.down_proj`` ``[local experts, hidden, inter / tp]`` (Mixtral too: transformers 5
      names its MoE block ``mlp``): transformers 5's stacked experts, when the layout was built with
      ``expert_order="hf_stacked"`` (:mod:`realloc.layout.stacked`): all experts (replicated, tp)
      or the rank's FSDP2 chunk of the expert axis, zero-size ``(0, rows, columns)`` where that
      chunk is empty (FSDP2's local tensor). A ZeRO-3 layout has no shaped views: its stacked
      ``ds_tensor`` partitions are :func:`~realloc.shards.views.flat_views`. With FSDP2 such a
      layout gets no ``qkv_proj`` / ``gate_up_proj`` views (transformers' q/k/v and gate/up are
      separate parameters, each chunked on its own).
    * ``layers.N.moe.routed_experts.inner_experts.w1_EFD`` (gates), ``w2_EDF`` (downs) and
      ``w3_EFD`` (ups): torchtitan's ``GroupedExperts`` local tensors under its EP + FSDP, for a
      layout built with ``expert_order="torchtitan"`` (:mod:`realloc.layout.torchtitan`),
      zero-size where FSDP2's chunk is empty.

    (Names and part order: ``stacked_params_mapping`` in vllm/model_executor/models/llama.py.)
    The parts stay in the result too, so one dict serves both conventions.

    Each fused tensor is a single view of the flat buffer spanning its parts, which exists
    because ``Layout`` places a stage's slots in forward order (q, k, v adjacent; gate, up
    adjacent) in one buffer per dtype. That is verified from the shard table (same dtype,
    ``buffer_offset`` contiguous, same trailing dims, no padding); ``ValueError`` if it does not
    hold (a fused tensor is never silently copied). Layers holding none of a fused tensor's parts
    (a model that is not Llama-style, no q/k/v bias) get no fused tensor; holding only some of
    them is a ``ValueError``.
    """
    check_choice("convention", convention, FUSED_CONVENTIONS)
    if convention == "megatron":
        return megatron_fused_views(rank_layout, buffers, padding=padding)
    if rank_layout.layout.fused_sharded:
        raise ValueError(
            f"{rank_layout}: the fsdp ranks hold chunks of Megatron's fused linear_qkv / linear_fc1 "
            "(qkv_order='megatron' with fsdp), not vLLM's qkv_proj / gate_up_proj; use convention='megatron'"
        )
    views = shard_views(rank_layout, buffers, padding=padding)
    by_slot = {s.slot: s for s in rank_layout.shards()}
    several = sorted(slot for slot, n in Counter(s.slot for s in rank_layout.shards()).items() if n > 1)
    if several:
        raise ValueError(
            f"{rank_layout}: vLLM's fused views need one shard per slot, but {several[0]} is held as "
            f"several (qkv_order={rank_layout.layout.qkv_order!r}); use convention='megatron' (Megatron's "
            "linear_qkv / linear_fc1 and the layout's expert views)"
        )
    spec_names = rank_layout.layout.spec.by_name
    layers = rank_layout.layout.stages[rank_layout.layout.topology.coords(rank_layout.rank)[2]]
    if rank_layout.layout.expert_order in ("hf_stacked", "torchtitan") and rank_layout.layout.topology.fsdp > 1:
        layers = []  # FSDP2 of transformers / torchtitan: q/k/v and gate/up are separate chunked tensors
    for layer in layers:
        prefix = f"model.layers.{layer}."
        for fused, parts in FUSED_PARTS.items():
            name = prefix + fused
            shards = [by_slot.get(prefix + part) for part in parts]
            in_model = [prefix + part in spec_names for part in parts]
            if all(s is None for s in shards) or (
                fused.startswith("self_attn.qkv") and in_model == [True, False, False]
            ):
                continue  # no such fused tensor in the model (DeepSeek MLA's q_proj has no k/v)
            if any(s is None for s in shards):
                missing = [prefix + p for p, s in zip(parts, shards) if s is None]
                raise ValueError(
                    f"{rank_layout}: cannot build {name}: the rank holds some of its parts but not {missing}"
                )
            views[name] = fused_view(name, shards, buffers, rank_layout)
    return views | _expert_order_views(rank_layout, buffers)


def _expert_order_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stacked expert views of the layout's ``expert_order`` (none for ``"hf"``): the same in
    either convention, since the attention's order does not change where the experts sit."""
    order = rank_layout.layout.expert_order
    if order == "vllm":
        return _expert_views(rank_layout, buffers, _vllm_expert_name)
    if order == "hf_stacked":
        return _stacked_expert_views(rank_layout, buffers)
    if order == "torchtitan":
        return _torchtitan_expert_views(rank_layout, buffers)
    return {}


def _vllm_expert_name(p) -> str:
    """vLLM's ``FusedMoE`` buffer routed expert weight ``p`` is part of (checkpoint module prefix);
    a block-FP8 weight's scales are ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``."""
    name = ".experts.w2_weight" if expert_projection(p) == 2 else ".experts.w13_weight"
    return p.name.split(".experts.")[0] + name + ("_scale_inv" if p.name.endswith("_scale_inv") else "")


def _expert_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor], name_of) -> dict[str, torch.Tensor]:
    """The rank's routed experts of every MoE layer as stacked tensors ``[local experts, rows,
    columns]``, one view each, named ``name_of(param spec)``: vLLM's ``w13_weight`` / ``w2_weight``
    or transformers 5's ``gate_up_proj`` / ``down_proj`` (per expert its gate then its up rows)."""
    spec = rank_layout.layout.spec
    stacks: dict[str, list] = {}
    for shard in rank_layout.shards():
        p = spec.by_name[shard.param]
        if p.expert is not None:
            stacks.setdefault(name_of(p), []).append(((p.expert, expert_projection(p, "hf_stacked")), shard))
    views = {}
    for name, parts in stacks.items():
        shards = [shard for _, shard in sorted(parts, key=lambda x: x[0])]
        experts, kinds = len({key[0] for key, _ in parts}), len({key[1] for key, _ in parts})
        if len(shards) != experts * kinds:
            raise ValueError(
                f"{rank_layout}: cannot build {name}: the rank holds {len(shards)} shards of {experts} experts "
                f"({kinds} tensor(s) of each are needed)"
            )
        flat = fused_view(name, shards, buffers, rank_layout)
        views[name] = flat.view((experts, flat.shape[0] // experts) + tuple(flat.shape[1:]))
    return views


def _sharded_fused_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FSDP2's local chunks of Megatron's fused ``linear_qkv`` / ``linear_fc1`` parameters of a
    ``qkv_order="megatron"`` layout with fsdp (``Layout.fused_sharded``): per fused parameter of the
    stage, ONE view of the rank's consecutive shards of it, ``[chunk rows, trailing dims]``, or FSDP2's
    empty local tensor (0 rows) where its chunk is empty."""
    layout = rank_layout.layout
    spans = flat_spans(rank_layout)
    device = next((b.device for b in buffers.values()), torch.device("cpu"))
    views: dict[str, torch.Tensor] = {}
    for storage, slot in layout.stage_slots(layout.topology.coords(rank_layout.rank)[2]):
        name = megatron_fused_name(slot, layout.expert_order == "hf")
        if name is None or name in views:
            continue
        p = layout.spec.by_name[storage]
        trailing = tuple(p.shape[1:])
        if name in spans:
            dtype, start, stop = spans[name]
            views[name] = buffers[dtype][start:stop].view((-1,) + trailing)
        else:
            views[name] = torch.empty((0,) + trailing, dtype=TORCH_DTYPES[p.dtype], device=device)
    return views


def _torchtitan_expert_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's ``layers.N.moe.routed_experts.inner_experts.w1_EFD`` / ``w2_EDF`` / ``w3_EFD`` of
    every MoE layer of the rank (:mod:`realloc.layout.torchtitan`), zero-size where FSDP2's chunk is."""
    views = _expert_views(rank_layout, buffers, torchtitan_name)
    layout = rank_layout.layout
    _, fsdp_rank, tp_rank, pp_rank = layout.topology.coords4(rank_layout.rank)
    device = next((b.device for b in buffers.values()), torch.device("cpu"))
    for p in layout.spec.params:
        if p.expert == 0 and p.layer in layout.stages[pp_rank] and torchtitan_name(p) not in views:
            shape = torchtitan_local_shape(p.shape, layout.topology, layout.num_experts, tp_rank, fsdp_rank)
            views[torchtitan_name(p)] = torch.empty(shape, dtype=TORCH_DTYPES[p.dtype], device=device)
    return views


def _stacked_expert_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's ``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj`` of every MoE
    layer of the rank (:mod:`realloc.layout.stacked`); where FSDP2's chunk of the expert axis is
    empty, a zero-size tensor of FSDP2's local shape ``(0, rows, columns)``."""
    views = _expert_views(rank_layout, buffers, stacked_name)
    layout = rank_layout.layout
    _, _, tp_rank, pp_rank = layout.topology.coords4(rank_layout.rank)
    device = next((b.device for b in buffers.values()), torch.device("cpu"))
    first: dict[str, list] = {}  # stacked name -> the tp-local shapes of expert 0's tensors
    for p in layout.spec.params:
        if p.expert == 0 and p.layer in layout.stages[pp_rank]:
            shape = list(p.shape)
            if p.tp_dim is not None:
                start, stop, _ = p.tp_range(layout.topology.tp, tp_rank)
                shape[p.tp_dim] = stop - start
            first.setdefault(stacked_name(p), []).append((p.dtype, shape))
    out = {}
    for name, parts in first.items():
        if name in views:
            out[name] = views[name]
            continue
        rows = sum(shape[0] for _, shape in parts)
        out[name] = torch.empty((0, rows, *parts[0][1][1:]), dtype=TORCH_DTYPES[parts[0][0]], device=device)
    return out


def megatron_fused_views(
    rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor], *, padding: bool = False
) -> dict[str, torch.Tensor]:
    """:func:`~realloc.shards.views.shard_views` plus Megatron-core's ``linear_qkv`` and ``linear_fc1``
    views of every layer the rank holds (``linear_fc1``: of the dense MLP, the shared experts and
    each routed expert; see the module's docstring)."""
    views = shard_views(rank_layout, buffers, padding=padding) | _expert_order_views(rank_layout, buffers)
    layout = rank_layout.layout
    if layout.fused_sharded:
        return views | _sharded_fused_views(rank_layout, buffers)
    spec, tp = layout.spec, layout.topology.tp
    _, _, tp_rank, pp_rank = layout.topology.coords4(rank_layout.rank)
    held = rank_layout.shards()
    by_slot: dict[str, list] = {}
    for shard in held:
        by_slot.setdefault(shard.slot, []).append(shard)
    for q, k, v in qkv_triples(spec, strict=False):  # DeepSeek MLA has no linear_qkv
        if q.layer is None or q.layer not in layout.stages[pp_rank]:
            continue
        boxes = []
        for p in (q, k, v):
            start, stop, _ = p.tp_range(tp, tp_rank)
            offsets, sizes = [0] * len(p.shape), list(p.shape)
            offsets[0], sizes[0] = start, stop - start
            boxes.append((p, p.name, p.name, offsets, sizes, list(sizes)))
        wanted = [(e[2], tuple(e[3]), tuple(e[4])) for e in megatron_qkv_order(boxes, tp)]
        shards = sorted((s for p in (q, k, v) for s in by_slot.get(p.name, ())), key=lambda s: s.buffer_offset)
        name = f"model.layers.{q.layer}.self_attention.linear_qkv.{q.name.rsplit('.', 1)[1]}"
        if [(s.slot, s.offsets, s.sizes) for s in shards] != wanted:
            raise ValueError(
                f"{rank_layout}: {name} cannot be one view: the rank's q/k/v shards are not in "
                f"Megatron's linear_qkv order (per query group: q heads, k, v); build the layout "
                f"with qkv_order='megatron' (it has qkv_order={layout.qkv_order!r})"
            )
        views[name] = fused_view(name, shards, buffers, rank_layout)
    # linear_fc1 = [gate; up] of every dense MLP, of the shared experts (SharedExpertMLP,
    # megatron/core/transformer/moe/shared_experts.py) and of every routed expert the rank holds
    # (SequentialMLP's local_experts.N.linear_fc1, megatron/core/transformer/moe/experts.py)
    fc1 = sorted(
        {
            (slot[: -len(f"{gate}.weight")], gate, up)
            for slot in by_slot
            for gate, up in _FC1_PARTS
            if slot.endswith(f".{gate}.weight")
        }
    )
    for prefix, gate, up in fc1:
        for suffix in ("weight", "bias"):  # linear_fc1.bias with mlp_bias
            parts = [by_slot.get(f"{prefix}{part}.{suffix}", []) for part in (gate, up)]
            if not any(parts):
                continue
            name = megatron_fused_name(f"{prefix}{gate}.{suffix}")
            if name is None:  # not a gate Megatron fuses
                continue
            if [len(p) for p in parts] != [1, 1]:
                raise ValueError(
                    f"{rank_layout}: cannot build {name}: the rank holds {len(parts[0])} gate and "
                    f"{len(parts[1])} up shards, one of each is needed"
                )
            views[name] = fused_view(name, [parts[0][0], parts[1][0]], buffers, rank_layout)
    return views


#: The gate and up projections Megatron's ``linear_fc1`` fuses, ``[gate; up]`` (the ``glu`` of
#: megatron/core/transformer/mlp.py chunks the local output in two, the first half gated): the
#: checkpoints' ``gate_proj``/``up_proj`` and Mixtral's routed experts' ``w1``/``w3``.
_FC1_PARTS = (("gate_proj", "up_proj"), ("w1", "w3"))

#: Megatron-core ``GPTModel`` parameter names -> the names :func:`megatron_fused_views` gives
#: (dense and MoE decoder layers; a routed expert's index is the model's, which the caller
#: makes of Megatron's rank-local ``local_experts`` index). Followed: megatron/core/models/gpt/gpt_model.py (``embedding``,
#: ``decoder``, ``output_layer``), megatron/core/models/gpt/gpt_layer_specs.py
#: (``get_gpt_layer_local_spec``: ``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm``/
#: ``k_layernorm``; ``get_gpt_layer_with_transformer_engine_spec``: the norms fused into the next
#: linear as ``layer_norm_weight``), megatron/core/transformer/attention.py (``linear_qkv``,
#: ``linear_proj``), megatron/core/transformer/mlp.py (``linear_fc1``, ``linear_fc2``),
#: megatron/core/transformer/moe/moe_layer.py (``router``, ``shared_experts``), moe/experts.py
#: (``SequentialMLP``'s ``local_experts.N``: one MLP per expert; ``TEGroupedMLP``'s ``weightN`` are
#: not mapped) and moe/shared_experts.py (``SharedExpertMLP``: an ``MLP`` of
#: ``moe_shared_expert_intermediate_size``, tensor parallel in the dense tp group, without biases,
#: and with ``moe_shared_expert_gate`` its ``gate_weight`` ``[1, hidden]``, replicated, whose sigmoid
#: scales the shared experts' output: Qwen2-MoE's ``shared_expert_gate``).
#:
#: A pattern listed more than once names a tensor the checkpoints of the families spell
#: differently; the spec has one of them (:func:`megatron_core_view`'s ``held``): the router is
#: ``mlp.gate`` (Mixtral ``block_sparse_moe.gate``), a routed expert's ``linear_fc2`` its
#: ``down_proj`` (Mixtral ``w2``), the shared experts' ``linear_fc2`` DeepSeek's
#: ``mlp.shared_experts.down_proj`` or Qwen2-MoE's ``mlp.shared_expert.down_proj``.
#: ``linear_fc1`` views are named by :func:`~realloc.layout.sharded.megatron_fused_name` in every
#: family. DeepSeek's multi-latent attention (``linear_q_down_proj``, ``linear_kv_up_proj``, ...)
#: is not mapped.
MEGATRON_CORE_NAMES: tuple[tuple[str, str], ...] = (
    (r"embedding\.word_embeddings\.weight", r"model.embed_tokens.weight"),
    (r"decoder\.layers\.(\d+)\.input_layernorm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (
        r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.layer_norm_weight",
        r"model.layers.\1.input_layernorm.weight",
    ),
    (
        r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.(weight|bias)",
        r"model.layers.\1.self_attention.linear_qkv.\2",
    ),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"decoder\.layers\.(\d+)\.self_attention\.q_layernorm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"decoder\.layers\.(\d+)\.self_attention\.k_layernorm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"decoder\.layers\.(\d+)\.pre_mlp_layernorm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.layer_norm_weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.(weight|bias)", r"model.layers.\1.mlp.linear_fc1.\2"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2\.(weight|bias)", r"model.layers.\1.mlp.down_proj.\2"),
    (r"decoder\.layers\.(\d+)\.mlp\.router\.weight", r"model.layers.\1.mlp.gate.weight"),
    (r"decoder\.layers\.(\d+)\.mlp\.router\.weight", r"model.layers.\1.block_sparse_moe.gate.weight"),
    (
        r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.(weight|bias)",
        r"model.layers.\1.mlp.experts.local_experts.\2.linear_fc1.\3",
    ),
    (
        r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.(weight|bias)",
        r"model.layers.\1.mlp.experts.\2.down_proj.\3",
    ),
    (
        r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.(weight|bias)",
        r"model.layers.\1.block_sparse_moe.experts.\2.w2.\3",
    ),
    (
        r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.linear_fc1\.weight",
        r"model.layers.\1.mlp.shared_experts.linear_fc1.weight",
    ),
    (
        r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.linear_fc2\.weight",
        r"model.layers.\1.mlp.shared_experts.down_proj.weight",
    ),
    (
        r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.linear_fc2\.weight",
        r"model.layers.\1.mlp.shared_expert.down_proj.weight",
    ),
    (r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.gate_weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
    (r"decoder\.final_layernorm\.weight", r"model.norm.weight"),
    (r"output_layer\.weight", r"lm_head.weight"),
)


def megatron_core_view(name: str, held: Container[str] | None = None) -> str | None:
    """The :func:`megatron_fused_views` name of Megatron-core ``GPTModel`` parameter ``name``
    (:data:`MEGATRON_CORE_NAMES`; None: not a decoder's this maps). Where the families name it
    differently, the first of their names that ``held`` (the rank's views) has; the first listed
    when none is held, or ``held`` is None.

    Example:
        >>> megatron_core_view("decoder.layers.3.self_attention.linear_qkv.weight")
        'model.layers.3.self_attention.linear_qkv.weight'
        >>> megatron_core_view("decoder.layers.0.mlp.linear_fc2.weight"), megatron_core_view("output_layer.weight")
        ('model.layers.0.mlp.down_proj.weight', 'lm_head.weight')
        >>> megatron_core_view("decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight")
        'model.layers.1.mlp.experts.local_experts.5.linear_fc1.weight'
        >>> megatron_core_view("decoder.layers.2.mlp.router.weight", {"model.layers.2.block_sparse_moe.gate.weight"})
        'model.layers.2.block_sparse_moe.gate.weight'
        >>> megatron_core_view("decoder.layers.0.mlp.shared_experts.linear_fc2.weight", {"model.layers.0.mlp.shared_expert.down_proj.weight"})
        'model.layers.0.mlp.shared_expert.down_proj.weight'
        >>> megatron_core_view("decoder.layers.0.mlp.experts.linear_fc1.weight0") is None
        True
    """
    import re

    found = [m.expand(target) for pattern, target in MEGATRON_CORE_NAMES if (m := re.fullmatch(pattern, name))]
    if not found:
        return None
    return next((t for t in found if held is not None and t in held), found[0])
