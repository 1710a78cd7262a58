"""Box arithmetic: hyper-rectangles of a global tensor as ``(offsets, sizes)``."""

from __future__ import annotations

import math

Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_index(offsets, sizes) -> tuple[slice, ...]:
    """The index that cuts box ``(offsets, sizes)`` out of a full tensor: ``full[box_index(o, s)]``."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def contains(outer: Box, inner: Box) -> bool:
    (oo, os_), (io, is_) = outer, inner
    return all(o <= i and i + s <= o + z for o, z, i, s in zip(oo, os_, io, is_))


def intersect(a: Box, b: Box) -> Box | None:
    offsets, sizes = [], []
    for ao, az, bo, bz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + az, bo + bz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def inside_shape(box: Box, shape: tuple[int, ...]) -> bool:
    offsets, sizes = box
    return len(offsets) == len(sizes) == len(shape) and all(
        s > 0 and o >= 0 and o + s <= d for o, s, d in zip(offsets, sizes, shape)
    )


def numel(box: Box) -> int:
    return math.prod(box[1])


def split_rows(box: Box, parts: int) -> list[Box]:
    """Split ``box`` along dim 0 into at most ``parts`` near-equal boxes."""
    offsets, sizes = box
    parts = max(1, min(parts, sizes[0]))
    base, extra = divmod(sizes[0], parts)
    out, start = [], offsets[0]
    for i in range(parts):
        n = base + (i < extra)
        out.append(((start,) + offsets[1:], (n,) + sizes[1:]))
        start += n
    return out


def take_prefix(box: Box, max_elements: int) -> tuple[Box | None, list[Box]]:
    """Cut from ``box`` a leading box of at most ``max_elements`` elements.

    Returns ``(prefix or None, remainder boxes)``. Cuts whole rows of dim 0 when a row fits,
    otherwise cuts inside the first row (recursively on the lower dims), so any cap >= 1 element
    makes progress and the pieces, in order, tile ``box`` exactly.
    """
    offsets, sizes = box
    if max_elements <= 0:
        return None, [box]
    total = math.prod(sizes)
    if total <= max_elements:
        return box, []
    row = total // sizes[0]
    rows = max_elements // row
    if rows:
        head = ((offsets[0],) + offsets[1:], (rows,) + sizes[1:])
        tail = ((offsets[0] + rows,) + offsets[1:], (sizes[0] - rows,) + sizes[1:])
        return head, [tail]
    if len(sizes) == 1:
        return None, [box]
    sub_head, sub_rest = take_prefix((offsets[1:], sizes[1:]), max_elements)
    if sub_head is None:
        return None, [box]
    first = lambda b: ((offsets[0],) + b[0], (1,) + b[1])  # noqa: E731 - lift a row sub-box
    rest = [first(b) for b in sub_rest]
    if sizes[0] > 1:
        rest.append(((offsets[0] + 1,) + offsets[1:], (sizes[0] - 1,) + sizes[1:]))
    return first(sub_head), rest
