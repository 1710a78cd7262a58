"""The same routes in other step orders, simulated (issue 26: is the plan the cause?).

    PYTHONPATH=. python benchmarks/schedule_variants.py --anchor 1

plans anchor ``--anchor`` of ``realloc simulate --anchors`` (0-3), then re-colours its routes
into steps three ways (the planner's greedy colouring, largest route first, which it uses below
``LARGE_PLAN_ROUTES``; the cyclic schedule ``(dst - src) mod W``; greedy by receiver) and
simulates each on the anchor's cluster. Phases are kept (fan-out steps after the others).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from realloc.plan import Plan, StepTable
from realloc.plan import schedule as S
from realloc.sim import cluster_preset, simulate
from realloc.sim.engine import list_sizes, route_arrays
from realloc.spec import load_spec
from realloc_tools.offline.simulate import ANCHORS, CONFIGS, plan_move


def rescheduled(plan: Plan, colour) -> Plan:
    src, dst, lists, starts = route_arrays(plan)
    step = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    nbytes = list_sizes(plan)[0][lists]
    new, n, forward_from = np.zeros(src.size, dtype=np.int64), 0, 0
    for phase in (False, True):
        forward_from = n
        idx = np.flatnonzero((step >= plan.forward_from) == phase)
        if idx.size:
            c = colour(src[idx], dst[idx], nbytes[idx])
            new[idx], n = c + n, n + int(c.max()) + 1
    order = np.argsort(new * (int(src.max()) + 1) + src, kind="stable")
    table = StepTable(src[order], dst[order], lists[order], np.searchsorted(new[order], np.arange(n + 1)))
    return Plan(
        plan.segments, plan.segment_lists, plan.local_copies, table, plan.bucket_bytes, plan.nodes, forward_from
    )


def greedy(order_of):
    def colour(src, dst, nbytes):
        order = order_of(src, dst, nbytes)
        out = np.empty(src.size, dtype=np.int64)
        out[order] = S._colour(src[order].tolist(), dst[order].tolist())
        return out

    return colour


VARIANTS = {
    "greedy, largest first (the planner's)": greedy(lambda s, d, b: np.lexsort((d, s, -b))),
    "cyclic (dst - src) mod W": lambda s, d, b: S._cyclic_steps(s, d),
    "greedy by receiver, largest first": greedy(lambda s, d, b: np.lexsort((-b, d))),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", type=int, default=1)
    args = p.parse_args()
    a = ANCHORS[args.anchor]
    cluster = cluster_preset(a.cluster)
    spec = load_spec(str(CONFIGS / a.config))
    plan, _ = plan_move(spec, a.src, a.dst, cluster.gpus_per_node, a.dst_workers, a.src_format, a.dst_format)
    print(f"{a.name}: {a.src} -> {a.dst} on {a.cluster}")
    for name, colour in VARIANTS.items():
        started = time.perf_counter()
        r = simulate(rescheduled(plan, colour), cluster)
        print(
            f"  {name:40s} {r.num_steps:4d} steps  {r.seconds:.3f} s  {r.ratio_to_receiver_nic_floor:.2f}x the "
            f"receiver-NIC floor ({r.receiver_nic_floor_seconds:.3f} s)  receiver NICs idle "
            f"{r.idle['receiver NIC']:.0%}  ({time.perf_counter() - started:.1f} s)"
        )


if __name__ == "__main__":
    main()
