"""Resharding load: read every stored box once, balanced over the workers, then let the planner
move the boxes into the target layout.

A stored box is ``(param, offsets, sizes)`` as saved; dp replicas and the tied head's copy store
the same box in several files (and replication adds copies of files), but it is read once. Each
box is assigned to one reader: a worker on a node whose directory holds a file containing it.

Assignment method: greedy LPT (largest box first, to the least-loaded eligible worker). The goal
is the makespan of the read phase, i.e. minimise the largest bytes read by one worker; that is
NP-hard in general, LPT is within 4/3 of optimal when every worker is eligible and, in any case,
never exceeds ``total/workers + largest box`` over the eligible set (the greedy list-scheduling
bound), in O(boxes log boxes + boxes * workers). A min-cost assignment (``linear_sum_assignment``)
minimises a sum, not the maximum, so it would need the slot-expansion trick the planner uses on
far more rows (thousands of boxes); LPT is the standard tool for this objective. Ties go to the
worker reading its own rank's file.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from realloc.ckpt.errors import MissingShardsError
from realloc.ckpt.manifest import ShardRecord, param_table
from realloc.layout import Group, Layout, Shard
from realloc.plan import Placement
from realloc.shards import TORCH_DTYPES, ShardStore

Key = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class ReadTask:
    """Worker ``worker`` reads shard ``record`` from rank ``rank``'s file on its node ``node``."""

    worker: int
    node: str
    rank: int
    record: ShardRecord

    @property
    def key(self) -> Key:
        return self.record.key

    @property
    def nbytes(self) -> int:
        return self.record.local_nbytes


@dataclass
class ReadAssignment:
    tasks: dict[int, list[ReadTask]] = field(default_factory=dict)

    def all(self) -> list[ReadTask]:
        return [t for ts in self.tasks.values() for t in ts]

    def loads(self) -> dict[int, int]:
        return {w: sum(t.nbytes for t in ts) for w, ts in self.tasks.items()}


def stored_units(stored: Mapping[int, Sequence[ShardRecord]]) -> dict[Key, list[tuple[int, ShardRecord]]]:
    """Each distinct stored box and the (rank, record) of every rank file that stores it."""
    units: dict[Key, list[tuple[int, ShardRecord]]] = defaultdict(list)
    for rank, records in sorted(stored.items()):
        for rec in records:
            if rec.numel:
                units[rec.key].append((rank, rec))
    return dict(units)


def assign_readers(
    stored: Mapping[int, Sequence[ShardRecord]],
    copies: Mapping[int, Iterable[str]],
    placement: Placement,
    *,
    exclude: Iterable[tuple[str, int]] = (),
    keep: Iterable[ReadTask] = (),
) -> ReadAssignment:
    """One reader per stored box (boxes already read in ``keep`` stay with their reader).

    ``stored`` maps a saved rank to the shard records of its file (``manifest.shards``);
    ``copies`` maps it to the nodes holding its file; ``exclude`` lists ``(node, rank)`` copies
    found corrupt. Raises :class:`MissingShardsError` naming boxes no live node can read.

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> from realloc.ckpt.files import build_rank_file
        >>> from realloc.ckpt.manifest import CheckpointId
        >>> from realloc.shards import allocate_buffers
        >>> lay = Layout(ModelSpec.preset("tiny"), Topology(dp=2))
        >>> recs = {r: build_rank_file(CheckpointId("r", 0, r), lay, allocate_buffers(lay, r), "a")[1].shards
        ...         for r in (0, 1)}
        >>> a = assign_readers(recs, {0: {"a"}, 1: {"a"}}, Placement(("a", "a")))
        >>> sum(a.loads().values()) == lay.rank_bytes(0)   # each stored box read once
        True
    """
    excluded = set(exclude)
    result = ReadAssignment()
    loads: dict[int, int] = defaultdict(int)
    done = set()
    for t in keep:
        result.tasks.setdefault(t.worker, []).append(t)
        loads[t.worker] += t.nbytes
        done.add(t.key)
    units = {k: v for k, v in stored_units(stored).items() if k not in done}
    missing = []
    order = sorted(units, key=lambda k: (-units[k][0][1].local_nbytes, k))
    for key in order:
        options: dict[int, tuple[str, int, ShardRecord]] = {}  # worker -> its best (node, rank, record)
        for rank, rec in units[key]:
            for node in sorted(copies.get(rank, ())):
                if (node, rank) in excluded:
                    continue
                for w in placement.workers_on(node):
                    best = options.get(w)
                    if best is None or (rank != w, rank) < (best[1] != w, best[1]):  # own file, then lowest rank
                        options[w] = (node, rank, rec)
        if not options:
            missing.append(f"{key[0]} offsets={key[1]} sizes={key[2]} (stored by ranks {[r for r, _ in units[key]]})")
            continue
        worker = min(options, key=lambda w: (loads[w], options[w][1] != w, w))
        node, rank, rec = options[worker]
        task = ReadTask(worker, node, rank, rec)
        result.tasks.setdefault(worker, []).append(task)
        loads[worker] += task.nbytes
    if missing:
        raise MissingShardsError(
            f"{len(missing)} stored shards have no usable copy on a live node, e.g. {missing[:3]}", missing
        )
    return result


