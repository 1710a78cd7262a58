"""Flat (row-major) ranges of boxes, and DeepSpeed ZeRO-3's flat partitions built from them.

DeepSpeed ZeRO stage 3 (``Init._partition_param`` in deepspeed/runtime/zero/partition_parameters.py,
deepspeedai/DeepSpeed) partitions a parameter over its data-parallel partition group of ``world``
ranks by flattening it (``param.contiguous().view(-1)``) and cutting the flat tensor into
``world`` equal parts after padding:

* ``partition_size = ceil(numel / world)`` (``_aligned_size`` = numel + ``_padding_size``, the
  padding up to a multiple of ``world``, then ``// world``);
* rank ``i`` (its rank in the partition group) holds flat elements
  ``[i * partition_size, min((i + 1) * partition_size, numel))``;
* its ``ds_tensor`` is 1-D with ``partition_size`` elements on *every* rank: the tail past
  ``numel`` (the last holding rank's padding, and all of it on ranks past the end) is never part
  of the parameter. DeepSpeed leaves it uninitialised (``torch.empty``); here it is zero.
* With Megatron tensor parallelism (``Init(mpu=...)``: the partition group is the data-parallel
  group) the parameter is the tp-local tensor as Megatron allocates it, so the flat tensor is the
  tp shard's, vocabulary padding rows included (``[P / tp, hidden]``; :func:`zero3_parts_pieces`).

A layout with ``Topology(fsdp_split="zero3")`` holds a rank's flat range of a tp box as the few
boxes :func:`flat_range_boxes` cuts it into, consecutive in the rank's buffer, so the buffer
slice is exactly the ``ds_tensor`` (:func:`zero3_pieces`; see docs/conventions.md, "ZeRO-3 flat
partitions"). This module is the geometry alone; :func:`realloc.shards.views.flat_views` gives a
rank's partitions as tensors.
"""

from __future__ import annotations

import math

from realloc.boxes import Box

__all__ = [
    "check_parts",
    "flat_range_boxes",
    "padded_pieces",
    "zero3_partition",
    "zero3_parts_pieces",
    "zero3_pieces",
]


