"""What user code sees on a worker: the shard context (the record of a shard change it is told
of, :class:`~actors.records.ShardChange`, crosses the Ray boundary: it is in actors/records.py).

User code runs on the workers in three ways: ``group.run(fn)`` calls ``fn(ctx, ...)``;
``group.call("method")`` calls a method of the user's worker subclass, which reads
``self.context()``; and the worker's ``on_shards_changed(ctx, change)`` hook runs after every
committed change of its shards. All three get a :class:`ShardContext`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from actors.worker.parallel import ParallelGroups
from realloc.layout import Layout, RankLayout, Topology
from realloc.shards import BindReport, bind_module, fused_views, shard_views


@dataclass
class ShardContext:
    """One worker's view of its shards in the current layout.

    ``tensors`` maps slot names (``model.layers.3.mlp.up_proj.weight``, ``lm_head.weight``) to the
    worker's local shards, padding included; writing into them updates the worker's weights. (A
    ZeRO-3 layout, ``fsdp_split="zero3"``: each slot's 1-D flat partition, :func:`realloc.shards.views.flat_views`;
    ``qkv_order="megatron"`` with FSDP2: Megatron's fused ``linear_qkv`` / ``linear_fc1`` chunks in
    place of q/k/v/gate/up, :func:`realloc.shards.fused.fused_views` with ``convention="megatron"``.)
    ``layout`` is the group's layout value, ``shards`` the rank's shards (global offsets) and
    ``groups`` the dp/fsdp/tp/pp process groups of this rank of the layout
    (:class:`~actors.worker.parallel.ParallelGroups`). ``version`` is the weight version these tensors
    hold (record it with every token generated). Everything here is valid until the next change
    (which :meth:`safe_point` may bring: it updates this context in place).
    """

    rank: int
    topology: Topology
    dp_rank: int
    tp_rank: int
    pp_rank: int
    device: torch.device
    tensors: dict[str, torch.Tensor]
    shards: tuple
    layout: Layout | None = None
    groups: ParallelGroups | None = None
    rank_layout: RankLayout | None = None
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False)
    fsdp_rank: int = 0
    version: int = 0
    on_safe_point: "Callable[[ShardContext], bool] | None" = field(default=None, repr=False)

    def safe_point(self) -> bool:
        """Call between two decode steps of a long call: a staged update committed with
        ``commit(at="safe_point")`` switches in here, at the same step on every rank of this
        model replica (they agree over the replica's group, so every rank of the replica must
        call it the same number of times). Then ``on_shards_changed`` has run, this context holds
        the new tensors and ``version``, and it returns True. Outside staged updates it returns
        False after one small all-reduce over the replica (none when the replica is one rank)."""
        return self.on_safe_point(self) if self.on_safe_point is not None else False

    def views(self, *, padding: bool = False) -> dict[str, torch.Tensor]:
        """Slot name -> view of the rank's shard: the real box only (vocabulary padding
        invisible), or with ``padding=True`` the padded local tensor engines like Megatron hold."""
        return shard_views(self.rank_layout, self.buffers, padding=padding)

    def fused_views(self, convention: str = "vllm") -> dict[str, torch.Tensor]:
        """:meth:`views` plus vLLM's fused ``qkv_proj`` and ``gate_up_proj`` of every layer
        (``convention="megatron"``: Megatron-core's ``linear_qkv`` and ``linear_fc1``), as views
        spanning the parts (no copies)."""
        return fused_views(self.rank_layout, self.buffers, convention=convention)

    def bind(
        self,
        module: torch.nn.Module,
        *,
        fused: bool = False,
        name_map: "Mapping[str, str] | Callable[[str], str | None] | None" = None,
        strict: bool = True,
    ) -> BindReport:
        """Make ``module``'s parameters the rank's shard tensors (no copies; same Parameter
        objects, so an optimizer keeps its state). Names are HF slot names unless ``name_map``
        says otherwise; ``fused=True`` offers vLLM's fused views too."""
        return bind_module(module, self.fused_views() if fused else self.views(), name_map=name_map, strict=strict)
