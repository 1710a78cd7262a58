"""DTensor interop: a DTensor state dict (FSDP2, torchtitan's FSDP+TP) against a rank's layout.

FSDP2 (``torch.distributed.fsdp.fully_shard``) and torchtitan hold every parameter as a
``DTensor``: a device mesh, a placement per mesh dimension and a local tensor. The local tensor
of a rank is one box of the global tensor; :func:`local_box` computes it with torch's own rule
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``), so the boxes
compared here are the engine's, not re-derived, with one exception: FSDP2's ``_StridedShard``
(FSDP over a tensor-parallel shard of the same dimension). There torch 2.13's rule splits the
global rows into ``split_factor`` chunks and each into the FSDP chunks, which are FSDP2's chunks
of the tp-local rows only where tp divides the rows; a vocabulary tp does not divide (19 rows,
tp=2, fsdp=3) gets other rows, not even a box on some ranks, than FSDP2 holds
(``_chunk_with_empty`` of the tp-local tensor), so that dimension's box is FSDP2's own
(:func:`_strided_boxes`). And every box's sizes must be the local tensor's shape, or the DTensor is
refused (``ValueError``) rather than copied as other rows.

* :func:`mesh_topology` derives the layout's topology from the mesh: dimension names
  ``dp_replicate``/``dp`` (replicated), ``dp_shard``/``fsdp``/``dp_shard_cp`` (sharded) and ``tp``
  as torchtitan names them; a one-dimensional mesh without names is sharded data parallelism.
  The meshes ``fully_shard`` (torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param.py)
  leaves on its DTensors: its own 1-D or 2-D (HSDP: ``(dp_replicate, dp_shard)``) mesh for plain
  parameters (``_init_sharding_spec_plain``); the dp mesh concatenated with a tp DTensor's
  (``_init_sharding_spec_tp``: torchtitan's ``spmd_backend="partial_dtensor"``, dims
  ``(dp_replicate, fsdp, tp)``, cp already folded into ``fsdp``); and, with ``dp_mesh_dims``
  (torchtitan's default ``spmd_backend="spmd_types"``: ``resolve_fsdp_mesh`` in
  torchtitan/distributed/fsdp.py), the parameters' own storage mesh ``(dp_replicate, dp_shard,
  tp)`` (``_init_sharding_spec_spmd``), where context parallelism's ``dp_shard`` x ``cp`` are
  flattened into one FSDP dim named ``dp_shard_cp`` (``_get_mesh_info_from_named_dims`` joins the
  names): cp ranks hold different FSDP chunks, so that dim is fsdp (``fsdp = dp_shard * cp``), as
  partial_dtensor's ``fsdp`` dim already is. A bare ``cp`` dim (not folded into FSDP) is refused.
* :func:`check_boxes` refuses (``ValueError`` naming the parameter and both boxes) a state dict
  whose local tensors are not exactly the rank's boxes in the layout: a wrong rank order or
  another sharding rule would otherwise be a silent wrong weight.
* :func:`read_local` / :func:`write_local` copy between the local tensors and the rank's shard
  views (the weights the reallocation moves), in either direction.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch

from realloc.layout import RankLayout, Topology

#: Mesh dimension names and the topology field each one sets (``dp_shard_cp``: FSDP2's flattened
#: ``dp_shard`` x ``cp`` dim under torchtitan's ``spmd_types`` backend, see the module docstring).
MESH_NAMES = {"dp_replicate": "dp", "dp": "dp", "dp_shard": "fsdp", "fsdp": "fsdp", "dp_shard_cp": "fsdp", "tp": "tp"}


def local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the global tensor that ``tensor``'s local part holds (a plain
    tensor holds all of itself)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = tensor.device_mesh, tensor.placements
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    offsets, sizes = [int(o) for o in offsets], [int(s) for s in sizes]
    coordinate = mesh.get_coordinate()
    if coordinate is not None:
        for dim, (offset, size) in _strided_boxes(
            tuple(tensor.shape), tuple(mesh.shape), coordinate, placements
        ).items():
            offsets[dim], sizes[dim] = (offset if size else int(tensor.shape[dim])), size
    held = tuple(tensor.to_local().shape)
    if tuple(sizes) != held:
        raise ValueError(
            f"a DTensor placed {tuple(placements)} on mesh {mesh.mesh_dim_names} {tuple(mesh.shape)} holds "
            f"a local tensor of shape {held}, not the {tuple(sizes)} its placements give (global shape "
            f"{tuple(tensor.shape)}): which rows it holds cannot be told, so it is not read"
        )
    return tuple(offsets), tuple(sizes)


def _chunk(offset: int, size: int, parts: int, index: int) -> tuple[int, int]:
    """``(offset, size)`` of chunk ``index`` of ``torch.chunk`` of the range ``[offset, offset + size)``
    into ``parts`` (an empty chunk past the end)."""
    step = -(-size // parts)
    first = min(index * step, size)
    return offset + first, min(step, size - first)


def _strided_boxes(global_shape: tuple, mesh_shape: tuple, coordinate, placements) -> dict[int, tuple[int, int]]:
    """Tensor dim -> ``(offset, size)`` of FSDP2's chunk where a ``_StridedShard`` says FSDP2 cut a
    tensor-parallel shard: the later mesh dims' ``Shard`` of that tensor dim first (tp's rows), then
    FSDP2's ``torch.chunk`` of those rows (torch 2.13 ``FSDPParam._init_sharded_param``:
    ``_chunk_with_empty`` of the tp-local tensor; ``_init_sharding_spec_tp`` / ``_spmd`` name it
    ``_StridedShard(dim, split_factor=tp)``). torch's ``compute_local_shape_and_global_offset``
    reads ``_StridedShard`` as a split of the global rows into ``split_factor`` chunks, then of each;
    when tp does not divide the rows (a vocabulary 19 rows over tp=2, fsdp=3: tp rows 10 and 9,
    FSDP2 chunks 4, 4, 2 and 3, 3, 3) those are other rows than FSDP2 holds."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = {}
    for i, strided in enumerate(placements):
        if not isinstance(strided, _StridedShard):
            continue
        dim = strided.dim
        if any(isinstance(p, (Shard, _StridedShard)) and p.dim == dim for p in placements[:i]):
            continue  # not FSDP2's pattern: torch's own rule stands
        shards = (Shard, _StridedShard)
        later = [j for j in range(i + 1, len(placements)) if isinstance(placements[j], shards)]
        later = [j for j in later if placements[j].dim == dim]
        if any(isinstance(placements[j], _StridedShard) for j in later) or (
            int(strided.split_factor) != math.prod(mesh_shape[j] for j in later)
        ):
            continue
        offset, size = 0, int(global_shape[dim])
        for j in later:  # tp's Shard first (right-to-left sharding), then FSDP2's chunk
            offset, size = _chunk(offset, size, mesh_shape[j], int(coordinate[j]))
        out[dim] = _chunk(offset, size, mesh_shape[i], int(coordinate[i]))
    return out


