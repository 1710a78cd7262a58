"""Checkpoint plans at cluster scale, without running them (``realloc ckpt-demo --plan-only``).

Builds the three plans a run makes — clique replication after a save, retrieval after losing
node 0 (its ranks restarted on a fresh node with empty storage), and a resharding load into a
generation layout — from the layouts alone (file size = a rank's buffer bytes) and reports the
planner's statistics: bytes per link kind, node egress, balance, estimated and planning time,
what shipping each plan to its workers costs (the largest per-worker slice, slicing time:
realloc/plan/slices.py) and the seconds the cluster simulator gives it (realloc/sim, H100
preset unless another is given).
"""

from __future__ import annotations

import time

from realloc.ckpt.manifest import ShardRecord, param_table
from realloc.ckpt.replication import cliques, file_table, replication_groups, retrieval_groups
from realloc.ckpt.reshard import assign_readers, reshard_groups
from realloc.layout import Layout, Topology
from realloc.plan import Bandwidths, Placement, Plan, plan_exchange
from realloc.plan.slices import shipping_stats
from realloc.sim import Cluster, cluster_preset, simulate
from realloc.spec import ModelSpec

FRESH_NODE = "node-fresh"


def checkpoint_plans(
    spec: ModelSpec,
    train: Topology,
    generate: Topology,
    per_node: int,
    factor: int = 2,
    jump: int | None = None,
    bandwidths: Bandwidths = Bandwidths(),
    cluster: Cluster | None = None,
) -> dict:
    """Statistics of the replication, retrieval and resharding-load plans of one configuration.

    Example:
        >>> r = checkpoint_plans(ModelSpec.preset("tiny"), Topology(dp=2, tp=2), Topology(tp=4), per_node=2)
        >>> r["replication"]["bytes_inter_node"] == r["model_files_bytes"]
        True
    """
    if generate.world_size != train.world_size:
        raise ValueError(f"generation layout {generate} must have the {train.world_size} ranks of {train}")
    world = train.world_size
    cluster = cluster_preset("h100") if cluster is None else cluster
    placement = Placement.blocks(world, per_node)
    jump = per_node if jump is None else jump
    saved = Layout(spec, train)
    file_bytes = {r: saved.rank_bytes(r) for r in range(world)}
    table = file_table(file_bytes)
    report: dict = {
        "model": spec.name,
        "train": str(train),
        "generate": str(generate),
        "workers": world,
        "nodes": placement.num_nodes,
        "jump": jump,
        "factor": factor,
        "model_files_bytes": sum(file_bytes.values()),
    }

    t0 = time.perf_counter()
    holdings, needs = replication_groups(file_bytes, placement, jump, factor)
    plan = plan_exchange(holdings, needs, placement, table, bandwidths=bandwidths)
    report["replication"] = _summary(plan, time.perf_counter() - t0, cluster)

    holders = {r: {placement.nodes[m] for m in clique} for clique in cliques(world, jump, factor) for r in clique}
    lost = placement.nodes[0]
    after = Placement(tuple(FRESH_NODE if n == lost else n for n in placement.nodes))
    survivors = {r: nodes - {lost} for r, nodes in holders.items()}
    t0 = time.perf_counter()
    holdings, needs = retrieval_groups(survivors, file_bytes, after, range(world))
    plan = plan_exchange(holdings, needs, after, table, bandwidths=bandwidths)
    report["retrieval_after_losing_one_node"] = _summary(plan, time.perf_counter() - t0, cluster)

    t0 = time.perf_counter()
    stored = {r: tuple(ShardRecord.of(s, 0) for s in saved.shards(r)) for r in range(world)}
    assignment = assign_readers(stored, holders, placement)
    loads = assignment.loads()
    holdings, needs = reshard_groups(assignment, Layout(spec, generate))
    plan = plan_exchange(holdings, needs, placement, param_table(spec), bandwidths=bandwidths)
    summary = _summary(plan, time.perf_counter() - t0, cluster)
    summary["bytes_read"] = sum(loads.values())
    summary["max_reader_bytes"] = max(loads.values())
    summary["mean_reader_bytes"] = sum(loads.values()) // world
    report["reshard_load"] = summary
    return report


def _summary(plan: Plan, seconds: float, cluster: Cluster) -> dict:
    stats = plan.stats
    shipping = shipping_stats(plan)
    simulated = simulate(plan, cluster)
    senders = [v for v in stats["rank_send_bytes"].values() if v]
    return {
        "bytes_inter_node": stats["bytes_inter_node"],
        "bytes_intra_node": stats["bytes_intra_node"],
        "bytes_local_copy": stats["bytes_local_copy"],
        "max_node_egress_bytes": stats["max_node_egress_bytes"],
        "senders": len(senders),
        "max_sender_bytes": max(senders, default=0),
        "min_sender_bytes": min(senders, default=0),
        "steps": stats["num_steps"],
        "estimated_seconds": stats["estimated_seconds"],
        "plan_seconds": seconds,
        "max_slice_bytes": shipping["max_bytes"],
        "plan_pickle_bytes": shipping["plan_pickle_bytes"],
        "slice_seconds": shipping["slice_seconds"],
        "worker_prepare_seconds": shipping["prepare_seconds"],
        "simulated_seconds": simulated.seconds,
        "simulated_binding": simulated.binding,
        "simulated_cluster": simulated.cluster,
    }
