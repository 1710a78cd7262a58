"""The same routes in other step orders, simulated (issue 26: is the plan the cause? issue 39:
which order reaches the floor?).

    PYTHONPATH=. python benchmarks/schedule_variants.py --anchor 1

plans anchor ``--anchor`` of ``realloc simulate --anchors`` (0-3), then re-colours its routes
into steps several ways and simulates each on the anchor's cluster (phases are kept: fan-out
steps after the others):

* the planner's :func:`realloc.plan.schedule.timed_steps` (a list schedule in time);
* the greedy colouring the planner used before it (largest route first, each into the lowest
  step free at both ends);
* the cyclic schedule ``(dst - src) mod W``;
* independent send and receive queues: an executor that runs a worker's sends and its receives
  as two queues, each in step order, instead of finishing a step's send and receive before the
  worker's next step. The simulator's model is unchanged: every worker is simulated as two on
  its node, one that only sends and one that only receives (a NIC and a link carry each
  direction at its own rate in the model, so the two halves share nothing), fan-out routes read
  from the entry's receiving half (after its receives: the real executor would wait for the
  message only), local copies on the receiving half; the routes are scheduled by
  ``timed_steps`` on the split workers, and the driver's dispatch is charged for the real
  workers.

Prints, per variant: steps, simulated seconds, the ratio to the receiver-NIC floor, receiver
NICs idle, and the lower bound of every schedule under that executor (the busiest worker's
routes back to back, latencies included: lockstep charges a worker the longer of its send and
receive sums at best; the split queues the same).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from realloc.plan import Plan, StepTable
from realloc.plan import schedule as S
from realloc.sim import Cluster, cluster_preset, simulate
from realloc.sim.engine import GB, list_sizes, route_arrays
from realloc.spec import load_spec
from realloc_tools.offline.simulate import ANCHORS, CONFIGS, plan_move


def rescheduled(plan: Plan, colour, split: bool = False) -> Plan:
    """``plan`` with its routes re-coloured by ``colour(src, dst, nbytes)`` per phase; with
    ``split``, every worker ``w`` as a sender ``2w`` and a receiver ``2w + 1`` (see the module
    docstring)."""
    src, dst, lists, starts = route_arrays(plan)
    step = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    forward = step >= plan.forward_from
    nodes, local = plan.nodes, plan.local_copies
    if split:
        src, dst = np.where(forward, 2 * src + 1, 2 * src), 2 * dst + 1
        nodes = [n for node in plan.nodes for n in (node, node)]
        local = [(2 * w + 1, j) for w, j in plan.local_copies]
    nbytes = list_sizes(plan)[0][lists]
    new, n, forward_from = np.zeros(src.size, dtype=np.int64), 0, 0
    for phase in (False, True):
        forward_from = n
        idx = np.flatnonzero(forward == phase)
        if idx.size:
            c = colour(src[idx], dst[idx], nbytes[idx])
            new[idx], n = c + n, n + int(c.max()) + 1
    order = np.argsort(new * (int(src.max()) + 1) + src, kind="stable")
    table = StepTable(src[order], dst[order], lists[order], np.searchsorted(new[order], np.arange(n + 1)))
    return Plan(plan.segments, plan.segment_lists, local, table, plan.bucket_bytes, nodes, forward_from)


def largest_first(src, dst, nbytes) -> np.ndarray:
    """The planner's colouring before issue 39: largest route first, each into the lowest step
    free at both ends."""
    order = np.lexsort((dst, src, -nbytes))
    send_busy: dict[int, int] = defaultdict(int)
    recv_busy: dict[int, int] = defaultdict(int)
    out = np.empty(src.size, dtype=np.int64)
    for r in order.tolist():
        busy = send_busy[int(src[r])] | recv_busy[int(dst[r])]
        free = ~busy & (busy + 1)
        send_busy[int(src[r])] |= free
        recv_busy[int(dst[r])] |= free
        out[r] = free.bit_length() - 1
    return out


def route_seconds(plan: Plan, cluster: Cluster) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src, dst, seconds)`` of every route as the simulator times it alone (no NIC shared)."""
    src, dst, lists, _ = route_arrays(plan)
    nbytes, msgs = (a[lists] for a in list_sizes(plan))
    node = np.unique(np.array(plan.nodes, dtype=object).astype(str), return_inverse=True)[1]
    rate = np.where(node[src] != node[dst], cluster.nic_gbps, cluster.nvlink_gbps) * GB
    wire = nbytes / rate + -(-msgs // cluster.buckets_in_flight) * cluster.message_latency_s
    host = cluster.host_route_s + msgs * cluster.host_message_s
    return src, dst, cluster.step_latency_s + np.maximum(wire, host)


def serial_bound(plan: Plan, cluster: Cluster) -> float:
    """No schedule under either executor beats the busiest worker's sends or receives back to
    back (each route at its own seconds), then the driver's dispatch."""
    src, dst, seconds = route_seconds(plan, cluster)
    width = len(plan.nodes)
    busiest = max(np.bincount(src, seconds, width).max(), np.bincount(dst, seconds, width).max())
    return float(busiest) + cluster.driver_s_per_worker * width


VARIANTS = {
    "timed (the planner's)": lambda s, d, b: S.timed_steps(s, d, b),
    "greedy, largest first (before)": largest_first,
    "cyclic (dst - src) mod W": lambda s, d, b: S._cyclic_steps(s, d),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", type=int, default=1)
    p.add_argument(
        "--message-latency-s",
        type=float,
        default=None,
        help="a what-if, not the model: the per-message latency instead of the preset's (0: messages coalesced)",
    )
    args = p.parse_args()
    a = ANCHORS[args.anchor]
    changes = {} if args.message_latency_s is None else {"message_latency_s": args.message_latency_s}
    cluster = cluster_preset(a.cluster, **changes)
    spec = load_spec(str(CONFIGS / a.config))
    plan, _ = plan_move(spec, a.src, a.dst, cluster.gpus_per_node, a.dst_workers, a.src_format, a.dst_format)
    bound = serial_bound(plan, cluster)
    print(f"{a.name}: {a.src} -> {a.dst} on {a.cluster}; every schedule's bound {bound:.3f} s")
    runs = [(name, rescheduled(plan, colour), cluster, 0.0) for name, colour in VARIANTS.items()]
    halves = cluster.replace(gpus_per_node=2 * cluster.gpus_per_node, nics_per_node=2 * cluster.nics_per_node)
    # the driver dispatches to the real workers: charge it for them, not for the halves
    runs.append(
        ("independent send/receive queues", rescheduled(plan, VARIANTS["timed (the planner's)"], True), halves, -1.0)
    )
    for name, variant, on, driver in runs:
        started = time.perf_counter()
        r = simulate(variant, on)
        seconds = r.seconds + driver * cluster.driver_s_per_worker * len(plan.nodes)
        print(
            f"  {name:34s} {r.num_steps:4d} steps  {seconds:.3f} s  {seconds / r.receiver_nic_floor_seconds:.3f}x the "
            f"receiver-NIC floor ({r.receiver_nic_floor_seconds:.3f} s; bound {bound / r.receiver_nic_floor_seconds:.3f}x)  "
            f"receiver NICs idle {r.idle['receiver NIC']:.0%}  ({time.perf_counter() - started:.1f} s)"
        )


if __name__ == "__main__":
    main()
