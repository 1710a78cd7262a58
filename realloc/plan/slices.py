"""One worker's share of a plan: what the driver ships to it, and nothing else.

A plan of 2,048 workers has millions of routes; any one worker runs a few thousand of them. Each
worker receives a :class:`PlanSlice`: its routes with their steps, the segment lists they name
(as ranges of the runs of segments they cover), its local copies, and the plan's scalars. The
driver cuts every worker's slice at once from the plan's arrays (:func:`slice_plan`): one sort
of all route ends groups the routes by worker, and the segment lists a worker sends and those it
receives are cut as two :class:`ListPart`\\ s, each computed once for all the workers that send
(or receive) the same lists, as the dp replicas of a layout do. Neither the driver nor a worker
ever scans another worker's routes.

A slice answers what an executor asks of a plan (``segment_list``, ``list_bytes``,
``buckets``, ``reads_destination``, ``forward_from``, ``bucket_bytes``) with the plan's values,
and its routes are exactly the plan's routes of that worker (``tests/test_plan_slices.py``), so a
worker executing its slice does what it did with the whole plan. Segment lists keep their ids
in the plan: both ends of a route name the same list and cut it into the same buckets.
"""

from __future__ import annotations

import gc
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from realloc._checks import check_int
from realloc.boxes import contains
from realloc.layout import RankLayout, Shard
from realloc.plan.records import BUCKET_ALIGN, Piece, Plan, Segment, buckets
from realloc.plan.tables import PackedRuns, SegmentTable, StepTable, distinct, expand, list_ranges
from realloc.spec import DTYPE_BYTES

__all__ = ["ListPart", "PlanSlice", "shipping_stats", "slice_plan"]


