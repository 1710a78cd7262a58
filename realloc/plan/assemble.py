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
from realloc.plan.cells import cells_sizes
from realloc.plan.records import Plan, Segment, bucket_count
from realloc.plan.routing import ID, Router
from realloc.plan.schedule import schedule_routes, steps_of
from realloc.plan.tables import IndexChain, SegmentTable

__all__ = ["build_plan", "makespan"]


def build_plan(router: Router, bucket_bytes: int) -> Plan:
    """Step 4: the router's deliveries as a :class:`~realloc.plan.records.Plan`. One route per
    ``(phase, src, dst)`` carrying its keys in the order they were recorded, key lists
    interned, segments as runs of blocks, routes scheduled into steps, and the statistics.

    Routes go sorted by ``(phase, src, dst)`` into the schedule, so a stable sort by step alone
    puts them in ``(step, src)`` order. Arrays of millions of routes stay 32-bit where their
    values fit (worker ids, list ids): half the memory each pass over them reads."""
    phase, src, dst, starts, keys = _routes(router)
    key_lists, route_list, local_copies = _intern(router, keys, starts)
    segments, segment_lists, list_bytes, counts = _segment_table(router, key_lists, bucket_bytes)
    bytes_of = list_bytes[route_list]
    step, num_steps, forward_from = schedule_routes(phase, src, dst, bytes_of)
    by_step = np.argsort(step.astype(np.uint16 if num_steps <= 1 << 16 else np.int64), kind="stable")
    src, dst, route_list = src[by_step], dst[by_step], route_list[by_step]
    step_starts = np.zeros(num_steps + 1, dtype=np.int64)
    np.cumsum(np.bincount(step, minlength=num_steps), out=step_starts[1:])
    bytes_of = list_bytes[route_list]
    steps = steps_of(src, dst, route_list, step_starts)
    stats = _stats(router, src, dst, bytes_of, step_starts, local_copies, list_bytes)
    stats["num_buckets"] = int(counts[route_list].sum())
    return Plan(segments, segment_lists, local_copies, steps, bucket_bytes, router.placement.nodes, forward_from, stats)


