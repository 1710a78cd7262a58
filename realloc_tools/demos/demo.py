"""``realloc demo``: a model on 8 actors over 2 nodes, moved through several layouts and verified."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from actors.trace import check_trace_path, write_chrome_trace
from realloc.boxes import box_index
from realloc.layout import Topology
from realloc_tools.cluster import ray_for_command

DEFAULT_ROUTE = ["dp=2,tp=2,pp=2", "dp=1,tp=4,pp=2", "dp=2,tp=4,pp=1", "dp=8,tp=1,pp=1", "dp=2,tp=2,pp=2"]


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="reallocate a model through several layouts on Ray actors and verify it")
    p.add_argument("--address", help="Ray cluster address (default: start a local Ray with simulated nodes)")
    p.add_argument("--model", default="small", help="preset or HF config.json (default: small, 112 MB bf16)")
    p.add_argument(
        "--layouts",
        default=";".join(DEFAULT_ROUTE),
        help="';'-separated layouts to visit in order (default: %(default)s)",
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes when starting Ray locally")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL)")
    p.add_argument("--bucket-mb", type=float, default=16, help="bucket size in MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the table as one JSON object")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="write every move's timeline (each worker's phases and transfers) as Chrome trace JSON (Perfetto)",
    )
    p.set_defaults(func=run_demo)


def _progress(done: int, total: int, label: str) -> None:
    width = 24
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<48}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\n")


def verify_against_reference(group, reference: dict[str, torch.Tensor]) -> int:
    """Compare every box of every rank with the driver-side full tensors; returns boxes checked."""
    checked = 0
    for rank, boxes in group.shard_boxes().items():
        for param, offsets, sizes, tensor in boxes:
            expected = reference[param][box_index(offsets, sizes)]
            if not torch.equal(tensor, expected):
                raise AssertionError(f"rank {rank}: {param} box {offsets}+{sizes} differs from the reference")
            checked += 1
    return checked


def run_demo(args: argparse.Namespace) -> int:
    import json

    from actors.driver.group import ModelGroup
    from realloc.shards.synthetic import synthetic_state_dict
    from realloc.spec import load_spec

    layouts = [Topology.parse(t) for t in args.layouts.split(";") if t.strip()]
    if len(layouts) < 2:
        raise ValueError("--layouts needs at least two layouts separated by ';'")
    sizes = {t.world_size for t in layouts}
    if len(sizes) != 1:
        raise ValueError(f"every layout must have the same number of ranks, got {sorted(sizes)}")
    if args.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, got {args.nodes}")
    if args.trace is not None:
        check_trace_path(args.trace)
    spec = load_spec(args.model)
    for t in layouts:
        t.check(spec)
    traces = []
    workers = layouts[0].world_size
    per_node = -(-workers // args.nodes)
    started = time.perf_counter()
    rows = []
    with ray_for_command(args.address, args.nodes, per_node) as where:
        print(
            f"realloc demo: {spec.name} ({spec.total_bytes() / 1e6:.0f} MB) on {workers} actors, {where}",
            file=sys.stderr,
        )
        group = ModelGroup.create(
            spec, layouts[0], name="demo", use_gpu=args.gpu, bucket_bytes=int(args.bucket_mb * (1 << 20))
        )
        try:
            print(
                f"workers on {group.placement.num_nodes} nodes; ready in {time.perf_counter() - started:.1f}s",
                file=sys.stderr,
            )
            reference = synthetic_state_dict(spec, args.seed)
            group.init_synthetic(args.seed)
            verify_against_reference(group, reference)
            steps = len(layouts) - 1
            for i, dst in enumerate(layouts[1:]):
                _progress(i, steps, f"{group.topology} -> {dst}")
                stats = group.reallocate(dst)
                if args.trace is not None:
                    traces.append(group.last_trace())
                checked = verify_against_reference(group, reference)
                rows.append({**stats.as_dict(), "verified_boxes": checked})
            _progress(steps, steps, "done")
        finally:
            group.shutdown()
    total = time.perf_counter() - started
    if traces:
        write_chrome_trace(args.trace, traces)
        print(f"trace of {len(traces)} moves written to {args.trace} (open it in ui.perfetto.dev)", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": spec.name, "workers": workers, "transitions": rows, "total_seconds": total}))
        return 0
    width = max(len("transition"), *(len(r["transition"]) for r in rows))
    header = (
        f"{'transition':<{width}} {'intra MB':>9} {'inter MB':>9} {'local MB':>9} {'seconds':>8} {'GB/s':>6}  "
        "verified   slowest worker: its slowest phase"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['transition']:<{width}} {r['bytes_intra_node'] / 1e6:>9.1f} {r['bytes_inter_node'] / 1e6:>9.1f} "
            f"{r['bytes_local'] / 1e6:>9.1f} {r['seconds']:>8.3f} {r['gbps']:>6.2f}  {r['verified_boxes']} boxes  "
            + (
                f"{r['slowest_worker']}: {r['slowest_phase']} {r['slowest_phase_seconds']:.3f}s"
                if r["slowest_worker"]
                else "-"
            )
        )
    print(f"all {len(rows)} transitions bit-exact; total {total:.1f}s")
    return 0
