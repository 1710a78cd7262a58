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

from realloc.boxes import Box, inside_shape, split_rows
from realloc.layout import Group, Layout
from realloc.placement import Placement
from realloc.plan import BUCKET_ALIGN, Plan, Route, Segment, bucket_count
from realloc.spec import DTYPE_BYTES, ModelSpec

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20
LSA_MAX_ROWS = 512
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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"bandwidth {name} must be positive, got {getattr(self, name)!r}")


ParamTable = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)


def plan_exchange(
    holdings: Sequence[Group],
    needs: Sequence[Group],
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
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1024:
        raise ValueError(f"bucket_bytes must be an integer of at least 1024, got {bucket_bytes!r}")
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
                not isinstance(w, int) or isinstance(w, bool) or w < 0 for w in workers):
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
        src_layout.groups(list(src_workers) if src_workers is not None else None),
        dst_layout.groups(list(dst_workers) if dst_workers is not None else None),
        placement, table, bucket_bytes=bucket_bytes, bandwidths=bandwidths,
    )


# -- validation -----------------------------------------------------------------------------


def _validate(holdings: Sequence[Group], needs: Sequence[Group], placement: Placement, params: ParamTable) -> None:
    for name, (shape, dtype) in params.items():
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"parameter {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    for what, groups in (("holdings", holdings), ("needs", needs)):
        for g in groups:
            if not g.workers:
                raise ValueError(f"{what}: a group has no workers")
            placement.check_workers(g.workers, what)
            for param, offsets, sizes in g.pieces:
                if param not in params:
                    raise ValueError(f"{what}: unknown parameter {param!r}")
                if not inside_shape((tuple(offsets), tuple(sizes)), tuple(params[param][0])):
                    raise ValueError(
                        f"{what}: box offsets={tuple(offsets)} sizes={tuple(sizes)} is empty or outside "
                        f"{param!r} of shape {tuple(params[param][0])}"
                    )


# -- step 1: cells and bundles ---------------------------------------------------------------


@dataclass
class _Bundle:
    cells: list[Box]
    params: list[str]
    nbytes: int
    holders: dict[str, list[int]]  # node -> holder workers (sorted)
    needers: dict[str, list[int]]  # node -> needing workers (sorted)


def _node_map(workers: set[int], placement: Placement) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for w in sorted(workers):
        out[placement.nodes[w]].append(w)
    return dict(out)


def _bundles(holdings: Sequence[Group], needs: Sequence[Group], params: ParamTable,
             placement: Placement) -> tuple[list[_Bundle], int]:
    order = {name: i for i, name in enumerate(params)}
    hold_by_param: dict[str, list[tuple[int, Box]]] = defaultdict(list)
    need_by_param: dict[str, list[tuple[int, Box]]] = defaultdict(list)
    for gi, g in enumerate(holdings):
        for param, offsets, sizes in g.pieces:
            hold_by_param[param].append((gi, (tuple(offsets), tuple(sizes))))
    for gi, g in enumerate(needs):
        for param, offsets, sizes in g.pieces:
            need_by_param[param].append((gi, (tuple(offsets), tuple(sizes))))

    keyed: dict[tuple[frozenset, frozenset], list[tuple[int, str, Box]]] = defaultdict(list)
    missing: list[str] = []
    for param in sorted(need_by_param, key=order.__getitem__):
        held = hold_by_param.get(param, [])
        boxes = [b for _, b in held] + [b for _, b in need_by_param[param]]
        ndim = len(boxes[0][0])
        cuts = [sorted({b[0][d] for b in boxes} | {b[0][d] + b[1][d] for b in boxes}) for d in range(ndim)]
        covering = _covering_masks(held, cuts)
        needing = _covering_masks(need_by_param[param], cuts)
        cells: dict[Box, tuple[int, ...]] = {}
        for _, box in need_by_param[param]:
            for cell, index in _grid_cells_indexed(box, cuts):
                cells.setdefault(cell, index)
        holder_sets: dict[int, frozenset] = {}
        need_sets: dict[int, frozenset] = {}
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
                missing.append(f"{param} offsets={cell[0]} sizes={cell[1]}")
                continue
            holders = holder_sets.get(mask)
            if holders is None:
                holders = holder_sets[mask] = frozenset(held[i][0] for i in _bits(mask))
            needers = need_sets.get(need_mask)
            if needers is None:
                needers = need_sets[need_mask] = frozenset(need_by_param[param][i][0] for i in _bits(need_mask))
            keyed[holders, needers].append((order[param], param, cell))
    if missing:
        raise ValueError(f"{len(missing)} needed boxes are held by no worker, e.g. {missing[:3]}")

    bundles: list[_Bundle] = []
    lower_bound = 0
    hold_maps: dict[frozenset, dict[str, list[int]]] = {}
    need_maps: dict[frozenset, dict[str, list[int]]] = {}
    for (holders, needers), cells in sorted(keyed.items(), key=lambda kv: kv[1][0]):
        nbytes = sum(_box_bytes(c, params[p][1]) for _, p, c in cells)
        if holders not in hold_maps:
            hold_maps[holders] = _node_map({w for gi in holders for w in holdings[gi].workers}, placement)
        if needers not in need_maps:
            need_maps[needers] = _node_map({w for gi in needers for w in needs[gi].workers}, placement)
        # bundles sharing a node map share the dict: nothing below mutates it
        b = _Bundle([c for _, _, c in cells], [p for _, p, _ in cells], nbytes, hold_maps[holders], need_maps[needers])
        lower_bound += nbytes * sum(1 for node in b.needers if node not in b.holders)
        bundles.append(b)
    return bundles, lower_bound


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


