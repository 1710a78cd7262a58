"""Benchmark: the copy floor of a transition, every byte copied once by one core, no Ray.

``realloc bench``'s lower bound charges every intra-node and local byte at the machine's
contiguous memcpy rate. A transition's boxes are not all contiguous: a row-parallel weight
split over more tp ranks arrives as rows of a fraction of its width, and such a box is a strided
copy whoever makes it (it must be read or written with a stride in one of the two layouts).
This measures what the copies of a plan cost on this machine: one process, one thread, the
planner's plan for ``--nodes`` simulated nodes, and every route and local copy of it run as a
direct box-to-box copy (``realloc.shards.copy_local``: what a worker's zero-copy read and local
copy run), warm buffers, best of ``--repeats``. It prints, per transition, the bytes, the
one-core time and rate, the share of bytes in boxes strided on either side, and the contiguous
one-core memcpy rate measured in the same process.

It is a floor for the copies, not for a move: a move over several nodes also sends the
inter-node bytes (here they are copied like the others), and several workers share the cores.

Usage:  python benchmarks/copy_floor.py [--model bench-1gb] [--nodes 2] [--repeats 3]
                                        [--transitions "dp=4,tp=2->tp=8;..."] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from realloc import Layout, ModelSpec, Placement, Topology, plan_reallocation
from realloc.shards import ShardStore, allocate_buffers, copy_local

TRANSITIONS = (
    "dp=2,tp=2,pp=2->dp=4,tp=2;dp=4,tp=2->dp=2,tp=2,pp=2;dp=4,tp=2->tp=8;tp=8->dp=4,tp=2;"
    "dp=2,tp=2,pp=2->tp=2,pp=4;tp=2,pp=4->dp=2,tp=2,pp=2;fsdp=8->dp=4,tp=2;dp=4,tp=2->fsdp=8"
)


def strided_bytes(plan, src: dict, dst: dict) -> int:
    """Bytes of the plan's segments whose box is not one contiguous view on both sides."""
    total = 0
    pairs = [(w, w, j, False) for w, j in plan.local_copies]
    pairs += [(a, b, j, plan.reads_destination(s)) for s, a, b, j in plan.routes()]
    for a, b, j, forward in pairs:
        sender = dst[a] if forward else src[a]
        for seg in plan.segment_list(j):
            views = sender.views(seg.param, seg.offsets, seg.sizes) + dst[b].views(seg.param, seg.offsets, seg.sizes)
            if not all(v.is_contiguous() for v in views):
                total += seg.nbytes
    return total


def floor(spec: ModelSpec, a: Topology, b: Topology, placement: Placement, repeats: int) -> dict:
    src_layout, dst_layout = Layout(spec, a), Layout(spec, b)
    plan = plan_reallocation(spec, src_layout, dst_layout, placement)
    n = len(placement.nodes)
    src = {r: ShardStore(src_layout.shards(r), allocate_buffers(src_layout, r)) for r in range(n)}
    dst = {r: ShardStore(dst_layout.shards(r), allocate_buffers(dst_layout, r)) for r in range(n)}

    def run() -> int:
        moved = sum(copy_local(src[w], dst[w], plan.segment_list(j)) for w, j in plan.local_copies)
        for s, step in enumerate(plan.steps):
            senders = dst if plan.reads_destination(s) else src
            moved += sum(copy_local(senders[x], dst[y], plan.segment_list(j)) for x, y, j in step)
        return moved

    moved = run()  # warm-up: pages touched, plans of the copies
    best = min(_timed(run) for _ in range(repeats))
    return {
        "src": str(a),
        "dst": str(b),
        "bytes": moved,
        "one_core_seconds": best,
        "one_core_gbps": moved / best / 1e9,
        "strided_share": strided_bytes(plan, src, dst) / moved,
    }


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    b.copy_(a)
    return nbytes / min(_timed(lambda: b.copy_(a)) for _ in range(repeats)) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench-1gb", help="preset (default bench-1gb)")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes the plan is made for (default 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--transitions", default=TRANSITIONS, help="'a->b;c->d' (default: realloc bench's 8 directions)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = ModelSpec.preset(args.model)
    pairs = [tuple(Topology.parse(x) for x in t.split("->")) for t in args.transitions.split(";")]
    workers = pairs[0][0].world_size
    placement = Placement.blocks(workers, -(-workers // args.nodes))
    rows = [floor(spec, a, b, placement, args.repeats) for a, b in pairs]
    report = {
        "model": args.model,
        "nodes": args.nodes,
        "workers": workers,
        "memcpy_1core_gbps": memcpy_gbps(256 << 20, args.repeats),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{args.model}, {workers} workers planned on {args.nodes} node(s); contiguous memcpy, one core: "
        f"{report['memcpy_1core_gbps']:.1f} GB/s"
    )
    for r in rows:
        print(
            f"  {r['src']:>24} -> {r['dst']:<24} {r['bytes'] / 1e9:5.2f} GB  one core {1e3 * r['one_core_seconds']:6.1f} ms "
            f"({r['one_core_gbps']:4.1f} GB/s)  strided {100 * r['strided_share']:3.0f}% of bytes"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