@dataclass(eq=False)
class ListPart:
    """Segment lists as ranges of a table of their own: list ``list_ids[k]`` is the segments
    ``range_lo[r]:range_hi[r]`` of the table for ``r`` in ``list_ptr[k]:list_ptr[k + 1]``, in
    order; ``runs`` are the runs of the plan's segment table those ranges cover, packed."""

    list_ids: np.ndarray
    list_ptr: np.ndarray
    range_lo: np.ndarray
    range_hi: np.ndarray
    runs: PackedRuns
    _segments: SegmentTable | None = field(default=None, repr=False)
    _rows: tuple | None = field(default=None, repr=False)  # runs.segment_rows(), once per process

    @property
    def segments(self) -> SegmentTable:
        """The unpacked table (once per process)."""
        if self._segments is None:
            self._segments = self.runs.unpack()
        return self._segments

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_segments": None, "_rows": None}  # what ships is the packed form

    def segment_list(self, k: int) -> list[Segment]:
        out: list[Segment] = []
        for r in range(int(self.list_ptr[k]), int(self.list_ptr[k + 1])):
            out.extend(self.segments.span(int(self.range_lo[r]), int(self.range_hi[r])))
        return out

    def check(self) -> None:
        n = int(self.runs.run_sizes().sum())
        if len(self.list_ptr) != len(self.list_ids) + 1 or (
            len(self.range_lo)
            and (int(self.range_lo.min()) < 0 or int(self.range_hi.max()) > n or np.any(self.range_hi < self.range_lo))
        ):
            raise ValueError("malformed plan slice: a segment list's ranges lie outside its segments")
        runs = self.runs
        unknown = sorted(set(runs.dtypes) - set(DTYPE_BYTES))
        if unknown:
            raise ValueError(f"plan slice segment dtype {unknown[0]!r} is not one of {sorted(DTYPE_BYTES)}")
        width = runs.offsets.shape[1] if runs.offsets.ndim == 2 else 0
        real = np.arange(width) < runs.ndim.reshape(-1, 1)  # the columns of each cell's dims
        if len(runs.ndim) and (
            int(runs.ndim.min()) < 1 or np.any((runs.offsets < 0) & real) or np.any((runs.sizes < 1) & real)
        ):
            raise ValueError(
                "plan slice segment box (offsets, sizes) is invalid: every box has at least one "
                "dimension, offsets of at least 0 and sizes of at least 1"
            )

    def check_held(self, lists: np.ndarray, held: RankLayout, side: str) -> None:
        """``ValueError`` (:meth:`PlanSlice.check_held`) unless every segment of this part's
        lists among ``lists`` lies in a shard of ``held`` of its parameter, with its dtype."""
        k = np.flatnonzero(np.isin(self.list_ids, lists))
        if not len(k):
            return
        ranges = expand(self.list_ptr[k].astype(np.int64), (self.list_ptr[k + 1] - self.list_ptr[k]).astype(np.int64))
        runs = self.runs
        if self._rows is None:
            self._rows = runs.segment_rows()
        params, param, dtype, row = self._rows
        edges = np.zeros(len(param) + 1, dtype=np.int64)
        np.add.at(edges, self.range_lo[ranges], 1)
        np.add.at(edges, self.range_hi[ranges], -1)
        needed = np.cumsum(edges[:-1]) > 0
        by_param: dict[str, list[Shard]] = {}
        for shard in held.shards():
            by_param.setdefault(shard.param, []).append(shard)
        # Parameters whose shards here have the same boxes and dtypes (the layers of a stage)
        # form one class: whether a cell is held is decided per class, cell and dtype, then
        # looked up per segment (a slice has up to millions of segments, a few thousand cells).
        classes: dict[tuple, int] = {}
        of_param = np.fromiter(
            (
                classes.setdefault(tuple((sh.dtype, sh.offsets, sh.sizes) for sh in by_param.get(p, ())), len(classes))
                for p in params
            ),
            dtype=np.int64,
            count=len(params),
        )
        rows = len(runs.ndim)
        cell_lo = runs.offsets.astype(np.int64)
        cell_hi = cell_lo + runs.sizes
        cell_ndim = runs.ndim.astype(np.int64)
        dtype_ids = {d: i for i, d in enumerate(runs.dtypes)}
        held_cells = np.zeros((len(classes), max(len(runs.dtypes), 1), rows), dtype=bool)
        for c, shards in enumerate(classes):
            for kind, offsets, sizes in shards:
                d, n = dtype_ids.get(kind), len(offsets)
                if d is None or n > cell_lo.shape[1]:
                    continue
                held_cells[c, d] |= (
                    (cell_ndim == n)
                    & np.all(cell_lo[:, :n] >= offsets, axis=1)
                    & np.all(cell_hi[:, :n] <= np.add(offsets, sizes), axis=1)
                )
        inside = held_cells.reshape(-1)[(of_param[param] * held_cells.shape[1] + dtype) * rows + row]
        seg_ndim = runs.ndim[row]
        bad = np.flatnonzero(needed & ~inside)
        if len(bad):
            i = int(bad[0])
            n = int(seg_ndim[i])
            seg = Segment(
                params[param[i]],
                tuple(runs.offsets[row[i], :n].tolist()),
                tuple(runs.sizes[row[i], :n].tolist()),
                runs.dtypes[dtype[i]],
            )
            j = next(
                int(self.list_ids[q])
                for q in k.tolist()
                if any(
                    self.range_lo[r] <= i < self.range_hi[r]
                    for r in range(int(self.list_ptr[q]), int(self.list_ptr[q + 1]))
                )
            )
            _refuse_segment(seg, j, held, by_param, side)

    def to_json(self) -> dict:
        return {
            "list_ids": self.list_ids.tolist(),
            "list_ptr": self.list_ptr.tolist(),
            "range_lo": self.range_lo.tolist(),
            "range_hi": self.range_hi.tolist(),
            "segments": [[list(p), d, [[list(o), list(s)] for o, s in cells]] for p, d, cells in self.segments.runs],
        }

    @staticmethod
    def from_json(data: dict) -> "ListPart":
        table = SegmentTable(
            [(tuple(p), d, [(tuple(o), tuple(s)) for o, s in cells]) for p, d, cells in data["segments"]]
        )
        ints = lambda k: np.asarray(data[k], dtype=np.int64)  # noqa: E731
        return ListPart(ints("list_ids"), ints("list_ptr"), ints("range_lo"), ints("range_hi"), PackedRuns.pack(table))


