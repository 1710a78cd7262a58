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
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from realloc.boxes import Box
from realloc.plan.records import Route, Segment

__all__ = ["IndexChain", "PackedRuns", "SegmentTable", "StepTable", "distinct", "expand"]


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

    @property
    def starts(self) -> list[int]:
        """The index of each run's first segment, then the number of segments."""
        return self._starts

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

    def span(self, start: int, stop: int) -> Iterator[Segment]:
        """``self[start:stop]`` as an iterator, walking the runs (no search per segment)."""
        r = bisect_right(self._starts, start) - 1
        i = start
        while i < stop:
            params, dtype, cells = self.runs[r]
            base, end = self._starts[r], min(stop, self._starts[r + 1])
            while i < end:
                p, c = divmod(i - base, len(cells))
                yield Segment(params[p], cells[c][0], cells[c][1], dtype)
                i += 1
            r += 1

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


def list_ranges(segment_lists) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every segment list as runs of consecutive segment ids: ``(ptr, lo, hi)``, list ``j`` being
    ids ``lo[r]:hi[r]`` for ``r`` in ``ptr[j]:ptr[j + 1]`` (empty runs left out). The one reading
    of a plan's lists as ranges, shared by the slicer (realloc/plan/slices.py) and the simulator
    (realloc/sim/engine.py): a range or an :class:`IndexChain` of step-1 ranges is taken as it
    is, anything else (ids in a tuple) by its runs."""
    lo: list[int] = []
    hi: list[int] = []
    ptr = [0]
    for ids in segment_lists:
        spans = ids.ranges if isinstance(ids, IndexChain) else [ids] if isinstance(ids, range) else None
        if spans is None or any(r.step != 1 for r in spans):
            a = np.fromiter(ids, dtype=np.int64)
            cut = np.flatnonzero(np.diff(a) != 1) + 1
            spans = [range(int(p[0]), int(p[-1]) + 1) for p in np.split(a, cut) if len(p)]
        for r in spans:
            if len(r):
                lo.append(r.start)
                hi.append(r.stop)
        ptr.append(len(lo))
    return tuple(np.asarray(x, dtype=np.int64) for x in (ptr, lo, hi))


class StepTable(_ReadOnlyList):
    """The steps of a large plan as arrays, a read-only list of steps: routes sorted by step,
    step ``s`` being routes ``starts[s]:starts[s + 1]``. Pickles as four arrays."""

    def __init__(self, src, dst, lists, starts):
        self.src, self.dst, self.lists = (np.asarray(a, dtype=np.int64) for a in (src, dst, lists))
        self.starts = np.asarray(starts, dtype=np.int64)

    @staticmethod
    def of(steps: "Sequence[list[Route]]") -> "StepTable":
        """``steps`` as a table (itself when it is one): a plan's routes as arrays, in step order."""
        if isinstance(steps, StepTable):
            return steps
        flat = np.array([r for step in steps for r in step], dtype=np.int64).reshape(-1, 3)
        starts = np.zeros(len(steps) + 1, dtype=np.int64)
        np.cumsum([len(step) for step in steps], out=starts[1:])
        return StepTable(flat[:, 0], flat[:, 1], flat[:, 2], starts)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def _item(self, index: int) -> list[Route]:
        a, b = int(self.starts[index]), int(self.starts[index + 1])
        return [Route(*r) for r in zip(self.src[a:b].tolist(), self.dst[a:b].tolist(), self.lists[a:b].tolist())]

    def __repr__(self) -> str:
        return f"StepTable({len(self)} steps, {len(self.src)} routes)"


