"""Layouts: which boxes of which parameters every rank holds, and where they sit in its buffers.

A box is a hyper-rectangle of a parameter's global tensor: ``offsets`` and ``sizes`` per dim
(as torch.distributed.checkpoint's chunks). Every rank keeps one flat buffer per dtype; each
shard is a contiguous ``local_shape`` tensor at ``buffer_offset`` in the buffer of its dtype.
The box sits at the origin of the local tensor; the local tensor can be larger than the box
(vocabulary padding), the rest being zeros that are never part of the global tensor.

Ranks of different dp replicas hold identical shards, so shards are computed once per
``(fsdp_rank, tp_rank, pp_rank)`` coordinate: a 16,384-rank layout costs what a 64-coordinate one does.

Sharded data parallelism (``Topology.fsdp > 1``, FSDP2 / HSDP): a parameter's box on a rank is
its tp box further cut along dim 0 as ``torch.chunk(tp_local, fsdp, dim=0)`` does: chunks of
``ceil(n / fsdp)`` rows, fsdp rank ``i`` holding rows ``[i*c, min((i+1)*c, n))`` of the tp-local
tensor; ``n`` counts the vocabulary padding rows when ``vocab_pad_multiple > 1`` (Megatron's padded
shard, padding rows local zeros of the chunk), else only the real rows. A rank whose chunk is empty
(the last fsdp ranks when ``n < fsdp`` or chunks do not fill them) has **no shard** of that
parameter in its table at all (FSDP2 keeps a zero-size local tensor there). With ``fsdp == 1``
nothing changes. See docs/conventions.md, "Sharded data parallelism (FSDP2/HSDP)". With
``Topology.fsdp_split == "zero3"`` the padded tp-local tensor is instead flattened and cut as
DeepSpeed ZeRO-3 does (:func:`realloc.layout.zero3.zero3_parts_pieces`): a rank holds up to three
shards of a 2-D parameter, consecutive in its buffer, the last padded (or one padding-only shard of
empty box). Both cuts: :mod:`realloc.layout.sharded`. Under ``qkv_order="megatron"`` the engine is
Megatron's model, whose fused ``linear_qkv`` / ``linear_fc1`` are ONE parameter each: the fsdp ranks
cut those whole (:func:`realloc.layout.sharded.engine_params`, ``Layout.fused_sharded``).

Expert parallelism (``Topology.ep > 1`` or ``etp != tp``; docs/conventions.md, "Expert
parallelism"): the dense parameters are laid out as above, by ``(tp_rank, pp_rank)``; a routed
expert's tensors (``ParamSpec.expert``) are held by the ranks of the expert-parallel rank
(:meth:`~realloc.layout.topology.Topology.expert_coords`) whose contiguous block of experts contains it
(:func:`expert_range`), cut ``etp`` ways along their tp dim. A rank's shards are its dense and
expert shards in forward order (``expert_order="vllm"``: vLLM's fused expert buffers, see
:mod:`realloc.layout.conventions`). The planner input then has two kinds of groups per stage: dense
groups (one per tp rank, over dp) and expert groups (one per ``(etp_rank, ep_rank)``, over the
expert data-parallel replicas); a rank is in one of each, and for every parameter the groups
holding it are disjoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from realloc._checks import check_positive
from realloc.boxes import Box
from realloc.layout.conventions import (
    check_options,
    fused_mlp_order,
    megatron_qkv_order,
    stacked_expert_order,
)
from realloc.layout.formats import check_block_layout
from realloc.layout.holdings import Group, PieceTable
from realloc.layout.sharded import engine_params, sharded_pieces
from realloc.layout.stacked import stacked_owners, stacked_pieces
from realloc.layout.topology import Topology
from realloc.layout.torchtitan import torchtitan_expert_pieces
from realloc.spec import DTYPE_BYTES, ModelSpec
from realloc.spec.formats import formatted


@dataclass(frozen=True)
class Shard:
    """One parameter's piece on one rank.

    ``param`` names the storage tensor (a tied head on its own stage holds a shard of the
    embedding); ``slot`` is the name the rank's model uses for it (``lm_head.weight`` there).
    """

    param: str
    slot: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    buffer_offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def box(self) -> Box:
        return self.offsets, self.sizes


def expert_range(num_experts: int, ep: int, ep_rank: int) -> range:
    """The routed experts expert-parallel rank ``ep_rank`` holds: a contiguous block, the
    ``num_experts % ep`` leftover experts one each to the first ranks (vLLM's
    ``determine_expert_map``, linear placement; Megatron-core's ``num_experts / ep`` blocks
    when ep divides the experts).

    Example:
        >>> [list(expert_range(10, 4, r)) for r in range(4)]
        [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    """
    base, extra = divmod(num_experts, ep)
    start = ep_rank * base + min(ep_rank, extra)
    return range(start, start + base + (ep_rank < extra))


class Layout:
    """The shards of every rank of ``spec`` laid out in ``topology``: *the* layout value.

    A layout is one value everywhere (a group's state, a peer's source or destination in a
    plan, a prepared destination, a checkpoint manifest): spec, topology and vocabulary padding
    travel together and are never rebuilt from parts. Two layouts are equal when they place
    every element identically: same spec, same dp/tp/pp, same *effective* layers per stage
    (an explicit ``layer_split`` equal to the default rule's split is the same layout) and the
    same padding and engine conventions (``vocab_pad_rule``, ``qkv_order``, ``expert_order``:
    see :mod:`realloc.layout.conventions`; ``layout.options`` holds all four). Layouts are hashable and
    pickle without their cached shard tables.

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> lay = Layout(ModelSpec.preset("tiny"), Topology(dp=1, tp=2, pp=2))
        >>> [s.slot for s in lay.shards(0)][:2]
        ['model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight']
        >>> lay == Layout(lay.spec, Topology(tp=2, pp=2, layer_split=lay.layer_counts))
        True
        >>> lay == lay.with_topology(Topology(tp=2, pp=2)), lay == Layout(lay.spec, lay.topology, 64)
        (True, False)
    """

    def __init__(
        self,
        spec: ModelSpec,
        topology: Topology,
        vocab_pad_multiple: int = 1,
        vocab_pad_rule: str = "megatron",
        qkv_order: str = "hf",
        expert_order: str = "hf",
        weight_format: str | None = None,
    ):
        if not isinstance(spec, ModelSpec):
            raise ValueError(f"a layout needs a realloc.ModelSpec, got {type(spec).__name__}")
        if not isinstance(topology, Topology):
            raise ValueError(f"a layout needs a realloc.Topology, got {type(topology).__name__}")
        check_positive("vocab_pad_multiple", vocab_pad_multiple)
        if weight_format is not None:  # None: the spec's own format (a formatted spec keeps its)
            spec = formatted(spec, weight_format)
        check_block_layout(spec, topology, qkv_order, expert_order)
        topology.check(spec)
        check_options(spec, topology, vocab_pad_multiple, vocab_pad_rule, qkv_order, expert_order)
        self.spec = spec
        self.topology = topology
        self.vocab_pad_multiple = vocab_pad_multiple
        self.vocab_pad_rule = vocab_pad_rule  # realloc.layout.conventions: engine conventions
        self.qkv_order = qkv_order
        self.expert_order = expert_order
        self.stages = topology.stage_layers(spec)
        self.num_experts = 1 + max((p.expert for p in spec.params if p.expert is not None), default=-1)
        self._stage_cache: dict[int, tuple] = {}
        self._box_cache: dict[tuple, tuple] = {}
        self._rank_cache: dict[tuple[int, int, int, int], tuple[tuple[Shard, ...], dict[str, int]]] = {}

    @property
    def sharded_padding(self) -> bool:
        """Whether the fsdp ranks cut the *padded* tp-local tensor (vocabulary padding rows part of
        the sharded parameter): always under ZeRO-3 (DeepSpeed flattens Megatron's padded local
        tensor), under FSDP2 when ``vocab_pad_multiple > 1`` (Megatron's padded vocabulary) or the
        model is Megatron's (``qkv_order="megatron"``: Megatron-LM pads the vocabulary to a multiple
        of ``make_vocab_size_divisible_by * tp`` whatever the multiple, 1 included, so a tp that
        does not divide it still gives padded local tensors: ``_vocab_size_with_padding`` in
        megatron/training/tokenizer/tokenizer.py); FSDP2 of an HF-named model with
        ``vocab_pad_multiple=1`` chunks the real rows (a DTensor's local tensor)."""
        return self.topology.fsdp_split == "zero3" or self.vocab_pad_multiple > 1 or self.fused_sharded

    @property
    def fused_sharded(self) -> bool:
        """Whether the fsdp ranks cut Megatron's fused ``linear_qkv`` / ``linear_fc1`` parameters
        (``qkv_order="megatron"`` with ``fsdp > 1``) rather than q/k/v/gate/up one by one."""
        return self.topology.fsdp > 1 and self.qkv_order == "megatron"

    # -- value semantics -------------------------------------------------------------------
    @property
    def layer_counts(self) -> tuple[int, ...]:
        """Transformer layers of each pipeline stage (the effective split)."""
        return tuple(len(s) for s in self.stages)

    @property
    def key(self) -> tuple:
        """What decides where every element sits; equal keys mean equal layouts."""
        t = self.topology
        return (
            self.spec,
            t.dp,
            t.tp,
            t.pp,
            self.layer_counts,
            self.vocab_pad_multiple,
            t.fsdp,
            self.vocab_pad_rule,
            self.qkv_order,
            t.fsdp_split,
            t.ep,
            t.etp,
            self.expert_order,
        )

    @property
    def options(self) -> dict:
        """Everything but spec and topology: ``Layout(spec, topology, **layout.options)``."""
        return {
            "vocab_pad_multiple": self.vocab_pad_multiple,
            "vocab_pad_rule": self.vocab_pad_rule,
            "qkv_order": self.qkv_order,
            "expert_order": self.expert_order,
            "weight_format": self.spec.weight_format,
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self is other or self.key == other.key)

    def __hash__(self) -> int:
        return hash(self.key)

    def __getstate__(self) -> dict:
        return {"spec": self.spec, "topology": self.topology, **self.options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["spec"],
            state["topology"],
            state["vocab_pad_multiple"],
            state.get("vocab_pad_rule", "megatron"),
            state.get("qkv_order", "hf"),
            state.get("expert_order", "hf"),
            state.get("weight_format"),
        )

    def with_topology(self, topology: Topology) -> "Layout":
        """The same model, padding and conventions in another topology."""
        return Layout(self.spec, topology, **self.options)

    def __str__(self) -> str:
        t = self.topology
        text = f"dp={t.dp}," + (f"fsdp={t.fsdp}," if t.fsdp > 1 else "") + f"tp={t.tp},pp={t.pp}"
        if t.pp > 1:
            text += f" (layers {'/'.join(map(str, self.layer_counts))})"
        if t.fsdp_split != "fsdp2":
            text += f" {t.fsdp_split}"
        if self.vocab_pad_multiple != 1:
            text += f" vocab pad {self.vocab_pad_multiple}"
        if self.vocab_pad_rule != "megatron":
            text += f" vocab rule {self.vocab_pad_rule}"
        if self.qkv_order != "hf":
            text += f" qkv {self.qkv_order}"
        if t.ep != 1:
            text += f" ep {t.ep}"
        if t.etp is not None:
            text += f" etp {t.etp}"
        if self.expert_order != "hf":
            text += f" experts {self.expert_order}"
        if self.spec.weight_format is not None:
            text += f" format {self.spec.weight_format}"
        return text

    def __repr__(self) -> str:
        return f"Layout({self.spec.name}, {self})"

    def at(self, rank: int) -> "RankLayout":
        """Rank ``rank`` of this layout, as one value."""
        self.topology.coords(rank)  # ValueError outside the layout
        return RankLayout(self, rank)

    def stage_slots(self, pp_rank: int) -> list[tuple[str, str]]:
        """``(storage param, slot name)`` held by pipeline stage ``pp_rank``, in forward order."""
        layers = self.stages[pp_rank]
        last = len(self.stages) - 1
        slots, tied_heads = [], []
        for p in self.spec.params:
            if p.role == "embed":
                if pp_rank == 0:
                    slots.append((p.name, p.name))
                elif pp_rank == last and (alias := self.spec.tied_head_of(p.name)):
                    tied_heads.append((p.name, alias))  # the head runs last: keep forward order
            elif p.role == "layer":
                if p.layer in layers:
                    slots.append((p.name, p.name))
            elif pp_rank == last:
                slots.append((p.name, p.name))
        return slots + tied_heads

    def _stage(self, pp_rank: int) -> tuple[list[tuple], dict[int, list[tuple]]]:
        """``(slots, experts)`` of a stage: ``(param spec, name, slot)`` of every slot in forward
        order, and the routed experts' ones by expert index (built once per stage)."""
        cached = self._stage_cache.get(pp_rank)
        if cached is None:
            by_name = self.spec.by_name
            slots = [(by_name[name], name, slot) for name, slot in self.stage_slots(pp_rank)]
            experts: dict[int, list[tuple]] = {}
            for entry in slots:
                if entry[0].expert is not None:
                    experts.setdefault(entry[0].expert, []).append(entry)
            cached = self._stage_cache[pp_rank] = (slots, experts)
        return cached

    def _box(self, p, name: str, slot: str, split: int, rank: int) -> tuple:
        # tensors of one kind (every layer's q_proj, every expert's down_proj) have one box per
        # (split, rank): computed once (tp_range reads only these fields of the spec)
        key = (p.shape, p.tp_dim, p.tp_unit, p.replicate_units, p.pad_to_tp, split, rank)
        box = self._box_cache.get(key)
        if box is None:
            offsets, sizes, local = [0] * len(p.shape), list(p.shape), list(p.shape)
            if p.tp_dim is not None:
                start, stop, local_size = p.tp_range(split, rank, self.vocab_pad_multiple, self.vocab_pad_rule)
                offsets[p.tp_dim], sizes[p.tp_dim], local[p.tp_dim] = start, stop - start, local_size
            box = self._box_cache[key] = (tuple(offsets), tuple(sizes), tuple(local))
        return p, name, slot, list(box[0]), list(box[1]), list(box[2])

    def _ordered(self, entries: list[tuple]) -> list[tuple]:
        """Entries in forward order -> in the buffer order of the engine conventions."""
        entries = fused_mlp_order(entries)  # gate/up biases after both weights (conventions)
        if self.qkv_order == "megatron":  # several shards per q/k/v param (realloc.layout.conventions)
            entries = megatron_qkv_order(entries, self.topology.tp)
        if self.expert_order != "hf":  # stacks: w13_weight / w2_weight, gate_up_proj / down_proj, w1 / w2 / w3
            entries = stacked_expert_order(entries, self.expert_order)
        return entries

    def _tp_boxes(self, tp_rank: int, pp_rank: int) -> list[tuple]:
        """``(param spec, name, slot, offsets, sizes, local shape)`` of every slot of the
        ``(tp_rank, pp_rank)`` coordinate before sharded data parallelism cuts it (without expert
        parallelism: routed experts are split by tp like every other parameter)."""
        t = self.topology  # routed experts: etp is tp here, or 1 (whole) with torchtitan's EP + FSDP
        return self._ordered(
            [
                self._box(p, name, slot, t.expert_tp, tp_rank % t.expert_tp)
                if p.expert is not None
                else self._box(p, name, slot, t.tp, tp_rank)
                for p, name, slot in self._stage(pp_rank)[0]
            ]
        )

    def tp_boxes(self, tp_rank: int, pp_rank: int) -> list[tuple]:
        """What sharded data parallelism shards on the ``(tp_rank, pp_rank)`` coordinate: every
        slot's ``(param spec, name, slot, offsets, sizes, local shape)`` in buffer order (a tp rank
        may hold no real rows of a padded vocabulary: then no fsdp rank does)."""
        return self._tp_boxes(tp_rank, pp_rank)

    def _dense_boxes(self, tp_rank: int, pp_rank: int) -> list[tuple]:
        """The boxes of the stage's parameters that are not routed experts, as :meth:`_tp_boxes`."""
        tp = self.topology.tp
        return self._ordered(
            [self._box(p, name, slot, tp, tp_rank) for p, name, slot in self._stage(pp_rank)[0] if p.expert is None]
        )

    def _expert_boxes(self, ep_rank: int, etp_rank: int, pp_rank: int) -> list[tuple]:
        """The boxes of the routed experts expert-parallel rank ``ep_rank`` holds on the stage,
        cut by ``etp``, in forward order of the experts (each expert's tensors in spec order)."""
        t, experts = self.topology, self._stage(pp_rank)[1]
        entries = [
            self._box(p, name, slot, t.expert_tp, etp_rank)
            for e in expert_range(self.num_experts, t.ep, ep_rank)
            for p, name, slot in experts.get(e, ())
        ]
        entries.sort(key=lambda entry: entry[0].layer)  # stable: layer by layer, experts in order
        return entries

    @cached_property
    def _coordinate_shards(self) -> dict[tuple[int, int, int], tuple[tuple[Shard, ...], dict[str, int]]]:
        """``(fsdp_rank, tp_rank, pp_rank)`` -> (shards, elements per dtype buffer)."""
        t = self.topology
        padded = self.sharded_padding  # does the sharded-DP engine see the padded local tensor?
        result = {}
        for pp_rank in range(t.pp):
            for tp_rank in range(t.tp):
                tp_boxes = self._tp_boxes(tp_rank, pp_rank)
                for fsdp_rank in range(t.fsdp):
                    fill: dict[str, int] = {}
                    shards = []
                    stacked = self._expert_pieces(tp_boxes, tp_rank, fsdp_rank)  # routed experts cut their own way
                    first = 0
                    for unit in engine_params(tp_boxes, self.fused_sharded, self.expert_order == "hf"):  # .sharded
                        if first in stacked:  # stacked experts (realloc.layout.stacked), torchtitan's (.torchtitan)
                            p, name, slot = unit[0][:3]
                            pieces = [(p, name, slot, o, z, local) for (o, z), local in stacked[first]]
                        elif t.fsdp == 1:
                            pieces = unit
                        else:
                            pieces = sharded_pieces(unit, t.fsdp_split, t.fsdp, fsdp_rank, padded)
                        first += len(unit)
                        for p, name, slot, offsets, sizes, local in pieces:
                            at = fill.get(p.dtype, 0)
                            shard = Shard(name, slot, tuple(offsets), tuple(sizes), tuple(local), p.dtype, at)
                            fill[p.dtype] = at + shard.local_numel
                            shards.append(shard)
                    result[fsdp_rank, tp_rank, pp_rank] = tuple(shards), fill
        return result

    def _expert_pieces(self, tp_boxes: list[tuple], tp_rank: int, fsdp_rank: int) -> dict[int, list]:
        """Entry index -> pieces of the routed experts of ``tp_boxes`` on ``(fsdp_rank, tp_rank)``
        when fsdp > 1 cuts them its own way: ``expert_order="hf_stacked"`` (stacked tensors) or
        torchtitan's EP + FSDP (``Topology.torchtitan_experts``); else ``{}``."""
        t = self.topology
        if t.torchtitan_experts:
            return torchtitan_expert_pieces(tp_boxes, t, self.num_experts, tp_rank, fsdp_rank)
        if self.expert_order != "hf_stacked" or t.fsdp == 1:
            return {}
        return stacked_pieces(tp_boxes, t.fsdp, fsdp_rank, t.fsdp_split == "zero3")

    @property
    def _by_expert_rank(self) -> bool:
        """Whether shards differ between the ranks of one ``(fsdp, tp, pp)`` coordinate (expert
        parallelism on Megatron's / vLLM's mesh; torchtitan's EP + FSDP keeps coordinates)."""
        return self.topology.expert_parallel and not self.topology.torchtitan_experts

    def _expert_rank_shards(self, rank: int) -> tuple[tuple[Shard, ...], dict[str, int]]:
        """(shards, elements per dtype buffer) of ``rank`` with expert parallelism: its dense and
        expert boxes in forward order, then the conventions' order (built once per coordinate)."""
        t = self.topology
        _, ep_rank, etp_rank, pp_rank = t.expert_coords(rank)
        key = (t.coords(rank)[1], ep_rank, etp_rank, pp_rank)
        cached = self._rank_cache.get(key)
        if cached is None:
            held = expert_range(self.num_experts, t.ep, ep_rank)
            entries = []
            for p, name, slot in self._stage(pp_rank)[0]:
                if p.expert is None:
                    entries.append(self._box(p, name, slot, t.tp, key[0]))
                elif p.expert in held:
                    entries.append(self._box(p, name, slot, t.expert_tp, etp_rank))
            fill: dict[str, int] = {}
            shards = []
            for p, name, slot, offsets, sizes, local in self._ordered(entries):
                at = fill.get(p.dtype, 0)
                shard = Shard(name, slot, tuple(offsets), tuple(sizes), tuple(local), p.dtype, at)
                fill[p.dtype] = at + shard.local_numel
                shards.append(shard)
            cached = self._rank_cache[key] = (tuple(shards), fill)
        return cached

    def shards_at(self, tp_rank: int, pp_rank: int, fsdp_rank: int = 0) -> tuple[Shard, ...]:
        """The shards of every rank of coordinate ``(fsdp_rank, tp_rank, pp_rank)``; with expert
        parallelism ranks of one coordinate differ in experts: use :meth:`shards`."""
        if self._by_expert_rank:
            raise ValueError(
                f"{self}: with expert parallelism the ranks of tp rank {tp_rank} hold different "
                "experts; ask for a rank's shards with shards(rank)"
            )
        return self._coordinate_shards[fsdp_rank, tp_rank, pp_rank][0]

    def shards(self, rank: int) -> tuple[Shard, ...]:
        if self._by_expert_rank:
            return self._expert_rank_shards(rank)[0]
        _, fsdp_rank, tp_rank, pp_rank = self.topology.coords4(rank)
        return self._coordinate_shards[fsdp_rank, tp_rank, pp_rank][0]

    def buffer_numels(self, rank: int) -> dict[str, int]:
        """Elements of each dtype buffer of ``rank``."""
        if self._by_expert_rank:
            return dict(self._expert_rank_shards(rank)[1])
        _, fsdp_rank, tp_rank, pp_rank = self.topology.coords4(rank)
        return dict(self._coordinate_shards[fsdp_rank, tp_rank, pp_rank][1])

    def rank_bytes(self, rank: int) -> int:
        return sum(n * DTYPE_BYTES[d] for d, n in self.buffer_numels(rank).items())

    def groups(self, workers: list[int] | None = None) -> list[Group]:
        """The layout as planner input: one group per ``(fsdp, tp, pp)`` coordinate.

        ``workers[rank]`` is the worker id of each rank (default: the rank itself), so two
        layouts over different workers (policy and reference model) share one id space.

        With expert parallelism, per stage: one dense group per tp rank (over dp, the stage's
        parameters that are not routed experts), then one expert group per ``(ep_rank,
        etp_rank)`` (over the expert data-parallel replicas, its experts' boxes).
        """
        world = self.topology.world_size
        if workers is None:
            workers = list(range(world))
        if len(workers) != world:
            raise ValueError(f"{len(workers)} worker ids for {world} ranks of {self.topology}")
        if self._by_expert_rank:
            return self._expert_groups(workers)
        groups = []
        for (fsdp_rank, tp_rank, pp_rank), (shards, _) in self._coordinate_shards.items():
            pieces = tuple((s.param, s.offsets, s.sizes) for s in shards if s.numel)
            members = tuple(workers[r] for r in self.topology.replica_ranks(tp_rank, pp_rank, fsdp_rank))
            groups.append(Group(members, pieces))
        return groups

    def _expert_groups(self, workers: list[int]) -> list[Group]:
        t, groups = self.topology, []

        def pieces(entries):
            return tuple((name, tuple(o), tuple(z)) for _, name, _, o, z, _ in entries if all(z))

        for pp_rank in range(t.pp):
            for tp_rank in range(t.tp):
                members = tuple(workers[r] for r in t.replica_ranks(tp_rank, pp_rank))
                groups.append(Group(members, pieces(self._dense_boxes(tp_rank, pp_rank))))
            if not self._stage(pp_rank)[1]:
                continue  # a stage of dense layers only
            for ep_rank in range(t.ep):
                for etp_rank in range(t.expert_tp):
                    members = tuple(workers[r] for r in t.expert_replica_ranks(etp_rank, ep_rank, pp_rank))
                    groups.append(Group(members, pieces(self._expert_boxes(ep_rank, etp_rank, pp_rank))))
        return groups

    def _expert_piece_table(self, workers: list[int] | None) -> PieceTable:
        """:meth:`piece_table` with expert parallelism: the groups of :meth:`_expert_groups`; the
        boxes of a routed expert's tensor are those of every tensor of its shape (one array pair
        per shape, shared), in the groups of its expert-parallel rank."""
        t = self.topology
        if workers is None:
            workers = list(range(t.world_size))
        if len(workers) != t.world_size:
            raise ValueError(f"{len(workers)} worker ids for {t.world_size} ranks of {t}")
        etp, groups = t.expert_tp, []
        owner = [r for r in range(t.ep) for _ in expert_range(self.num_experts, t.ep, r)]
        rows: dict[str, tuple[list[int], list[list[int]], list[list[int]]]] = {}
        tables: dict[str, tuple] = {}
        boxes: dict[tuple, tuple] = {}  # (shape, tp_dim, tp_unit) -> offsets, sizes of the etp ranks
        for pp_rank in range(t.pp):
            for tp_rank in range(t.tp):
                gi = len(groups)
                groups.append(tuple(workers[r] for r in t.replica_ranks(tp_rank, pp_rank)))
                for _, name, _, offsets, sizes, _ in self._dense_boxes(tp_rank, pp_rank):
                    if all(sizes):
                        entry = rows.setdefault(name, ([], [], []))
                        entry[0].append(gi)
                        entry[1].append(offsets)
                        entry[2].append(sizes)
            experts = self._stage(pp_rank)[1]
            if not experts:
                continue
            first = len(groups)
            groups += [
                tuple(workers[r] for r in t.expert_replica_ranks(etp_rank, ep_rank, pp_rank))
                for ep_rank in range(t.ep)
                for etp_rank in range(etp)
            ]
            indices = {r: np.arange(first + r * etp, first + (r + 1) * etp, dtype=np.int64) for r in range(t.ep)}
            for e, entries in experts.items():
                for p, name, slot in entries:
                    kind = (p.shape, p.tp_dim, p.tp_unit)
                    if kind not in boxes:
                        cut = [self._box(p, name, slot, etp, r) for r in range(etp)]
                        boxes[kind] = tuple(np.array([c[i] for c in cut], dtype=np.int64) for i in (3, 4))
                    tables[name] = (indices[owner[e]],) + boxes[kind]
        tables.update(_row_arrays(rows))
        return PieceTable(groups, tables, boxes_checked=True)

    def piece_table(self, workers: list[int] | None = None) -> PieceTable:
        """:meth:`groups` as a :class:`~realloc.layout.holdings.PieceTable` (the same groups in the same
        order), computed per ``(tp, pp)`` coordinate with the fsdp ranks' chunks as arrays:
        a 2,048-way sharded layout costs what an unsharded one does."""
        t = self.topology
        # zero3, Megatron's fused parameters and torchtitan's experts: from the shard table
        if t.fsdp > 1 and (t.fsdp_split != "fsdp2" or self.fused_sharded or t.torchtitan_experts):
            return PieceTable.of_groups(self.groups(workers))
        if t.expert_parallel:
            return self._expert_piece_table(workers)
        if workers is None:
            workers = list(range(t.world_size))
        if len(workers) != t.world_size:
            raise ValueError(f"{len(workers)} worker ids for {t.world_size} ranks of {t}")
        groups: list[tuple[int, ...]] = []
        rows: dict[str, tuple[list[int], list[list[int]], list[list[int]]]] = {}  # unsharded boxes
        parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}  # fsdp ranks' chunks
        ranks = np.arange(t.fsdp)
        for pp_rank in range(t.pp):
            for tp_rank in range(t.tp):
                base = len(groups)
                groups += [tuple(workers[r] for r in t.replica_ranks(tp_rank, pp_rank, f)) for f in range(t.fsdp)]
                tp_boxes = self._tp_boxes(tp_rank, pp_rank)
                whole = stacked_owners(tp_boxes, t.fsdp) if self.expert_order == "hf_stacked" else {}
                for i, (_, name, _, offsets, sizes, local) in enumerate(tp_boxes):
                    if not all(sizes):
                        continue
                    if t.fsdp == 1 or i in whole:  # unsharded, or a stacked expert one fsdp rank holds
                        entry = rows.setdefault(name, ([], [], []))
                        entry[0].append(base + whole.get(i, 0))
                        entry[1].append(offsets)
                        entry[2].append(sizes)
                        continue
                    # torch.chunk along dim 0 (of the padded rows if sharded_padding), as
                    # realloc.layout.sharded.fsdp2_parts_pieces cuts each rank's shard
                    n = sizes[0]
                    chunk = -(-(local[0] if self.sharded_padding else n) // t.fsdp)
                    first = np.minimum(ranks * chunk, n)
                    held = np.minimum(ranks * chunk + chunk, n) - first
                    keep = np.flatnonzero(held > 0)
                    off = np.tile(np.array(offsets, dtype=np.int64), (keep.size, 1))
                    siz = np.tile(np.array(sizes, dtype=np.int64), (keep.size, 1))
                    off[:, 0] += first[keep]
                    siz[:, 0] = held[keep]
                    parts.setdefault(name, []).append((base + keep, off, siz))
        tables = {name: tuple(np.concatenate(c) for c in zip(*chunks)) for name, chunks in parts.items()}
        tables.update(_row_arrays(rows))
        return PieceTable(groups, tables, boxes_checked=True)


def _row_arrays(rows: dict[str, tuple[list[int], list, list]]) -> dict[str, tuple]:
    """Per parameter ``(groups, offsets, sizes)`` lists -> arrays: one array per tensor rank
    for all parameters, then a view of it per parameter (one ``np.array`` call, not three per
    parameter)."""
    by_ndim: dict[int, list[str]] = {}
    for name, (_, o, _) in rows.items():
        by_ndim.setdefault(len(o[0]), []).append(name)
    out = {}
    for ndim, names in by_ndim.items():
        counts = [len(rows[name][0]) for name in names]
        ends = np.cumsum(counts).tolist()
        g = np.array([x for name in names for x in rows[name][0]], dtype=np.int64)
        o = np.array([x for name in names for x in rows[name][1]], dtype=np.int64).reshape(-1, ndim)
        z = np.array([x for name in names for x in rows[name][2]], dtype=np.int64).reshape(-1, ndim)
        for name, end, n in zip(names, ends, counts):
            out[name] = (g[end - n : end], o[end - n : end], z[end - n : end])
    return out


@dataclass(frozen=True)
class RankLayout:
    """One rank of a layout: what a worker holds (or will hold), as one value.

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> r = Layout(ModelSpec.preset("tiny"), Topology(tp=2)).at(1)
        >>> r.rank, sorted(r.buffer_numels()) == sorted(r.layout.buffer_numels(1))
        (1, True)
    """

    layout: Layout
    rank: int

    def shards(self) -> tuple[Shard, ...]:
        return self.layout.shards(self.rank)

    def buffer_numels(self) -> dict[str, int]:
        return self.layout.buffer_numels(self.rank)

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.layout}"
