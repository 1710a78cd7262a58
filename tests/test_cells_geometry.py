"""Cells cut once per geometry (realloc/plan/cells.py ``_labelled_cells``): a parameter whose
boxes were cut before under other group names gets that cut with its own names, the same as
cutting its boxes again (``_cut_cells``), whatever the groups, including groups named twice."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc.layout import PieceTable
from realloc.plan.cells import _cut_cells, _labelled_cells


@st.composite
def rows(draw, length: int):
    """PieceTable rows of one parameter along one dim of ``length``: boxes from a random cut,
    each named by a random group (sometimes the same group twice)."""
    cuts = sorted(set(draw(st.lists(st.integers(1, length - 1), max_size=5))))
    bounds = [0, *cuts, length]
    boxes = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
    boxes += draw(st.lists(st.sampled_from(boxes), max_size=2))  # a box held twice
    groups = draw(st.lists(st.integers(0, 9), min_size=len(boxes), max_size=len(boxes)))
    return (
        np.array(groups, dtype=np.int64),
        np.array([[o] for o, _ in boxes], dtype=np.int64).reshape(-1, 1),
        np.array([[s] for _, s in boxes], dtype=np.int64).reshape(-1, 1),
    )


def renamed(r, names):
    """The same boxes under other group names (a map of the groups, not always one-to-one)."""
    return (np.array([names[g] for g in r[0].tolist()], dtype=np.int64), r[1], r[2])


def geometry(held, needed) -> tuple:
    return (held[1].shape, needed[1].shape) + tuple(a.tobytes() for a in (held[1], held[2], needed[1], needed[2]))


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(2, 40))
def test_a_geometry_cut_once_gives_every_parameter_its_own_cut(data, length):
    held, needed = data.draw(rows(length)), data.draw(rows(length))
    names = data.draw(st.lists(st.integers(0, 12), min_size=10, max_size=10))
    geometries: dict = {}
    first = _labelled_cells(held, needed, geometry(held, needed), geometries)
    assert first == _cut_cells(PieceTable.boxes_of(held), PieceTable.boxes_of(needed))
    held2, needed2 = renamed(held, names), renamed(needed, names[::-1])
    assert _labelled_cells(held2, needed2, geometry(held2, needed2), geometries) == _cut_cells(
        PieceTable.boxes_of(held2), PieceTable.boxes_of(needed2)
    )