def flat_range_boxes(offsets: tuple[int, ...], sizes: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` (row-major flat order) of box ``(offsets, sizes)`` as boxes.

    Contract:

    * ``0 <= start <= stop <= numel`` of the box, else ``ValueError``; ``start == stop`` gives ``[]``.
    * The returned boxes, in order, list exactly the elements ``[start, stop)`` in row-major
      order: each box is itself a run of consecutive flat positions (all its dims after the first
      one larger than 1 are whole), and each starts where the previous ended. So the row-major
      flattening of the boxes, concatenated, is ``box.reshape(-1)[start:stop]``.
    * They are the fewest such runs: one box when the range is whole rows (or lies in one row,
      recursively); otherwise a partial first row (suffix of that row, recursively), the whole
      rows between, and a partial last row (prefix of that row, recursively), each present only
      when non-empty. At most ``2 * ndim - 1`` boxes: 1 for 1-D, 3 for 2-D; a suffix or prefix
      range (one ending at ``numel`` or starting at 0) takes at most ``ndim``.

    Example:
        >>> flat_range_boxes((0, 0), (3, 4), 2, 11)
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
        >>> flat_range_boxes((10, 5), (3, 4), 4, 12), flat_range_boxes((0,), (7,), 2, 5)
        ([((11, 5), (2, 4))], [((2,), (3,))])
    """
    offsets, sizes = tuple(offsets), tuple(sizes)
    total = math.prod(sizes)
    if len(offsets) != len(sizes) or not sizes or not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) of box offsets={offsets} sizes={sizes} ({total} elements)")
    if start == stop:
        return []
    if len(sizes) == 1:
        return [((offsets[0] + start,), (stop - start,))]
    row = total // sizes[0]  # elements of one index of dim 0
    first, first_in = divmod(start, row)
    last, last_in = divmod(stop, row)  # stop is exclusive: row ``last`` holds ``last_in`` of them

    def lift(r: int, inner: list[Box]) -> list[Box]:
        return [((offsets[0] + r,) + o, (1,) + s) for o, s in inner]

    if first == last:  # inside one row
        return lift(first, flat_range_boxes(offsets[1:], sizes[1:], first_in, stop - first * row))
    out = []
    if first_in:
        out += lift(first, flat_range_boxes(offsets[1:], sizes[1:], first_in, row))
        first += 1
    if last > first:
        out.append(((offsets[0] + first,) + offsets[1:], (last - first,) + sizes[1:]))
    if last_in:
        out += lift(last, flat_range_boxes(offsets[1:], sizes[1:], 0, last_in))
    return out


def zero3_partition(numel: int, world: int, rank: int) -> tuple[int, int, int]:
    """``(start, stop, partition_size)`` of ZeRO-3 rank ``rank`` of ``world`` on ``numel`` elements:
    flat elements ``[start, stop)``, ``partition_size - (stop - start)`` of padding after them.

    Example:
        >>> [zero3_partition(10, 4, r) for r in range(4)]
        [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]
        >>> zero3_partition(5, 4, 3)  # past the end: padding only
        (5, 5, 2)
    """
    if world < 1 or not 0 <= rank < world or numel < 0:
        raise ValueError(f"ZeRO-3 partition of {numel} elements: rank {rank} of world {world}")
    size = -(-numel // world)
    start = min(rank * size, numel)
    return start, min(start + size, numel), size


def zero3_pieces(
    offsets: tuple[int, ...], sizes: tuple[int, ...], world: int, rank: int
) -> list[tuple[Box, tuple[int, ...]]]:
    """ZeRO-3 rank ``rank``'s flat partition of box ``(offsets, sizes)`` as ``(box, local_shape)``
    pieces, to lie consecutively in a buffer; their local elements add up to the partition size.

    The pieces are :func:`flat_range_boxes` of the rank's range. Padding (the partition past the
    box's last element) extends the last piece's *last* dim, the box sitting at the origin of its
    local tensor as for vocabulary padding; so when padding follows a piece spanning several
    innermost rows, its last innermost row becomes a piece of its own (at most ``2 * ndim - 1``
    pieces still). A rank past the end holds one padding-only piece: the box origin with every
    size 0, local shape ``(1, ..., 1, partition_size)``. A partition size of 0 (an empty box)
    gives no piece. (:func:`zero3_parts_pieces` with one part that is its box.)

    Example:
        >>> zero3_pieces((0, 0), (2, 3), 4, 1)  # partition size 2: elements 2, 3
        [(((0, 2), (1, 1)), (1, 1)), (((1, 0), (1, 1)), (1, 1))]
        >>> zero3_pieces((0, 0), (2, 3), 4, 3)  # past the end: padding only
        [(((0, 0), (0, 0)), (1, 2))]
        >>> zero3_pieces((0, 0), (7, 2), 3, 2)  # elements 10..13 (rows 5, 6) and one of padding
        [(((5, 0), (1, 2)), (1, 2)), (((6, 0), (1, 2)), (1, 3))]
        >>> zero3_pieces((4,), (3,), 2, 1)
        [(((6,), (1,)), (2,))]
    """
    return [(box, local) for _, box, local in zero3_parts_pieces([(offsets, sizes, sizes)], world, rank)]


def check_parts(parts: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]], where: str = "") -> None:
    """``ValueError`` unless ``parts`` can be one engine parameter concatenated along dim 0: each
    ``(offsets, sizes, local_shape)`` with the box at the origin of its local tensor, padding only
    as trailing rows of dim 0 (``local_shape[1:] == sizes[1:]``), all with the same trailing dims."""
    for offsets, sizes, local in parts:
        if not (len(offsets) == len(sizes) == len(local) >= 1) or local[1:] != sizes[1:] or local[0] < sizes[0]:
            raise ValueError(
                f"{where or 'a part'}: box sizes {tuple(sizes)} in local shape {tuple(local)}: a sharded-DP "
                "parameter's parts may be padded only by trailing rows of dim 0"
            )
    if len({tuple(local[1:]) for _, _, local in parts}) > 1:
        raise ValueError(f"{where or 'parts'}: trailing dims differ, they are not one tensor along dim 0")


def zero3_parts_pieces(
    parts: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]], world: int, rank: int
) -> list[tuple[int, Box, tuple[int, ...]]]:
    """ZeRO-3 rank ``rank``'s flat partition of ONE engine parameter made of ``parts``, as
    ``(part index, box, local_shape)`` pieces to lie consecutively in a buffer.

    The parameter DeepSpeed flattens is the concatenation along dim 0 of the parts' local tensors
    (:func:`check_parts`): each ``(offsets, sizes, local_shape)`` is a box of a global tensor at the
    origin of a local tensor that may have trailing padding rows (Megatron's padded vocabulary
    shard: ``[P / tp, hidden]``), and several parts are a fused tensor (Megatron's ``linear_qkv``:
    per query group q, k, v boxes). Its ``numel`` counts the padding rows, so they are flattened
    and partitioned like real elements (never sent; zero here). The rank's range
    ``[rank * size, (rank + 1) * size)``, ``size = ceil(numel / world)``, is cut part by part into
    :func:`flat_range_boxes`; each run of padding (a part's padding rows, the partition's tail)
    extends the piece before it as :func:`zero3_pieces` describes, or is a padding-only piece (size-0
    box at its part's origin, local ``(1, ..., 1, n)``) when no real element of that part precedes
    it in the range.

    Example:
        >>> zero3_parts_pieces([((0, 0), (2, 2), (2, 2)), ((4, 0), (1, 2), (1, 2))], 2, 1)  # fused rows
        [(0, ((1, 1), (1, 1)), (1, 1)), (1, ((4, 0), (1, 2)), (1, 2))]
        >>> zero3_parts_pieces([((6, 0), (1, 2), (3, 2))], 2, 1)  # 1 real row in 3: padding only
        [(0, ((6, 0), (0, 0)), (1, 3))]
    """
    check_parts(parts, "zero3")
    totals = [math.prod(local) for _, _, local in parts]
    size = zero3_partition(sum(totals), world, rank)[2]  # (ValueError for a rank outside the world)
    start, stop = rank * size, (rank + 1) * size  # the tail past numel is padding of the last part
    if size == 0:
        return []
    out: list[tuple[int, Box, tuple[int, ...]]] = []
    base = 0
    for i, ((offsets, sizes, _), total) in enumerate(zip(parts, totals)):
        if i == len(parts) - 1:
            total += world * size - sum(totals)
        lo, hi = max(start, base), min(stop, base + total)
        if lo < hi:
            real = math.prod(sizes)
            r_lo, r_hi = lo - base, min(hi - base, real)
            boxes = flat_range_boxes(tuple(offsets), tuple(sizes), r_lo, r_hi) if r_lo < r_hi else []
            pad = hi - base - max(r_lo, real)
            out += [(i, box, local) for box, local in padded_pieces(tuple(offsets), tuple(sizes), boxes, max(pad, 0))]
        base += total
    return out


def padded_pieces(
    offsets: tuple[int, ...], sizes: tuple[int, ...], boxes: list[Box], pad: int
) -> list[tuple[Box, tuple[int, ...]]]:
    """``boxes`` (a flat run of a box) followed by ``pad`` padding elements, as ``(box, local)``:
    the padding extends the last innermost row of the last box, or is a padding-only piece."""
    if not pad:
        return [(b, b[1]) for b in boxes]
    if not boxes:
        return [((offsets, (0,) * len(sizes)), (1,) * (len(sizes) - 1) + (pad,))]
    boxes = list(boxes)  # the caller's list stays as it is
    last_offsets, last_sizes = boxes.pop()
    row = last_sizes[-1]
    if any(n > 1 for n in last_sizes[:-1]):  # keep all but its last innermost row as they are
        boxes += flat_range_boxes(last_offsets, last_sizes, 0, math.prod(last_sizes) - row)
        last_offsets = tuple(o + n - 1 for o, n in zip(last_offsets[:-1], last_sizes[:-1])) + last_offsets[-1:]
        last_sizes = (1,) * (len(sizes) - 1) + (row,)
    pieces = [(b, b[1]) for b in boxes]
    pieces.append(((last_offsets, last_sizes), last_sizes[:-1] + (row + pad,)))
    return pieces