def mesh_roles(mesh, placements: Sequence[Sequence[Any]] = ()) -> tuple[str, ...]:
    """Each dimension of a DTensor device mesh as ``"dp"``, ``"fsdp"`` or ``"tp"``, read by name
    (:data:`MESH_NAMES`; a 1-D mesh without names is fsdp). ``placements``: those of the DTensors
    on it; a dimension named ``"dp"`` they are sharded over is fsdp (``fully_shard`` over a mesh
    its user named ``("dp",)``), one they are replicated over is dp."""
    names = mesh.mesh_dim_names or (("fsdp",) if len(mesh.shape) == 1 else None)
    if names is None:
        raise ValueError(
            f"a device mesh of shape {tuple(mesh.shape)} needs dimension names "
            f"(one of {sorted(MESH_NAMES)}) to say which dimension is which"
        )
    roles: list[str] = []
    for i, name in enumerate(names):
        if name not in MESH_NAMES:
            raise ValueError(f"mesh dimension {name!r} is not one of {sorted(MESH_NAMES)}")
        role = MESH_NAMES[name]
        if name == "dp" and any(p[i].is_shard() for p in placements if len(p) > i):
            role = "fsdp"  # the tensors are sharded over it
        if role in roles:
            raise ValueError(f"mesh dimensions {names[roles.index(role)]!r} and {name!r} are both {role}")
        roles.append(role)
    return tuple(roles)