def reshard_groups(assignment: ReadAssignment, target: Layout) -> tuple[list[Group], list[Group]]:
    """Planner input: the readers hold the boxes they read; the target layout needs its shards."""
    holdings = [Group((w,), tuple(sorted(t.key for t in ts))) for w, ts in sorted(assignment.tasks.items()) if ts]
    return holdings, target.groups()


def planner_params(target: Layout) -> dict[str, tuple[tuple[int, ...], str]]:
    return param_table(target.spec)


def box_of_local(local: torch.Tensor, record: ShardRecord) -> torch.Tensor:
    """The stored box inside a shard's local tensor (it sits at the origin; the rest is padding)."""
    return local[tuple(slice(0, n) for n in record.sizes)]


def boxes_store(boxes: Mapping[Key, torch.Tensor]) -> ShardStore:
    """A :class:`ShardStore` over loose boxes (read from files), packed into flat per-dtype buffers.

    Example:
        >>> st = boxes_store({("w", (2,), (3,)): torch.arange(3.0)})
        >>> st.view("w", (3,), (2,)).tolist()
        [1.0, 2.0]
    """
    dtypes = {k: _dtype_name(t.dtype) for k, t in boxes.items()}
    fill: dict[str, int] = defaultdict(int)
    shards = []
    for key in sorted(boxes):
        param, offsets, sizes = key
        dtype = dtypes[key]
        shards.append(Shard(param, param, offsets, sizes, sizes, dtype, fill[dtype]))
        fill[dtype] += boxes[key].numel()
    count = Counter(dtypes.values())
    buffers = {}
    for d, n in fill.items():
        only = next(t for k, t in boxes.items() if dtypes[k] == d) if count[d] == 1 else None
        # A lone contiguous box (a whole rank file, typically) is its own buffer: no copy.
        if only is not None and only.is_contiguous():
            buffers[d] = only.reshape(-1)
        else:
            buffers[d] = torch.empty(n, dtype=TORCH_DTYPES[d])
    for shard in shards:
        target = buffers[shard.dtype][shard.buffer_offset : shard.buffer_offset + shard.numel]
        box = boxes[shard.param, shard.offsets, shard.sizes]
        if target.data_ptr() != box.data_ptr():
            target.copy_(box.reshape(-1))
    return ShardStore(shards, buffers)


def _dtype_name(dtype: torch.dtype) -> str:
    for name, t in TORCH_DTYPES.items():
        if t == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {sorted(TORCH_DTYPES)}")