@dataclass
class PackedRuns:
    """A :class:`SegmentTable` as arrays (what a worker's slice of a plan carries; a pickle of
    it is a few arrays, not thousands of tuples): run ``r`` has the names ``names[run_names[r]]``,
    dtype ``dtypes[run_dtypes[r]]`` and the cells of cell list ``run_cells[r]``, that list being
    rows ``cell_ptr[l]:cell_ptr[l + 1]`` of ``offsets``/``sizes`` (their first ``ndim`` columns)."""

    names: list[tuple[str, ...]]
    dtypes: list[str]
    run_names: np.ndarray
    run_dtypes: np.ndarray
    run_cells: np.ndarray
    cell_ptr: np.ndarray
    ndim: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

    @staticmethod
    def pack(table: SegmentTable) -> "PackedRuns":
        """Every run of ``table``; names tuples and cell lists shared by runs are stored once."""
        names: dict[tuple[str, ...], int] = {}
        by_id: dict[int, int] = {}  # id(names tuple) -> its number: runs share the tuple objects
        dtypes: dict[str, int] = {}
        lists: dict[int, int] = {}
        cells: list = []
        ptr = [0]
        run_names, run_dtypes, run_cells = [], [], []
        for params, dtype, cs in table.runs:
            n = by_id.get(id(params))
            if n is None:  # hashing a tuple of a stage's names costs more than the rest of the loop
                n = by_id[id(params)] = names.setdefault(params, len(names))
            run_names.append(n)
            run_dtypes.append(dtypes.setdefault(dtype, len(dtypes)))
            k = lists.get(id(cs))
            if k is None:
                k = lists[id(cs)] = len(ptr) - 1
                cells.extend(cs)
                ptr.append(len(cells))
            run_cells.append(k)
        ndim = np.fromiter((len(o) for o, _ in cells), dtype=np.int8, count=len(cells))
        width = int(ndim.max(initial=1))
        offsets = np.zeros((len(cells), width), dtype=np.int64)
        sizes = np.zeros((len(cells), width), dtype=np.int64)
        for d in np.unique(ndim).tolist():  # the cells of each rank as one 2-d array
            rows = np.flatnonzero(ndim == d)
            offsets[rows, :d] = np.array([cells[i][0] for i in rows.tolist()], dtype=np.int64)
            sizes[rows, :d] = np.array([cells[i][1] for i in rows.tolist()], dtype=np.int64)
        # int32 where every box ends below 2**31 (the dims of one tensor: half the bytes shipped);
        # a checkpoint's rank file is one byte dimension that can pass it (int32 wrapped a 5 GiB
        # file into a 1 GiB box that validated and moved the wrong bytes)
        coords = np.int32 if not len(cells) or int((offsets + sizes).max()) < 2**31 else np.int64
        ints = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        return PackedRuns(
            list(names),
            list(dtypes),
            ints(run_names),
            np.asarray(run_dtypes, dtype=np.int8),
            ints(run_cells),
            ints(ptr),
            ndim,
            offsets.astype(coords),
            sizes.astype(coords),
        )

    def segment_rows(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """Every segment of the table as arrays, in the table's order, without a segment object:
        ``(params, param, dtype, row)``, segment ``i`` being parameter ``params[param[i]]`` of
        dtype ``dtypes[dtype[i]]`` with the cell of row ``row[i]`` (``offsets``, ``sizes``,
        ``ndim``). A run's segments go parameter by parameter, cell by cell (:class:`SegmentTable`)."""
        lengths = np.fromiter((len(n) for n in self.names), dtype=np.int64, count=len(self.names))
        name_ptr = np.cumsum(lengths) - lengths
        cells = np.diff(self.cell_ptr)[self.run_cells].astype(np.int64)
        per_run = lengths[self.run_names] * cells
        run = np.repeat(np.arange(len(per_run)), per_run)
        i = np.arange(int(per_run.sum()), dtype=np.int64) - (np.cumsum(per_run) - per_run)[run]
        param = name_ptr[self.run_names[run]] + i // cells[run]
        row = self.cell_ptr[self.run_cells[run]] + i % cells[run]
        return [p for names in self.names for p in names], param, self.run_dtypes[run].astype(np.int64), row

    def run_sizes(self) -> np.ndarray:
        """Segments per run."""
        lengths = np.fromiter((len(n) for n in self.names), dtype=np.int64, count=len(self.names))
        return lengths[self.run_names] * np.diff(self.cell_ptr)[self.run_cells]

    def unpack(self) -> SegmentTable:
        """The table these arrays stand for."""
        cells = [
            [
                (tuple(o[:d]), tuple(s[:d]))
                for o, s, d in zip(self.offsets[a:b].tolist(), self.sizes[a:b].tolist(), self.ndim[a:b].tolist())
            ]
            for a, b in zip(self.cell_ptr[:-1].tolist(), self.cell_ptr[1:].tolist())
        ]
        return SegmentTable(
            [
                (self.names[n], self.dtypes[d], cells[c])
                for n, d, c in zip(self.run_names.tolist(), self.run_dtypes.tolist(), self.run_cells.tolist())
            ]
        )


def expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without the loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, counts) + np.arange(total, dtype=np.int64)


def distinct(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a``, ascending (a sort: cheaper than ``np.unique``'s hash on the
    small arrays of one worker)."""
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a
