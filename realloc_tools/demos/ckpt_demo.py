"""``realloc ckpt-demo``: save with replication, lose a node, restore on a fresh one, reshard-load.

By default it starts a simulated cluster on this machine (a head without CPUs plus ``--nodes``
worker nodes; the workers fill all but one, which stays empty for the replacements). With
``--address`` it attaches to a running cluster instead and "loses" the node of rank 0 by
killing its workers and deleting that node's checkpoint directory.

Example::

    realloc ckpt-demo                                  # simulated 3-node cluster, ~110M-param model
    realloc ckpt-demo --model tiny --json              # fast, machine-readable
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from realloc.ckpt.local_store import default_root
from realloc.layout import Topology
from realloc.spec import ModelSpec, decoder_spec, preset_names

DEMO_MODEL = "demo-110m"
#: At most this many workers per node in ``--plan-only`` without ``--gpus-per-node`` (a GPU node's eight).
PLAN_ONLY_PER_NODE = 8


def add_ckpt_demo_parser(subparsers: Any) -> None:
    """Register ``ckpt-demo`` on an argparse subparsers object (``func(args) -> exit status``)."""
    p = subparsers.add_parser(
        "ckpt-demo",
        help="save, lose a node, restore: local checkpoints with replication, timed",
        description="Save a model group's shards to node-local storage with clique replication, remove "
        "a node, start replacement workers on a fresh node and restore every shard from the replicas; "
        "then load the checkpoint into another layout. Prints the timings.",
    )
    _add_arguments(p)
    p.set_defaults(func=run_ckpt_demo)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEMO_MODEL,
        help=f"{DEMO_MODEL} (default: hidden 768, 8 layers, vocab 32000, bf16) or a preset: "
        f"{', '.join(preset_names())}",
    )
    p.add_argument("--topology", default="dp=2,tp=2,pp=2", help="training layout (default %(default)s)")
    p.add_argument(
        "--reshard-to",
        default="dp=4,tp=2,pp=1",
        help="layout the checkpoint is finally loaded into (default %(default)s)",
    )
    p.add_argument("--factor", type=int, default=2, help="replication factor (default 2)")
    p.add_argument("--nodes", type=int, default=3, help="simulated worker nodes (default 3, one left empty)")
    p.add_argument("--address", default=None, help="attach to this Ray cluster instead of simulating one")
    p.add_argument(
        "--root",
        default=None,
        help="checkpoint root (default: a fresh directory under /dev/shm/realloc-ckpt, removed after)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="no Ray: print the replication, retrieval and resharding plans for --gpus-per-node "
        "workers per node (any model size)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        help="workers per node with --plan-only (default: as the demo places them, the workers spread over "
        f"--nodes minus one nodes, at most {PLAN_ONLY_PER_NODE} per node)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo as a standalone program; returns the exit status (0: every shard verified)."""
    parser = argparse.ArgumentParser(prog="realloc ckpt-demo")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_ckpt_demo(args)
    except ValueError as exc:
        print(f"realloc ckpt-demo: error: {exc}", file=sys.stderr)
        return 2


def demo_spec(name: str) -> ModelSpec:
    if name == DEMO_MODEL:
        return decoder_spec(DEMO_MODEL, hidden=768, intermediate=2048, layers=8, heads=12, vocab=32000)
    if name not in preset_names():
        raise ValueError(f"unknown --model {name!r}; use {DEMO_MODEL} or a preset: {', '.join(preset_names())}")
    return ModelSpec.preset(name)


def run_ckpt_demo(args: argparse.Namespace) -> int:
    """The demo; returns 0 when every restored shard is bit-exact, 1 otherwise."""
    spec = demo_spec(args.model)
    train, generate = Topology.parse(args.topology), Topology.parse(args.reshard_to)
    train.check(spec)
    generate.check(spec)
    if generate.world_size != train.world_size:
        raise ValueError(f"--reshard-to {generate} must have the {train.world_size} ranks of --topology {train}")
    if args.plan_only:
        return _plan_only(spec, train, generate, args)
    if args.address is None and args.nodes < 2:
        raise ValueError(
            f"--nodes must be at least 2 (workers on at least one, one left for replacements), got {args.nodes}"
        )
    import ray

    from actors.driver.checkpoint import CheckpointManager
    from actors.driver.group import ModelGroup

    world = train.world_size
    # Default: node-local RAM (/dev/shm), as the manager's own default, in a directory of its own.
    root = Path(args.root) if args.root else _fresh_dir(default_root())
    cluster, sim_nodes, rows = None, [], []
    started = time.perf_counter()
    try:
        if args.address is None:
            from ray.cluster_utils import Cluster

            per_node = demo_workers_per_node(world, args.nodes)
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
            sim_nodes = [cluster.add_node(num_cpus=per_node) for _ in range(args.nodes)]
            ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        else:
            ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
        rows.append(("start cluster", time.perf_counter() - started, None, f"{len(ray.nodes())} nodes"))

        t0 = time.perf_counter()
        group = ModelGroup.create(spec, train, name="ckpt-demo", timeout_s=120)
        group.init_synthetic(seed=1)
        rows.append(
            (
                "start workers + init",
                time.perf_counter() - t0,
                spec.total_bytes(),
                f"{world} workers on {group.placement.num_nodes} nodes",
            )
        )
        manager = CheckpointManager(group, root=root, run_id="ckpt-demo", factor=args.factor)

        stats = manager.save(1).wait()
        rows.append(
            (
                "save (sync)",
                stats.total_seconds,
                stats.bytes_written,
                f"write {stats.write_seconds:.2f}s + replicate {stats.replicate_seconds:.2f}s "
                f"({_mb(stats.bytes_replicated_inter_node)} inter-node)",
            )
        )
        t0 = time.perf_counter()
        handle = manager.save(2, is_async=True)
        returned = time.perf_counter() - t0
        group.init_synthetic(seed=2)  # "training" goes on: the save holds its snapshot
        stats = handle.wait()
        rows.append(
            (
                "save (async)",
                returned,
                stats.bytes_written,
                f"returned after the snapshot; background writes {stats.worker_write_seconds:.2f}s; "
                f"wait(): replicate {stats.replicate_seconds:.2f}s",
            )
        )

        lost = group.placement.nodes[0]
        t0 = time.perf_counter()
        _lose_node(group, manager, lost, cluster, sim_nodes)
        replaced = group.replace_dead_workers()
        rows.append(
            (
                "lose node + replace",
                time.perf_counter() - t0,
                None,
                f"ranks {replaced} -> node {group.placement.nodes[replaced[0]][:8]} (empty storage)",
            )
        )

        load = manager.load()
        ok = group.verify_synthetic(seed=1) == {}
        rows.append(
            (
                "restore (after loss)",
                load.total_seconds,
                load.bytes_inter_node + load.bytes_local,
                f"{_mb(load.bytes_local)} local + {_mb(load.bytes_inter_node)} from replicas; "
                f"exchange {load.exchange_seconds:.2f}s; bit-exact: {ok}",
            )
        )

        group.reallocate(generate)
        group.init_synthetic(seed=3)
        load = manager.load()
        ok_reshard = group.verify_synthetic(seed=1) == {}
        rows.append(
            (
                f"reshard load -> {generate}",
                load.total_seconds,
                load.bytes_read,
                f"read once, max {_mb(load.max_reader_bytes)}/reader; "
                f"{_mb(load.bytes_inter_node)} inter-node; bit-exact: {ok_reshard}",
            )
        )
        group.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
            from actors.wire.zero_copy import sweep_stale_buffers

            sweep_stale_buffers()  # killed workers cannot unlink their shared-memory buffers
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    _report(rows, spec, train, args.json, ok and ok_reshard)
    return 0 if ok and ok_reshard else 1


