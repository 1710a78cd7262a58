"""Megatron-core's fused tensors of a rank as views of its flat buffers (``fused_views(convention="megatron")``).

Per layer ``N`` the rank holds (Megatron's module names, under the global layer prefix
``model.layers.N.`` that :func:`realloc.binding.layer_name_map` maps from local numbering):

* ``model.layers.N.self_attention.linear_qkv.weight`` (and ``.bias`` with q/k/v biases):
  Megatron-core's ``SelfAttention.linear_qkv`` local tensor (megatron/core/transformer/attention.py):
  for each local query group, the q rows of its heads, then its k head, then its v head. One view
  of the buffer, which exists when the layout was built with ``qkv_order="megatron"``
  (:mod:`realloc.conventions`), or when the rank holds a single query group (then it is
  ``[q; k; v]`` in any order).
* ``model.layers.N.mlp.linear_fc1.weight``: ``linear_fc1`` with ``gated_linear_unit``
  (megatron/core/transformer/mlp.py: ``glu`` chunks the local output into gate and up):
  ``[gate; up]`` of the rank, adjacent in every layout (vLLM's ``gate_up_proj`` is the same rows).

Nothing is copied: a layout whose shards are not in that order gives a ``ValueError``.
"""

from __future__ import annotations

from typing import Mapping

import torch

from realloc.binding import _fused_view, shard_views
from realloc.conventions import megatron_qkv_order, qkv_triples
from realloc.layout import RankLayout

__all__ = ["megatron_fused_views"]


def megatron_fused_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor], *,
                         padding: bool = False) -> dict[str, torch.Tensor]:
    """:func:`realloc.binding.shard_views` plus Megatron-core's ``linear_qkv`` and ``linear_fc1``
    views of every layer the rank holds."""
    views = shard_views(rank_layout, buffers, padding=padding)
    layout = rank_layout.layout
    spec, tp = layout.spec, layout.topology.tp
    _, _, tp_rank, pp_rank = layout.topology.coords4(rank_layout.rank)
    held = rank_layout.shards()
    by_slot: dict[str, list] = {}
    for shard in held:
        by_slot.setdefault(shard.slot, []).append(shard)
    for q, k, v in qkv_triples(spec):
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
            raise ValueError(f"{rank_layout}: {name} cannot be one view: the rank's q/k/v shards are not in "
                             f"Megatron's linear_qkv order (per query group: q heads, k, v); build the layout "
                             f"with qkv_order='megatron' (it has qkv_order={layout.qkv_order!r})")
        views[name] = _fused_view(name, shards, buffers, rank_layout)
    for layer in layout.stages[pp_rank]:
        prefix = f"model.layers.{layer}.mlp."
        parts = [by_slot.get(prefix + part, []) for part in ("gate_proj.weight", "up_proj.weight")]
        if not any(parts):
            continue
        name = prefix + "linear_fc1.weight"
        if [len(p) for p in parts] != [1, 1]:
            raise ValueError(f"{rank_layout}: cannot build {name}: the rank holds {len(parts[0])} gate and "
                             f"{len(parts[1])} up shards, one of each is needed")
        views[name] = _fused_view(name, [parts[0][0], parts[1][0]], buffers, rank_layout)
    return views