class _Router:
    def __init__(self, placement: Placement, params: ParamTable, bandwidths: Bandwidths):
        self.placement = placement
        self.params = params
        self.bandwidths = bandwidths
        self.egress: dict[int, int] = defaultdict(int)   # worker -> bytes sent
        self.ingress: dict[int, int] = defaultdict(int)  # worker -> bytes received
        self.node_egress: dict[str, int] = defaultdict(int)
        # Routes carry (bundle id, part, parts) keys, expanded into segments once per distinct
        # key list when the plan is built: dp replicas share them, so this is what scales.
        # (phase, src, dst) -> keys; phase 0: from holders (intra or inter node), 1: fan-out.
        self.bundles: list[_Bundle] = []
        self.routes: dict[tuple[int, int, int], list[tuple[int, int, int]]] = defaultdict(list)
        self.local: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        # class (holder nodes) -> list of (dst node, bundle id)
        self.remote: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
        self.pairs: set[tuple[str, str]] = set()

    def _least(self, workers: list[int], load: dict[int, int]) -> int:
        if len(workers) == 1:
            return workers[0]
        return min(workers, key=lambda w: (load[w], w))

    def _send(self, phase: int, src: int, dst: int, key: tuple[int, int, int], nbytes: int) -> None:
        self.routes[phase, src, dst].append(key)
        self.egress[src] += nbytes
        self.ingress[dst] += nbytes

    def route_bundle(self, b: _Bundle) -> None:
        bid = len(self.bundles)
        self.bundles.append(b)
        whole = (bid, 0, 1)
        remote = self.remote[tuple(sorted(b.holders))]
        for node, needers in b.needers.items():
            local_holders = b.holders.get(node)
            if local_holders is None:
                remote.append((node, bid))
                continue
            holding = set(local_holders)
            for w in needers:
                if w in holding:
                    self.local[w].append(whole)
                else:
                    src = self._least(local_holders, self.egress)
                    self._send(0, src, w, whole, b.nbytes)

    def assign_remote(self) -> None:
        for holder_nodes in sorted(self.remote):
            demands = self.remote[holder_nodes]
            if not demands:
                continue
            by_dst: dict[str, list[int]] = defaultdict(list)
            for node, bid in demands:
                by_dst[node].append(bid)
            parts = max(1, min(MAX_SENDERS_PER_CELL, len(holder_nodes) // len(by_dst)))
            rows = [(node, p, sum(self.bundles[b].nbytes for b in bs) // parts) for node, bs in sorted(by_dst.items())
                    for p in range(parts)]
            chosen = self._balance(list(holder_nodes), rows)
            for (node, part, nbytes), h in zip(rows, chosen):
                self.node_egress[h] += nbytes
                self.pairs.add((h, node))
                for bid in by_dst[node]:
                    self._deliver(bid, h, node, part, parts)

    def _balance(self, holders: list[str], rows: list[tuple[str, int, int]]) -> list[str]:
        """Holder node for each row: min total cost with convex slot costs (see module doc)."""
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

    def _deliver(self, bid: int, holder_node: str, dst_node: str, part: int, parts: int) -> None:
        b = self.bundles[bid]
        key = (bid, part, parts)
        nbytes = b.nbytes if parts == 1 else sum(
            _box_bytes(pieces[part], self.params[p][1])
            for p, c in zip(b.params, b.cells) if part < len(pieces := split_rows(c, parts)))
        if not nbytes:
            return
        needers = b.needers[dst_node]
        src = self._least(b.holders[holder_node], self.egress)
        entry = self._least(needers, self.ingress)
        self._send(0, src, entry, key, nbytes)
        for w in needers:
            if w != entry:
                self._send(1, entry, w, key, nbytes)

    def _segments_of(self, key: tuple[int, int, int]) -> list[tuple[str, Box]]:
        bid, part, parts = key
        b = self.bundles[bid]
        if parts == 1:
            return list(zip(b.params, b.cells))
        out = []
        for p, c in zip(b.params, b.cells):
            pieces = split_rows(c, parts)
            if part < len(pieces):
                out.append((p, pieces[part]))
        return out

    # -- step 4: steps, interning, stats -------------------------------------------------------

    def build(self, bucket_bytes: int) -> Plan:
        segments: list[Segment] = []
        seg_index: dict[tuple[str, Box], int] = {}
        lists: list[tuple[int, ...]] = []
        list_index: dict[tuple[tuple[int, int, int], ...], int] = {}
        list_bytes: list[int] = []

        seg_bytes: list[int] = []  # segments[i].nbytes, computed once
        key_segments: dict[tuple[int, int, int], tuple[list[int], int]] = {}  # key -> (ids, bytes)

        def segment_ids(key: tuple[int, int, int]) -> tuple[list[int], int]:
            entry = key_segments.get(key)
            if entry is None:
                ids, total = [], 0
                for param, box in self._segments_of(key):
                    i = seg_index.get((param, box))
                    if i is None:
                        i = seg_index[param, box] = len(segments)
                        seg = Segment(param, box[0], box[1], self.params[param][1])
                        segments.append(seg)
                        seg_bytes.append(seg.nbytes)
                    ids.append(i)
                    total += seg_bytes[i]
                entry = key_segments[key] = (ids, total)
            return entry

        def intern(keys: list[tuple[int, int, int]]) -> int:
            k = tuple(keys)
            j = list_index.get(k)
            if j is None:
                entries = [segment_ids(key) for key in keys]
                j = list_index[k] = len(lists)
                lists.append(tuple(i for ids, _ in entries for i in ids))
                list_bytes.append(sum(total for _, total in entries))
            return j

        local_copies = [(w, intern(items)) for w, items in sorted(self.local.items())]
        nodes = self.placement.nodes
        phases: list[list[tuple[int, int, int, int]]] = [[], []]
        for (phase, src, dst), items in self.routes.items():
            j = intern(items)
            phases[phase].append((list_bytes[j], src, dst, j))
        steps: list[list[Route]] = []
        forward_from = 0
        for routes in phases:
            forward_from = len(steps)
            routes.sort(key=lambda r: (-r[0], r[1], r[2]))
            steps.extend(_colour(routes))

        stats = self._stats(steps, local_copies, list_bytes, nodes)
        bucket_counts = {}
        aligned = np.array(seg_bytes, dtype=np.int64)
        aligned = -(-aligned // BUCKET_ALIGN) * BUCKET_ALIGN
        for step in steps:
            for _, _, j in step:
                if j not in bucket_counts:
                    ids = lists[j]
                    if ids and int(aligned[np.array(ids, dtype=np.int64)].sum()) <= bucket_bytes:
                        # every segment starts aligned and the aligned sizes fit: one bucket, uncut
                        bucket_counts[j] = 1
                    else:
                        bucket_counts[j] = bucket_count([segments[i] for i in ids], bucket_bytes)
        stats["num_buckets"] = sum(bucket_counts[j] for step in steps for _, _, j in step)
        return Plan(segments, lists, local_copies, steps, bucket_bytes, nodes, forward_from, stats)

    def _stats(self, steps, local_copies, list_bytes, nodes) -> dict:
        intra = inter = 0
        node_in: dict[str, int] = defaultdict(int)
        node_out: dict[str, int] = defaultdict(int)
        send: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        seconds = 0.0
        bw = self.bandwidths
        for step in steps:
            slowest = 0.0
            for src, dst, j in step:
                n = list_bytes[j]
                send[src] += n
                recv[dst] += n
                if nodes[src] == nodes[dst]:
                    intra += n
                    slowest = max(slowest, n / bw.intra_node)
                else:
                    inter += n
                    node_out[nodes[src]] += n
                    node_in[nodes[dst]] += n
                    slowest = max(slowest, n / bw.inter_node)
            seconds += slowest
        local_per_worker: dict[int, int] = defaultdict(int)
        for w, j in local_copies:
            local_per_worker[w] += list_bytes[j]
        seconds += max(local_per_worker.values(), default=0) / bw.local_copy
        return {
            "bytes_total": intra + inter,
            "bytes_intra_node": intra,
            "bytes_inter_node": inter,
            "bytes_local_copy": sum(local_per_worker.values()),
            "max_node_egress_bytes": max(node_out.values(), default=0),
            "max_node_ingress_bytes": max(node_in.values(), default=0),
            "node_egress_bytes": dict(sorted(node_out.items())),
            "node_ingress_bytes": dict(sorted(node_in.items())),
            "rank_send_bytes": {str(k): v for k, v in sorted(send.items())},
            "rank_recv_bytes": {str(k): v for k, v in sorted(recv.items())},
            "num_steps": len(steps),
            "num_routes": sum(len(s) for s in steps),
            "estimated_seconds": seconds,
            "bandwidths": {"intra_node": bw.intra_node, "inter_node": bw.inter_node, "local_copy": bw.local_copy},
        }


def _colour(routes: list[tuple[int, int, int, int]]) -> list[list[Route]]:
    """Greedy edge colouring: each step holds at most one send and one receive per worker."""
    send_busy: dict[int, int] = defaultdict(int)  # worker -> bitmask of steps where it sends
    recv_busy: dict[int, int] = defaultdict(int)
    steps: list[list[Route]] = []
    for _, src, dst, j in routes:
        busy = send_busy[src] | recv_busy[dst]
        free = ~busy & (busy + 1)  # lowest clear bit
        s = free.bit_length() - 1
        send_busy[src] |= free
        recv_busy[dst] |= free
        while len(steps) <= s:
            steps.append([])
        steps[s].append(Route(src, dst, j))
    return steps
