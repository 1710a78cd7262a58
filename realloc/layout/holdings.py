"""Planner input: which group of workers holds (or needs) which box of which parameter.

A :class:`Group` lists one coordinate's boxes as Python tuples, which is what a caller writes
by hand (checkpoint retrieval, tests) and what :meth:`~realloc.layout.Layout.groups` gives. A
layout of thousands of sharded ranks has millions of such boxes; :class:`PieceTable` keeps them
per parameter as three integer arrays, so the planner handles a parameter's boxes at once and
compares whole parameters by value (the same kind of tensor in every layer has the same boxes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Group:
    """Workers that hold (or need) exactly the same boxes of the parameters listed: one shard
    coordinate over its replicas (with expert parallelism a worker is in a dense group and an
    expert group, which list different parameters)."""

    workers: tuple[int, ...]
    pieces: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # (param, offsets, sizes)


@dataclass(frozen=True)
class PieceTable:
    """``groups[i]`` are the workers of group ``i``; ``params[name] = (group, offsets, sizes)``:
    group index per box ``(k,)`` and the boxes ``(k, ndim)``, in group order, then each group's
    own order. Boxes are non-empty.

    Example:
        >>> t = PieceTable.of_groups([Group((0, 1), (("w", (0,), (4,)),)), Group((2,), (("w", (4,), (4,)),))])
        >>> t.groups, [a.tolist() for a in t.params["w"]]
        ([(0, 1), (2,)], [[0, 1], [[0], [4]], [[4], [4]]])
    """

    groups: list[tuple[int, ...]]
    params: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    #: The boxes lie inside their parameters' shapes by construction (a layout's, built from the
    #: spec it was checked against): the planner checks only the names and the workers.
    boxes_checked: bool = False

    @staticmethod
    def of_groups(groups: Sequence[Group]) -> "PieceTable":
        rows: dict[str, tuple[list[int], list[tuple[int, ...]], list[tuple[int, ...]]]] = {}
        for gi, g in enumerate(groups):
            for param, offsets, sizes in g.pieces:
                entry = rows.setdefault(param, ([], [], []))
                entry[0].append(gi)
                entry[1].append(tuple(offsets))
                entry[2].append(tuple(sizes))
        params = {}
        for param, (gis, offsets, sizes) in rows.items():
            ndims = {len(o) for o in offsets} | {len(s) for s in sizes}
            if len(ndims) != 1:
                raise ValueError(f"boxes of {param!r} have different numbers of dims: {sorted(ndims)}")
            ndim = ndims.pop()
            params[param] = (np.array(gis, dtype=np.int64), _matrix(offsets, ndim), _matrix(sizes, ndim))
        return PieceTable([tuple(g.workers) for g in groups], params)

    def boxes(self, param: str) -> list[tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]]:
        """``(group, box)`` of every box of ``param``, as Python tuples."""
        return self.boxes_of(self.params[param])

    @staticmethod
    def boxes_of(rows: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[tuple[int, tuple[tuple[int, ...], ...]]]:
        """``(group, box)`` of every row of one parameter's ``(group, offsets, sizes)`` arrays."""
        gis, offsets, sizes = rows
        return [(g, (tuple(o), tuple(s))) for g, o, s in zip(gis.tolist(), offsets.tolist(), sizes.tolist())]


def _matrix(rows: list[tuple[int, ...]], ndim: int) -> np.ndarray:
    try:
        return np.array(rows, dtype=np.int64).reshape(len(rows), ndim)
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(f"box coordinates must be integers: {err}") from None
