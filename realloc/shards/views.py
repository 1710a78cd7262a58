"""A rank's shards as tensor views of its flat buffers, never copies.

A worker keeps its weights in one flat buffer per dtype (:mod:`realloc.layout`); every shard is
a contiguous ``local_shape`` tensor at ``buffer_offset`` in the buffer of its dtype.

* :func:`shard_views`: slot name (HF names: ``model.layers.3.self_attn.q_proj.weight``,
  ``lm_head.weight``) -> view of the real box (``padding=False``) or of the padded local tensor
  (``padding=True``, what Megatron's and vLLM's vocab-parallel embeddings hold).
* :func:`flat_views`: slot name -> the rank's 1-D flat partition of it (DeepSpeed ZeRO-3's
  ``ds_tensor`` for a ``fsdp_split="zero3"`` layout).
* :func:`fused_view`: ONE view spanning a fused tensor's parts in the buffer, on which
  :func:`realloc.shards.fused.fused_views` builds vLLM's and Megatron-core's fused tensors.
* :func:`check_buffers`: what every one of them checks first.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping

import torch

from realloc.layout import RankLayout, Shard
from realloc.layout.sharded import megatron_fused_name
from realloc.layout.stacked import stacked_name
from realloc.shards.store import TORCH_DTYPES, local_tensor

__all__ = ["check_buffers", "flat_spans", "flat_views", "fused_view", "shard_views"]


def check_buffers(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor]) -> None:
    """``ValueError`` unless ``buffers`` are the rank's flat buffers: one per dtype of the layout,
    of that dtype, 1-D and contiguous, at least as long as the layout needs."""
    if not isinstance(rank_layout, RankLayout):
        raise ValueError(f"expected a realloc RankLayout (layout.at(rank)), got {type(rank_layout).__name__}")
    for dtype, numel in rank_layout.buffer_numels().items():
        if not isinstance(buffers, Mapping):
            raise ValueError(f"buffers must map dtype name -> flat tensor, got {type(buffers).__name__}")
        buf = buffers.get(dtype)
        if not isinstance(buf, torch.Tensor):
            raise ValueError(f"{rank_layout}: no {dtype} buffer (buffers hold {sorted(buffers)})")
        if buf.dtype != TORCH_DTYPES[dtype]:
            raise ValueError(f"{rank_layout}: the {dtype} buffer has dtype {buf.dtype}")
        if buf.dim() != 1 or (buf.numel() > 1 and buf.stride(0) != 1):
            raise ValueError(
                f"{rank_layout}: the {dtype} buffer must be a flat contiguous tensor, "
                f"got shape {tuple(buf.shape)} strides {buf.stride()}"
            )
        if buf.numel() < numel:
            raise ValueError(
                f"{rank_layout}: the {dtype} buffer holds {buf.numel()} elements, the layout needs {numel}"
            )


def shard_views(
    rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor], *, padding: bool = False
) -> dict[str, torch.Tensor]:
    """Slot name -> view of that shard in ``buffers`` (no copy), in the rank's forward order.

    ``padding=False``: the real box only (``local.narrow(dim, 0, size)`` along a padded dim), so
    the vocabulary padding is invisible and the shapes are those of the global tensor's slice.
    ``padding=True``: the whole local tensor, padding rows included (Megatron's
    ``VocabParallelEmbedding`` / vLLM's ``VocabParallelEmbedding``/``ParallelLMHead`` hold it
    padded; choose the layout's ``vocab_pad_multiple`` and ``vocab_pad_rule`` to match the engine).

    A slot held as several shards (q/k/v under ``Layout(qkv_order="megatron")``: one per query
    group) is no single tensor and has no view here; ``fused_views(..., convention="megatron")``
    gives the ``linear_qkv`` tensor they make up. Under ``qkv_order="megatron"`` with fsdp the
    engine parameters are Megatron's fused ``linear_qkv`` / ``linear_fc1`` chunks, so q/k/v/gate/up
    have no view here at all (``fused_views(..., convention="megatron")`` gives the chunks).

    Sharded data parallelism (FSDP2): a slot whose chunk is empty on this rank (no shard in the
    layout) gets an empty tensor of FSDP2's shape there, 0 rows and the tp box's other dims, so a
    module built from the rank's FSDP2 local tensors binds with ``strict=True``. A ZeRO-3 layout
    (``fsdp_split="zero3"``) holds slots as flat partitions, not tensors of the slot's shape:
    ``ValueError`` pointing to :func:`flat_views`.

    ``ValueError`` when a buffer is missing, of another dtype, not flat or too small.
    """
    check_buffers(rank_layout, buffers)
    topology = rank_layout.layout.topology
    if topology.fsdp_split == "zero3":  # (fsdp == 1 always reads "fsdp2")
        raise ValueError(
            f"{rank_layout}: a zero3 layout holds each slot as a flat partition (up to three boxes "
            "of it, padded), not as a tensor of the slot's shape; bind the flat partitions "
            "(DeepSpeed's ds_tensor) with realloc.shards.views.flat_views(rank_layout, buffers)"
        )
    views = {}
    pieces = Counter(s.slot for s in rank_layout.shards())
    fused = rank_layout.layout.fused_sharded  # parts of Megatron's fused parameters: no view of their own
    routed = rank_layout.layout.expert_order == "hf"  # routed experts' linear_fc1 per expert (else stacked)
    for shard in rank_layout.shards():
        if pieces[shard.slot] > 1 or (fused and megatron_fused_name(shard.slot, routed)):
            continue
        local = local_tensor(shard, buffers)
        if not padding:
            for dim, (size, full) in enumerate(zip(shard.sizes, shard.local_shape)):
                if size != full:
                    local = local.narrow(dim, 0, size)
        views[shard.slot] = local
    if topology.fsdp > 1 and (
        fused or len(views) < len(rank_layout.layout.stage_slots(topology.coords(rank_layout.rank)[2]))
    ):
        views = _with_empty_chunks(rank_layout, buffers, views)
    return views


def _with_empty_chunks(
    rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor], views: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``views`` plus a 0-row tensor for every slot of the stage whose FSDP2 chunk is empty here
    (FSDP2's ``_get_dim_chunked_size``: the chunk's size with 0 along dim 0), in forward order."""
    _, _, tp_rank, pp_rank = rank_layout.layout.topology.coords4(rank_layout.rank)
    # the tp boxes FSDP2 chunks (a tp rank may hold no vocabulary rows at all: then no fsdp rank does)
    tp_boxes = {entry[2]: entry for entry in rank_layout.layout.tp_boxes(tp_rank, pp_rank)}
    device = next((b.device for b in buffers.values()), torch.device("cpu"))
    fused = rank_layout.layout.fused_sharded
    # experts stacked (transformers' gate_up_proj, torchtitan's w1/w2/w3: fused_views) are not per-expert chunks
    stacked = rank_layout.layout.expert_order == "hf_stacked" or rank_layout.layout.topology.torchtitan_experts
    by_name = rank_layout.layout.spec.by_name
    out = {}
    for name, slot in rank_layout.layout.stage_slots(pp_rank):
        if fused and megatron_fused_name(slot, rank_layout.layout.expert_order == "hf"):
            continue  # a part of linear_qkv / linear_fc1: realloc.shards.fused.fused_views
        if slot in views:
            out[slot] = views[slot]
        elif stacked and by_name[name].expert is not None:
            continue  # an expert of another rank's chunk of the stack
        else:
            p, _, _, _, sizes, _ = tp_boxes[slot]
            out[slot] = torch.empty((0,) + tuple(sizes[1:]), dtype=TORCH_DTYPES[p.dtype], device=device)
    return out


def flat_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Slot name -> the rank's flat partition of that slot: ONE 1-D view of its dtype's buffer
    spanning the slot's shards, padding included (no copy), in forward order.

    For a zero3 layout this is DeepSpeed's ``ds_tensor``: ``partition_size`` elements on every rank,
    the real ones first (what :func:`shard_views` refuses to give as shaped tensors). For other
    layouts it is each local tensor flattened (FSDP2's empty chunks absent). Under
    ``qkv_order="megatron"`` with fsdp (``Layout.fused_sharded``) the engine parameters are
    Megatron's fused ones: ``model.layers.N.self_attention.linear_qkv.{weight,bias}`` and
    ``model.layers.N.mlp.linear_fc1.{weight,bias}`` replace q/k/v/gate/up (:func:`flat_spans`). A
    zero3 layout with ``expert_order="hf_stacked"`` gives each MoE layer's routed experts as
    transformers 5's stacked ``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj`` partitions
    (their ``ds_tensor``) instead of per-expert slots (:mod:`realloc.layout.stacked`). ``ValueError``
    for buffers :func:`shard_views` refuses too.

    Example:
        >>> from realloc import Layout, ModelSpec, Topology
        >>> from realloc.shards import allocate_buffers
        >>> rank = Layout(ModelSpec.preset("tiny"), Topology(fsdp=8, fsdp_split="zero3")).at(7)
        >>> views = flat_views(rank, allocate_buffers(rank.layout, 7))
        >>> views["model.embed_tokens.weight"].shape, views["model.norm.weight"].shape
        (torch.Size([12012]), torch.Size([12]))
    """
    check_buffers(rank_layout, buffers)
    return {name: buffers[dtype][start:stop] for name, (dtype, start, stop) in flat_spans(rank_layout).items()}


def flat_spans(rank_layout: RankLayout) -> dict[str, tuple[str, int, int]]:
    """Engine parameter name -> ``(dtype, start, stop)`` of its consecutive shards in the rank's buffer:
    slot names, and for a layout whose fsdp ranks cut Megatron's fused parameters
    (``Layout.fused_sharded``) their names (``...self_attention.linear_qkv.weight``,
    ``...mlp.linear_fc1.weight``) in place of q/k/v/gate/up, and for a zero3 layout of stacked
    experts the stacked names. ``ValueError`` if not consecutive."""
    layout = rank_layout.layout
    fused = layout.fused_sharded
    stacked = layout.expert_order == "hf_stacked" and layout.topology.fsdp_split == "zero3"
    spans: dict[str, list] = {}
    for s in rank_layout.shards():
        p = layout.spec.by_name[s.param]
        if stacked and p.expert is not None:
            name = stacked_name(p)  # ZeRO-3's stacked ds_tensor
        else:
            name = (fused and megatron_fused_name(s.slot, layout.expert_order == "hf")) or s.slot
        span = spans.setdefault(name, [s.dtype, s.buffer_offset, s.buffer_offset])
        if span[2] != s.buffer_offset or span[0] != s.dtype:
            raise ValueError(f"{rank_layout}: the shards of {name} are not consecutive in one buffer")
        span[2] += s.local_numel
    return {name: tuple(span) for name, span in spans.items()}


def fused_view(
    name: str, parts: list[Shard], buffers: Mapping[str, torch.Tensor], rank_layout: RankLayout
) -> torch.Tensor:
    """ONE view of ``buffers`` spanning ``parts`` (a fused tensor's shards, in order) along dim 0;
    ``ValueError`` naming ``name`` when they are not adjacent, alike and unpadded (never a copy)."""
    first = parts[0]
    for prev, shard in zip(parts, parts[1:]):
        problem = None
        if shard.dtype != first.dtype:
            problem = f"{shard.slot} is {shard.dtype}, {first.slot} is {first.dtype}"
        elif shard.local_shape[1:] != first.local_shape[1:]:
            problem = f"{shard.slot} has trailing dims {shard.local_shape[1:]}, {first.slot} {first.local_shape[1:]}"
        elif shard.buffer_offset != prev.buffer_offset + prev.local_numel:
            problem = (
                f"{shard.slot} starts at element {shard.buffer_offset} of the {shard.dtype} buffer, "
                f"not right after {prev.slot} (ends at {prev.buffer_offset + prev.local_numel})"
            )
        if problem:
            raise ValueError(f"{rank_layout}: {name} cannot be one view of the buffer ({problem}); refusing to copy")
    for shard in parts:
        if shard.sizes != shard.local_shape:
            raise ValueError(
                f"{rank_layout}: {name} cannot be one view: {shard.slot} is padded "
                f"(box {shard.sizes} in local {shard.local_shape}); refusing to copy"
            )
    rows = sum(s.local_shape[0] for s in parts)
    numel = sum(s.local_numel for s in parts)
    flat = buffers[first.dtype]
    return flat[first.buffer_offset : first.buffer_offset + numel].view((rows,) + tuple(first.local_shape[1:]))
