"""The exchange planner: from who holds which boxes and who needs which, to a :class:`Plan`.

Input is deliberately general: ``holdings`` and ``needs`` are lists of :class:`Group` (workers
that hold/need identical box lists), plus a placement (node per worker) and parameter shapes.
A reallocation between two layouts, checkpoint replication, retrieval after node loss and
checkpoint loading are all this one call.

Algorithm (docs/architecture.md has the why and the measurements):

1. **Cells.** Per parameter, cut every needed box at every holder/need boundary; each cell gets
   the set of holder groups and need groups that cover it. Cells with the same (holders, needers)
   sets form a *bundle*: a replicated norm becomes one bundle needed by all tp groups, so it
   crosses each node boundary once, not once per source tp rank.
2. **Per (bundle, destination node).** A needing worker that holds the cell copies locally.
   If another worker of the node holds it, the copy stays in the node (least-loaded local holder).
   Otherwise it is a *remote demand*: the bytes enter the node exactly once, into one *entry*
   worker (least-loaded among the node's needing workers) and fan out inside the node from
   there. Inter-node bytes therefore equal the lower bound by construction.
3. **Sender balance.** Remote demands sharing a set of holder nodes form a class; rows are
   ``(destination node, part)`` and columns are holder-node *slots*. With slot ``j`` of node
   ``h`` costing ``load[h] + j * mean_bytes``, a min-cost assignment (scipy
   ``linear_sum_assignment`` on this expanded matrix) fills the least-loaded nodes first, i.e.
   balances egress, and a small bonus for a (holder, destination) pair already used keeps the
   number of peers low. When every row is alike the optimum is a round robin over the sorted
   slots, computed directly (LSA on tied costs is cubic: 3.6 s at 2048 rows here); above
   ``LSA_MAX_ROWS`` rows a largest-first greedy on the same costs is used. When a class has more
   holder nodes than destination nodes, each cell is cut into row parts sent by different nodes.
4. **Steps.** Routes (one per sender/receiver pair and phase) are edge-coloured greedily, largest
   first: in a step each worker sends at most one route and receives at most one. Intra-node
   fan-out routes come after every inter-node route.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from realloc._checks import check_int, check_number, is_int
from realloc.boxes import Box, split_rows
from realloc.layout import Group, Layout, PieceTable
from realloc.plan.placement import Placement
from realloc.plan.records import BUCKET_ALIGN, Plan, Segment, bucket_count
from realloc.plan.tables import IndexChain, SegmentTable, StepTable
from realloc.spec import DTYPE_BYTES, ModelSpec

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20
LSA_MAX_ROWS = 512
#: Worker ids and route keys in the planner's arrays (half the memory traffic of int64).
_ID = np.int32
#: Parts a cell may be cut into so that several holder nodes send it in parallel.
MAX_SENDERS_PER_CELL = 8


@dataclass(frozen=True)
class Bandwidths:
    """Link speeds (bytes/s) for the time estimate. Defaults: H100 nodes, NVLink 4 inside a node,
    one 400 Gb/s NIC per GPU between nodes, HBM3 copies."""

    intra_node: float = 300e9
    inter_node: float = 45e9
    local_copy: float = 1000e9

    def __post_init__(self) -> None:
        for name in ("intra_node", "inter_node", "local_copy"):
            check_number(f"bandwidth {name}", getattr(self, name), positive=True, allowed="positive")


ParamTable = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)


def plan_exchange(
    holdings: "Sequence[Group] | PieceTable",
    needs: "Sequence[Group] | PieceTable",
    placement: Placement,
    params: ParamTable,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    bandwidths: Bandwidths = Bandwidths(),
) -> Plan:
    """Plan how every needed box reaches every worker that needs it.

    Example:
        >>> from realloc.layout import Group
        >>> hold = [Group((0,), (("w", (0,), (8,)),))]
        >>> need = [Group((1, 2), (("w", (0,), (8,)),))]
        >>> plan = plan_exchange(hold, need, Placement(("a", "b", "b")), {"w": ((8,), "float32")})
        >>> plan.stats["bytes_inter_node"], plan.stats["bytes_intra_node"]
        (32, 32)
    """
    started = time.perf_counter()
    check_int("bucket_bytes", bucket_bytes, 1024)
    holdings, needs = (x if isinstance(x, PieceTable) else PieceTable.of_groups(x) for x in (holdings, needs))
    _validate(holdings, needs, placement, params)
    bundles, lower_bound_parts = _bundles(holdings, needs, params, placement)
    planner = _Router(placement, params, bandwidths)
    for bundle in bundles:
        planner.route_bundle(bundle)
    planner.assign_remote()
    plan = planner.build(bucket_bytes)
    plan.stats["lower_bound_inter_node_bytes"] = lower_bound_parts
    plan.plan_seconds = time.perf_counter() - started
    log.debug("planned %d routes in %d steps: %d B inter-node (bound %d), %d B intra-node, %d B local, %.3fs",
              plan.stats["num_routes"], plan.stats["num_steps"], plan.stats["bytes_inter_node"], lower_bound_parts,
              plan.stats["bytes_intra_node"], plan.stats["bytes_local_copy"], plan.plan_seconds)
    return plan


def plan_reallocation(
    spec: ModelSpec,
    src: "Layout | object",
    dst: "Layout | object",
    placement: Placement,
    *,
    src_workers: Sequence[int] | None = None,
    dst_workers: Sequence[int] | None = None,
    vocab_pad_multiple: int = 1,
    vocab_pad_rule: str = "megatron",
    qkv_order: str = "hf",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    bandwidths: Bandwidths = Bandwidths(),
) -> Plan:
    """Plan moving ``spec`` from layout/topology ``src`` to ``dst``.

    By default both layouts live on workers ``0..world-1`` (one model group changing layout);
    pass ``src_workers``/``dst_workers`` to copy between groups (policy -> reference model).
    ``vocab_pad_multiple``, ``vocab_pad_rule`` and ``qkv_order`` apply to a topology given for
    ``src``/``dst`` (a :class:`Layout` carries its own; give layouts when the sides differ).

    Example:
        >>> from realloc import ModelSpec, Topology, Placement
        >>> spec = ModelSpec.preset("tiny")
        >>> plan = plan_reallocation(spec, Topology(dp=2, tp=2), Topology(tp=4), Placement.blocks(4, 2))
        >>> plan.stats["num_steps"] > 0
        True
    """
    options = dict(vocab_pad_multiple=vocab_pad_multiple, vocab_pad_rule=vocab_pad_rule, qkv_order=qkv_order)
    src_layout = src if isinstance(src, Layout) else Layout(spec, src, **options)
    dst_layout = dst if isinstance(dst, Layout) else Layout(spec, dst, **options)
    if src_layout.spec is not spec:
        spec.check_same_as(src_layout.spec)
    if dst_layout.spec is not spec:
        spec.check_same_as(dst_layout.spec)
    if src_workers is None and dst_workers is None and src_layout.topology.world_size != dst_layout.topology.world_size:
        raise ValueError(
            f"source {src_layout.topology} has {src_layout.topology.world_size} ranks but destination "
            f"{dst_layout.topology} has {dst_layout.topology.world_size}; one model group keeps its "
            "workers (give src_workers/dst_workers to copy between groups)"
        )
    for name, workers in (("src_workers", src_workers), ("dst_workers", dst_workers)):
        if workers is None:
            continue
        if isinstance(workers, (str, bytes)) or not isinstance(workers, Sequence) or any(
                not is_int(w) or w < 0 for w in workers):
            raise ValueError(f"{name} must be a sequence of non-negative worker ids, got {workers!r}"[:200])
        repeated = sorted({w for w in workers if list(workers).count(w) > 1})
        if repeated:
            raise ValueError(f"{name} names worker(s) {repeated[:5]} more than once: one worker holds one rank")
    for name, layout, workers in (("src", src_layout, src_workers), ("dst", dst_layout, dst_workers)):
        count = layout.topology.world_size if workers is None else len(workers)
        if workers is None and count > placement.num_workers:
            raise ValueError(f"{name} layout {layout.topology} has {count} ranks but placement has {placement.num_workers} workers")
    table = {p.name: (p.shape, p.dtype) for p in spec.params}
    return plan_exchange(
        src_layout.piece_table(list(src_workers) if src_workers is not None else None),
        dst_layout.piece_table(list(dst_workers) if dst_workers is not None else None),
        placement, table, bucket_bytes=bucket_bytes, bandwidths=bandwidths,
    )


# -- validation -----------------------------------------------------------------------------


def _validate(holdings: PieceTable, needs: PieceTable, placement: Placement, params: ParamTable) -> None:
    for name, (shape, dtype) in params.items():
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"parameter {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    for what, table in (("holdings", holdings), ("needs", needs)):
        for workers in table.groups:
            if not workers:
                raise ValueError(f"{what}: a group has no workers")
            placement.check_workers(workers, what)
        unknown = [p for p in table.params if p not in params]
        if unknown:
            raise ValueError(f"{what}: unknown parameter {unknown[0]!r}")
        if table.boxes_checked:
            continue
        by_ndim: dict[int, list[str]] = defaultdict(list)
        for param, (_, offsets, _) in table.params.items():
            if offsets.shape[1] != len(params[param][0]):
                _refuse_box(what, param, table, 0, params)
            by_ndim[offsets.shape[1]].append(param)
        for names in by_ndim.values():  # all boxes of one rank of tensor at once
            offsets = np.concatenate([table.params[p][1] for p in names])
            sizes = np.concatenate([table.params[p][2] for p in names])
            counts = [len(table.params[p][1]) for p in names]
            shapes = np.repeat(np.array([params[p][0] for p in names], dtype=np.int64).reshape(len(names), -1),
                               counts, axis=0)
            bad = np.flatnonzero((offsets < 0).any(1) | (sizes < 1).any(1) | (offsets + sizes > shapes).any(1))
            if bad.size:
                at = int(bad[0])
                k = int(np.searchsorted(np.cumsum(counts), at, side="right"))
                _refuse_box(what, names[k], table, at - sum(counts[:k]), params)


def _refuse_box(what: str, param: str, table: PieceTable, i: int, params: ParamTable) -> None:
    _, offsets, sizes = table.params[param]
    raise ValueError(f"{what}: box offsets={tuple(offsets[i].tolist())} sizes={tuple(sizes[i].tolist())} is empty "
                     f"or outside {param!r} of shape {tuple(params[param][0])}")


# -- step 1: cells and bundles ---------------------------------------------------------------


@dataclass
class _Bundle:
    #: ``(params, dtype, cells)``: every param of ``params`` (one dtype) has exactly ``cells`` in
    #: this bundle (the same kind of tensor in many layers shares one cell list).
    blocks: list[tuple[tuple[str, ...], str, list[Box]]]
    nbytes: int
    holders: dict[str, list[int]]  # node -> holder workers (sorted)
    needers: dict[str, list[int]]  # node -> needing workers (sorted)


def _node_map(workers: set[int], placement: Placement) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for w in sorted(workers):
        out[placement.nodes[w]].append(w)
    return dict(out)


#: A parameter's cells grouped by (holder groups, need groups), and the needed cells no one holds.
_Pattern = tuple[dict[tuple[frozenset, frozenset], list[Box]], list[Box]]


def _bundles(holdings: PieceTable, needs: PieceTable, params: ParamTable,
             placement: Placement) -> tuple[list[_Bundle], int]:
    order = {name: i for i, name in enumerate(params)}

    # Parameters with the same dtype, holder boxes and need boxes (the same kind of tensor in
    # every layer of a stage) have the same cells: each distinct signature is cut once, and a
    # bundle holds one block per signature, however many layers share it.
    patterns: dict[tuple, tuple[_Pattern, list[str]]] = {}
    missing: list[str] = []
    unheld_count = 0
    nothing = (np.zeros(0, dtype=np.int64),) * 3
    for param in sorted(needs.params, key=order.__getitem__):
        held, needed = holdings.params.get(param, nothing), needs.params[param]
        signature = (params[param][1], len(params[param][0])) + tuple(a.tobytes() for a in held + needed)
        entry = patterns.get(signature)
        if entry is None:
            cells = _cut_cells(holdings.boxes(param) if param in holdings.params else [], needs.boxes(param))
            entry = patterns[signature] = (cells, [])
        entry[1].append(param)
        unheld = entry[0][1]
        unheld_count += len(unheld)
        missing += [f"{param} offsets={cell[0]} sizes={cell[1]}" for cell in unheld[:3 - len(missing)]]
    if unheld_count:
        raise ValueError(f"{unheld_count} needed boxes are held by no worker, e.g. {missing}")
    keyed: dict[tuple[frozenset, frozenset], list[tuple[tuple[str, ...], str, list[Box]]]] = defaultdict(list)
    for (dtype, *_), ((by_sets, _), names) in patterns.items():
        for sets, cells in by_sets.items():
            keyed[sets].append((tuple(names), dtype, cells))

    bundles: list[_Bundle] = []
    lower_bound = 0
    sizes: dict[tuple[int, str], int] = {}  # (id of a cell list, dtype) -> bytes

    def cells_bytes(cells: list[Box], dtype: str) -> int:
        n = sizes.get((id(cells), dtype))
        if n is None:
            n = sizes[id(cells), dtype] = _cells_bytes(cells, dtype)
        return n

    hold_maps: dict[frozenset, dict[str, list[int]]] = {}
    need_maps: dict[frozenset, dict[str, list[int]]] = {}
    for (holders, needers), blocks in sorted(keyed.items(), key=lambda kv: min(
            (order[b[0][0]], b[2][0]) for b in kv[1])):
        blocks.sort(key=lambda b: order[b[0][0]])
        nbytes = sum(len(names) * cells_bytes(cells, dtype) for names, dtype, cells in blocks)
        if holders not in hold_maps:
            hold_maps[holders] = _node_map({w for gi in holders for w in holdings.groups[gi]}, placement)
        if needers not in need_maps:
            need_maps[needers] = _node_map({w for gi in needers for w in needs.groups[gi]}, placement)
        # bundles sharing a node map share the dict: nothing below mutates it
        b = _Bundle(blocks, nbytes, hold_maps[holders], need_maps[needers])
        lower_bound += nbytes * (len(b.needers) - sum(1 for node in b.holders if node in b.needers))
        bundles.append(b)
    return bundles, lower_bound


def _cells_bytes(cells: list[Box], dtype: str) -> int:
    return sum(_box_bytes(c, dtype) for c in cells)


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


def _box_bytes(box: Box, dtype: str) -> int:
    n = DTYPE_BYTES[dtype]
    for s in box[1]:
        n *= s
    return n


# -- steps 2 and 3: routing ------------------------------------------------------------------


@dataclass(frozen=True)
class _NeedNodes:
    """A need map as arrays: needing nodes (node-map order) and, per node, its needing workers."""

    node_idx: np.ndarray       # node index of each needing node
    workers: list[list[int]]   # needing workers of each needing node
    padded: np.ndarray         # the same as a (nodes, most workers on a node) array, -1 padded
    position: dict[str, int]   # node name -> its position in these arrays
    everywhere: np.ndarray     # every position


class _Router:
    """Steps 2 and 3: where each bundle's bytes come from and which worker they enter.

    Deliveries are recorded as ``(phase, src, dst, key)`` with keys ``(bundle, part, parts)``;
    phase 0 moves bytes from holders (intra or inter node), phase 1 fans them out inside a node.
    A bundle's remote deliveries are recorded as arrays at once, with the result of choosing the
    least-loaded sender and entry worker one delivery at a time (:meth:`_deliver`,
    :meth:`_senders`); copies inside a node that holds the bundle are chosen one at a time.
    """

    def __init__(self, placement: Placement, params: ParamTable, bandwidths: Bandwidths):
        self.placement = placement
        self.params = params
        self.bandwidths = bandwidths
        self.node_names = sorted(set(placement.nodes))
        self.node_index = {n: i for i, n in enumerate(self.node_names)}
        self.node_of = np.array([self.node_index[n] for n in placement.nodes], dtype=np.int64)
        self.egress = np.zeros(placement.num_workers, dtype=np.int64)   # worker -> bytes sent
        self.ingress = np.zeros(placement.num_workers, dtype=np.int64)  # worker -> bytes received
        self.node_egress: dict[str, int] = defaultdict(int)
        self.bundles: list[_Bundle] = []
        self.keys: list[tuple[int, int, int]] = []
        self.key_ids: dict[tuple[int, int, int], int] = {}
        self.key_bytes: list[int] = []
        self.deliveries: list[tuple[int, np.ndarray, np.ndarray, int]] = []  # (phase, srcs, dsts, key)
        self.pending: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        self.local: dict[int, list[int]] = defaultdict(list)  # worker -> key ids it copies locally
        # class (holder nodes) -> (bundle id, positions of its remote needing nodes in _NeedNodes)
        self.remote: dict[tuple[str, ...], list[tuple[int, np.ndarray]]] = defaultdict(list)
        self.pairs: set[tuple[str, str]] = set()
        self._need_nodes: dict[int, _NeedNodes] = {}
        self._holder_workers: dict[int, np.ndarray | None] = {}
        self._splits: dict[tuple[int, int, int], list[Box]] = {}

    # -- keys --------------------------------------------------------------------------------
    def _key(self, bid: int, part: int, parts: int) -> int:
        k = (bid, part, parts)
        i = self.key_ids.get(k)
        if i is None:
            i = self.key_ids[k] = len(self.keys)
            self.keys.append(k)
            self.key_bytes.append(self.bundles[bid].nbytes if parts == 1 else sum(  # whole: counted by _bundles
                len(names) * _cells_bytes(cells, dtype) for names, dtype, cells in self.blocks_of(k)))
        return i

    def blocks_of(self, key: tuple[int, int, int]) -> list[tuple[tuple[str, ...], str, list[Box]]]:
        """The blocks a key moves: its bundle's, or part ``part`` of ``parts`` of every cell."""
        bid, part, parts = key
        blocks = self.bundles[bid].blocks
        if parts == 1:
            return blocks
        out = []
        for names, dtype, cells in blocks:
            split = self._splits.get((id(cells), part, parts))
            if split is None:
                split = self._splits[id(cells), part, parts] = [
                    pieces[part] for c in cells if part < len(pieces := split_rows(c, parts))]
            if split:
                out.append((names, dtype, split))
        return out

    # -- recording ---------------------------------------------------------------------------
    def _least(self, workers: list[int], load: np.ndarray) -> int:
        if len(workers) == 1:
            return workers[0]
        return min(workers, key=lambda w: (int(load[w]), w))

    def _send(self, phase: int, src: int, dst: int, key: int) -> None:
        for column, value in zip(self.pending, (phase, src, dst, key)):
            column.append(value)
        nbytes = self.key_bytes[key]
        self.egress[src] += nbytes
        self.ingress[dst] += nbytes

    def _record(self, phase: int, src: np.ndarray, dst: np.ndarray, key: int) -> None:
        """``_send`` for many routes of one key at once."""
        if src.size:
            self.deliveries.append((phase, src, dst, key))
            for load, ends in ((self.egress, src), (self.ingress, dst)):
                if ends.size > load.size // 4:
                    load += np.bincount(ends, minlength=load.size) * self.key_bytes[key]
                else:
                    np.add.at(load, ends, self.key_bytes[key])

    def _need_nodes_of(self, needers: dict[str, list[int]]) -> _NeedNodes:
        info = self._need_nodes.get(id(needers))  # need maps are shared and live as long as the router
        if info is None:
            workers = list(needers.values())
            padded = np.full((len(workers), max(map(len, workers))), -1, dtype=_ID)
            for i, ws in enumerate(workers):
                padded[i, :len(ws)] = ws
            info = self._need_nodes[id(needers)] = _NeedNodes(
                np.array([self.node_index[n] for n in needers], dtype=np.int64), workers, padded,
                {n: i for i, n in enumerate(needers)}, np.arange(len(workers)))
        return info

    def _single_holders(self, holders: dict[str, list[int]]) -> np.ndarray | None:
        """Node index -> its one holder worker (-1 elsewhere), or None when a node has several."""
        if id(holders) not in self._holder_workers:
            table = None
            if all(len(ws) == 1 for ws in holders.values()):
                table = np.full(len(self.node_names), -1, dtype=_ID)
                for node, ws in holders.items():
                    table[self.node_index[node]] = ws[0]
            self._holder_workers[id(holders)] = table
        return self._holder_workers[id(holders)]

    # -- step 2 ------------------------------------------------------------------------------
    def route_bundle(self, b: _Bundle) -> None:
        bid = len(self.bundles)
        self.bundles.append(b)
        for node, local_holders in b.holders.items():
            needers = b.needers.get(node)
            if needers is None:
                continue
            whole = self._key(bid, 0, 1)
            holding = set(local_holders)
            for w in needers:
                if w in holding:
                    self.local[w].append(whole)
                else:
                    self._send(0, self._least(local_holders, self.egress), w, whole)
        info = self._need_nodes_of(b.needers)
        remote = info.everywhere
        served = [info.position[n] for n in b.holders if n in info.position]
        if served:
            remote = np.delete(remote, served)
        if remote.size:
            self.remote[tuple(sorted(b.holders))].append((bid, remote))

    # -- step 3 ------------------------------------------------------------------------------
    def assign_remote(self) -> None:
        for holder_nodes in sorted(self.remote):
            demands = self.remote[holder_nodes]
            nodes = np.concatenate([self._need_nodes_of(self.bundles[bid].needers).node_idx[pos]
                                    for bid, pos in demands])
            weights = np.concatenate([np.full(pos.size, self.bundles[bid].nbytes, dtype=np.int64)
                                      for bid, pos in demands])
            node_bytes = np.zeros(len(self.node_names), dtype=np.int64)
            np.add.at(node_bytes, nodes, weights)
            dst_nodes = np.unique(nodes)  # node indices follow sorted node names
            parts = max(1, min(MAX_SENDERS_PER_CELL, len(holder_nodes) // len(dst_nodes)))
            rows = [(self.node_names[n], p, int(node_bytes[n]) // parts) for n in dst_nodes.tolist()
                    for p in range(parts)]
            chosen = self._balance(list(holder_nodes), rows)
            sender = np.full((len(self.node_names), parts), -1, dtype=np.int64)
            for (node, part, nbytes), h in zip(rows, chosen):
                self.node_egress[h] += nbytes
                self.pairs.add((h, node))
                sender[self.node_index[node], part] = self.node_index[h]
            for bid, pos in demands:
                for part in range(parts):
                    self._deliver(bid, pos, sender[:, part], part, parts)

    def _balance(self, holders: list[str], rows: list[tuple[str, int, int]]) -> list[str]:
        """Holder node for each row: min total cost with convex slot costs (see module doc)."""
        if len(holders) == 1:
            return holders * len(rows)
        mean = max(1, sum(r[2] for r in rows) // len(rows))
        slots_per = -(-len(rows) // len(holders))
        bonus = mean * 0.25
        row_nodes = {r[0] for r in rows}
        holder_set = set(holders)
        alike = len({r[2] for r in rows}) == 1 and not any(
            h in holder_set and n in row_nodes for h, n in self.pairs)
        if alike:
            order = sorted(holders, key=lambda h: (self.node_egress[h], h))
            return [order[i % len(order)] for i in range(len(rows))]
        if len(rows) <= LSA_MAX_ROWS:
            cost = np.empty((len(rows), len(holders) * slots_per))
            for c, h in enumerate(holders):
                for j in range(slots_per):
                    cost[:, c * slots_per + j] = self.node_egress[h] + j * mean
            for r, (node, _, nbytes) in enumerate(rows):
                cost[r] *= nbytes
                for c, h in enumerate(holders):
                    if (h, node) in self.pairs:
                        cost[r, c * slots_per:(c + 1) * slots_per] -= bonus * nbytes
            from scipy.optimize import linear_sum_assignment  # 0.4 s to import; most plans never need it

            row_ind, col_ind = linear_sum_assignment(cost)
            out = [""] * len(rows)
            for r, c in zip(row_ind, col_ind):
                out[r] = holders[c // slots_per]
            return out
        load = {h: self.node_egress[h] for h in holders}
        out = [""] * len(rows)
        for r in sorted(range(len(rows)), key=lambda i: (-rows[i][2], i)):
            node, _, nbytes = rows[r]
            h = min(holders, key=lambda h: (load[h] - (bonus if (h, node) in self.pairs else 0), h))
            load[h] += nbytes
            out[r] = h
        return out

    def _deliver(self, bid: int, pos: np.ndarray, sender: np.ndarray, part: int, parts: int) -> None:
        """Part ``part`` of bundle ``bid`` into its needing nodes at ``pos``, each sent by the
        holder node ``sender[node]``: into one entry worker per node, then fanned out."""
        b = self.bundles[bid]
        key = self._key(bid, part, parts)
        nbytes = self.key_bytes[key]
        if not nbytes:
            return
        info = self._need_nodes_of(b.needers)
        holder_nodes = sender[info.node_idx[pos]]
        single = self._single_holders(b.holders)
        src = single[holder_nodes] if single is not None else self._senders(b, holder_nodes, nbytes)
        # The nodes' needing workers are disjoint, so each node's entry (least ingress, lowest
        # id on ties) does not depend on the other nodes' choices: all at once.
        candidates = info.padded[pos]
        if candidates.shape[1] == 1:  # one needing worker per node: it is the entry
            self._record(0, src, candidates[:, 0], key)
            return
        present = candidates >= 0
        load = np.where(present, self.ingress[candidates], np.iinfo(np.int64).max)
        choice = np.argmin(load, axis=1)
        entry = candidates[np.arange(pos.size), choice]
        fan = present.copy()
        fan[np.arange(pos.size), choice] = False
        fan_src, fan_dst = np.broadcast_to(entry[:, None], fan.shape)[fan], candidates[fan]
        self._record(0, src, entry, key)
        self._record(1, fan_src, fan_dst, key)

    def _senders(self, b: _Bundle, holder_nodes: np.ndarray, nbytes: int) -> np.ndarray:
        """The holder worker sending each delivery: one at a time, each delivery would go to the
        holder of its node with the least egress (lowest id on ties), which then has ``nbytes``
        more. For ``k`` deliveries from one node that is the ``k`` smallest of
        ``(egress[w] + j * nbytes, w)`` over its holders ``w`` and ``j = 0..k-1``, in order."""
        src = np.empty(holder_nodes.size, dtype=_ID)
        for h in np.unique(holder_nodes).tolist():
            at = np.flatnonzero(holder_nodes == h)
            workers = np.array(b.holders[self.node_names[h]], dtype=np.int64)
            loads = self.egress[workers][:, None] + np.arange(at.size, dtype=np.int64) * nbytes
            ids = np.broadcast_to(workers[:, None], loads.shape).ravel()
            src[at] = ids[np.lexsort((ids, loads.ravel()))[:at.size]]
        return src

    # -- step 4: route lists, segments, steps, stats -----------------------------------------

    def build(self, bucket_bytes: int) -> Plan:
        counts = [d[1].size for d in self.deliveries]
        phase, keys = (np.concatenate([np.repeat(np.array([d[i] for d in self.deliveries], dtype=_ID), counts),
                                       np.array(self.pending[i], dtype=_ID)]) for i in (0, 3))
        src, dst = (np.concatenate([d[i].astype(_ID, copy=False) for d in self.deliveries]
                                   + [np.array(self.pending[i], dtype=_ID)]) for i in (1, 2))
        # one route per (phase, src, dst), carrying its keys in the order they were recorded
        width = self.placement.num_workers
        if 2 * width * width >= 2**31:  # past 32,768 workers the route number needs 64 bits
            phase = phase.astype(np.int64)
        route_of = (phase * width + src) * width + dst
        order = np.argsort(route_of, kind="stable")
        route_of, keys = route_of[order], keys[order]
        new = np.ones(keys.size, dtype=bool)
        new[1:] = route_of[1:] != route_of[:-1]
        starts = np.flatnonzero(new)
        lengths = np.diff(np.append(starts, keys.size))

        key_lists: list[tuple[int, ...]] = []
        list_index: dict[tuple[int, ...], int] = {}

        def intern(k: tuple[int, ...]) -> int:
            j = list_index.get(k)
            if j is None:
                j = list_index[k] = len(key_lists)
                key_lists.append(k)
            return j

        local_copies = [(w, intern(tuple(ks))) for w, ks in sorted(self.local.items())]
        route_list = np.empty(starts.size, dtype=np.int64)
        bits = len(self.keys).bit_length()
        for length in np.unique(lengths).tolist():  # routes carrying `length` keys: their distinct key lists
            routes = np.flatnonzero(lengths == length)
            carried = keys[starts[routes][:, None] + np.arange(length)]
            if length == 1:  # one key: the distinct keys, in key order
                used = np.flatnonzero(np.bincount(carried[:, 0], minlength=len(self.keys)))
                ids = np.zeros(len(self.keys), dtype=np.int64)
                ids[used] = [intern((k,)) for k in used.tolist()]
                route_list[routes] = ids[carried[:, 0]]
            elif length * bits <= 62:  # each route's key list as one integer, then unique integers
                code = (carried.astype(np.int64) << (np.arange(length, dtype=np.int64) * bits)).sum(axis=1)
                _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
                ids = np.array([intern(tuple(carried[i].tolist())) for i in first.tolist()], dtype=np.int64)
                route_list[routes] = ids[inverse.reshape(-1)]
            else:
                route_list[routes] = [intern(tuple(row)) for row in carried.tolist()]
        first_of_route = route_of[starts].astype(np.int64)
        route_phase, route_src, route_dst = (first_of_route // (width * width), first_of_route // width % width,
                                             first_of_route % width)

        segments, segment_lists, list_bytes, counts = self._segment_table(key_lists, bucket_bytes)
        bytes_of = np.array(list_bytes, dtype=np.int64)[route_list] if route_list.size else route_list
        step, num_steps, forward_from = _schedule(route_phase, route_src, route_dst, bytes_of)
        by_step = np.argsort(step * width + route_src, kind="stable")
        route_src, route_dst, route_list, bytes_of = (a[by_step] for a in (route_src, route_dst, route_list, bytes_of))
        step_starts = np.searchsorted(step[by_step], np.arange(num_steps + 1))
        steps = _steps_of(route_src, route_dst, route_list, step_starts)
        stats = self._stats(route_src, route_dst, bytes_of, step_starts, local_copies, list_bytes)
        stats["num_buckets"] = int(np.array(counts, dtype=np.int64)[route_list].sum()) if route_list.size else 0
        return Plan(segments, segment_lists, local_copies, steps, bucket_bytes, self.placement.nodes,
                    forward_from, stats)

    def _segment_table(self, key_lists: list[tuple[int, ...]], bucket_bytes: int):
        """Segments as runs of blocks, each key's one contiguous range (lists of several keys
        chain their keys' ranges); bytes and bucket counts per list."""
        runs: list[tuple[tuple[str, ...], str, list[Box]]] = []
        key_range: dict[int, range] = {}
        aligned: dict[int, int] = {}  # key -> bytes with every segment padded to BUCKET_ALIGN
        cell_sizes: dict[tuple[int, str], int] = {}
        total = 0
        for k in sorted({k for ks in key_lists for k in ks}):
            first, padded = total, 0
            for names, dtype, cells in self.blocks_of(self.keys[k]):
                runs.append((names, dtype, cells))
                total += len(names) * len(cells)
                size = cell_sizes.get((id(cells), dtype))
                if size is None:
                    size = cell_sizes[id(cells), dtype] = sum(
                        -(-_box_bytes(c, dtype) // BUCKET_ALIGN) * BUCKET_ALIGN for c in cells)
                padded += len(names) * size
            key_range[k], aligned[k] = range(first, total), padded
        table = SegmentTable(runs)
        lists: list[Sequence[int]] = []
        list_bytes: list[int] = []
        counts: list[int] = []
        shapes: dict[int, tuple] = {}  # id of a cell list -> its cells' sizes
        known: dict[tuple, int] = {}  # size signature of a list -> its bucket count
        for ks in key_lists:
            if len(ks) == 1:
                ids, nbytes, padded = key_range[ks[0]], self.key_bytes[ks[0]], aligned[ks[0]]
            else:
                ids = IndexChain([key_range[k] for k in ks])
                nbytes, padded = sum(self.key_bytes[k] for k in ks), sum(aligned[k] for k in ks)
            lists.append(ids)
            list_bytes.append(nbytes)
            if padded <= bucket_bytes:
                counts.append(int(nbytes > 0))
            else:  # larger than one bucket: cut it as the executors will
                counts.append(self._bucket_count(ks, bucket_bytes, shapes, known))
        return table, lists, list_bytes, counts

    def _bucket_count(self, ks: tuple[int, ...], bucket_bytes: int, shapes: dict, known: dict) -> int:
        """``bucket_count`` of a list's segments. Cutting depends only on the sequence of
        segment sizes and dtypes (not names or offsets), so lists with the same sequence (the
        same experts on another rank, the same layers on another replica) are cut once."""
        blocks = [b for k in ks for b in self.blocks_of(self.keys[k])]
        signature = []
        for names, dtype, cells in blocks:
            sizes = shapes.get(id(cells))
            if sizes is None:
                sizes = shapes[id(cells)] = tuple(z for _, z in cells)
            signature.append((len(names), dtype, sizes))
        signature = tuple(signature)
        n = known.get(signature)
        if n is None:
            n = known[signature] = bucket_count([Segment(p, o, z, dtype) for names, dtype, cells in blocks
                                                 for p in names for o, z in cells], bucket_bytes)
        return n

    def _stats(self, src, dst, nbytes, step_starts, local_copies, list_bytes) -> dict:
        """Plan statistics from the routes (sorted by step, step ``s`` being
        ``step_starts[s]:step_starts[s + 1]``)."""
        bw = self.bandwidths
        workers = self.placement.num_workers
        nodes = len(self.node_names)
        src_node, dst_node = self.node_of[src], self.node_of[dst]
        intra = src_node == dst_node
        inter = ~intra
        inter_bytes = nbytes[inter]
        node_out = np.bincount(src_node[inter], weights=inter_bytes, minlength=nodes)
        node_in = np.bincount(dst_node[inter], weights=inter_bytes, minlength=nodes)
        num_steps = len(step_starts) - 1
        seconds_each = nbytes / np.where(intra, bw.intra_node, bw.inter_node)
        slowest = np.maximum.reduceat(seconds_each, step_starts[:-1]) if num_steps else np.zeros(0)
        local_per_worker: dict[int, int] = defaultdict(int)
        for w, j in local_copies:
            local_per_worker[w] += list_bytes[j]
        seconds = float(slowest.sum()) + max(local_per_worker.values(), default=0) / bw.local_copy

        def table(ends: np.ndarray, weights: np.ndarray, size: int, name) -> dict[str, int]:
            """Bytes per sender (receiver), for every one that sends (receives) something."""
            total = np.bincount(ends, weights=weights, minlength=size)
            used = np.bincount(ends, minlength=size) > 0
            return {name(i): int(total[i]) for i in np.flatnonzero(used).tolist()}

        node_name, rank_name = self.node_names.__getitem__, str
        return {
            "bytes_total": int(nbytes.sum()),
            "bytes_intra_node": int(nbytes[intra].sum()),
            "bytes_inter_node": int(inter_bytes.sum()),
            "bytes_local_copy": sum(local_per_worker.values()),
            "max_node_egress_bytes": int(node_out.max(initial=0)),
            "max_node_ingress_bytes": int(node_in.max(initial=0)),
            "node_egress_bytes": table(src_node[inter], inter_bytes, nodes, node_name),
            "node_ingress_bytes": table(dst_node[inter], inter_bytes, nodes, node_name),
            "rank_send_bytes": table(src, nbytes, workers, rank_name),
            "rank_recv_bytes": table(dst, nbytes, workers, rank_name),
            "num_steps": num_steps,
            "num_routes": int(src.size),
            "estimated_seconds": seconds,
            "bandwidths": {"intra_node": bw.intra_node, "inter_node": bw.inter_node, "local_copy": bw.local_copy},
        }


#: Plans with more routes than this keep their steps as a :class:`StepTable` (arrays), and are
#: scheduled by :func:`_cyclic_steps` when that costs few steps (:func:`_cyclic_suits`);
#: smaller ones by the greedy :func:`_colour`, as lists.
LARGE_PLAN_ROUTES = 100_000


def _cyclic_suits(src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether the cyclic schedule of these routes is within 10% (+8) of the fewest steps any
    schedule can have (the largest number of routes one worker sends or receives).

    Dense exchanges (every worker talks to most others: a sharded source to many replicas) pass;
    sparse ones (each worker talks to a few peers) would get up to ``W`` steps and fail."""
    if src.size <= LARGE_PLAN_ROUTES:
        return False
    width = int(max(src.max(), dst.max())) + 1
    degree = max(int(np.bincount(src).max()), int(np.bincount(dst).max()))
    colours = int(np.count_nonzero(np.bincount((dst - src) % width, minlength=width)))
    return colours <= 1.1 * degree + 8


def _schedule(phase: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Step of every route: phase 0 steps first, then phase 1 (fan-out); returns
    ``(step per route, number of steps, first phase-1 step)``."""
    step = np.zeros(src.size, dtype=np.int64)
    num_steps = forward_from = 0
    for ph in (0, 1):
        forward_from = num_steps
        idx = np.flatnonzero(phase == ph)
        if not idx.size:
            continue
        if _cyclic_suits(src[idx], dst[idx]):
            colours = _cyclic_steps(src[idx], dst[idx])
        else:
            order = np.lexsort((dst[idx], src[idx], -nbytes[idx]))
            colours = np.empty(idx.size, dtype=np.int64)
            colours[order] = _colour(src[idx][order].tolist(), dst[idx][order].tolist())
        step[idx] = colours + num_steps
        num_steps += int(colours.max()) + 1
    return step, num_steps, forward_from


def _cyclic_steps(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Step ``(dst - src) mod W`` (``W`` past the largest worker id), steps left empty removed.

    For one ``src`` the steps of its routes differ because their ``dst`` do, and for one ``dst``
    because their ``src`` do: a proper schedule in at most ``W`` steps, computed without a loop.
    It suits dense exchanges (every worker talks to most others, so any schedule needs about
    ``W`` steps); sparse ones get the greedy colouring, which needs about their degree.
    """
    width = int(max(src.max(), dst.max())) + 1
    colour = (dst - src) % width
    used = np.bincount(colour, minlength=width) > 0
    return (np.cumsum(used) - 1)[colour]


def _colour(src: list[int], dst: list[int]) -> list[int]:
    """Greedy edge colouring, in the given order: each step holds at most one send and one
    receive per worker; returns the step of each route."""
    send_busy: dict[int, int] = defaultdict(int)  # worker -> bitmask of steps where it sends
    recv_busy: dict[int, int] = defaultdict(int)
    out = []
    for s_, d_ in zip(src, dst):
        busy = send_busy[s_] | recv_busy[d_]
        free = ~busy & (busy + 1)  # lowest clear bit
        send_busy[s_] |= free
        recv_busy[d_] |= free
        out.append(free.bit_length() - 1)
    return out


def _steps_of(src: np.ndarray, dst: np.ndarray, lists: np.ndarray, starts: np.ndarray):
    """Routes sorted by step as lists of :class:`Route`, or a :class:`StepTable` for large plans."""
    table = StepTable(src, dst, lists, starts)
    if src.size > LARGE_PLAN_ROUTES:
        return table
    return [list(s) for s in table]
