"""What one trainer rank holds, read from its module as it is: realloc's ``WeightSource``.

A trainer that realloc did not start (FSDP2 in a framework's Ray actors, a torchrun job) hands
its module to :class:`ShardSource`. Nothing is gathered: the rank's layout is read from the
tensors where they say it, and declared where they cannot:

* **DTensors** (FSDP2 ``fully_shard``, with or without tensor parallelism: torchtitan's
  composition). The device mesh gives the topology (``realloc.shards.dtensor.mesh_topology``:
  dimension names ``dp_replicate``/``dp``, ``dp_shard``/``fsdp``/``dp_shard_cp``, ``tp``) and the rank's
  coordinates give its realloc rank; each local tensor must be exactly its box in that layout,
  computed with torch's own rule (``realloc.shards.dtensor.check_boxes``).
* **Plain tensors**: the whole model on one rank (default), or a declaration
  (``topology="tp=2"``, ``rank=``) of what each rank's local tensors are; every tensor's shape
  must then be its shard's in the declared layout.
* **transformers 5's stacked experts** (``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
  ``mlp.experts.down_proj`` ``[E, H, I]``: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), detected by those
  names: the rank is read in ``Layout(expert_order="hf_stacked")`` (:mod:`realloc.layout.stacked`),
  each stacked tensor copied into the layout's view of it, the other parameters into their shards
  (Mixtral's router ``mlp.gate`` is the spec's ``block_sparse_moe.gate``). Plain tensors (one
  rank, or a declaration) must have the views' shapes; an FSDP2 DTensor of a stacked tensor must
  be ``Shard(0)`` on the fsdp mesh dimension and replicated on the others, its local part the
  layout's chunk of the expert axis (tensor parallel stacked DTensors, transformers'
  ``packed_colwise`` ``_StridedShard``, are refused). Tensors left plain among DTensors (buffers:
  ``fully_shard`` does not shard them) are taken as held whole and their box copied.
* **Megatron-core** (:meth:`ShardSource.megatron`): the declaration read from Megatron's parallel
  state (tp, dp, pp, ep and etp, cp folded into dp: cp ranks hold the same weights; tp fastest,
  as Megatron orders ranks; each stage's layers and each expert-parallel rank's experts numbered
  from 0, as Megatron numbers them), the parameters named as ``GPTModel`` names them
  (``realloc.shards.fused.MEGATRON_CORE_NAMES``: dense and MoE layers, ``SequentialMLP`` experts,
  ``SharedExpertMLP`` shared experts and their gate; the spec's family names them: Mixtral's
  ``block_sparse_moe``, Qwen2-MoE's ``shared_expert``) and held in Megatron's order (``linear_qkv``
  per query group, every ``linear_fc1`` as ``[gate; up]``: ``Layout(qkv_order="megatron")``); each
  local tensor must have its view's shape in that layout, and together they must write every shard
  of the rank. A parameter realloc maps that the spec does not have (shared experts read with a
  spec without them) is refused naming both.

Buffers the spec names (DeepSeek-V3's router ``e_score_correction_bias``, a ``ParamSpec`` with
``buffer=True``) are read with the parameters; the module's other buffers (rotary ``inv_freq``)
are not weights and are left out.

Every refusal (a parameter the model spec does not have or misses, a global shape or dtype
that differs, a declaration the tensors contradict, a local box that is not the layout's) is a
``ValueError`` naming the parameter, raised before any byte moves.

The same object is a vLLM ``WeightSource``: iterating it gathers every full tensor, as vLLM's
``ModuleSource`` does, so vLLM's own backends (``nccl``) can be run on it side by side; realloc's
trainer engine (:mod:`actors.trainer.engine`) never iterates it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor

from realloc.layout import Layout, RankLayout, Topology
from realloc.layout.conventions import check_megatron_tied, megatron_vocab_pad_multiple
from realloc.layout.sharded import megatron_fused_name
from realloc.layout.stacked import stacked_name
from realloc.shards import ShardStore
from realloc.shards.dtensor import check_boxes, local_box, local_part, mesh_roles, mesh_topology, read_local
from realloc.shards.fused import fused_views, megatron_core_view, megatron_fused_views
from realloc.shards.store import allocate_buffers
from realloc.shards.views import shard_views
from realloc.spec import ModelSpec
from realloc.spec.hf_config import spec_from_hf_config
from realloc.spec.moe import checkpoint_state_dict


@dataclass
class Holdings:
    """One rank's part of the trainer: the layout of all ranks, this rank in it, its local
    tensors (by parameter name) and a flat copy of them the wire sends from (refreshed per round)."""

    layout: Layout
    rank: int
    tensors: dict[str, torch.Tensor]
    store: ShardStore
    #: ``(tensor, its view of the store, index or None)`` per parameter where the names are not
    #: the layout's (Megatron-core's, transformers 5's stacked experts): the tensor's local part
    #: (``to_local()`` of a DTensor), indexed by ``index`` when given (a tensor held whole of
    #: which the layout keeps a box), is copied into the view; None: the tensors are keyed by the
    #: layout's slots
    copies: list[tuple[torch.Tensor, torch.Tensor, tuple | None]] | None = None
    #: The module ``tensors`` were read from: each refresh first checks that they are still its
    #: parameters (None: not checked)
    module: torch.nn.Module | None = None

    @property
    def me(self) -> RankLayout:
        return self.layout.at(self.rank)

    def refresh(self) -> int:
        """Copy the local tensors into the store (the weights as they are now); bytes copied.
        ``ValueError`` when the module's parameters were replaced since they were read."""
        self.check_current()
        if self.copies is None:
            return read_local(self.store.shard_tensors(), self.me, self.tensors)
        total = 0
        with torch.no_grad():
            for tensor, view, index in self.copies:
                local = local_part(tensor)
                view.copy_(local if index is None else local[index])
                total += view.numel() * view.element_size()
        return total

    def check_current(self) -> None:
        """``ValueError`` unless every tensor read is still a parameter of :attr:`module`. Loading
        a checkpoint with ``load_state_dict(assign=True)``, ``module.to(...)`` or ``_apply``
        replaces parameters: the tensors read at ``trainer_init`` would then be sent as they were,
        not the weights the module holds."""
        if self.module is None:
            return
        current = {id(p) for p in self.module.parameters()} | {id(b) for b in self.module.buffers()}
        replaced = [name for name, t in self.tensors.items() if id(t) not in current]
        if replaced:
            raise ValueError(
                f"{len(replaced)} parameter(s) of the module, {replaced[:3]}, are not the tensors this rank read "
                "when the trainer engine started: they were replaced since (load_state_dict(assign=True), "
                ".to(), a re-wrap); their new values would not be sent. Start a new trainer engine "
                "(trainer_init) on the module as it is now"
            )


