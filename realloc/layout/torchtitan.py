"""Expert parallelism with FSDP as torchtitan composes them: a rank's pieces of the routed experts.

Read in pytorch/torchtitan (b5bcd76c66d0acb1a08b176d9639425bc55e0b2a):
``torchtitan/distributed/parallel_dims.py`` (``ParallelDims.build_mesh``: the dense mesh
``(pp, dp_replicate, fsdp, tp)`` and the sparse mesh ``(pp, dp_replicate, efsdp, ep)`` unflatten
the same world, ep fastest, ``efsdp = dp_shard * cp * tp / ep``),
``torchtitan/models/common/moe_sharding.py`` (``expert_param_placement_sparse``: ``Shard(0)`` on
ep, experts never tensor parallel under EP), ``torchtitan/models/common/moe.py``
(``GroupedExperts``: ``w1_EFD``/``w3_EFD`` ``[E, F, D]`` = gate/up, ``w2_EDF`` ``[E, D, F]`` = down),
``torchtitan/distributed/fsdp.py`` (MoE blocks: ``fully_shard`` of the experts on ``efsdp`` with
``Shard(0)``, or ``Shard(1)`` when ``efsdp * ep > num_experts``) and
``torchtitan/models/common/decoder.py`` (``num_experts % ep == 0``). The mesh named above is
``spmd_backend="partial_dtensor"``'s; the default ``"spmd_types"`` shards on the storage meshes
``(pp, dp_replicate, dp_shard, cp, tp)`` / ``(pp, dp_replicate, efsdp, ep)`` with the same rank
order and chunks (``resolve_fsdp_mesh`` / ``resolve_sparse_fsdp_mesh`` in fsdp.py; the efsdp
placement is torch's ``_StridedShard(0, split_factor=ep)``, the same ``torch.chunk`` of the ep
rank's stack): re-read at the newest stored torchtitan, still b5bcd76c, 2026-12-08.

So with ``Topology(dp, fsdp, tp, pp, ep, etp=1)`` (``dp`` = dp_replicate, ``fsdp`` = dp_shard,
no cp), inside a pipeline stage and replica, ``i = tp_rank + tp * fsdp_rank``: ep rank ``i % ep``
holds experts ``[r*E/ep, (r+1)*E/ep)``, whole (etp 1), and its efsdp rank ``k = i // ep`` of
``efsdp = fsdp * tp / ep`` holds

* ``Shard(0)`` (``efsdp * ep <= E``): experts ``[k*c, (k+1)*c)`` of that block, ``c = ceil(E/ep /
  efsdp)`` (``torch.chunk``), every tensor of them whole;
* ``Shard(1)`` (``efsdp * ep > E``): every expert of the block, each tensor's rows (dim 0 of
  gate/up: F, of down: D, i.e. dim 1 of torchtitan's stacks) ``[k*c, min((k+1)*c, n))``,
  ``c = ceil(n / efsdp)``; nothing where that chunk is empty.

A rank's experts then depend on ``(fsdp_rank, tp_rank)`` only, as its dense shards do: the
layout stays one shard table per ``(fsdp_rank, tp_rank, pp_rank)`` coordinate, replicated over dp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from realloc.boxes import Box
from realloc.layout.conventions import expert_projection

if TYPE_CHECKING:
    from realloc.layout.topology import Topology

__all__ = ["torchtitan_expert_pieces", "torchtitan_local_shape", "torchtitan_name"]


def _mesh(topology: "Topology", num_experts: int, tp_rank: int, fsdp_rank: int) -> tuple[range, bool, int, int]:
    """``(experts held, Shard(0)?, efsdp rank, efsdp)`` of coordinate ``(fsdp_rank, tp_rank)``."""
    t = topology
    i = tp_rank + t.tp * fsdp_rank
    ep_rank, efsdp_rank = i % t.ep, i // t.ep
    efsdp = t.fsdp * t.tp // t.ep
    per = num_experts // t.ep
    block = range(ep_rank * per, (ep_rank + 1) * per)
    whole = efsdp * t.ep <= num_experts  # torchtitan's Shard(0) on the expert axis, else Shard(1)
    chunk = -(-per // efsdp)
    return (block[efsdp_rank * chunk : (efsdp_rank + 1) * chunk] if whole else block), whole, efsdp_rank, efsdp


def _rows(n: int, efsdp: int, efsdp_rank: int) -> tuple[int, int]:
    """``(first, count)`` of the rows efsdp rank ``efsdp_rank`` holds of ``n`` (``torch.chunk``)."""
    rows = -(-n // efsdp)
    first = min(efsdp_rank * rows, n)
    return first, min(first + rows, n) - first


def torchtitan_local_shape(
    shape: tuple[int, ...], topology: "Topology", num_experts: int, tp_rank: int, fsdp_rank: int
) -> tuple[int, ...]:
    """The local shape of the stack ``[E, *shape]`` of one expert tensor kind on coordinate
    ``(fsdp_rank, tp_rank)`` (FSDP2's local tensor, zero-size where its chunk is empty)."""
    held, whole, efsdp_rank, efsdp = _mesh(topology, num_experts, tp_rank, fsdp_rank)
    if whole:
        return (len(held),) + tuple(shape)
    return (len(held), _rows(shape[0], efsdp, efsdp_rank)[1]) + tuple(shape[1:])


def torchtitan_name(p) -> str:
    """torchtitan's name of the stack routed expert weight ``p`` is part of (the FQN its
    state_dict_adapter maps checkpoints to: ``layers.N.moe.routed_experts.inner_experts.w1_EFD``)."""
    kind = ("w1_EFD", "w3_EFD", "w2_EDF")[expert_projection(p, "torchtitan")]
    return f"layers.{p.layer}.moe.routed_experts.inner_experts.{kind}"


def torchtitan_expert_pieces(
    entries: list[tuple], topology: "Topology", num_experts: int, tp_rank: int, fsdp_rank: int
) -> dict[int, list[tuple[Box, tuple[int, ...]]]]:
    """Entry index -> the ``(box, local_shape)`` pieces coordinate ``(fsdp_rank, tp_rank)`` holds
    of every routed expert entry of ``entries`` (``(param spec, name, slot, offsets, sizes,
    local)``, experts as whole boxes), ``[]`` for the experts it holds nothing of.

    Example (8 experts, fsdp=4, ep=2: efsdp 2, ``2 * 2 <= 8``: Shard(0), 2 experts each):
        >>> from realloc.layout.topology import Topology
        >>> from realloc.spec import ParamSpec
        >>> t = Topology(fsdp=4, ep=2, etp=1)
        >>> e = [(ParamSpec(f"experts.{x}.w", (4, 2), "float32", "layer", 0, expert=x), "", "", [0, 0], [4, 2], [4, 2])
        ...      for x in range(8)]
        >>> sorted(i for i, p in torchtitan_expert_pieces(e, t, 8, 0, 3).items() if p)  # i = 3: ep 1, efsdp 1
        [6, 7]
        >>> four = Topology(fsdp=8, ep=2, etp=1)  # 4 experts: efsdp 4, 4 x 2 > 4: Shard(1)
        >>> torchtitan_expert_pieces(e[:4], four, 4, 0, 3)[2]  # ep 1 (experts 2, 3), row 1 of 4
        [(((1, 0), (1, 2)), (1, 2))]
    """
    mine, whole, efsdp_rank, efsdp = _mesh(topology, num_experts, tp_rank, fsdp_rank)
    out: dict[int, list] = {}
    for index, (p, _, _, offsets, sizes, _) in enumerate(entries):
        if p.expert is None:
            continue
        out[index] = []
        if p.expert not in mine:
            continue
        offsets, sizes = list(offsets), list(sizes)
        if not whole:  # the rows of this efsdp rank
            first, sizes[0] = _rows(sizes[0], efsdp, efsdp_rank)
            offsets[0] += first
            if not sizes[0]:
                continue
        out[index] = [((tuple(offsets), tuple(sizes)), tuple(sizes))]
    return out
