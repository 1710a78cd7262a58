"""Binding a user's ``nn.Module`` to a worker's shard tensors, without copies.

:mod:`realloc.shards.views` hands a rank's shards out as *views* of its flat buffers
(:func:`~realloc.shards.views.shard_views`, :func:`~realloc.shards.fused.fused_views`); this
module makes a module's parameters alias them:

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
    >>> from realloc.shards import allocate_buffers, shard_views
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
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from realloc.layout import RankLayout

__all__ = ["BindReport", "bind_module", "layer_name_map"]


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


def bind_module(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    name_map: "Mapping[str, str | None] | Callable[[str], str | None] | None" = None,
    strict: bool = True,
) -> BindReport:
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
        raise ValueError(
            f"cannot bind the module: no shard tensor for parameters {missing[:5]}{more} "
            f"(slots look like {known}...); give a name_map, map them to None, or strict=False"
        )
    for _, param, _, tensor in plan:
        param.data = tensor
    used = {slot for _, _, slot, _ in plan}
    return BindReport(
        bound=tuple(name for name, _, _, _ in plan),
        unbound=tuple(unbound),
        unused_slots=tuple(slot for slot in tensors if slot not in used),
    )


def layer_name_map(
    rank_layout: RankLayout, local_prefix: str = "model.layers.", *, slot_prefix: str = "model.layers."
) -> Callable[[str], str]:
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
            raise ValueError(
                f"{name}: local layer {local} but {rank_layout} holds {len(layers)} layers "
                f"({layers.start}..{layers.stop - 1})"
            )
        return f"{slot_prefix}{layers[local]}.{match.group(2)}"

    return to_slot