class ShardSource(WeightSource):
    """A trainer rank's weights as it holds them (see the module's docstring).

    ``module``: the rank's model (DTensor parameters, or plain ones). ``spec``: the model's
    :class:`~realloc.spec.ModelSpec` (default: from ``module.config``, a transformers config, in
    the parameters' dtype). ``topology``/``rank``: the declaration for plain local tensors (a
    topology string such as ``"tp=2"`` and this rank's realloc rank in it); with DTensors, a
    topology given must be the mesh's.
    """

    #: Megatron-core's vocabulary padding (:meth:`megatron` reads it from the model's vocab_size)
    vocab_pad_multiple = 1

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        spec: ModelSpec | None = None,
        topology: "str | Topology | None" = None,
        rank: int | None = None,
        naming: str = "hf",
    ):
        if naming not in NAMINGS:
            raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
        if naming == "megatron" and (spec is None or topology is None or rank is None):
            raise ValueError(
                "naming='megatron' needs spec=, topology= and rank=: use ShardSource.megatron(model, spec)"
            )
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"ShardSource needs the trainer rank's torch.nn.Module, got {type(module).__name__}")
        if spec is not None and not isinstance(spec, ModelSpec):
            raise ValueError(f"spec must be a realloc ModelSpec or None, got {type(spec).__name__}")
        if topology is not None and not isinstance(topology, (str, Topology)):
            raise ValueError(f"topology must be a topology string (e.g. 'tp=2') or None, got {topology!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise ValueError(f"rank must be a non-negative int or None, got {rank!r}")
        self.module, self.naming = module, naming
        self.declared = Topology.parse(topology) if isinstance(topology, str) else topology
        self.declared_rank = rank
        self.spec = spec if spec is not None else _spec_of(module)
        self._holdings: Holdings | None = None

    @classmethod
    def megatron(cls, module: torch.nn.Module, spec: ModelSpec) -> "ShardSource":
        """A rank of a Megatron-core trainer (``GPTModel``: dense layers, or MoE layers of
        ``SequentialMLP`` experts): the declaration read from Megatron's parallel state
        (megatron/core/parallel_state.py: tp, dp, cp, pp, ep and etp sizes and ranks) and each
        stage's layers from Megatron's own offsets (megatron/core/transformer/transformer_layer.py
        ``get_transformer_layer_offset``: uneven first and last stages become ``layer_split``).
        ``spec``: the HF model it trains (``spec_from_hf_config``).

        Context parallelism is folded into dp for weights: cp splits the sequence, not the weights,
        so the ranks of a dp-cp group hold the same dense weights, and the declaration is
        ``Topology(dp=dp*cp, tp, pp, ep, etp)`` with dp rank the rank in Megatron's dp-cp group
        (``get_data_parallel_group(with_context_parallel=True).rank()``, ``cp_rank + cp*dp_rank`` in
        the default order ``tp-cp-ep-dp-pp``; read from the group, so a dp rank set by hand,
        ``set_data_parallel_rank``, cannot give two cp ranks one realloc rank). The realloc rank ``tp_rank + tp*(dpcp_rank + dp*cp*pp_rank)``
        is then Megatron's global rank, and realloc's expert mesh (tp-ep-dp-pp,
        :meth:`~realloc.layout.Topology.expert_coords`) is Megatron's: its expert RankGenerator
        (``initialize_model_parallel``) has cp=1 and expert dp ``world/(etp*ep*pp)``, cp folded into
        expert dp. Hierarchical or hybrid cp only add communication groups inside the dp-cp group
        and change neither. A rank whose expert-parallel or expert tensor-parallel rank in
        Megatron's parallel state is not the one this numbering gives it (a non-default ``order``)
        is refused (its ``local_experts`` would be read as others), and so are virtual pipeline
        stages. The vocabulary padding is the model's (``GPTModel.vocab_size``:
        :func:`~realloc.layout.conventions.megatron_vocab_pad_multiple`), and its
        ``share_embeddings_and_output_weights`` must be the spec's ``tie_word_embeddings``
        (:func:`~realloc.layout.conventions.check_megatron_tied`)."""
        from megatron.core import parallel_state as ps

        if (ps.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
            raise ValueError(
                "virtual pipeline stages (interleaved schedules) are not supported: a rank holds several "
                "model chunks; give each chunk's module its own source"
            )
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        dp, cp = ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
        # the ranks holding the same weights: the dp-cp group itself, not get_data_parallel_rank/_world_size,
        # which answer a value set by hand (set_data_parallel_rank/_world_size) whatever with_context_parallel says
        group = ps.get_data_parallel_group(with_context_parallel=True)
        dpcp, dpcp_rank = group.size(), group.rank()
        if dpcp != dp * cp:
            raise ValueError(
                f"Megatron's parallel state has a dp-cp group of {dpcp} ranks, not dp*cp = {dp}*{cp} (a data-parallel "
                "size set by hand, set_data_parallel_world_size?): realloc reads cp as part of dp and needs "
                "Megatron's own groups"
            )
        rank = ps.get_tensor_model_parallel_rank() + tp * (dpcp_rank + dpcp * ps.get_pipeline_model_parallel_rank())
        split = megatron_layer_split(module.config, pp) if pp > 1 else None
        uneven = split is not None and len(set(split)) > 1
        ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        experts = {"ep": ep, "etp": etp} if ep > 1 or etp != tp else {}  # the expert mesh: tp-ep-dp-pp
        topology = Topology(dp=dpcp, tp=tp, pp=pp, layer_split=split if uneven else None, **experts)
        if topology.expert_parallel:  # the experts this rank is given must be the ones Megatron gave it
            _, ep_rank, etp_rank, _ = topology.expert_coords(rank)
            held = (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
            if (ep_rank, etp_rank) != held:
                raise ValueError(
                    f"Megatron's parallel state gives this rank expert-parallel rank {held[0]} and expert "
                    f"tensor-parallel rank {held[1]}; rank {rank} of {topology} (dp={dp} x cp={cp} as dp; Megatron's "
                    f"default order tp-cp-ep-dp-pp, expert mesh tp-ep-dp-pp) would be ({ep_rank}, {etp_rank}): the "
                    "rank order (initialize_model_parallel's order=) is not Megatron's default, and its experts "
                    "would be read as other experts; use order='tp-cp-ep-dp-pp'"
                )
        check_megatron_tied(spec, getattr(module, "share_embeddings_and_output_weights", None))
        source = cls(module, spec=spec, topology=topology, rank=rank, naming="megatron")
        source.vocab_pad_multiple = megatron_vocab_pad_multiple(spec, getattr(module, "vocab_size", None), tp)
        return source

    # -- vLLM's WeightSource (what vLLM's own backends read) ---------------------------------------
    def metadata(self) -> list[ParamMeta]:
        if self.naming == "megatron":
            return [ParamMeta(p.name, getattr(torch, p.dtype), tuple(p.shape)) for p in self.spec.params]
        return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.naming == "megatron":
            raise NotImplementedError("a Megatron-core source is not iterated whole: realloc's engine sends its shards")
        for name, param in self.module.named_parameters():
            yield name, materialize_full_tensor(param)

    # -- realloc ------------------------------------------------------------------------------------
    def holdings(self) -> Holdings:
        """This rank's :class:`Holdings` (read and checked once; ``ValueError`` naming what differs)."""
        if self._holdings is None:
            self._holdings = self._read()
        return self._holdings

    def _read(self) -> Holdings:
        tensors = dict(self.module.named_parameters())
        if self.naming == "megatron":
            return replace(
                _megatron_holdings(self.spec, self.declared, self.declared_rank, tensors, self.vocab_pad_multiple),
                module=self.module,
            )
        tensors |= _spec_buffers(self.module, self.spec)
        if any(_STACKED.match(name) for name in tensors):
            return self._read_stacked(tensors)
        _check_names(self.spec, tensors)
        topology, rank, dtensors = self._topology_and_rank(tensors)
        layout = Layout(self.spec, topology)
        me = layout.at(rank)
        _check_tied(self.spec, tensors, me)
        if dtensors:
            check_boxes(me, tensors)
        else:
            _check_plain(me, tensors)
        held = {s.slot for s in me.shards()}
        missing = sorted(held - set(tensors))
        if missing:
            raise ValueError(f"rank {rank} of {layout} holds {missing[:5]} but the module has no such parameter")
        store = ShardStore(me.shards(), allocate_buffers(layout, rank))
        return Holdings(layout, rank, tensors, store, module=self.module)

    def _topology_and_rank(self, tensors: dict[str, torch.Tensor]) -> tuple[Topology, int, bool]:
        """The rank's topology and realloc rank (from the DTensors' mesh, else the declaration)
        and whether the tensors are DTensors."""
        from torch.distributed.tensor import DTensor

        meshes = [t.device_mesh for t in tensors.values() if isinstance(t, DTensor)]
        if not meshes:
            topology = self.declared or Topology()
            if topology.world_size > 1 and self.declared_rank is None:
                raise ValueError(f"a declared topology ({topology}) needs this rank's rank= as well")
            return topology, self.declared_rank or 0, False
        mesh = max(meshes, key=lambda m: m.ndim)  # FSDP2 with tp: the (dp_shard, tp) mesh; norms: its dp part
        on_mesh = [t.placements for t in tensors.values() if isinstance(t, DTensor) and t.device_mesh == mesh]
        topology, roles = mesh_topology(mesh, on_mesh), mesh_roles(mesh, on_mesh)
        if self.declared is not None and _sizes(self.declared) != _sizes(topology):
            raise ValueError(
                f"the declared topology {self.declared} is not what the DTensors' device mesh says ({topology})"
            )
        rank = _mesh_rank(mesh, topology, roles)
        if self.declared_rank is not None and self.declared_rank != rank:
            raise ValueError(
                f"the declared rank {self.declared_rank} is not this rank's place in the device mesh ({rank})"
            )
        return self.declared or topology, rank, True

    def _read_stacked(self, tensors: dict[str, torch.Tensor]) -> Holdings:
        """A transformers 5 MoE module (stacked experts): ``Layout(expert_order="hf_stacked")``,
        each tensor copied into its view of the rank's store (see the module's docstring)."""
        from torch.distributed.tensor import DTensor

        mixtral = any(".block_sparse_moe." in p.name for p in self.spec.params)
        # the module's names as the spec's: stacked tensors as their per-expert names (global
        # shapes, on the meta device), Mixtral's mlp.gate as block_sparse_moe.gate
        meta = {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for n, t in tensors.items()}
        as_spec = checkpoint_state_dict(meta, "mixtral" if mixtral else "qwen3_moe")
        _check_names(self.spec, as_spec)
        topology, rank, distributed = self._topology_and_rank(tensors)
        layout = Layout(self.spec, topology, expert_order="hf_stacked")
        me = layout.at(rank)
        _check_tied(self.spec, as_spec, me)
        store = ShardStore(me.shards(), allocate_buffers(layout, rank))
        views = fused_views(me, store.buffers)
        slots = {s.slot: s for s in me.shards()}
        renamed = {n: n.replace(".mlp.", ".block_sparse_moe.") if mixtral else n for n in tensors}
        if distributed:  # torch's own boxes of the DTensors that are not stacked experts
            check_boxes(
                me, {n: t for n, t in tensors.items() if isinstance(t, DTensor) and not _STACKED.match(n)}, renamed
            )
        copies, written = [], set()
        for name, t in tensors.items():
            stacked = _STACKED.match(name) is not None
            target = name if stacked else renamed[name]
            if stacked and isinstance(t, DTensor):
                _check_stacked_dtensor(name, t, me)
            elif stacked and distributed:
                raise ValueError(
                    f"stacked experts {name} are a plain tensor among DTensors: realloc reads transformers 5's "
                    "stacked experts sharded by fully_shard (Shard(0)), or every tensor plain (ShardSource(topology=, rank=))"
                )
            elif distributed and not isinstance(t, DTensor):  # held whole (a buffer): the layout's box of it
                shard = slots.get(target)
                if shard is not None:
                    index = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.sizes))
                    copies.append((t, views[target], index))
                    written.add(target)
                continue
            view = views.get(target)
            if view is None:
                if 0 in local_box(t)[1]:
                    continue  # an empty FSDP2 chunk: the layout holds nothing of it either
                raise ValueError(f"parameter {name} ({target}) is not held by rank {rank} of {layout}")
            shape = tuple(local_part(t).shape)
            if shape != tuple(view.shape):
                raise ValueError(
                    f"parameter {name} is {shape} on this rank; rank {rank} of {layout} holds {target} as "
                    f"{tuple(view.shape)}: the declared topology (or the model) is not what the rank holds"
                )
            copies.append((t, view, None))
            written.add(target)
        unwritten = sorted(
            s.slot
            for s in me.shards()
            if s.slot not in written
            and not (
                self.spec.by_name[s.param].expert is not None and stacked_name(self.spec.by_name[s.param]) in written
            )
        )
        if unwritten:
            raise ValueError(f"rank {rank} of {layout} holds {unwritten[:5]} but the module has no such tensor")
        return Holdings(layout, rank, tensors, store, copies, module=self.module)


#: How the module names its parameters: ``"hf"`` (the checkpoint's names, as transformers and
#: FSDP2 keep them) or ``"megatron"`` (Megatron-core's ``GPTModel``).
NAMINGS = ("hf", "megatron")


def megatron_layer_split(config, pp: int) -> tuple[int, ...]:
    """Transformer layers per pipeline stage of a Megatron ``TransformerConfig``, by Megatron's
    own offsets of each stage (``get_transformer_layer_offset(config, pp_rank=...)``; with a
    ``pipeline_model_parallel_layout``, the layout's ``get_layer_offset(pp_rank=...)``: megatron-core
    0.16's ``get_transformer_layer_offset`` does not pass ``pp_rank`` on to the layout, so every
    stage would get the calling rank's offset, a different split on every rank)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout:
        offsets = [layout.get_layer_offset(layer_type=LayerType.decoder, pp_rank=r) for r in range(pp)]
    else:
        offsets = [get_transformer_layer_offset(config, pp_rank=r) for r in range(pp)]
    offsets.append(config.num_layers)
    return tuple(b - a for a, b in zip(offsets, offsets[1:]))


def _model_name(name: str, stage: list[int], experts: list[int]) -> str:
    """Megatron's rank-local numbering as the model's: a stage's ``decoder.layers.{i}.`` is layer
    ``stage[i]``, an expert-parallel rank's ``local_experts.{j}.`` its expert ``experts[j]``."""
    m = re.match(r"decoder\.layers\.(\d+)\.", name)
    if m is None:
        return name
    local = int(m.group(1))
    if local >= len(stage):
        raise ValueError(
            f"Megatron-core parameter {name}: this pipeline stage holds {len(stage)} layers, not layer {local}"
        )
    rest = name[m.end() :]
    e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.", rest)
    if e is not None:
        j = int(e.group(1))
        if j >= len(experts):
            raise ValueError(
                f"Megatron-core parameter {name}: this rank holds {len(experts)} routed experts, not {j + 1}"
            )
        rest = f"mlp.experts.local_experts.{experts[j]}.{rest[e.end() :]}"
    return f"decoder.layers.{stage[local]}.{rest}"


def _megatron_holdings(
    spec: ModelSpec, topology: Topology, rank: int, tensors: dict[str, torch.Tensor], vocab_pad_multiple: int = 1
) -> Holdings:
    """A Megatron-core rank: each parameter copied into its view of the store (Megatron's order).
    A pipeline stage numbers its layers from 0, an expert-parallel rank its routed experts: they
    are the stage's layers and the rank's experts (a contiguous block) of the layout. The
    vocabulary is Megatron's padded one (``vocab_pad_multiple``): its real rows are copied."""
    layout = Layout(spec, topology, vocab_pad_multiple, qkv_order="megatron")
    me = layout.at(rank)
    stage = list(layout.stages[topology.coords(rank)[2]])
    experts = sorted({e for s in me.shards() if (e := spec.by_name[s.param].expert) is not None})
    store = ShardStore(me.shards(), allocate_buffers(layout, rank))
    views = megatron_fused_views(me, store.buffers)
    padded = shard_views(me, store.buffers, padding=True)  # VocabParallelEmbedding's local tensors
    copies, written = [], set()
    in_model = {megatron_fused_name(p.name) or p.name for p in spec.params}
    for name, t in tensors.items():
        local = _model_name(name, stage, experts)
        target = megatron_core_view(local, views)  # the family's name the rank holds, else the model has
        if target is not None and target not in views:
            target = megatron_core_view(local, in_model)
        if target is None:
            raise ValueError(
                f"Megatron-core parameter {name} is not a GPT decoder's that realloc maps "
                "(realloc.shards.fused.MEGATRON_CORE_NAMES)"
            )
        view = views.get(target)
        if view is None and target not in in_model:
            raise ValueError(
                f"Megatron-core parameter {name} is checkpoint tensor {target}, which model {spec.name!r} does not "
                "have: the spec is not the Megatron model's (shared experts, their gate, another family?)"
            )
        if view is None:
            raise ValueError(f"Megatron-core parameter {name} ({target}) is not held by rank {rank} of {layout}")
        whole = padded.get(target, view)  # the padded vocabulary as Megatron holds it
        if tuple(t.shape) != tuple(whole.shape) or t.dtype != view.dtype:
            raise ValueError(
                f"Megatron-core parameter {name} is {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} on this "
                f"rank; rank {rank} of {layout} holds {target} as {str(view.dtype).removeprefix('torch.')} "
                f"{tuple(whole.shape)}: the declaration (or the model) is not what the rank holds"
            )
        real = None if whole.shape == view.shape else tuple(slice(0, n) for n in view.shape)  # padding not read
        copies.append((t, view, real))
        written.add(target)
    unwritten = sorted(s.slot for s in me.shards() if (megatron_fused_name(s.slot) or s.slot) not in written)
    if unwritten:
        raise ValueError(
            f"rank {rank} of {layout} holds {unwritten[:5]} but the Megatron-core model has no such parameter"
        )
    return Holdings(layout, rank, tensors, store, copies)


#: transformers 5's stacked experts of a MoE layer (:mod:`realloc.layout.stacked`)
_STACKED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _spec_buffers(module: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The module's buffers the spec holds as weights (``ParamSpec.buffer``: DeepSeek-V3's
    ``e_score_correction_bias``); Mixtral's ``mlp.`` is matched as ``block_sparse_moe.``."""
    wanted = {p.name for p in spec.params if p.buffer}
    return {
        n: b for n, b in module.named_buffers() if n in wanted or n.replace(".mlp.", ".block_sparse_moe.") in wanted
    }


def _check_stacked_dtensor(name: str, t: torch.Tensor, me: RankLayout) -> None:
    """``ValueError`` unless stacked DTensor ``t`` is FSDP2's: ``Shard(0)`` (the expert axis) on
    the fsdp mesh dimension, replicated on the others, its local part the experts ``me`` holds."""
    from torch.distributed.tensor import Replicate, Shard

    names = t.device_mesh.mesh_dim_names or ("fsdp",)
    for role, placement in zip(mesh_roles(t.device_mesh, [t.placements]), t.placements):
        ok = placement == Shard(0) if role == "fsdp" else isinstance(placement, Replicate)
        if not ok:
            raise ValueError(
                f"stacked experts {name} are placed {tuple(t.placements)} on mesh {tuple(names)}: realloc reads "
                "transformers 5's stacked experts as FSDP2 holds them, Shard(0) (whole experts) on the fsdp "
                "dimension and replicated elsewhere; tensor-parallel stacked DTensors (transformers' "
                "packed_colwise _StridedShard) are not a box of the global tensor: give plain local tensors "
                "with ShardSource(topology=, rank=)"
            )
    layer = int(name.split(".")[2])
    spec = me.layout.spec.by_name
    held = sorted(
        {spec[s.param].expert for s in me.shards() if spec[s.param].layer == layer and spec[s.param].expert is not None}
    )
    offsets, sizes = local_box(t)
    if sizes[0] != len(held) or (held and offsets[0] != held[0]):
        raise ValueError(
            f"stacked experts {name}: this rank's local part is experts [{offsets[0]}, {offsets[0] + sizes[0]}); "
            f"rank {me.rank} of {me.layout} holds experts {held}: another rank order or sharding rule?"
        )


def _spec_of(module: torch.nn.Module) -> ModelSpec:
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        raise ValueError(
            f"{type(module).__name__} has no transformers config to read the model from: give ShardSource(spec=...)"
        )
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"the module's parameters have dtypes {sorted(map(str, dtypes))}: give ShardSource(spec=...)")
    return spec_from_hf_config(config.to_dict(), dtype=str(dtypes.pop()).removeprefix("torch."))


