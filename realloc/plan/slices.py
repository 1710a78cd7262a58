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


class _Parts:
    """Cuts the :class:`ListPart` of a set of segment lists, once per distinct set.

    Each range of a list covers a run of runs of the plan's table; a part's table is the runs of
    its ranges, range after range (a run two of its ranges cover appears twice), so cutting a
    part is gathers proportional to its ranges: no sort, no search."""

    def __init__(self, plan: Plan):
        table, self.ptr, lo, hi = _table_and_ranges(plan)
        self.packed = PackedRuns.pack(table)
        starts = np.asarray(table.starts, dtype=np.int64)
        first = np.searchsorted(starts, lo, side="right") - 1
        last = np.searchsorted(starts, hi - 1, side="right") - 1
        self.first, self.runs = first, last - first + 1  # each range's runs
        self.skip, self.length = lo - starts[first], hi - lo  # where it starts in them, how long
        self.segments = starts[last + 1] - starts[first]  # segments of its runs
        self.cache: dict[bytes, ListPart] = {}

    def of(self, lists: np.ndarray) -> ListPart:
        named = distinct(lists)
        key = named.tobytes()
        part = self.cache.get(key)
        if part is None:
            counts = self.ptr[named + 1] - self.ptr[named]
            r = expand(self.ptr[named], counts)
            base = np.cumsum(self.segments[r]) - self.segments[r]
            ptr = np.zeros(len(named) + 1, dtype=np.int32)
            np.cumsum(counts, out=ptr[1:])
            lo = base + self.skip[r]
            part = self.cache[key] = ListPart(
                named.astype(np.int32),
                ptr,
                lo.astype(np.int32),
                (lo + self.length[r]).astype(np.int32),
                self.packed.take(expand(self.first[r], self.runs[r])),
            )
        return part


def slice_plan(plan: Plan, workers: Sequence[int] | None = None) -> list[PlanSlice]:
    """Every worker's :class:`PlanSlice` of ``plan`` (or those of ``workers``), in that order.

    One stable sort of all route ends groups the routes by worker (a worker's sends first, then
    its receives); the segment lists it sends (with those it copies locally) and those it
    receives become two parts, each cut once per distinct set of lists and shared by the slices
    that name the same set."""
    n_workers = len(plan.nodes)
    src, dst, lists, step_of = _route_arrays(plan)
    n = len(src)
    # numpy's stable sort of 16-bit integers is a radix sort: linear in the routes
    ends = np.concatenate([src, dst]).astype(np.int16 if n_workers <= 2**15 else np.int64)
    order = np.argsort(ends, kind="stable")
    bounds = np.searchsorted(ends[order], np.arange(n_workers + 1))
    parts = _Parts(plan)
    local: dict[int, list[int]] = {}
    for w, j in plan.local_copies:
        local.setdefault(w, []).append(j)
    routes = np.stack([src, dst, lists], axis=1).astype(np.int32)
    steps = step_of.astype(np.int32)
    route_of = order % max(n, 1)  # the route of each end, grouped by worker
    out = []
    for w in range(n_workers) if workers is None else workers:
        a, b = bounds[w], bounds[w + 1]
        k = a + int(np.searchsorted(order[a:b], n))  # ends below n are its sends (ascending), then its receives
        own = route_of[a:b]
        copies = local.get(w, [])
        sends = lists[route_of[a:k]]
        out.append(
            PlanSlice(
                int(w),
                n_workers,
                len(plan.steps),
                plan.bucket_bytes,
                plan.forward_from,
                steps[own],
                routes[own],
                tuple(copies),
                (
                    parts.of(np.concatenate([sends, np.asarray(copies, dtype=sends.dtype)]) if copies else sends),
                    parts.of(lists[route_of[k:b]]),
                ),
            )
        )
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
