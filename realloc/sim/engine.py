"""A plan's steps run on a model of a cluster (:class:`~realloc.sim.cluster.Cluster`).

The executor's semantics (actors/wire/executor.py ``StepRunner``): each worker runs only its steps, in
order; in a step it posts its send and its receive together and finishes both before its next
step; there is no barrier between steps. So a route starts when both its ends have finished their
previous steps, and takes

    step_latency + max(wire, host)
    wire = bytes / rate + ceil(messages / buckets_in_flight) * message_latency
    host = host_route + messages * host_message

where ``rate`` is the receiver's and the sender's NIC (inter-node; a NIC shared by several
workers is split between the routes of a step that use it) or the link inside the node
(``nvlink_gbps``), whichever is slower. A worker first makes its local copies (``copy_gbps``).
The move ends when the last worker does; then come the floors no schedule beats (a NIC's bytes at
its rate; with ``machine_*_gbps``, the machine's cores moving every byte), and the driver's
dispatch. Every step is simulated with arrays (one numpy pass a step, none per route).

What it reports: seconds, the binding resource (the largest share of the critical path: the
chain of routes each of which started when the one before it ended, or a floor when it is longer
than that path), the critical path by resource, idle fractions of the NICs, links and workers,
the slowest worker, and the floors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from realloc.plan.records import Plan, Segment
from realloc.plan.tables import SegmentTable, StepTable, list_ranges
from realloc.sim.cluster import Cluster
from realloc.spec import DTYPE_BYTES

__all__ = ["RESOURCES", "SimResult", "list_sizes", "route_arrays", "simulate"]

#: What can bind a move (critical path shares and floors are named so).
RESOURCES = ("receiver NIC", "sender NIC", "NVLink", "local copy", "host", "latency")
#: A piece of at least this many bytes travels as its own message (actors/wire/executor.py
#: ``DIRECT_MIN_BYTES``' default; the sim layer imports no torch, so it keeps its own copy).
DIRECT_MIN_BYTES = 256 << 10
GB = 1e9


@dataclass
class SimResult:
    """One simulated move; :meth:`to_json` is plain JSON."""

    cluster: str
    workers: int
    nodes: int
    num_steps: int
    num_routes: int
    bytes_inter_node: int
    bytes_intra_node: int
    bytes_local_copy: int
    seconds: float
    binding: str
    #: The data plane: the critical path, or a floor where that is longer (seconds less the driver).
    data_seconds: float
    driver_seconds: float
    critical_path: dict[str, float]
    critical_path_routes: int
    floors: dict[str, float]
    receiver_nic_floor_seconds: float
    ratio_to_receiver_nic_floor: float | None
    #: This plan's own floor under the executor's pairing: the busiest worker's sum over its steps
    #: of the longer of its send and its receive (each at its own rate, no waits for peers).
    schedule_floor_seconds: float
    idle: dict[str, float]
    slowest_worker: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _segment_bytes(segments) -> np.ndarray:
    """Bytes of every segment, as an array (runs of a :class:`SegmentTable` without a Segment each)."""
    if isinstance(segments, SegmentTable):
        parts, known = [], {}
        for params, dtype, cells in segments.runs:
            key = (id(cells), dtype)
            sizes = known.get(key)
            if sizes is None:
                item = DTYPE_BYTES[dtype]
                sizes = known[key] = np.array([item * int(np.prod(z)) for _, z in cells], dtype=np.int64)
            parts.append(np.tile(sizes, len(params)))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return np.array([Segment.nbytes.fget(s) for s in segments], dtype=np.int64)


def list_sizes(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes, messages)`` of every segment list of ``plan``.

    Messages as the executor cuts them (``messages()``): every piece of at least
    ``DIRECT_MIN_BYTES`` alone, runs of smaller ones together, at least one per bucket; counted
    from the segments (a segment cut across buckets counts once: a small overcount of none)."""
    seg = _segment_bytes(plan.segments)
    cum = np.concatenate([[0], np.cumsum(seg)])
    cbig = np.concatenate([[0], np.cumsum(seg >= DIRECT_MIN_BYTES)])
    ptr, lo, hi = list_ranges(plan.segment_lists)

    def per_list(per_range: np.ndarray) -> np.ndarray:
        total = np.concatenate([[0], np.cumsum(per_range, dtype=np.int64)])
        return total[ptr[1:]] - total[ptr[:-1]]

    nbytes, big, count = per_list(cum[hi] - cum[lo]), per_list(cbig[hi] - cbig[lo]), per_list(hi - lo)
    small = count - big
    buckets = -(-nbytes // plan.bucket_bytes)
    return nbytes, np.maximum(big + np.minimum(small, big + 1), buckets)


def route_arrays(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(src, dst, segment list, step starts)`` of the plan's routes, sorted by step."""
    t = StepTable.of(plan.steps)
    return t.src, t.dst, t.lists, t.starts


def _placement(plan: Plan, cluster: Cluster, workers: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Node index and NIC id of every worker, and the number of NICs."""
    if len(plan.nodes) < workers:
        raise ValueError(f"plan names {workers} workers but places {len(plan.nodes)} on nodes")
    names, node = np.unique(np.array(plan.nodes, dtype=object).astype(str), return_inverse=True)
    order = np.argsort(node, kind="stable")
    first = np.searchsorted(node[order], np.arange(len(names)))
    local = np.empty(node.size, dtype=np.int64)
    local[order] = np.arange(node.size) - first[node[order]]
    if local.max(initial=0) >= cluster.gpus_per_node:
        busiest = names[np.bincount(node).argmax()]
        raise ValueError(
            f"plan puts {int(np.bincount(node).max())} workers on node {busiest!r} but cluster "
            f"{cluster.name!r} has gpus_per_node {cluster.gpus_per_node}"
        )
    nic = node * cluster.nics_per_node + local * cluster.nics_per_node // cluster.gpus_per_node
    return node.astype(np.int64), nic.astype(np.int64), len(names) * cluster.nics_per_node


def _shares(step: np.ndarray, nic: np.ndarray, inter: np.ndarray, width: int) -> np.ndarray:
    """Routes of the same step on the same NIC (1 for intra-node routes)."""
    out = np.ones(step.size, dtype=np.int64)
    if inter.any():
        key = step[inter] * width + nic[inter]
        _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
        out[inter] = counts[inverse.reshape(-1)]
    return out


def _paired(src, dst, step, seconds, workers: int, num_steps: int) -> float:
    """Largest over workers of the sum over its steps of max(its send's, its receive's seconds)."""
    if not src.size:
        return 0.0
    keys = np.concatenate([src * num_steps + step, dst * num_steps + step])
    unique, inverse = np.unique(keys, return_inverse=True)
    inverse = inverse.reshape(-1)
    sent = np.bincount(inverse[: src.size], weights=seconds, minlength=unique.size)
    got = np.bincount(inverse[src.size :], weights=seconds, minlength=unique.size)
    per_worker = np.bincount(unique // num_steps, weights=np.maximum(sent, got), minlength=workers)
    return float(per_worker.max())


def simulate(plan: Plan, cluster: Cluster) -> SimResult:
    """Run ``plan``'s steps on ``cluster`` (see the module docstring)."""
    if not isinstance(cluster, Cluster):
        raise ValueError(f"simulate needs a Cluster, got {type(cluster).__name__}")
    src, dst, lists, starts = route_arrays(plan)
    list_bytes, list_msgs = list_sizes(plan)
    locals_ = np.array(plan.local_copies, dtype=np.int64).reshape(-1, 2)
    workers = int(max(src.max(initial=-1), dst.max(initial=-1), locals_[:, 0].max(initial=-1))) + 1
    workers = max(workers, 1)
    node, nic, num_nics = _placement(plan, cluster, workers)
    nbytes, msgs = list_bytes[lists], list_msgs[lists]
    inter = node[src] != node[dst]
    num_steps = len(starts) - 1
    step = np.repeat(np.arange(num_steps, dtype=np.int64), np.diff(starts))

    # -- every route's duration and what it spends it on ------------------------------------
    nic_rate, link_rate = cluster.nic_gbps * GB, cluster.nvlink_gbps * GB
    rate_out = np.where(inter, nic_rate / _shares(step, nic[src], inter, num_nics), link_rate)
    rate_in = np.where(inter, nic_rate / _shares(step, nic[dst], inter, num_nics), link_rate)
    rate = np.minimum(rate_out, rate_in)
    bw_time = nbytes / rate
    msg_lat = -(-msgs // cluster.buckets_in_flight) * cluster.message_latency_s
    wire = bw_time + msg_lat
    host = cluster.host_route_s + msgs * cluster.host_message_s
    on_wire = wire >= host
    dur = cluster.step_latency_s + np.maximum(wire, host)
    # resource of each route's bytes: 0 receiver NIC, 1 sender NIC, 2 NVLink
    resource = np.where(inter, np.where(rate_in <= rate_out, 0, 1), 2)

    local_bytes = np.bincount(locals_[:, 0], weights=list_bytes[locals_[:, 1]], minlength=workers)
    ready = local_bytes / (cluster.copy_gbps * GB)
    last = np.full(workers, -1, dtype=np.int64)
    pred = np.full(src.size, -1, dtype=np.int64)
    begin = np.zeros(src.size)
    busy = ready.copy()
    earliest = np.full(workers, np.inf)
    for s in range(num_steps):
        a, b = int(starts[s]), int(starts[s + 1])
        if a == b:
            continue
        sa, da = src[a:b], dst[a:b]
        rs, rd = ready[sa], ready[da]
        start = np.maximum(rs, rd)
        pred[a:b] = np.where(rs >= rd, last[sa], last[da])
        begin[a:b] = start
        fin = start + dur[a:b]
        ids = np.arange(a, b)
        touched = np.concatenate([sa, da])
        earliest[touched] = np.inf
        np.minimum.at(earliest, touched, np.concatenate([start, start]))
        ready[sa], last[sa] = fin, ids  # a worker sends at most once a step: its ready is its send's end
        later = fin >= ready[da]
        ready[da] = np.where(later, fin, ready[da])
        last[da] = np.where(later, ids, last[da])
        touched = np.unique(touched)
        busy[touched] += ready[touched] - earliest[touched]

    # -- the critical path --------------------------------------------------------------------
    dag = float(ready.max(initial=0.0))
    path = dict.fromkeys(RESOURCES, 0.0)
    slowest = int(ready.argmax()) if workers else 0
    r, hops = int(last[slowest]), 0
    while r >= 0:
        hops += 1
        path["latency"] += cluster.step_latency_s
        if on_wire[r]:
            path[RESOURCES[int(resource[r])]] += float(bw_time[r])
            path["latency"] += float(msg_lat[r])
        else:
            path["host"] += float(host[r])
        first = r
        r = int(pred[r])
    path["local copy"] += float(begin[first]) if hops else dag  # the chain starts after local copies

    # -- floors ------------------------------------------------------------------------------
    copied = float(nbytes[~inter].sum() + local_bytes.sum())
    nic_in = np.bincount(nic[dst[inter]], weights=nbytes[inter], minlength=num_nics) / nic_rate
    nic_out = np.bincount(nic[src[inter]], weights=nbytes[inter], minlength=num_nics) / nic_rate
    link_in = np.bincount(dst[~inter], weights=nbytes[~inter], minlength=workers) / link_rate
    floors = {
        "receiver NIC": float(nic_in.max(initial=0.0)),
        "sender NIC": float(nic_out.max(initial=0.0)),
        "NVLink": float(link_in.max(initial=0.0)),
        "local copy": float(local_bytes.max(initial=0.0) / (cluster.copy_gbps * GB)),
    }
    data = max(dag, *floors.values())
    schedule_floor = _paired(src, dst, step, bw_time, workers, num_steps)
    if cluster.shared_machine:
        # One machine's cores move every byte and also run every message's handshake: the
        # latencies a worker waits through do not overlap the machine's byte work.
        floors["host"] = float(nbytes[inter].sum()) / (cluster.machine_inter_gbps * GB) + copied / (
            cluster.machine_copy_gbps * GB
        )
        waits = np.bincount(src, weights=cluster.step_latency_s + msg_lat, minlength=workers)
        waits += np.bincount(dst, weights=cluster.step_latency_s + msg_lat, minlength=workers)
        data = max(data, floors["host"] + float(waits.max(initial=0.0)))
    driver = cluster.driver_s_per_worker * workers
    if data > dag:
        binding = max(floors, key=floors.get)
    else:
        binding = max(path, key=path.get)
    shares = dict(path, host=path["host"] + driver)
    if data <= dag and shares["host"] > shares[binding]:
        binding = "host"

    def idle(busy_time: np.ndarray) -> float:
        used = busy_time[busy_time > 0]
        return float(1.0 - np.minimum(used / data, 1.0).mean()) if used.size and data > 0 else 1.0

    receiver_floor = floors["receiver NIC"]
    me = slowest
    return SimResult(
        cluster=cluster.name,
        workers=workers,
        nodes=int(node.max(initial=-1)) + 1,
        num_steps=num_steps,
        num_routes=int(src.size),
        bytes_inter_node=int(nbytes[inter].sum()),
        bytes_intra_node=int(nbytes[~inter].sum()),
        bytes_local_copy=int(local_bytes.sum()),
        seconds=data + driver,
        binding=binding,
        data_seconds=data,
        driver_seconds=driver,
        critical_path=shares,
        critical_path_routes=hops,
        floors=floors,
        receiver_nic_floor_seconds=receiver_floor,
        ratio_to_receiver_nic_floor=(data + driver) / receiver_floor if receiver_floor > 0 else None,
        schedule_floor_seconds=schedule_floor,
        idle={
            "receiver NIC": idle(nic_in),
            "sender NIC": idle(nic_out),
            "NVLink": idle(link_in),
            "workers": idle(busy),
        },
        slowest_worker={
            "worker": me,
            "node": str(plan.nodes[me]) if me < len(plan.nodes) else None,
            "finish_seconds": float(ready[me]) if workers else 0.0,
            "busy_seconds": float(busy[me]) if workers else 0.0,
            "steps": int(np.count_nonzero((src == me) | (dst == me))),
            "inter_node_bytes_received": int(nbytes[inter & (dst == me)].sum()),
            "bytes_received": int(nbytes[dst == me].sum()),
        },
    )