def _check_names(spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> None:
    """``ValueError`` unless the module's parameters are the spec's, with its global shapes and dtypes."""
    want = {p.name: p for p in spec.params}
    extra = sorted(set(tensors) - set(want) - set(spec.aliases))
    if extra:
        raise ValueError(f"the module has parameters {extra[:5]} that model {spec.name!r} does not ({len(extra)})")
    absent = sorted(set(want) - set(tensors))
    if absent:
        raise ValueError(f"the module has no parameter {absent[:5]} of model {spec.name!r} ({len(absent)} missing)")
    for name, t in tensors.items():
        p = want.get(name)
        if p is None:
            continue
        if tuple(t.shape) != tuple(p.shape) or str(t.dtype).removeprefix("torch.") != p.dtype:
            raise ValueError(
                f"parameter {name} is {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}; model "
                f"{spec.name!r} has {p.dtype} {tuple(p.shape)}"
            )


def _check_tied(spec: ModelSpec, tensors: dict, rank: RankLayout) -> None:
    """``ValueError`` when the module holds a head the spec ties to the embedding
    (``tie_word_embeddings``) as a parameter of its own where the rank's layout holds no such slot
    (only a last pipeline stage that is not the first keeps its copy of the embedding there):
    ``named_parameters()`` names a tied head once, under the embedding, so the module does not tie
    them and its head would never be sent."""
    held = {s.slot for s in rank.shards()}
    own = sorted(a for a in spec.aliases if a in tensors and a not in held)
    if own:
        raise ValueError(
            f"the module holds {own} as parameter(s) of its own, but model {spec.name!r} ties them to "
            f"{[spec.aliases[a] for a in own]} (tie_word_embeddings=True): the module does not tie them, so its "
            "head would not be sent; give the spec of the model it trains (tie_word_embeddings=False) or tie "
            "the module's weights"
        )


def _check_plain(rank: RankLayout, tensors: dict[str, torch.Tensor]) -> None:
    """Plain local tensors: each must have its shard's shape in the declared layout."""
    for s in rank.shards():
        t = tensors.get(s.slot)
        if t is not None and tuple(t.shape) != tuple(s.sizes):
            raise ValueError(
                f"parameter {s.slot} is {tuple(t.shape)} on this rank; rank {rank.rank} of {rank.layout} holds "
                f"{tuple(s.sizes)} (offsets {tuple(s.offsets)}): the declared topology is not what the rank holds"
            )


def _sizes(t: Topology) -> tuple[int, int, int, int]:
    return (t.dp, t.fsdp, t.tp, t.pp)


def _mesh_rank(mesh, topology: Topology, roles: tuple[str, ...]) -> int:
    """This process's realloc rank: its coordinates in ``mesh`` (whose dimensions are ``roles``,
    :func:`~realloc.shards.dtensor.mesh_roles`), in realloc's rank order (tp fastest)."""
    coords = mesh.get_coordinate()
    if coords is None:
        raise ValueError("this process is not in the DTensors' device mesh")
    at = {"dp": 0, "fsdp": 0, "tp": 0}
    for role, c in zip(roles, coords):
        at[role] = int(c)
    return at["tp"] + topology.tp * (at["fsdp"] + topology.fsdp * at["dp"])