def _routes(router: Router):
    """The router's deliveries grouped into routes, sorted by ``(phase, src, dst)``:
    ``(phase, src, dst, starts, keys)``, route ``r`` carrying ``keys[starts[r]:starts[r + 1]]``
    in the order they were recorded (deliveries' arrays first, then the single sends)."""
    counts = [d[0].size for d in router.deliveries]
    route_of = np.concatenate([d[0] for d in router.deliveries] + [np.array(router.pending[0], router.route_dtype)])
    keys = np.concatenate(
        [np.repeat(np.array([d[1] for d in router.deliveries], dtype=ID), counts), np.array(router.pending[1], ID)]
    )
    width = router.placement.num_workers
    order = np.argsort(route_of, kind="stable")
    route_of, keys = route_of[order], keys[order]
    new = np.ones(keys.size, dtype=bool)
    new[1:] = route_of[1:] != route_of[:-1]
    starts = np.flatnonzero(new)
    first = route_of[starts]  # 32-bit divisions below 32,768 workers
    rest = first // width
    return (rest // width).astype(np.int8), (rest % width).astype(ID), (first % width).astype(ID), starts, keys


def _intern(router: Router, keys: np.ndarray, starts: np.ndarray):
    """Every distinct key list once: ``(key_lists, route_list, local_copies)``, the lists as
    arrays of key ids in the order they were interned (local copies first, by worker; then the
    routes' lists by length, each length's lists in order of their code or first route)."""
    key_lists: list[np.ndarray] = []
    list_index: dict[bytes, int] = {}

    def intern(k: np.ndarray) -> int:
        code = k.tobytes()
        j = list_index.get(code)
        if j is None:
            j = list_index[code] = len(key_lists)
            key_lists.append(k)
        return j

    local_copies = [(w, intern(np.array(ks, dtype=ID))) for w, ks in sorted(router.local.items())]
    lengths = np.diff(starts, append=keys.size)
    first_key = keys[starts]
    nkeys = len(router.keys)
    # one key: the distinct keys, in key order (the shortest lists: interned first)
    used = np.flatnonzero(np.bincount(first_key[lengths == 1], minlength=nkeys))
    ids = np.zeros(nkeys, dtype=ID)
    ids[used] = [intern(k) for k in used.astype(ID).reshape(-1, 1)]
    route_list = ids[first_key]
    multi = np.flatnonzero(lengths > 1)
    multi = multi[np.argsort(lengths[multi], kind="stable")]  # by length, each length's in route order
    bounds = np.flatnonzero(np.diff(lengths[multi], prepend=0, append=0)).tolist()
    bits = nkeys.bit_length()
    for a, b in zip(bounds[:-1], bounds[1:]):  # routes carrying `length` keys: their distinct key lists
        routes = multi[a:b]
        length = int(lengths[routes[0]])
        carried = keys[starts[routes][:, None] + np.arange(length)]
        if length * bits <= 62:  # each route's key list as one integer, lists in order of it
            code = (carried.astype(np.int64) << (np.arange(length, dtype=np.int64) * bits)).sum(axis=1)
            _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
            ids = np.array([intern(carried[i]) for i in first.tolist()], dtype=ID)
            route_list[routes] = ids[inverse.reshape(-1)]
        else:  # lists in order of their first route
            route_list[routes] = [intern(row) for row in carried]
    return key_lists, route_list, local_copies


def _segment_table(router: Router, key_lists: list[np.ndarray], bucket_bytes: int):
    """Segments as runs of blocks, each key's one contiguous range (lists of several keys
    chain their keys' ranges, adjacent ones merged); bytes and bucket counts per list (arrays)."""
    runs: list[tuple[tuple[str, ...], str, list[Box]]] = []
    nkeys = len(router.keys)
    key_lo = np.zeros(nkeys, dtype=np.int64)
    key_hi = np.zeros(nkeys, dtype=np.int64)
    aligned = np.zeros(nkeys, dtype=np.int64)  # key -> bytes with every segment padded to BUCKET_ALIGN
    cell_sizes: dict[tuple[int, str], int] = {}
    # one object per distinct tuple of names: a pickle of the table (or of a worker's slice of
    # it, realloc/plan/slices.py) then writes each tuple once, not once per run
    names_of: dict[tuple[str, ...], tuple[str, ...]] = {}
    flat = np.concatenate(key_lists) if key_lists else np.zeros(0, dtype=ID)
    used = np.zeros(nkeys, dtype=bool)
    used[flat] = True
    total = 0
    for k in np.flatnonzero(used).tolist():
        key = router.keys[k]
        first = total
        if key[2] == 1:  # a whole bundle: its padded size was counted with its bytes
            padded = router.bundles[key[0]].padded
            for names, dtype, cells in router.bundles[key[0]].blocks:
                runs.append((names_of.setdefault(names, names), dtype, cells))
                total += len(names) * len(cells)
        else:
            padded = 0
            for names, dtype, cells in router.blocks_of(key):
                runs.append((names_of.setdefault(names, names), dtype, cells))
                total += len(names) * len(cells)
                size = cell_sizes.get((id(cells), dtype))
                if size is None:
                    size = cell_sizes[id(cells), dtype] = cells_sizes(cells, dtype)[1]
                padded += len(names) * size
        key_lo[k], key_hi[k], aligned[k] = first, total, padded
    table = SegmentTable(runs)
    lengths = np.fromiter(map(len, key_lists), dtype=np.int64, count=len(key_lists))
    ptr = np.zeros(len(key_lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=ptr[1:])
    per_list = lambda per_key: np.add.reduceat(per_key[flat], ptr[:-1]) if flat.size else per_key[:0]  # noqa: E731
    key_bytes = np.array(router.key_bytes, dtype=np.int64)
    list_bytes, padded = per_list(key_bytes), per_list(aligned)
    # a list's ranges: its keys' ranges, a key's range merged into the one before when they meet
    lo, hi = key_lo[flat], key_hi[flat]
    joins = np.zeros(flat.size, dtype=bool)
    joins[1:] = lo[1:] == hi[:-1]
    joins[ptr[:-1]] = False
    keep = np.flatnonzero(~joins)
    ends = np.append(keep[1:], flat.size) - 1
    range_ptr = np.searchsorted(keep, ptr).tolist()
    range_lo, range_hi = lo[keep].tolist(), hi[ends].tolist()
    lists: list[Sequence[int]] = []
    for r0, r1 in zip(range_ptr[:-1], range_ptr[1:]):
        if r1 - r0 == 1:
            lists.append(range(range_lo[r0], range_hi[r0]))
        else:
            lists.append(IndexChain([range(x, y) for x, y in zip(range_lo[r0:r1], range_hi[r0:r1])]))
    counts = (list_bytes > 0).astype(np.int64)
    shapes: dict[int, tuple] = {}  # id of a cell list -> its cells' sizes
    known: dict[tuple, int] = {}  # size signature of a list -> its bucket count
    for j in np.flatnonzero(padded > bucket_bytes).tolist():  # larger than one bucket: cut it as the executors will
        counts[j] = _bucket_count(router, key_lists[j].tolist(), bucket_bytes, shapes, known)
    return table, lists, list_bytes, counts


def _bucket_count(router: Router, ks: list[int], bucket_bytes: int, shapes: dict, known: dict) -> int:
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


def makespan(src: np.ndarray, dst: np.ndarray, seconds: np.ndarray, step_starts: np.ndarray, workers: int) -> float:
    """When the last route finishes when the routes (sorted by step, step ``s`` being
    ``step_starts[s]:step_starts[s + 1]``, route ``r`` taking ``seconds[r]``) run as the
    executor runs them and :func:`~realloc.plan.schedule.timed_steps` schedules them: each
    worker's steps in order, a step's send and receive together, no barrier between steps; a
    route starts when both its ends have finished their previous steps.

    Example:
        >>> a = np.array
        >>> makespan(a([0, 2, 1]), a([1, 3, 3]), a([1.0, 5.0, 2.0]), a([0, 2, 3]), 4)  # 0->1 and 2->3, then 1->3
        7.0
    """
    free = np.zeros(workers)  # when each worker has finished its steps so far
    for a, b in zip(step_starts[:-1].tolist(), step_starts[1:].tolist()):
        s, d = src[a:b], dst[a:b]  # one send and one receive per worker in a step: no repeats
        end = np.maximum(free[s], free[d]) + seconds[a:b]
        free[s] = np.maximum(free[s], end)
        free[d] = np.maximum(free[d], end)  # a worker's receive after its send of the same step
    return float(free.max(initial=0.0))


def _stats(router: Router, src, dst, nbytes, step_starts, local_copies, list_bytes) -> dict:
    """Plan statistics from the routes (sorted by step, step ``s`` being
    ``step_starts[s]:step_starts[s + 1]``). Per-node tables are summed from per-worker ones
    (bytes are integers below 2**53: float sums of them are exact in any order)."""
    bw = router.bandwidths
    workers = router.placement.num_workers
    nodes = len(router.node_names)
    # Millions of routes: every pass writes into as few fresh arrays as it can (a fresh array of
    # 4 million float64 is 8,000 page faults before it holds anything)
    node_of = router.node_of.astype(np.int16 if nodes < 1 << 15 else np.int32)
    intra = node_of[src] == node_of[dst]
    inter = ~intra
    weights = nbytes.astype(np.float64)  # bincount's weights (it would convert them on every call)
    seconds_of = np.divide(weights, bw.inter_node)
    np.divide(weights, bw.intra_node, out=seconds_of, where=intra)
    num_steps = len(step_starts) - 1
    local_per_worker: dict[int, int] = defaultdict(int)
    for w, j in local_copies:
        local_per_worker[w] += int(list_bytes[j])
    seconds = makespan(src, dst, seconds_of, step_starts, workers)
    seconds += max(local_per_worker.values(), default=0) / bw.local_copy
    del seconds_of

    def table(total: np.ndarray, routes: np.ndarray, name) -> dict[str, int]:
        """Bytes per sender (receiver), for every one that sends (receives) something."""
        return {name(i): int(total[i]) for i in np.flatnonzero(routes).tolist()}

    node_name, rank_name = router.node_names.__getitem__, str
    out: dict = {}
    at = np.empty(src.size, dtype=np.intp)
    for end, side, node_side in ((src, "send", "egress"), (dst, "recv", "ingress")):
        # per worker and kind (intra-node 0, inter-node 1): bytes and routes, in one pass each
        np.left_shift(end, 1, out=at, casting="unsafe")
        at += inter
        total = np.bincount(at, weights=weights, minlength=2 * workers).reshape(workers, 2)
        routes = np.bincount(at, minlength=2 * workers).reshape(workers, 2)
        node_total = np.bincount(router.node_of, weights=total[:, 1], minlength=nodes)
        node_routes = np.bincount(router.node_of, weights=routes[:, 1], minlength=nodes)
        out[node_side] = node_total
        out[f"node_{node_side}_bytes"] = table(node_total, node_routes, node_name)
        out[f"rank_{side}_bytes"] = table(total.sum(axis=1), routes.sum(axis=1), rank_name)
    inter_total = int(nbytes.sum(where=inter))
    return {
        "bytes_total": int(nbytes.sum()),
        "bytes_intra_node": int(nbytes.sum()) - inter_total,
        "bytes_inter_node": inter_total,
        "bytes_local_copy": sum(local_per_worker.values()),
        "max_node_egress_bytes": int(out["egress"].max(initial=0)),
        "max_node_ingress_bytes": int(out["ingress"].max(initial=0)),
        "node_egress_bytes": out["node_egress_bytes"],
        "node_ingress_bytes": out["node_ingress_bytes"],
        "rank_send_bytes": out["rank_send_bytes"],
        "rank_recv_bytes": out["rank_recv_bytes"],
        "num_steps": num_steps,
        "num_routes": int(src.size),
        "estimated_seconds": seconds,
        "bandwidths": {"intra_node": bw.intra_node, "inter_node": bw.inter_node, "local_copy": bw.local_copy},
    }
