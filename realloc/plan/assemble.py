"""Step 4 of the exchange planner (:mod:`realloc.plan.planner`): the plan from the routes.

Routes (one per sender/receiver pair and phase) carry interned key lists; segments are runs of
blocks, each key one contiguous range of them (:class:`~realloc.plan.tables.SegmentTable`);
bucket counts come from cutting each distinct sequence of segment sizes once; the routes are
scheduled into steps (:mod:`realloc.plan.schedule`); and the statistics and time estimate are
computed from the scheduled routes.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

from realloc.boxes import Box
from realloc.plan.cells import box_bytes
from realloc.plan.records import BUCKET_ALIGN, Plan, Segment, bucket_count
from realloc.plan.routing import ID, Router
from realloc.plan.schedule import schedule_routes, steps_of
from realloc.plan.tables import IndexChain, SegmentTable

__all__ = ["build_plan"]


def build_plan(router: Router, bucket_bytes: int) -> Plan:
    """Step 4: the router's deliveries as a :class:`~realloc.plan.records.Plan`. One route per
    ``(phase, src, dst)`` carrying its keys in the order they were recorded, key lists
    interned, segments as runs of blocks, routes scheduled into steps, and the statistics."""
    counts = [d[1].size for d in router.deliveries]
    phase, keys = (
        np.concatenate(
            [
                np.repeat(np.array([d[i] for d in router.deliveries], dtype=ID), counts),
                np.array(router.pending[i], dtype=ID),
            ]
        )
        for i in (0, 3)
    )
    src, dst = (
        np.concatenate(
            [d[i].astype(ID, copy=False) for d in router.deliveries] + [np.array(router.pending[i], dtype=ID)]
        )
        for i in (1, 2)
    )
    # one route per (phase, src, dst), carrying its keys in the order they were recorded
    width = router.placement.num_workers
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

    local_copies = [(w, intern(tuple(ks))) for w, ks in sorted(router.local.items())]
    route_list = np.empty(starts.size, dtype=np.int64)
    bits = len(router.keys).bit_length()
    for length in np.unique(lengths).tolist():  # routes carrying `length` keys: their distinct key lists
        routes = np.flatnonzero(lengths == length)
        carried = keys[starts[routes][:, None] + np.arange(length)]
        if length == 1:  # one key: the distinct keys, in key order
            used = np.flatnonzero(np.bincount(carried[:, 0], minlength=len(router.keys)))
            ids = np.zeros(len(router.keys), dtype=np.int64)
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
    route_phase, route_src, route_dst = (
        first_of_route // (width * width),
        first_of_route // width % width,
        first_of_route % width,
    )

    segments, segment_lists, list_bytes, counts = _segment_table(router, key_lists, bucket_bytes)
    bytes_of = np.array(list_bytes, dtype=np.int64)[route_list] if route_list.size else route_list
    step, num_steps, forward_from = schedule_routes(route_phase, route_src, route_dst, bytes_of)
    by_step = np.argsort(step * width + route_src, kind="stable")
    route_src, route_dst, route_list, bytes_of = (a[by_step] for a in (route_src, route_dst, route_list, bytes_of))
    step_starts = np.searchsorted(step[by_step], np.arange(num_steps + 1))
    steps = steps_of(route_src, route_dst, route_list, step_starts)
    stats = _stats(router, route_src, route_dst, bytes_of, step_starts, local_copies, list_bytes)
    stats["num_buckets"] = int(np.array(counts, dtype=np.int64)[route_list].sum()) if route_list.size else 0
    return Plan(segments, segment_lists, local_copies, steps, bucket_bytes, router.placement.nodes, forward_from, stats)


def _segment_table(router: Router, key_lists: list[tuple[int, ...]], bucket_bytes: int):
    """Segments as runs of blocks, each key's one contiguous range (lists of several keys
    chain their keys' ranges); bytes and bucket counts per list."""
    runs: list[tuple[tuple[str, ...], str, list[Box]]] = []
    key_range: dict[int, range] = {}
    aligned: dict[int, int] = {}  # key -> bytes with every segment padded to BUCKET_ALIGN
    cell_sizes: dict[tuple[int, str], int] = {}
    # one object per distinct tuple of names: a pickle of the table (or of a worker's slice of
    # it, realloc/plan/slices.py) then writes each tuple once, not once per run
    names_of: dict[tuple[str, ...], tuple[str, ...]] = {}
    total = 0
    for k in sorted({k for ks in key_lists for k in ks}):
        first, padded = total, 0
        for names, dtype, cells in router.blocks_of(router.keys[k]):
            names = names_of.setdefault(names, names)
            runs.append((names, dtype, cells))
            total += len(names) * len(cells)
            size = cell_sizes.get((id(cells), dtype))
            if size is None:
                size = cell_sizes[id(cells), dtype] = sum(
                    -(-box_bytes(c, dtype) // BUCKET_ALIGN) * BUCKET_ALIGN for c in cells
                )
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
            ids, nbytes, padded = key_range[ks[0]], router.key_bytes[ks[0]], aligned[ks[0]]
        else:
            ids = IndexChain([key_range[k] for k in ks])
            nbytes, padded = sum(router.key_bytes[k] for k in ks), sum(aligned[k] for k in ks)
        lists.append(ids)
        list_bytes.append(nbytes)
        if padded <= bucket_bytes:
            counts.append(int(nbytes > 0))
        else:  # larger than one bucket: cut it as the executors will
            counts.append(_bucket_count(router, ks, bucket_bytes, shapes, known))
    return table, lists, list_bytes, counts


def _bucket_count(router: Router, ks: tuple[int, ...], bucket_bytes: int, shapes: dict, known: dict) -> int:
    """``bucket_count`` of a list's segments. Cutting depends only on the sequence of
    segment sizes and dtypes (not names or offsets), so lists with the same sequence (the
    same experts on another rank, the same layers on another replica) are cut once."""
    blocks = [b for k in ks for b in router.blocks_of(router.keys[k])]
    signature = []
    for names, dtype, cells in blocks:
        sizes = shapes.get(id(cells))
        if sizes is None:
            sizes = shapes[id(cells)] = tuple(z for _, z in cells)
        signature.append((len(names), dtype, sizes))
    signature = tuple(signature)
    n = known.get(signature)
    if n is None:
        n = known[signature] = bucket_count(
            [Segment(p, o, z, dtype) for names, dtype, cells in blocks for p in names for o, z in cells], bucket_bytes
        )
    return n


def _stats(router: Router, src, dst, nbytes, step_starts, local_copies, list_bytes) -> dict:
    """Plan statistics from the routes (sorted by step, step ``s`` being
    ``step_starts[s]:step_starts[s + 1]``)."""
    bw = router.bandwidths
    workers = router.placement.num_workers
    nodes = len(router.node_names)
    src_node, dst_node = router.node_of[src], router.node_of[dst]
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

    node_name, rank_name = router.node_names.__getitem__, str
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