@dataclass(eq=False)
class PlanSlice:
    """Worker ``worker``'s share of a plan of ``num_workers`` workers and ``num_steps`` steps.

    ``routes[i] = (src, dst, segment list)`` runs in step ``route_steps[i]`` (its sends first,
    then its receives, each in step order); ``local``: the segment lists of its local copies.
    ``parts``: the segment lists it names (those it sends and copies, then those it receives).
    """

    worker: int
    num_workers: int
    num_steps: int
    bucket_bytes: int
    forward_from: int
    route_steps: np.ndarray
    routes: np.ndarray  # [n, 3]: src, dst, segment list
    local: tuple[int, ...]
    parts: tuple[ListPart, ...]
    _where: dict | None = field(default=None, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_where": None}

    # -- what an executor asks of a plan ---------------------------------------------------
    def reads_destination(self, step: int) -> bool:
        """Whether senders of ``step`` forward from their destination buffers (as the plan's)."""
        return step >= self.forward_from

    def _index(self) -> dict[int, tuple[ListPart, int]]:
        """Segment list -> (its part, its place there). Built whole, then published: a worker's
        threads may ask at once (local copies run beside the transfers)."""
        where = self._where
        if where is None:
            where = {}
            for part in reversed(self.parts):  # the first part naming a list answers for it
                where.update((j, (part, k)) for k, j in enumerate(part.list_ids.tolist()))
            self._where = where
        return where

    def segment_list(self, index: int) -> list[Segment]:
        """The segments of the plan's segment list ``index`` (one this worker's routes name)."""
        hit = self._index().get(index)
        if hit is None:
            raise KeyError(f"segment list {index} is not in worker {self.worker}'s slice of the plan")
        return hit[0].segment_list(hit[1])

    def list_bytes(self, index: int) -> int:
        return sum(s.nbytes for s in self.segment_list(index))

    def buckets(self, index: int) -> list[list[Piece]]:
        return buckets(self.segment_list(index), self.bucket_bytes)

    def unpack(self) -> None:
        """Unpack every part's segment table and index the lists now (a worker does it as it
        receives its slice, ``actors.wire.executor.received_share``, before its threads read it)."""
        for part in self.parts:
            part.segments  # noqa: B018 - the property unpacks and keeps it
        self._index()

    def routes_by_step(self) -> dict[int, list[tuple[int, int, int]]]:
        """Step -> this worker's routes of it ``(src, dst, segment list)``, steps ascending."""
        out: dict[int, list[tuple[int, int, int]]] = {}
        for i in np.argsort(self.route_steps, kind="stable").tolist():
            out.setdefault(int(self.route_steps[i]), []).append(tuple(self.routes[i].tolist()))
        return out

    def peers(self) -> list[int]:
        """The workers this one sends to or receives from, ascending."""
        return [int(w) for w in np.unique(self.routes[:, :2]) if w != self.worker]

    # -- checks -------------------------------------------------------------------------------
    def validate(self, num_workers: int | None = None, worker: int | None = None) -> None:
        """``ValueError`` naming the first inconsistency, before the worker touches a buffer: it is
        worker ``worker``'s slice (when given); route ends are workers of the plan (of
        ``num_workers`` executors when given) and this worker is one of them; steps lie within the plan; in each step it sends at most once and receives at
        most once; every segment list it names is in the slice; ranges lie inside its segments;
        ``bucket_bytes`` is an integer of at least ``BUCKET_ALIGN``; segments have known dtypes and
        non-empty boxes. What the workers hold is checked by :meth:`check_held`."""
        n = self.num_workers
        check_int("plan slice bucket_bytes", self.bucket_bytes, BUCKET_ALIGN)
        if worker is not None and worker != self.worker:
            raise ValueError(f"plan slice of worker {self.worker} was shipped to worker {worker}")
        if num_workers is not None and num_workers != n:
            raise ValueError(f"plan slice is of a plan of {n} workers, not of the {num_workers} executing it")
        if not 0 <= self.worker < n:
            raise ValueError(f"plan slice of worker {self.worker}: worker ids are integers from 0 and below {n}")
        if not 0 <= self.forward_from <= self.num_steps:
            raise ValueError(f"plan forward_from {self.forward_from} is outside 0..{self.num_steps}")
        routes, steps = self.routes.reshape(-1, 3), self.route_steps
        if len(steps) != len(routes):
            raise ValueError("malformed plan slice: one step per route")
        if len(routes):
            if routes[:, :2].min() < 0 or routes[:, :2].max() >= n:
                raise ValueError(f"plan slice names workers outside 0..{n - 1}")
            if not np.all((routes[:, 0] == self.worker) | (routes[:, 1] == self.worker)):
                raise ValueError(f"plan slice of worker {self.worker} holds a route it neither sends nor receives")
            if steps.min() < 0 or steps.max() >= self.num_steps:
                raise ValueError(f"plan slice steps must lie within 0..{self.num_steps - 1}")
            for end, verb in ((0, "send"), (1, "receive")):
                twice = [s for s, c in Counter(steps[routes[:, end] == self.worker].tolist()).items() if c > 1]
                if twice:
                    raise ValueError(
                        f"plan step {twice[0]}: worker {self.worker} would {verb} more than once "
                        "(one send and one receive per worker per step)"
                    )
        for part in self.parts:
            part.check()
        named = set(routes[:, 2].tolist()) | set(self.local)
        missing = named.difference(*(p.list_ids.tolist() for p in self.parts))
        if missing:
            raise ValueError(f"malformed plan slice: segment list(s) {sorted(missing)[:5]} are not in it")

    def check_held(self, src: RankLayout | None, dst: RankLayout | None) -> None:
        """``ValueError`` naming the first segment this worker could not address, before any
        traffic: a parameter its layout lacks, a dtype other than the layout's, a box outside its
        tensor or outside every shard the worker holds of it (unchecked, the shard store raises a
        bare ``KeyError`` mid-transfer, or a dtype mismatch reinterprets the bytes).

        ``src``/``dst``: the layouts the worker sends from and receives into (None: not checked,
        as a checkpoint worker's file stores). A route of step ``s`` is read from ``dst`` from
        ``forward_from`` on (:meth:`reads_destination`), from ``src`` before; received routes and
        local copies are written into ``dst``; local copies are read from ``src``. (A zero-copy
        read of a same-node peer reads the list that peer checked against its own layout.) Array
        work per part and side: no segment object is made unless one is refused. Call after
        :meth:`validate`."""
        needs: dict[bool, set[int]] = {False: set(self.local), True: set(self.local)}
        for (a, b, j), s in zip(self.routes.reshape(-1, 3).tolist(), self.route_steps.tolist()):
            if a == self.worker:
                needs[self.reads_destination(s)].add(j)
            if b == self.worker:
                needs[True].add(j)
        for destination, held in ((False, src), (True, dst)):
            lists = needs[destination]
            if held is not None and lists:
                named = np.fromiter(lists, dtype=np.int64, count=len(lists))
                side = "destination" if destination else "source"
                for part in self.parts:
                    part.check_held(named, held, f"worker {self.worker}'s {side} ({{}})")

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "worker": self.worker,
            "num_workers": self.num_workers,
            "num_steps": self.num_steps,
            "bucket_bytes": self.bucket_bytes,
            "forward_from": self.forward_from,
            "route_steps": self.route_steps.tolist(),
            "routes": self.routes.tolist(),
            "local": list(self.local),
            "parts": [p.to_json() for p in self.parts],
        }

    @staticmethod
    def from_json(data: dict) -> "PlanSlice":
        """Rebuild a slice from :meth:`to_json` output; malformed input raises ``ValueError``."""
        try:
            out = PlanSlice(
                int(data["worker"]),
                int(data["num_workers"]),
                int(data["num_steps"]),
                int(data["bucket_bytes"]),
                int(data["forward_from"]),
                np.asarray(data["route_steps"], dtype=np.int64),
                np.asarray(data["routes"], dtype=np.int64).reshape(-1, 3),
                tuple(int(j) for j in data["local"]),
                tuple(ListPart.from_json(p) for p in data["parts"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed plan slice JSON: {err!r}") from None
        out.validate()
        return out


def _refuse_segment(seg: Segment, j: int, held: RankLayout, by_param: dict[str, list[Shard]], side: str) -> None:
    """The ``ValueError`` for segment ``seg`` of list ``j``, which no shard of ``side`` (a format
    string for ``held``) holds."""
    side = side.format(held)
    where = f"plan slice segment list {j}: segment"
    param = held.layout.spec.by_name.get(seg.param)
    shards = by_param.get(seg.param, ())
    if param is None and not shards:
        raise ValueError(f"{where} param {seg.param!r} is not a parameter of {held.layout.spec.name!r}")
    dtypes = sorted({sh.dtype for sh in shards} or {param.dtype})
    if seg.dtype not in dtypes:
        raise ValueError(
            f"{where} dtype {seg.dtype!r} of {seg.param!r} does not match its layout's dtype {dtypes[0]!r}"
        )
    shape = param.shape if param is not None else None
    if shape is not None and (
        len(seg.offsets) != len(shape) or not contains((tuple(0 for _ in shape), shape), seg.box)
    ):
        raise ValueError(
            f"{where} box offsets={seg.offsets} sizes={seg.sizes} lies outside {seg.param!r} of shape {tuple(shape)}"
        )
    raise ValueError(f"{where} box offsets={seg.offsets} sizes={seg.sizes} of {seg.param!r} is in no shard of {side}")


# -- cutting ------------------------------------------------------------------------------------
def _route_arrays(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(src, dst, segment list, step)`` of every route, in step order."""
    t = StepTable.of(plan.steps)
    return t.src, t.dst, t.lists, np.repeat(np.arange(len(t), dtype=np.int64), np.diff(t.starts))


def _table_and_ranges(plan: Plan) -> tuple[SegmentTable, np.ndarray, np.ndarray, np.ndarray]:
    """The plan's segments as a :class:`SegmentTable` and every segment list as ranges of it:
    ``(table, ptr, lo, hi)`` (:func:`~realloc.plan.tables.list_ranges`)."""
    table = plan.segments
    if not isinstance(table, SegmentTable):  # a small plan's list: one run a segment
        table = SegmentTable([((s.param,), s.dtype, [s.box]) for s in table])
    return table, *list_ranges(plan.segment_lists)


def _ptr(counts: np.ndarray) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]``: where each of consecutive blocks of ``counts`` starts (int64)."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _local_ptrs(ptr: np.ndarray, at: np.ndarray) -> np.ndarray:
    """For blocks ``at[p]:at[p + 1]`` of items whose global pointer is ``ptr`` (length items + 1),
    every block's own pointer ``ptr[at[p] : at[p + 1] + 1] - ptr[at[p]]``, the blocks back to
    back (block ``p``'s at ``at[p] + p``), as int32."""
    n = np.diff(at) + 1
    return (ptr[expand(at[:-1], n)] - np.repeat(ptr[at[:-1]], n)).astype(np.int32)


#: Route ends of the workers sliced together (:func:`slice_plan`)
_BLOCK_ENDS = 1 << 17
#: Parts x names of one block of the names' presence matrix (:meth:`_Parts.cut`)
_NAMES_BLOCK = 1 << 22


class _Parts:
    """Cuts the :class:`ListPart` of sets of segment lists, once per distinct set.

    Each range of a list covers a run of runs of the plan's table; a part's table is the runs of
    its ranges, range after range (a run two of its ranges cover appears twice), so cutting a
    part is gathers proportional to its ranges: no sort, no search. The new parts of a block of
    workers are cut together (:meth:`cut`): each of their arrays is one gather, then split; a
    part's arrays are views of those (a pickle of a view carries its own bytes only)."""

    def __init__(self, plan: Plan):
        table, self.ptr, lo, hi = _table_and_ranges(plan)
        self.packed = packed = PackedRuns.pack(table)
        starts = np.asarray(table.starts, dtype=np.int64)
        first = np.searchsorted(starts, lo, side="right") - 1
        last = np.searchsorted(starts, hi - 1, side="right") - 1
        self.first, self.runs = first, last - first + 1  # each range's runs
        self.skip, self.length = lo - starts[first], hi - lo  # where it starts in them, how long
        self.segments = starts[last + 1] - starts[first]  # segments of its runs
        # run r's cells are row r (PackedRuns.pack gives each run its own list where no two share)
        n = len(packed.run_cells)
        self.row_per_run = np.array_equal(packed.run_cells, np.arange(n)) and np.array_equal(
            packed.cell_ptr, np.arange(n + 1)
        )
        self.cache: dict[bytes, ListPart] = {}

    def of(self, requests: Sequence[np.ndarray]) -> list[ListPart]:
        """The part of each array of segment lists in ``requests`` (repeats and order do not
        matter); requests naming the same set share one part, across calls too."""
        named: list[np.ndarray] = []
        fresh: dict[bytes, None] = {}  # the sets not cut before, in the order of ``named``
        keys = []
        for lists in requests:
            d = distinct(lists.astype(np.int32))  # 32-bit: half the sort's time
            key = d.tobytes()
            keys.append(key)
            if key not in self.cache and key not in fresh:
                fresh[key] = None
                named.append(d)
        self.cache.update(zip(fresh, self.cut(named)))
        return [self.cache[key] for key in keys]

    def cut(self, named: list[np.ndarray]) -> list[ListPart]:
        """One :class:`ListPart` per array of distinct segment lists (ascending)."""
        pk = self.packed
        lists = np.concatenate(named) if named else np.zeros(0, dtype=np.int64)
        lp = _ptr(np.fromiter(map(len, named), dtype=np.int64, count=len(named)))  # lists of part p
        counts = self.ptr[lists + 1] - self.ptr[lists]
        cc = _ptr(counts)
        range_at = cc[lp]  # ranges of part p: range_at[p]:range_at[p + 1]
        r = expand(self.ptr[lists], counts)
        sc = _ptr(self.segments[r])
        lo = sc[:-1] - np.repeat(sc[range_at[:-1]], np.diff(range_at)) + self.skip[r]
        hi = (lo + self.length[r]).astype(np.int32)
        lo = lo.astype(np.int32)
        list_ptr = _local_ptrs(cc, lp)
        nruns = self.runs[r]
        rc = _ptr(nruns)
        run_at = rc[range_at]  # runs of part p: run_at[p]:run_at[p + 1]
        runs = expand(self.first[r], nruns)
        if self.row_per_run:
            rows, row_at, cell_ptr = runs, run_at, None
        else:
            cl = pk.run_cells[runs]
            ccounts = pk.cell_ptr[cl + 1] - pk.cell_ptr[cl]
            rows = expand(pk.cell_ptr[cl], ccounts)
            crc = _ptr(ccounts)
            row_at = crc[run_at]
            cell_ptr = _local_ptrs(crc, run_at)
        names, run_names = self._names(runs, run_at)
        run_dtypes = pk.run_dtypes[runs]
        ndim, offsets, sizes = pk.ndim[rows], np.take(pk.offsets, rows, axis=0), np.take(pk.sizes, rows, axis=0)
        count = np.arange(int(np.diff(run_at).max(initial=0)) + 1, dtype=np.int32)  # 0, 1, 2, ...
        out = []
        for p in range(len(named)):
            a, b = int(run_at[p]), int(run_at[p + 1])
            c, d = int(row_at[p]), int(row_at[p + 1])
            g, h = int(range_at[p]), int(range_at[p + 1])
            e, f = int(lp[p]), int(lp[p + 1])
            out.append(
                ListPart(
                    named[p],
                    list_ptr[e + p : f + p + 1],
                    lo[g:h],
                    hi[g:h],
                    PackedRuns(
                        names[p],
                        pk.dtypes,
                        run_names[a:b],
                        run_dtypes[a:b],
                        count[: b - a],
                        count[: b - a + 1] if cell_ptr is None else cell_ptr[a + p : b + p + 1],
                        ndim[c:d],
                        offsets[c:d],
                        sizes[c:d],
                    ),
                )
            )
        return out

    def _names(self, runs: np.ndarray, run_at: np.ndarray) -> tuple[list[list], np.ndarray]:
        """Each part's names (those its runs name, in the plan's order) and its runs' names
        numbered in them: a presence matrix of parts x names, a block of parts at a time."""
        pk = self.packed
        n_names = max(len(pk.names), 1)
        of_run = pk.run_names[runs]
        run_names = np.empty(len(runs), dtype=np.min_scalar_type(-n_names))  # int8 below 128 names
        names: list[list] = []
        block = max(1, _NAMES_BLOCK // n_names)
        n_parts = len(run_at) - 1
        for p0 in range(0, n_parts, block):
            p1 = min(p0 + block, n_parts)
            a, b = int(run_at[p0]), int(run_at[p1])
            cell = np.repeat(np.arange(0, (p1 - p0) * n_names, n_names), np.diff(run_at[p0 : p1 + 1]))
            cell += of_run[a:b]  # (part, name) of each run, flat
            present = np.zeros((p1 - p0, n_names), dtype=bool)
            present.reshape(-1)[cell] = True
            number = np.cumsum(present, axis=1, dtype=np.int32) - 1
            run_names[a:b] = number.reshape(-1)[cell]
            names += [[pk.names[i] for i in np.flatnonzero(row).tolist()] for row in present]
        return names, run_names


def slice_plan(plan: Plan, workers: Sequence[int] | None = None) -> list[PlanSlice]:
    """Every worker's :class:`PlanSlice` of ``plan`` (or those of ``workers``), in that order.

    One stable sort of all route ends groups the routes by worker (a worker's sends first, then
    its receives); the segment lists it sends (with those it copies locally) and those it
    receives become two parts, cut together for every worker and shared by the slices that name
    the same set."""
    n_workers = len(plan.nodes)
    src, dst, lists, step_of = _route_arrays(plan)
    n = len(src)
    # numpy's stable sort of 16-bit integers is a radix sort: linear in the routes
    ends = np.concatenate([src, dst]).astype(np.int16 if n_workers <= 2**15 else np.int64)
    order = np.argsort(ends, kind="stable")
    bounds = _ptr(np.bincount(ends, minlength=n_workers))
    local: dict[int, list[int]] = {}
    for w, j in plan.local_copies:
        local.setdefault(w, []).append(j)
    routes = np.empty((n, 3), dtype=np.int32)
    routes[:, 0], routes[:, 1], routes[:, 2] = src, dst, lists
    steps = step_of.astype(np.int32)
    parts = _Parts(plan)
    out: list[PlanSlice] = []
    chosen = range(n_workers) if workers is None else [int(w) for w in workers]
    # a block of workers at a time, so that the cut's arrays stay small (in cache, and below the
    # allocator's mmap threshold: reused rather than fresh pages faulted in): llama-70b
    # fsdp=2048 -> dp=256,tp=8 cut in 1.10-1.12 s in blocks of 2**17 route ends, 1.48-1.57 s in 2**20
    start = 0
    while start < len(chosen):
        block, own, requests, ends_taken = [], [], [], 0
        while start < len(chosen) and (not block or ends_taken < _BLOCK_ENDS):
            w = chosen[start]
            start += 1
            mine = order[bounds[w] : bounds[w + 1]]  # ascending: its sends (ends below n), then its receives
            k = int(np.searchsorted(mine, n))
            mine = mine.copy()
            mine[k:] -= n  # the routes of its ends
            block.append(w)
            own.append(mine)
            ends_taken += len(mine)
            sends = lists[mine[:k]]
            copies = local.get(w)
            requests.append(np.concatenate([sends, np.asarray(copies, dtype=sends.dtype)]) if copies else sends)
            requests.append(lists[mine[k:]])
        cut = parts.of(requests)
        out += [
            PlanSlice(
                w,
                n_workers,
                len(plan.steps),
                plan.bucket_bytes,
                plan.forward_from,
                np.take(steps, mine),
                np.take(routes, mine, axis=0),  # rows: several times faster than indexing with []
                tuple(local.get(w, ())),
                (cut[2 * i], cut[2 * i + 1]),
            )
            for i, (w, mine) in enumerate(zip(block, own))
        ]
    return out


def shipping_stats(plan: Plan) -> dict[str, Any]:
    """What shipping ``plan`` costs (realloc/plan/slices.py): the driver's time to cut every
    worker's slice and to pickle them all, the largest slice as pickled and its routes, the
    mean, and the time a worker takes to prepare the largest (unpickle, check, its routes by
    step, its segment tables unpacked)."""
    gc.disable()  # a full collection landing inside one of these timings would be charged to it
    try:
        started = time.perf_counter()
        slices = slice_plan(plan)
        cut = time.perf_counter() - started
        started = time.perf_counter()
        shipped = [pickle.dumps(p, protocol=5) for p in slices]
        pickled = time.perf_counter() - started
        largest = max(range(len(shipped)), key=lambda i: len(shipped[i]), default=None)
        prepare = None
        if largest is not None:
            started = time.perf_counter()
            piece = pickle.loads(shipped[largest])
            piece.validate(len(plan.nodes), largest)
            piece.routes_by_step()
            piece.unpack()
            prepare = time.perf_counter() - started
    finally:
        gc.enable()
    sizes = [len(b) for b in shipped]
    return {
        "slice_seconds": cut,
        "pickle_seconds": pickled,
        "max_bytes": max(sizes, default=0),
        "mean_bytes": sum(sizes) / len(sizes) if sizes else 0,
        "max_routes": max((len(p.routes) for p in slices), default=0),
        "largest_worker": largest,
        "prepare_seconds": prepare,
        "plan_pickle_bytes": len(pickle.dumps(plan, protocol=5)),
    }
