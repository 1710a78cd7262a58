"""Sharded data parallelism: how the fsdp ranks cut ONE engine parameter (FSDP2 or ZeRO-3).

An engine parameter under sharded data parallelism is the rank's tensor-parallel local tensor,
given here as its *parts*: ``(offsets, sizes, local_shape)`` boxes of global tensors, each at the
origin of its local tensor (trailing padding rows of dim 0 allowed: Megatron's padded vocabulary
shard), concatenated along dim 0 (:func:`realloc.layout.zero3.check_parts`). Usually one part;
several for a fused tensor: under ``Layout(qkv_order="megatron")`` the engine is Megatron's model,
which holds q/k/v as ONE ``linear_qkv`` parameter and gate/up as ONE ``linear_fc1``
(:func:`engine_params`), so FSDP2's chunks and ZeRO-3's partitions are of the fused tensors.

* ``fsdp_split="fsdp2"``: PyTorch FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
  ``FSDPParam._init_sharded_param``; ``_chunk_with_empty`` in ``_fsdp_common.py``) cuts the local
  tensor with ``torch.chunk(local, fsdp, dim=0)``: chunks of ``ceil(rows / fsdp)`` rows, fewer
  chunks than ranks when they run out (:func:`fsdp2_parts_pieces`).
* ``fsdp_split="zero3"``: DeepSpeed ZeRO-3 flattens it and cuts equal partitions
  (:func:`realloc.layout.zero3.zero3_parts_pieces`).

:func:`sharded_pieces` is what :class:`~realloc.layout.Layout` calls per engine parameter;
docs/conventions.md, "Sharded data parallelism (FSDP2/HSDP)" and "ZeRO-3 flat partitions".
"""

from __future__ import annotations

import re

from realloc.boxes import Box
from realloc.layout.zero3 import check_parts, zero3_parts_pieces

__all__ = ["engine_params", "fsdp2_parts_pieces", "megatron_fused_name", "sharded_pieces"]

_FUSED = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn\.(?P<qkv>[qkv])_proj"
    r"|(?:mlp|block_sparse_moe)\.(?:(?P<shared>shared_experts?)\.|experts\.(?P<expert>\d+)\.)?"
    r"(?P<fc1>gate_proj|up_proj|w1|w3))\.(?P<suffix>weight|bias)$"
)


def megatron_fused_name(slot: str, routed: bool = True) -> "str | None":
    """The Megatron-core parameter a slot is part of when Megatron's model holds it fused, else None:
    q/k/v -> ``model.layers.N.self_attention.linear_qkv.{weight,bias}`` (megatron/core/transformer/
    attention.py ``SelfAttention.linear_qkv``), gate/up -> ``model.layers.N.mlp.linear_fc1.{weight,bias}``
    (megatron/core/transformer/mlp.py, gated linear unit). MoE layers hold one ``linear_fc1``
    (an ``MLP`` with the gated linear unit) per expert too: the shared experts' ``[gate; up]`` is
    ``model.layers.N.mlp.shared_experts.linear_fc1`` (megatron/core/transformer/moe/shared_experts.py
    ``SharedExpertMLP``; HF ``mlp.shared_expert`` / ``mlp.shared_experts``), and routed expert
    ``E``'s is ``model.layers.N.mlp.experts.local_experts.E.linear_fc1`` (``SequentialMLP`` in
    megatron/core/transformer/moe/experts.py; ``E`` is the global index, Megatron's local one
    under expert parallelism 1, the only one FSDP composes with here). ``routed=False``: routed
    experts are not per-expert parameters (stacked by the layout's ``expert_order``).

    Example:
        >>> megatron_fused_name("model.layers.3.self_attn.k_proj.bias"), megatron_fused_name("model.layers.0.mlp.up_proj.weight")
        ('model.layers.3.self_attention.linear_qkv.bias', 'model.layers.0.mlp.linear_fc1.weight')
        >>> megatron_fused_name("model.layers.1.mlp.experts.2.gate_proj.weight")
        'model.layers.1.mlp.experts.local_experts.2.linear_fc1.weight'
        >>> megatron_fused_name("model.layers.0.mlp.down_proj.weight") is None
        True
    """
    m = _FUSED.match(slot)
    if not m:
        return None
    if m["qkv"]:
        module = "self_attention.linear_qkv"
    elif m["shared"]:
        module = "mlp.shared_experts.linear_fc1"
    elif m["expert"] is not None:
        if not routed:
            return None
        module = f"mlp.experts.local_experts.{m['expert']}.linear_fc1"
    elif m["fc1"] in ("w1", "w3"):
        return None  # Mixtral's w1/w3 are only routed experts'
    else:
        module = "mlp.linear_fc1"
    return f"model.layers.{m['layer']}.{module}.{m['suffix']}"


