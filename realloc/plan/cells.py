"""Step 1 of the exchange planner (:mod:`realloc.plan.planner`): cells and bundles.

Per parameter, every needed box is cut at every holder/need boundary; each cell gets the set of
holder groups and need groups that cover it. Cells with the same (holders, needers) sets form a
:class:`Bundle`: a replicated norm becomes one bundle needed by all tp groups, so it crosses each
node boundary once, not once per source tp rank.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from realloc.boxes import Box
from realloc.layout import PieceTable
from realloc.plan.inputs import ParamTable
from realloc.plan.placement import Placement
from realloc.plan.records import BUCKET_ALIGN
from realloc.spec import DTYPE_BYTES

__all__ = ["Bundle", "box_bytes", "bundles_of", "cells_bytes", "cells_sizes"]


@dataclass
class Bundle:
    """Cells with the same holder groups and need groups, and the nodes of those workers."""

    #: ``(params, dtype, cells)``: every param of ``params`` (one dtype) has exactly ``cells`` in
    #: this bundle (the same kind of tensor in many layers shares one cell list).
    blocks: list[tuple[tuple[str, ...], str, list[Box]]]
    nbytes: int
    #: ``nbytes`` with every cell padded to ``BUCKET_ALIGN``, as buckets lay them out (``records.buckets``)
    padded: int
    holders: dict[str, list[int]]  # node -> holder workers (sorted)
    needers: dict[str, list[int]]  # node -> needing workers (sorted)


def _node_map(workers: set[int], placement: Placement) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for w in sorted(workers):
        out[placement.nodes[w]].append(w)
    return dict(out)


#: A parameter's cells grouped by (holder groups, need groups), and the needed cells no one holds.
_Pattern = tuple[dict[tuple[frozenset, frozenset], list[Box]], list[Box]]


def bundles_of(
    holdings: PieceTable, needs: PieceTable, params: ParamTable, placement: Placement
) -> tuple[list[Bundle], int]:
    """The bundles of the cells every need cuts out of the holdings, and the lower bound of the
    inter-node bytes (per bundle, its bytes once into every needing node that holds none of it);
    ``ValueError`` when a needed cell is held by no one."""
    order = {name: i for i, name in enumerate(params)}

    # Parameters with the same dtype, holder boxes and need boxes (the same kind of tensor in
    # every layer of a stage) have the same cells: each distinct signature is cut once, and a
    # bundle holds one block per signature, however many layers share it.
    patterns: dict[tuple, tuple[_Pattern, list[str]]] = {}
    geometries: dict[tuple, _Pattern] = {}  # see _labelled_cells
    missing: list[str] = []
    unheld_count = 0
    nothing = (np.zeros(0, dtype=np.int64),) * 3
    for param in sorted(needs.params, key=order.__getitem__):
        held, needed = holdings.params.get(param, nothing), needs.params[param]
        raw = tuple(a.tobytes() for a in held + needed)
        signature = (params[param][1], len(params[param][0])) + raw
        entry = patterns.get(signature)
        if entry is None:
            geometry = (held[1].shape, needed[1].shape) + raw[1:3] + raw[4:]
            entry = patterns[signature] = (_labelled_cells(held, needed, geometry, geometries), [])
        entry[1].append(param)
        unheld = entry[0][1]
        unheld_count += len(unheld)
        missing += [f"{param} offsets={cell[0]} sizes={cell[1]}" for cell in unheld[: 3 - len(missing)]]
    if unheld_count:
        raise ValueError(f"{unheld_count} needed boxes are held by no worker, e.g. {missing}")
    keyed: dict[tuple[frozenset, frozenset], list[tuple[tuple[str, ...], str, list[Box]]]] = defaultdict(list)
    for (dtype, *_), ((by_sets, _), names) in patterns.items():
        for sets, cells in by_sets.items():
            keyed[sets].append((tuple(names), dtype, cells))

    bundles: list[Bundle] = []
    lower_bound = 0
    sizes: dict[tuple[int, str], tuple[int, int]] = {}  # (id of a cell list, dtype) -> bytes, padded bytes

    def cached_sizes(cells: list[Box], dtype: str) -> tuple[int, int]:
        n = sizes.get((id(cells), dtype))
        if n is None:
            n = sizes[id(cells), dtype] = cells_sizes(cells, dtype)
        return n

    hold_maps: dict[frozenset, dict[str, list[int]]] = {}
    need_maps: dict[frozenset, dict[str, list[int]]] = {}
    for (holders, needers), blocks in sorted(
        keyed.items(), key=lambda kv: min((order[b[0][0]], b[2][0]) for b in kv[1])
    ):
        blocks.sort(key=lambda b: order[b[0][0]])
        nbytes = padded = 0
        for names, dtype, cells in blocks:
            size, aligned = cached_sizes(cells, dtype)
            nbytes += len(names) * size
            padded += len(names) * aligned
        if holders not in hold_maps:
            hold_maps[holders] = _node_map({w for gi in holders for w in holdings.groups[gi]}, placement)
        if needers not in need_maps:
            need_maps[needers] = _node_map({w for gi in needers for w in needs.groups[gi]}, placement)
        # bundles sharing a node map share the dict: nothing below mutates it
        b = Bundle(blocks, nbytes, padded, hold_maps[holders], need_maps[needers])
        lower_bound += nbytes * (len(b.needers) - sum(1 for node in b.holders if node in b.needers))
        bundles.append(b)
    return bundles, lower_bound


def cells_bytes(cells: list[Box], dtype: str) -> int:
    return sum(box_bytes(c, dtype) for c in cells)


def cells_sizes(cells: list[Box], dtype: str) -> tuple[int, int]:
    """``cells``' bytes, and their bytes with each cell padded to ``BUCKET_ALIGN`` (one pass)."""
    nbytes = padded = 0
    for c in cells:
        n = box_bytes(c, dtype)
        nbytes += n
        padded += -(-n // BUCKET_ALIGN) * BUCKET_ALIGN
    return nbytes, padded


def _labelled_cells(
    held: tuple[np.ndarray, np.ndarray, np.ndarray],
    needed: tuple[np.ndarray, np.ndarray, np.ndarray],
    geometry: tuple,
    geometries: dict,
) -> _Pattern:
    """:func:`_cut_cells` of a parameter's held and needed boxes (``PieceTable`` rows: group,
    offsets, sizes; ``geometry``: a key of their boxes alone). The cut depends on the boxes; the
    groups only name the sets. So the boxes are cut once per geometry (``geometries``), and a
    parameter of a geometry already cut gets those sets renamed, box by box, from the groups of
    the first one cut to its own: the same expert tensor held by other ranks (DeepSeek-V3: 7,872
    group signatures) is not cut again. Where either names one group twice the boxes are cut (two
    boxes of one group fall into one set, which renaming would not merge)."""
    first = geometries.get(geometry)
    if first is None:
        geometries[geometry] = (
            (cut := _cut_cells(PieceTable.boxes_of(held), PieceTable.boxes_of(needed))),
            held[0].tolist(),
            needed[0].tolist(),
        )
        return cut
    (by_sets, unheld), h0, n0 = first
    h, n = held[0].tolist(), needed[0].tolist()
    if any(len(set(x)) < len(x) for x in (h0, n0, h, n)):
        return _cut_cells(PieceTable.boxes_of(held), PieceTable.boxes_of(needed))
    hmap, nmap = dict(zip(h0, h)), dict(zip(n0, n))
    return {
        (frozenset(hmap[g] for g in hs), frozenset(nmap[g] for g in ns)): cells for (hs, ns), cells in by_sets.items()
    }, unheld


def _cut_cells(held: list[tuple[int, Box]], needed: list[tuple[int, Box]]) -> _Pattern:
    """Cut every needed box at every held/needed boundary; group the grid cells by the sets of
    holder groups and need groups covering them (cells in sorted order); list unheld cells."""
    boxes = [b for _, b in held] + [b for _, b in needed]
    ndim = len(boxes[0][0])
    cuts = [sorted({b[0][d] for b in boxes} | {b[0][d] + b[1][d] for b in boxes}) for d in range(ndim)]
    covering = _covering_masks(held, cuts)
    needing = _covering_masks(needed, cuts)
    cells: dict[Box, tuple[int, ...]] = {}
    for _, box in needed:
        for cell, index in _grid_cells_indexed(box, cuts):
            cells.setdefault(cell, index)
    holder_sets: dict[int, frozenset] = {}
    need_sets: dict[int, frozenset] = {}
    by_sets: dict[tuple[frozenset, frozenset], list[Box]] = defaultdict(list)
    unheld: list[Box] = []
    for cell in sorted(cells):
        index = cells[cell]
        # A box covers a grid cell whole or not at all: the holders (needers) of a cell are
        # the held (needed) boxes covering its grid interval in every dim (bitmask per interval).
        mask = covering[0][index[0]]
        need_mask = needing[0][index[0]]
        for d in range(1, ndim):
            mask &= covering[d][index[d]]
            need_mask &= needing[d][index[d]]
        if not mask:
            unheld.append(cell)
            continue
        holders = holder_sets.get(mask)
        if holders is None:
            holders = holder_sets[mask] = frozenset(held[i][0] for i in _bits(mask))
        needers = need_sets.get(need_mask)
        if needers is None:
            needers = need_sets[need_mask] = frozenset(needed[i][0] for i in _bits(need_mask))
        by_sets[holders, needers].append(cell)
    return dict(by_sets), unheld


def _covering_masks(held: list[tuple[int, Box]], cuts: list[list[int]]) -> list[list[int]]:
    """Per dim, per grid interval ``k`` (between ``cuts[d][k]`` and ``cuts[d][k + 1]``): the bitmask
    of the entries of ``held`` whose box covers that interval (a sweep over interval starts/ends)."""
    out = []
    for d, points in enumerate(cuts):
        at = {c: k for k, c in enumerate(points)}
        toggles = [0] * len(points)
        for i, (_, (offsets, sizes)) in enumerate(held):
            bit = 1 << i
            toggles[at[offsets[d]]] ^= bit
            toggles[at[offsets[d] + sizes[d]]] ^= bit
        masks, current = [], 0
        for k in range(len(points) - 1):
            current ^= toggles[k]
            masks.append(current)
        out.append(masks)
    return out


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _grid_cells_indexed(box: Box, cuts: list[list[int]]) -> list[tuple[Box, tuple[int, ...]]]:
    """The grid cells of ``box`` with each cell's interval index per dim."""
    per_dim = []
    for d, (o, s) in enumerate(zip(*box)):
        points = cuts[d]
        first, last = bisect_left(points, o), bisect_left(points, o + s)
        per_dim.append([(points[k], points[k + 1] - points[k], k) for k in range(first, last)])
    if len(per_dim) == 2:
        rows, cols = per_dim
        return [(((o0, o1), (s0, s1)), (k0, k1)) for o0, s0, k0 in rows for o1, s1, k1 in cols]
    cells: list[tuple[tuple, tuple, tuple]] = [((), (), ())]
    for dim in per_dim:
        cells = [(off + (o,), siz + (s,), idx + (k,)) for off, siz, idx in cells for o, s, k in dim]
    return [((off, siz), idx) for off, siz, idx in cells]


def box_bytes(box: Box, dtype: str) -> int:
    n = DTYPE_BYTES[dtype]
    for s in box[1]:
        n *= s
    return n