def mesh_topology(mesh, placements: Sequence[Sequence[Any]] = ()) -> Topology:
    """The topology a DTensor device mesh stands for (pp=1: a mesh per pipeline stage), its
    dimensions read by :func:`mesh_roles`.

    Example:
        >>> from types import SimpleNamespace
        >>> str(mesh_topology(SimpleNamespace(mesh_dim_names=("dp_replicate", "dp_shard", "tp"), shape=(2, 4, 2))))
        'dp=2,fsdp=4,tp=2,pp=1'
    """
    sizes = {"dp": 1, "fsdp": 1, "tp": 1}
    for role, size in zip(mesh_roles(mesh, placements), mesh.shape):
        sizes[role] = int(size)
    return Topology(dp=sizes["dp"], tp=sizes["tp"], fsdp=sizes["fsdp"])


def _pairs(
    rank: RankLayout,
    state: Mapping[str, torch.Tensor],
    name_map: "Mapping[str, str] | Callable[[str], str | None] | None",
) -> list[tuple[str, object, torch.Tensor]]:
    slots = {s.slot: s for s in rank.shards()}
    pairs = []
    for name, tensor in state.items():
        slot = name_map(name) if callable(name_map) else (name_map or {}).get(name, name)
        if slot is None:
            continue
        if slot not in slots:
            if 0 in local_box(tensor)[1]:
                continue  # an empty chunk (FSDP2's last ranks): the layout leaves it out as well
            raise ValueError(f"state dict entry {name!r} (slot {slot!r}) is not held by {rank}")
        pairs.append((name, slots[slot], tensor))
    return pairs


def check_boxes(rank: RankLayout, state: Mapping[str, torch.Tensor], name_map=None) -> None:
    """``ValueError`` unless every entry's local tensor is exactly its shard's box on ``rank``."""
    wrong = []
    for name, shard, tensor in _pairs(rank, state, name_map):
        box = local_box(tensor)
        if box != (shard.offsets, shard.sizes):
            wrong.append(
                f"{name}: local box offsets={box[0]} sizes={box[1]}, layout {rank} holds "
                f"offsets={shard.offsets} sizes={shard.sizes}"
            )
    if wrong:
        raise ValueError(
            f"{len(wrong)} DTensor(s) do not hold what {rank} holds (another rank order or "
            f"sharding rule?): " + "; ".join(wrong[:3])
        )


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local tensor, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def read_local(
    views: Mapping[str, torch.Tensor], rank: RankLayout, state: Mapping[str, torch.Tensor], name_map=None
) -> int:
    """Copy each entry's local tensor into the rank's shard view (boxes checked first); bytes copied."""
    return _copy(rank, state, views, name_map, into_views=True)


def write_local(
    state: Mapping[str, torch.Tensor], rank: RankLayout, views: Mapping[str, torch.Tensor], name_map=None
) -> int:
    """Copy the rank's shard views into each entry's local tensor (boxes checked first); bytes copied."""
    return _copy(rank, state, views, name_map, into_views=False)


def _copy(
    rank: RankLayout, state: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor], name_map, into_views: bool
) -> int:
    check_boxes(rank, state, name_map)
    total = 0
    with torch.no_grad():
        for _, shard, tensor in _pairs(rank, state, name_map):
            local, view = local_part(tensor), views[shard.slot]
            (view if into_views else local).copy_(local if into_views else view)
            total += local.numel() * local.element_size()
    return total
