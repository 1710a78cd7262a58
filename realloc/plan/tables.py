"""The planner's large-plan containers: read-only lists backed by runs and arrays.

A plan of a sharded layout at scale has millions of segments and routes. The planner keeps them
as :class:`SegmentTable` (segments as runs of cells shared by the layers that have them),
:class:`IndexChain` (a segment list chaining ranges of such a table) and :class:`StepTable`
(steps as arrays). Each reads as the plain list it stands for (:class:`~realloc.plan.records.Plan`
compares and serialises them so), and a segment or route object exists only while someone looks
at it.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterator, Sequence

import numpy as np

from realloc.boxes import Box
from realloc.plan.records import Route, Segment

__all__ = ["IndexChain", "SegmentTable", "StepTable"]


class _ReadOnlyList(Sequence):
    """Indexing as a list's (negative indices, slices as lists, ``IndexError`` past the end);
    subclasses give ``__len__`` and ``_item`` for ``0 <= index < len(self)``."""

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._item(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"{type(self).__name__} index {index} out of range ({len(self)})")
        return self._item(index)

    def _item(self, index: int):
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))


class SegmentTable(_ReadOnlyList):
    """Segments stored as runs, a read-only list: run ``(params, dtype, cells)`` stands for
    ``[Segment(p, *cell, dtype) for p in params for cell in cells]``.

    The planner cuts each kind of tensor once and shares the cells among the layers that have
    them, so a plan of millions of segments holds thousands of runs; a segment object exists
    only while someone looks at it.
    """

    def __init__(self, runs: list[tuple[tuple[str, ...], str, list[Box]]]):
        self.runs = runs
        self._starts = [0]
        for params, _, cells in runs:
            self._starts.append(self._starts[-1] + len(params) * len(cells))

    def __len__(self) -> int:
        return self._starts[-1]

    def _item(self, index: int) -> Segment:
        r = bisect_right(self._starts, index) - 1
        params, dtype, cells = self.runs[r]
        p, c = divmod(index - self._starts[r], len(cells))
        return Segment(params[p], cells[c][0], cells[c][1], dtype)

    def __iter__(self) -> Iterator[Segment]:
        for params, dtype, cells in self.runs:
            for p in params:
                for offsets, sizes in cells:
                    yield Segment(p, offsets, sizes, dtype)

    def __repr__(self) -> str:
        return f"SegmentTable({len(self)} segments in {len(self.runs)} runs)"


class IndexChain(_ReadOnlyList):
    """Segment ids of a list that chains several ranges of a :class:`SegmentTable`, read-only."""

    def __init__(self, ranges: list[range]):
        self.ranges = ranges
        self._starts: list[int] = []  # computed on first use: most chains are only iterated

    def __len__(self) -> int:
        return sum(map(len, self.ranges))

    def _item(self, index: int) -> int:
        if not self._starts:
            self._starts = [0]
            for r in self.ranges:
                self._starts.append(self._starts[-1] + len(r))
        r = bisect_right(self._starts, index) - 1
        return self.ranges[r][index - self._starts[r]]

    def __iter__(self) -> Iterator[int]:
        for r in self.ranges:
            yield from r

    def __repr__(self) -> str:
        return f"IndexChain({self.ranges})"


class StepTable(_ReadOnlyList):
    """The steps of a large plan as arrays, a read-only list of steps: routes sorted by step,
    step ``s`` being routes ``starts[s]:starts[s + 1]``. Pickles as four arrays."""

    def __init__(self, src, dst, lists, starts):
        self.src, self.dst, self.lists = (np.asarray(a, dtype=np.int64) for a in (src, dst, lists))
        self.starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def _item(self, index: int) -> list[Route]:
        a, b = int(self.starts[index]), int(self.starts[index + 1])
        return [Route(*r) for r in zip(self.src[a:b].tolist(), self.dst[a:b].tolist(), self.lists[a:b].tolist())]

    def __repr__(self) -> str:
        return f"StepTable({len(self)} steps, {len(self.src)} routes)"
