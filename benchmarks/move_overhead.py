"""Benchmark: the host cost of a move, with the bytes taken out.

A model shaped like llama-7b (32 layers, 291 tensors) but with tiny dimensions (``--hidden``,
default 256: 43 MB in all), so a move's bytes take a millisecond or two and what is measured is
everything else: the driver's call, the workers' Python per box and per message, handle
exchange, synchronisation. On a GPU this host time is most of a move (docs/benchmarks.md, "GPU":
28-60 ms a move for 9 ms of copies on an H100), so it is measured here, where it is the same code.

Starts a local Ray with ``--nodes`` simulated nodes (8 workers), warms each transition up (two
round trips), then times ``--moves`` round trips and prints the medians of the driver's wall
time and of the workers' execute phase (``ReallocStats.seconds``). Every arrival is verified at
the end against the synthetic weights.

Usage:  python benchmarks/move_overhead.py [--nodes 1] [--moves 10] [--hidden 256]
                                           [--transitions "fsdp=8->tp=8;pp=2,tp=4->tp=8"] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.driver.group import ModelGroup
from realloc import Topology
from realloc.spec import decoder_spec
from realloc_tools.cluster import ray_for_command

ONE_NODE = "fsdp=8->tp=8;pp=2,tp=4->tp=8;tp=8->dp=4,tp=2"
TWO_NODES = "dp=2,tp=2,pp=2->dp=4,tp=2;dp=4,tp=2->tp=8;fsdp=8->dp=4,tp=2"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1, help="simulated nodes (default 1: every route zero-copy)")
    parser.add_argument("--moves", type=int, default=10, help="timed round trips per transition (default 10)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default 256; intermediate twice it)")
    parser.add_argument("--transitions", help=f"'a->b;c->d' (default: {ONE_NODE!r} on one node, {TWO_NODES!r} on more)")
    parser.add_argument("--keep", choices=("in_place", "host"), help="reallocate(..., keep=) both ways")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    spec = decoder_spec("overhead", hidden=args.hidden, intermediate=2 * args.hidden, layers=32, heads=32, vocab=1024)
    text = args.transitions or (ONE_NODE if args.nodes == 1 else TWO_NODES)
    pairs = [tuple(Topology.parse(x) for x in t.split("->")) for t in text.split(";")]
    rows = []
    with ray_for_command(None, args.nodes, -(-pairs[0][0].world_size // args.nodes), 256 << 20):
        group = ModelGroup.create(spec, pairs[0][0], name="overhead", timeout_s=120)
        try:
            group.init_synthetic(0)
            for src, dst in pairs:
                if group.topology != src:
                    group.reallocate(src)
                for _ in range(2):  # plans, communicators, reused pages, compiled copies
                    group.reallocate(dst, keep=args.keep)
                    group.reallocate(src, keep=args.keep)
                times: dict[str, list[tuple[float, float]]] = {"there": [], "back": []}
                for _ in range(args.moves):
                    for way, target in (("there", dst), ("back", src)):
                        t = time.perf_counter()
                        stats = group.reallocate(target, keep=args.keep)
                        times[way].append((time.perf_counter() - t, stats.seconds))
                for way, (a, b) in (("there", (src, dst)), ("back", (dst, src))):
                    rows.append(
                        {
                            "src": str(a),
                            "dst": str(b),
                            "wall_ms": 1e3 * statistics.median(w for w, _ in times[way]),
                            "execute_ms": 1e3 * statistics.median(e for _, e in times[way]),
                        }
                    )
            bad = group.verify_synthetic(0)
        finally:
            group.shutdown()
    report = {
        "tensors": len(spec.params),
        "model_bytes": spec.total_bytes(),
        "nodes": args.nodes,
        "moves": args.moves,
        "keep": args.keep,
        "rows": rows,
        "verified": not bad,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['tensors']} tensors, {spec.total_bytes() / 1e6:.1f} MB, {args.nodes} node(s), medians of "
            f"{args.moves}"
        )
        for r in rows:
            print(f"  {r['src']:>24} -> {r['dst']:<24} wall {r['wall_ms']:6.1f} ms   execute {r['execute_ms']:6.1f} ms")
        print("verified" if not bad else f"MISMATCH: {bad}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
