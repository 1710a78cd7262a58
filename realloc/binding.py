"""Binding a user's ``nn.Module`` to a worker's shard tensors, without copies.

A worker keeps its weights in one flat buffer per dtype (:mod:`realloc.layout`); every shard is
a contiguous ``local_shape`` tensor at ``buffer_offset`` in the buffer of its dtype. This module
hands those tensors out as *views* and makes a module's parameters alias them:

* :func:`shard_views`: slot name (HF names: ``model.layers.3.self_attn.q_proj.weight``,
  ``lm_head.weight``) -> view of the real box (``padding=False``) or of the padded local tensor
  (``padding=True``, what Megatron's and vLLM's vocab-parallel embeddings hold).
* :func:`flat_views`: slot name -> the rank's 1-D flat partition of it (DeepSpeed ZeRO-3's
  ``ds_tensor`` for a ``fsdp_split="zero3"`` layout).
* :func:`fused_view`: ONE view spanning a fused tensor's parts in the buffer (never a copy), on
  which :func:`realloc.fused.fused_views` builds vLLM's and Megatron-core's fused tensors.
* :func:`bind_module`: ``param.data = view`` for every parameter of a module, after checking
  every name, shape, dtype and device first (all or nothing). The Parameter objects stay the same,
  so an optimizer built on the module keeps its state across rebinds, and an optimizer step
  writes straight into the worker's buffers.
* :func:`layer_name_map`: module names numbered per pipeline stage -> global slot names.

Layer numbering conventions on a pipeline stage that holds global layers ``a..b``:

* vLLM keeps *global* indices: ``make_layers`` (vllm/model_executor/models/utils.py) fills the
  layers of other stages with ``PPMissingLayer`` placeholders (no parameters), so a stage's
  ``named_parameters()`` already read ``model.layers.{a..b}.*``: bind with no name map.
* Megatron numbers the layers of a stage's ``TransformerBlock`` *locally* (module names
  ``layers.0 .. layers.{b-a}``; only ``layer_number`` and the sharded state dict carry the global
  offset): bind with ``name_map=layer_name_map(rank_layout)`` (after translating Megatron's
  own module names to HF names, if the module uses them).

Rebinding after a layout change: the new rank layout gives new views; ``bind_module`` on the
same module rebinds the same Parameter objects (shapes must be equal, so a module built for tp=2
cannot be bound to a tp=4 rank: build the module for the topology it will run).

Example:
    >>> import torch
    >>> from realloc import Layout, ModelSpec, Topology
    >>> from realloc.shards import allocate_buffers
    >>> rank = Layout(ModelSpec.preset("tiny"), Topology(tp=2)).at(0)
    >>> views = shard_views(rank, allocate_buffers(rank.layout, rank.rank))
    >>> norm = torch.nn.Module()
    >>> norm.weight = torch.nn.Parameter(torch.ones(96, dtype=views["model.norm.weight"].dtype))
    >>> report = bind_module(norm, views, name_map=lambda n: "model.norm." + n, strict=False)
    >>> report.bound, norm.weight.data_ptr() == views["model.norm.weight"].data_ptr()
    (('weight',), True)
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from realloc.layout import RankLayout, Shard
from realloc.shards import TORCH_DTYPES, local_tensor

__all__ = ["BindReport", "bind_module", "check_buffers", "flat_views", "fused_view", "layer_name_map",
           "shard_views"]


# -- views ---------------------------------------------------------------------------------

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
            raise ValueError(f"{rank_layout}: the {dtype} buffer must be a flat contiguous tensor, "
                             f"got shape {tuple(buf.shape)} strides {buf.stride()}")
        if buf.numel() < numel:
            raise ValueError(f"{rank_layout}: the {dtype} buffer holds {buf.numel()} elements, the layout needs {numel}")


def shard_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor], *,
                padding: bool = False) -> dict[str, torch.Tensor]:
    """Slot name -> view of that shard in ``buffers`` (no copy), in the rank's forward order.

    ``padding=False``: the real box only (``local.narrow(dim, 0, size)`` along a padded dim), so
    the vocabulary padding is invisible and the shapes are those of the global tensor's slice.
    ``padding=True``: the whole local tensor, padding rows included (Megatron's
    ``VocabParallelEmbedding`` / vLLM's ``VocabParallelEmbedding``/``ParallelLMHead`` hold it
    padded; choose the layout's ``vocab_pad_multiple`` and ``vocab_pad_rule`` to match the engine).

    A slot held as several shards (q/k/v under ``Layout(qkv_order="megatron")``: one per query
    group) is no single tensor and has no view here; ``fused_views(..., convention="megatron")``
    gives the ``linear_qkv`` tensor they make up.

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
        raise ValueError(f"{rank_layout}: a zero3 layout holds each slot as a flat partition (up to three boxes "
                         "of it, padded), not as a tensor of the slot's shape; bind the flat partitions "
                         "(DeepSpeed's ds_tensor) with realloc.binding.flat_views(rank_layout, buffers)")
    views = {}
    pieces = Counter(s.slot for s in rank_layout.shards())
    for shard in rank_layout.shards():
        if pieces[shard.slot] > 1:
            continue
        local = local_tensor(shard, buffers)
        if not padding:
            for dim, (size, full) in enumerate(zip(shard.sizes, shard.local_shape)):
                if size != full:
                    local = local.narrow(dim, 0, size)
        views[shard.slot] = local
    if topology.fsdp > 1 and len(views) < len(rank_layout.layout.stage_slots(topology.coords(rank_layout.rank)[2])):
        views = _with_empty_chunks(rank_layout, buffers, views)
    return views


def _with_empty_chunks(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor],
                       views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``views`` plus a 0-row tensor for every slot of the stage whose FSDP2 chunk is empty here
    (FSDP2's ``_get_dim_chunked_size``: the chunk's size with 0 along dim 0), in forward order."""
    _, _, tp_rank, pp_rank = rank_layout.layout.topology.coords4(rank_layout.rank)
    first = {s.slot: s for s in rank_layout.layout.shards_at(tp_rank, pp_rank, 0)}  # fsdp rank 0 holds rows
    device = next((b.device for b in buffers.values()), torch.device("cpu"))
    out = {}
    for _, slot in rank_layout.layout.stage_slots(pp_rank):
        if slot in views:
            out[slot] = views[slot]
        else:
            shard = first[slot]
            out[slot] = torch.empty((0,) + tuple(shard.sizes[1:]), dtype=TORCH_DTYPES[shard.dtype], device=device)
    return out


def flat_views(rank_layout: RankLayout, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Slot name -> the rank's flat partition of that slot: ONE 1-D view of its dtype's buffer
    spanning the slot's shards, padding included (no copy), in forward order.

    For a zero3 layout this is DeepSpeed's ``ds_tensor``: ``partition_size`` elements on every rank,
    the real ones first (what :func:`shard_views` refuses to give as shaped tensors). For other
    layouts it is each local tensor flattened (FSDP2's empty chunks absent). ``ValueError`` for
    buffers :func:`shard_views` refuses too.

    Example:
        >>> from realloc import Layout, ModelSpec, Topology
        >>> from realloc.shards import allocate_buffers
        >>> rank = Layout(ModelSpec.preset("tiny"), Topology(fsdp=8, fsdp_split="zero3")).at(7)
        >>> views = flat_views(rank, allocate_buffers(rank.layout, 7))
        >>> views["model.embed_tokens.weight"].shape, views["model.norm.weight"].shape
        (torch.Size([12012]), torch.Size([12]))
    """
    check_buffers(rank_layout, buffers)
    spans: dict[str, list] = {}
    for s in rank_layout.shards():
        span = spans.setdefault(s.slot, [s.dtype, s.buffer_offset, s.buffer_offset])
        if span[2] != s.buffer_offset or span[0] != s.dtype:
            raise ValueError(f"{rank_layout}: the shards of {s.slot} are not consecutive in one buffer")
        span[2] += s.local_numel
    return {slot: buffers[dtype][start:stop] for slot, (dtype, start, stop) in spans.items()}


def fused_view(name: str, parts: list[Shard], buffers: Mapping[str, torch.Tensor],
               rank_layout: RankLayout) -> torch.Tensor:
    """ONE view of ``buffers`` spanning ``parts`` (a fused tensor's shards, in order) along dim 0;
    ``ValueError`` naming ``name`` when they are not adjacent, alike and unpadded (never a copy)."""
    first = parts[0]
    for prev, shard in zip(parts, parts[1:]):
        problem = None
        if shard.dtype != first.dtype:
            problem = f"{shard.slot} is {shard.dtype}, {first.slot} is {first.dtype}"
        elif shard.local_shape[1:] != first.local_shape[1:]:
            problem = (f"{shard.slot} has trailing dims {shard.local_shape[1:]}, "
                       f"{first.slot} {first.local_shape[1:]}")
        elif shard.buffer_offset != prev.buffer_offset + prev.local_numel:
            problem = (f"{shard.slot} starts at element {shard.buffer_offset} of the {shard.dtype} buffer, "
                       f"not right after {prev.slot} (ends at {prev.buffer_offset + prev.local_numel})")
        if problem:
            raise ValueError(f"{rank_layout}: {name} cannot be one view of the buffer ({problem}); "
                             "refusing to copy")
    for shard in parts:
        if shard.sizes != shard.local_shape:
            raise ValueError(f"{rank_layout}: {name} cannot be one view: {shard.slot} is padded "
                             f"(box {shard.sizes} in local {shard.local_shape}); refusing to copy")
    rows = sum(s.local_shape[0] for s in parts)
    numel = sum(s.local_numel for s in parts)
    flat = buffers[first.dtype]
    return flat[first.buffer_offset:first.buffer_offset + numel].view((rows,) + tuple(first.local_shape[1:]))


# -- binding -------------------------------------------------------------------------------

@dataclass(frozen=True)
class BindReport:
    """What :func:`bind_module` did.

    ``bound``: module parameter names now aliasing a shard tensor. ``unbound``: module parameters
    left as they were (mapped to ``None``, or with no tensor under ``strict=False``).
    ``unused_slots``: tensors no parameter took (fused parts under their own names, a head the
    module ties to its embedding, ...).
    """

    bound: tuple[str, ...]
    unbound: tuple[str, ...]
    unused_slots: tuple[str, ...]


def _resolver(name_map: object) -> Callable[[str], str | None]:
    if name_map is None:
        return lambda name: name
    if isinstance(name_map, Mapping):
        return lambda name: name_map.get(name, name)
    if callable(name_map):
        return name_map  # type: ignore[return-value]
    raise ValueError(f"name_map must be a mapping, a callable or None, got {type(name_map).__name__}")


def bind_module(module: nn.Module, tensors: Mapping[str, torch.Tensor], *,
                name_map: "Mapping[str, str | None] | Callable[[str], str | None] | None" = None,
                strict: bool = True) -> BindReport:
    """Make ``module``'s parameters alias ``tensors`` (``param.data = tensor``): zero-copy.

    Parameters come from ``module.named_parameters()`` (a tied weight once, under its first
    name). Each one's slot is ``name_map(name)`` for a callable, ``name_map.get(name, name)``
    for a mapping (names absent from it keep their own), or its own name; ``None`` means "not
    from the shards" and leaves the parameter as it is (reported in ``unbound``).

    The tensor must have exactly the parameter's shape, dtype and device (``ValueError`` naming
    the parameter and both shapes/dtypes/devices: nothing is reshaped or cast). With
    ``strict=True`` every parameter not mapped to ``None`` must find its tensor; with
    ``strict=False`` those without one are reported in ``unbound``. Every check runs before any
    parameter changes: a failing bind leaves the module exactly as it was.

    The Parameter objects stay the same (only their data changes), so optimizer state keyed by
    them stays valid across rebinds, and in-place updates (optimizer steps) write into the
    worker's buffers. A module on the meta device cannot be rebound this way: materialise it
    first (``module.to_empty(device=...)``).
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"bind_module needs an nn.Module, got {type(module).__name__}")
    if not isinstance(tensors, Mapping):
        raise ValueError(f"bind_module needs a mapping slot name -> tensor, got {type(tensors).__name__}")
    resolve = _resolver(name_map)
    plan: list[tuple[str, nn.Parameter, str, torch.Tensor]] = []
    unbound, missing, problems = [], [], []
    for name, param in module.named_parameters():
        slot = resolve(name)
        if slot is None:
            unbound.append(name)
            continue
        if not isinstance(slot, str):
            raise ValueError(f"name_map gave {slot!r} for parameter {name!r}; expected a slot name or None")
        tensor = tensors.get(slot)
        if tensor is None:
            missing.append(name if slot == name else f"{name} (-> {slot})")
            unbound.append(name)
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensors[{slot!r}] is a {type(tensor).__name__}, not a tensor")
        where = name if slot == name else f"{name} (slot {slot})"
        if tuple(tensor.shape) != tuple(param.shape):
            problems.append(f"parameter {where}: module shape {tuple(param.shape)}, shard shape {tuple(tensor.shape)}")
        elif tensor.dtype != param.dtype:
            problems.append(f"parameter {where}: module dtype {param.dtype}, shard dtype {tensor.dtype}")
        elif tensor.device != param.device:
            problems.append(f"parameter {where}: module device {param.device}, shard device {tensor.device}")
        else:
            plan.append((name, param, slot, tensor))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError("cannot bind the module: " + "; ".join(problems[:5]) + more)
    if strict and missing:
        known = sorted(tensors)[:5]
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"cannot bind the module: no shard tensor for parameters {missing[:5]}{more} "
                         f"(slots look like {known}...); give a name_map, map them to None, or strict=False")
    for _, param, _, tensor in plan:
        param.data = tensor
    used = {slot for _, _, slot, _ in plan}
    return BindReport(bound=tuple(name for name, _, _, _ in plan), unbound=tuple(unbound),
                      unused_slots=tuple(slot for slot in tensors if slot not in used))


def layer_name_map(rank_layout: RankLayout, local_prefix: str = "model.layers.", *,
                   slot_prefix: str = "model.layers.") -> Callable[[str], str]:
    """Name map for a module numbering its layers locally ``0..k-1`` on a pipeline stage.

    ``{local_prefix}{i}.{rest}`` -> ``{slot_prefix}{first + i}.{rest}``, ``first`` being the first
    global layer of the rank's stage (Megatron's convention; vLLM keeps global indices and needs
    no map). Other names are unchanged. A local index outside the stage's ``k`` layers raises
    ``ValueError`` (the module was built for another split).

    Example:
        >>> from realloc import Layout, ModelSpec, Topology
        >>> rank = Layout(ModelSpec.preset("tiny"), Topology(pp=2)).at(1)
        >>> m = layer_name_map(rank)
        >>> m("model.layers.0.mlp.up_proj.weight"), m("lm_head.weight")
        ('model.layers.2.mlp.up_proj.weight', 'lm_head.weight')
    """
    if not isinstance(rank_layout, RankLayout):
        raise ValueError(f"expected a realloc RankLayout (layout.at(rank)), got {type(rank_layout).__name__}")
    layers = rank_layout.layout.stages[rank_layout.layout.topology.coords(rank_layout.rank)[2]]
    pattern = re.compile(re.escape(local_prefix) + r"(\d+)\.(.+)$")

    def to_slot(name: str) -> str:
        match = pattern.match(name)
        if not match:
            return name
        local = int(match.group(1))
        if not 0 <= local < len(layers):
            raise ValueError(f"{name}: local layer {local} but {rank_layout} holds {len(layers)} layers "
                             f"({layers.start}..{layers.stop - 1})")
        return f"{slot_prefix}{layers[local]}.{match.group(2)}"

    return to_slot