def engine_params(entries: list[tuple], fused: bool, routed: bool = True) -> list[list[tuple]]:
    """A coordinate's entries ``(param spec, name, slot, ...)`` in buffer order -> the engine's
    parameters, each the list of its parts: one entry each, or with ``fused`` (Megatron's model,
    ``Layout(qkv_order="megatron")``) the consecutive entries of one :func:`megatron_fused_name` as
    one parameter (``linear_qkv``: every local query group's q, k, v boxes; ``linear_fc1``: gate,
    up, of the dense MLP, the shared experts and, with ``routed``, each routed expert).
    """
    out: list[list[tuple]] = []
    last = None
    for entry in entries:
        name = megatron_fused_name(entry[2], routed) if fused else None
        if name is not None and name == last:
            out[-1].append(entry)
        else:
            out.append([entry])
        last = name
    return out


def fsdp2_parts_pieces(
    parts: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]], fsdp: int, rank: int
) -> list[tuple[int, Box, tuple[int, ...]]]:
    """FSDP2 rank ``rank``'s chunk ``torch.chunk(local, fsdp, dim=0)[rank]`` of the parameter made of
    ``parts`` (their local tensors concatenated along dim 0), as ``(part index, box, local_shape)``.

    The chunk has ``c = ceil(rows / fsdp)`` rows (``rows`` counting padding rows), rows
    ``[rank * c, min((rank + 1) * c, rows))``; ``[]`` when that is empty (``torch.chunk`` gave fewer
    chunks: FSDP2's empty local tensor, no shard). Each part the chunk meets gives one piece: its
    real rows in the chunk as the box, at the origin of the piece's local rows (the part's padding
    rows in the chunk after them); a piece of padding rows only has a box of 0 rows (the part's other dims).

    Example:
        >>> fsdp2_parts_pieces([((0, 0), (3, 2), (3, 2))], 2, 1)  # rows 2..3 of 3: one row
        [(0, ((2, 0), (1, 2)), (1, 2))]
        >>> fsdp2_parts_pieces([((8, 0), (3, 2), (4, 2))], 2, 1)  # padded to 4 rows: rows 2, 3
        [(0, ((10, 0), (1, 2)), (2, 2))]
        >>> fsdp2_parts_pieces([((0,), (2,), (2,)), ((5,), (2,), (2,))], 4, 2)  # a fused [a; b]
        [(1, ((5,), (1,)), (1,))]
        >>> fsdp2_parts_pieces([((0,), (2,), (2,))], 4, 3)  # torch.chunk gives 2 chunks
        []
    """
    check_parts(parts, "fsdp2")
    if not 0 <= rank < fsdp:
        raise ValueError(f"FSDP2 chunk of rank {rank} of fsdp={fsdp}")
    rows = sum(local[0] for _, _, local in parts)
    chunk = -(-rows // fsdp)
    start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    out: list[tuple[int, Box, tuple[int, ...]]] = []
    base = 0
    for i, (offsets, sizes, local) in enumerate(parts):
        lo, hi = max(start, base) - base, min(stop, base + local[0]) - base
        base += local[0]
        if lo >= hi:
            continue
        held = max(0, min(hi, sizes[0]) - lo)
        box = ((offsets[0] + min(lo, sizes[0]),) + tuple(offsets[1:]), (held,) + tuple(sizes[1:]))
        out.append((i, box, (hi - lo,) + tuple(local[1:])))
    return out


def sharded_pieces(entries: list[tuple], split: str, fsdp: int, fsdp_rank: int, padded: bool) -> list[tuple]:
    """One engine parameter's tp entries ``(param spec, name, slot, offsets, sizes, local_shape)``
    (its parts, in order) -> the entries of fsdp rank ``fsdp_rank``'s pieces of it, in buffer order.

    ``padded``: the engine shards the padded local tensor (its padding rows are part of the
    parameter); otherwise only the real rows (the box) are, as a DTensor's local tensor without
    vocabulary padding.
    """
    parts = [(tuple(e[3]), tuple(e[4]), tuple(e[5]) if padded else tuple(e[4])) for e in entries]
    cut = zero3_parts_pieces if split == "zero3" else fsdp2_parts_pieces
    out = []
    for i, (offsets, sizes), local in cut(parts, fsdp, fsdp_rank):
        p, name, slot = entries[i][:3]
        out.append((p, name, slot, list(offsets), list(sizes), list(local)))
    return out
