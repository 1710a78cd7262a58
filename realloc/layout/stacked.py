"""transformers 5's stacked experts (``Layout(expert_order="hf_stacked")``): geometry of a rank's part.

transformers 5 holds a MoE layer's routed experts as two parameters of its ``...Experts`` module
(``Qwen3MoeExperts`` in models/qwen3_moe/modeling_qwen3_moe.py, ``MixtralExperts`` in
models/mixtral/modeling_mixtral.py, likewise Qwen2-MoE and DeepSeek-V2/V3):

* ``model.layers.N.mlp.experts.gate_up_proj`` ``[E, 2 * inter, hidden]``: per expert its gate rows
  then its up rows (conversion_mapping.py: ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``
  of ``gate_proj``/``up_proj``, Mixtral ``w1``/``w3``);
* ``model.layers.N.mlp.experts.down_proj`` ``[E, hidden, inter]``.

Mixtral's module is ``mlp`` too (its checkpoints' ``block_sparse_moe.`` is renamed ``.mlp.``).
The spec keeps one tensor per expert (the checkpoint names), so here a stacked tensor is the
sequence of per-expert boxes ``gate_0, up_0, gate_1, up_1, ...`` (``down_0, down_1, ...``), each
the expert's tensor-parallel box, whose row-major concatenation is the stacked tensor:

* **tensor parallel** (distributed/tensor_parallel.py): ``gate_up_proj`` is ``"packed_colwise"``,
  ``_StridedShard(dim=1, split_factor=2)``: the rank's gate rows then its up rows of every expert,
  ``[E, 2 * inter / tp, hidden]``; ``down_proj`` is ``"rowwise"``, ``Shard(-1)``:
  ``[E, hidden, inter / tp]``. Those are the per-expert tp boxes, in vLLM's ``w13``/``w2`` order.
* **FSDP2** (``fully_shard``, torch/distributed/fsdp/_fully_shard/_fsdp_param.py): dim 0 of the
  (tp-local) stacked tensor is chunked, ``torch.chunk(local, fsdp, dim=0)``: fsdp rank ``i`` holds
  whole experts ``[i*c, min((i+1)*c, E))``, ``c = ceil(E / fsdp)``, and nothing (a zero-size local
  tensor) past them (:func:`stacked_pieces`).
* **ZeRO-3** (deepspeed/runtime/zero/partition_parameters.py ``_partition_param``): the
  (tp-local) stacked tensor is flattened and cut into ``fsdp`` parts of ``ceil(numel / fsdp)``
  elements; a part crosses expert (and gate/up) boundaries, so it is the flat ranges of the
  per-expert boxes it covers, padding after the last (:func:`stacked_pieces`).
"""

from __future__ import annotations

import math

from realloc.boxes import Box
from realloc.layout.conventions import expert_projection
from realloc.layout.zero3 import flat_range_boxes, padded_pieces, zero3_partition

__all__ = ["stacked_name", "stacked_owners", "stacked_pieces"]


def stacked_name(p) -> str:
    """transformers 5's name of the stacked tensor routed expert weight ``p`` is part of.

    Example:
        >>> from realloc.spec import ParamSpec
        >>> w3 = ParamSpec("model.layers.3.block_sparse_moe.experts.7.w3.weight", (4, 8), "bfloat16", "layer", 3, expert=7)
        >>> stacked_name(w3)  # Mixtral's up projection: transformers 5 names its MoE block mlp
        'model.layers.3.mlp.experts.gate_up_proj'
    """
    kind = "down_proj" if expert_projection(p, "hf_stacked") == 2 else "gate_up_proj"
    # a block-FP8 layout's scales: FP8Experts' gate_up_proj_scale_inv / down_proj_scale_inv
    # (src/transformers/integrations/finegrained_fp8.py), stacked as their weights
    scales = "_scale_inv" if p.name.endswith("_scale_inv") else ""
    return f"model.layers.{p.layer}.mlp.experts.{kind}{scales}"


def _stacks(entries: list[tuple]) -> dict[tuple, list[int]]:
    """Indices of ``entries`` (``(param spec, name, slot, offsets, sizes, local)`` in the stacked
    order of :func:`realloc.layout.conventions.stacked_expert_order`) per stacked tensor."""
    stacks: dict[tuple, list[int]] = {}
    for i, entry in enumerate(entries):
        p = entry[0]
        if p.expert is not None:
            stacks.setdefault((p.layer, expert_projection(p, "hf_stacked") == 2), []).append(i)
    return stacks


def _owners(entries: list[tuple], indices: list[int], fsdp: int) -> dict[int, int]:
    """Entry index -> the FSDP2 rank holding it whole: ``torch.chunk`` of the stack's expert axis."""
    position = {e: n for n, e in enumerate(dict.fromkeys(entries[i][0].expert for i in indices))}
    chunk = -(-len(position) // fsdp)
    return {i: position[entries[i][0].expert] // chunk for i in indices}


def stacked_owners(entries: list[tuple], fsdp: int) -> dict[int, int]:
    """Entry index -> the fsdp rank holding that routed expert tensor whole, for every routed
    expert entry of ``entries`` under FSDP2 (as :func:`stacked_pieces` places them)."""
    out: dict[int, int] = {}
    for indices in _stacks(entries).values():
        out.update(_owners(entries, indices, fsdp))
    return out


def stacked_pieces(
    entries: list[tuple], fsdp: int, fsdp_rank: int, zero3: bool
) -> dict[int, list[tuple[Box, tuple[int, ...]]]]:
    """Entry index -> the ``(box, local_shape)`` pieces fsdp rank ``fsdp_rank`` holds of that
    routed expert tensor, for every routed expert entry of ``entries`` (a tp coordinate's boxes in
    stacked order); ``[]`` where it holds none of it.

    FSDP2: whole experts of the rank's chunk of the expert axis. ZeRO-3: the rank's flat partition
    of each stacked tensor, as the flat ranges of the per-expert boxes it covers
    (:func:`~realloc.layout.zero3.flat_range_boxes`), consecutive, padding in the last piece (or
    one padding-only piece, box of size 0 at the first expert's origin, on a rank past the end).
    """
    out: dict[int, list] = {}
    for indices in _stacks(entries).values():
        for i in indices:
            out[i] = []
        if not zero3:
            for i, owner in _owners(entries, indices, fsdp).items():
                if owner == fsdp_rank:
                    _, _, _, offsets, sizes, local = entries[i]
                    out[i] = [((tuple(offsets), tuple(sizes)), tuple(local))]
            continue
        numels = [math.prod(entries[i][4]) for i in indices]
        start, stop, size = zero3_partition(sum(numels), fsdp, fsdp_rank)
        at, last = 0, indices[0]
        for i, n in zip(indices, numels):
            lo, hi = max(start - at, 0), min(stop - at, n)
            if lo < hi:
                boxes = flat_range_boxes(tuple(entries[i][3]), tuple(entries[i][4]), lo, hi)
                out[i] = [(b, b[1]) for b in boxes]
                last = i
            at += n
        pad = size - (stop - start)
        if pad:
            e = entries[last]
            out[last] = padded_pieces(tuple(e[3]), tuple(e[4]), [b for b, _ in out[last]], pad)
    return out