def _plan_only(spec: ModelSpec, train: Topology, generate: Topology, args: argparse.Namespace) -> int:
    from realloc.ckpt.estimate import checkpoint_plans

    per_node = args.gpus_per_node
    if per_node is None:
        per_node = min(PLAN_ONLY_PER_NODE, demo_workers_per_node(train.world_size, args.nodes))
    if per_node < 1:
        raise ValueError(f"--gpus-per-node must be positive, got {per_node}")
    report = checkpoint_plans(spec, train, generate, per_node, args.factor)
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"model {spec.name}: {_gb(report['model_files_bytes'])} of rank files, {report['workers']} workers on "
        f"{report['nodes']} nodes, cliques jump={report['jump']} factor={report['factor']}"
    )
    print(
        f"{'plan':<34} {'inter-node':>11} {'local':>10} {'max node out':>13} {'senders (min-max)':>24} "
        f"{'est. s':>7} {'plan s':>7}"
    )
    for name in ("replication", "retrieval_after_losing_one_node", "reshard_load"):
        r = report[name]
        senders = f"{r['senders']} ({_gb(r['min_sender_bytes'])}-{_gb(r['max_sender_bytes'])})"
        print(
            f"{name:<34} {_gb(r['bytes_inter_node']):>11} {_gb(r['bytes_local_copy']):>10} "
            f"{_gb(r['max_node_egress_bytes']):>13} {senders:>24} {r['estimated_seconds']:>7.2f} "
            f"{r['plan_seconds']:>7.2f}"
        )
    r = report["reshard_load"]
    print(
        f"reshard reads: {_gb(r['bytes_read'])} read once; max {_gb(r['max_reader_bytes'])} per reader "
        f"(mean {_gb(r['mean_reader_bytes'])})"
    )
    return 0


def demo_workers_per_node(world: int, nodes: int) -> int:
    """Workers per node in the simulated demo: ``world`` workers spread over all ``nodes`` but one
    (left empty for the replacements).

    Example:
        >>> demo_workers_per_node(8, 3)
        4
    """
    if nodes < 1:
        raise ValueError(f"--nodes must be positive, got {nodes}")
    return -(-world // max(1, nodes - 1))


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _fresh_dir(parent: Path) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="demo-", dir=parent))


def _lose_node(group, manager, node: str, cluster, sim_nodes) -> None:
    import ray

    if cluster is not None:
        cluster.remove_node(next(n for n in sim_nodes if n.node_id == node))
    else:
        for rank, where in enumerate(group.placement.nodes):
            if where == node:
                ray.kill(group.actors[rank])
    shutil.rmtree(manager.node_dir(node), ignore_errors=True)  # its local storage is gone with it
    deadline = time.monotonic() + 120
    while not group.dead_workers():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker of node {node} was reported dead after 120 s")
        time.sleep(0.5)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _report(rows: list, spec: ModelSpec, train: Topology, as_json: bool, ok: bool) -> None:
    if as_json:
        print(
            json.dumps(
                {
                    "model": spec.name,
                    "model_bytes": spec.total_bytes(),
                    "topology": str(train),
                    "ok": ok,
                    "steps": [{"step": s, "seconds": round(t, 3), "bytes": b, "detail": d} for s, t, b, d in rows],
                }
            )
        )
        return
    print(f"model {spec.name} ({_mb(spec.total_bytes())}), layout {train}")
    print(f"{'step':<30} {'seconds':>8} {'bytes':>11}  detail")
    for step, seconds, nbytes, detail in rows:
        print(f"{step:<30} {seconds:>8.2f} {_mb(nbytes):>11}  {detail}")
    print("all shards bit-exact" if ok else "MISMATCH: some shards differ")


if __name__ == "__main__":
    raise SystemExit(main())
