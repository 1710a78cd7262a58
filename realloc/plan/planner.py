"""The exchange planner: from who holds which boxes and who needs which, to a :class:`Plan`.

Input is deliberately general: ``holdings`` and ``needs`` are lists of :class:`Group` (workers
that hold/need identical box lists), plus a placement (node per worker) and parameter shapes.
A reallocation between two layouts, checkpoint replication, retrieval after node loss and
checkpoint loading are all this one call.

Algorithm (docs/architecture.md has the why and the measurements), one module per step:

1. **Cells** (:mod:`~realloc.plan.cells`). Per parameter, cut every needed box at every
   holder/need boundary; each cell gets the set of holder groups and need groups that cover
   it. Cells with the same (holders, needers) sets form a *bundle*: a replicated norm becomes
   one bundle needed by all tp groups, so it crosses each node boundary once, not once per
   source tp rank.
2. **Per (bundle, destination node)** (:mod:`~realloc.plan.routing`). A needing worker that
   holds the cell copies locally. If another worker of the node holds it, the copy stays in the
   node (least-loaded local holder). Otherwise it is a *remote demand*: the bytes enter the
   node exactly once, into one *entry* worker (least-loaded among the node's needing workers)
   and fan out inside the node from there. Inter-node bytes therefore equal the lower bound by
   construction.
3. **Sender balance** (:mod:`~realloc.plan.routing`). Remote demands sharing a set of holder
   nodes form a class; rows are ``(destination node, part)`` and columns are holder-node
   *slots*. With slot ``j`` of node ``h`` costing ``load[h] + j * mean_bytes``, a min-cost
   assignment (scipy ``linear_sum_assignment`` on this expanded matrix) fills the least-loaded
   nodes first, i.e. balances egress, and a small bonus for a (holder, destination) pair
   already used keeps the number of peers low. When every row is alike the optimum is a round
   robin over the sorted slots, computed directly (LSA on tied costs is cubic: 3.6 s at 2048
   rows here); above ``LSA_MAX_ROWS`` rows a largest-first greedy on the same costs is used.
   When a class has more holder nodes than destination nodes, each cell is cut into row parts
   sent by different nodes.
4. **Steps** (:mod:`~realloc.plan.assemble`, :mod:`~realloc.plan.schedule`). Routes (one per
   sender/receiver pair and phase) are edge-coloured greedily, largest first: in a step each
   worker sends at most one route and receives at most one. Intra-node fan-out routes come
   after every inter-node route.

This module is the orchestrator: :func:`plan_exchange` runs the four steps,
:func:`plan_reallocation` checks two layouts and their workers and builds its input.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from realloc._checks import check_int, is_int
from realloc.layout import Group, Layout, PieceTable
from realloc.plan.assemble import build_plan
from realloc.plan.cells import bundles_of
from realloc.plan.inputs import DEFAULT_BUCKET_BYTES, Bandwidths, ParamTable
from realloc.plan.placement import Placement
from realloc.plan.records import Plan
from realloc.plan.routing import Router
from realloc.spec import DTYPE_BYTES, ModelSpec

__all__ = ["plan_exchange", "plan_reallocation"]

log = logging.getLogger(__name__)


def plan_exchange(
    holdings: "Sequence[Group] | PieceTable",
    needs: "Sequence[Group] | PieceTable",
    placement: Placement,
    params: ParamTable,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    bandwidths: Bandwidths = Bandwidths(),
) -> Plan:
    """Plan how every needed box reaches every worker that needs it.

    Example:
        >>> from realloc.layout import Group
        >>> hold = [Group((0,), (("w", (0,), (8,)),))]
        >>> need = [Group((1, 2), (("w", (0,), (8,)),))]
        >>> plan = plan_exchange(hold, need, Placement(("a", "b", "b")), {"w": ((8,), "float32")})
        >>> plan.stats["bytes_inter_node"], plan.stats["bytes_intra_node"]
        (32, 32)
    """
    started = time.perf_counter()
    check_int("bucket_bytes", bucket_bytes, 1024)
    holdings, needs = (x if isinstance(x, PieceTable) else PieceTable.of_groups(x) for x in (holdings, needs))
    _validate(holdings, needs, placement, params)
    bundles, lower_bound_parts = bundles_of(holdings, needs, params, placement)
    planner = Router(placement, params, bandwidths)
    for bundle in bundles:
        planner.route_bundle(bundle)
    planner.assign_remote()
    plan = build_plan(planner, bucket_bytes)
    plan.stats["lower_bound_inter_node_bytes"] = lower_bound_parts
    plan.plan_seconds = time.perf_counter() - started
    log.debug(
        "planned %d routes in %d steps: %d B inter-node (bound %d), %d B intra-node, %d B local, %.3fs",
        plan.stats["num_routes"],
        plan.stats["num_steps"],
        plan.stats["bytes_inter_node"],
        lower_bound_parts,
        plan.stats["bytes_intra_node"],
        plan.stats["bytes_local_copy"],
        plan.plan_seconds,
    )
    return plan


def plan_reallocation(
    spec: ModelSpec,
    src: "Layout | object",
    dst: "Layout | object",
    placement: Placement,
    *,
    src_workers: Sequence[int] | None = None,
    dst_workers: Sequence[int] | None = None,
    vocab_pad_multiple: int = 1,
    vocab_pad_rule: str = "megatron",
    qkv_order: str = "hf",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    bandwidths: Bandwidths = Bandwidths(),
) -> Plan:
    """Plan moving ``spec`` from layout/topology ``src`` to ``dst``.

    By default both layouts live on workers ``0..world-1`` (one model group changing layout);
    pass ``src_workers``/``dst_workers`` to copy between groups (policy -> reference model).
    ``vocab_pad_multiple``, ``vocab_pad_rule`` and ``qkv_order`` apply to a topology given for
    ``src``/``dst`` (a :class:`Layout` carries its own; give layouts when the sides differ).

    Example:
        >>> from realloc import ModelSpec, Topology, Placement
        >>> spec = ModelSpec.preset("tiny")
        >>> plan = plan_reallocation(spec, Topology(dp=2, tp=2), Topology(tp=4), Placement.blocks(4, 2))
        >>> plan.stats["num_steps"] > 0
        True
    """
    options = dict(vocab_pad_multiple=vocab_pad_multiple, vocab_pad_rule=vocab_pad_rule, qkv_order=qkv_order)
    src_layout = src if isinstance(src, Layout) else Layout(spec, src, **options)
    dst_layout = dst if isinstance(dst, Layout) else Layout(spec, dst, **options)
    if src_layout.spec is not spec:
        spec.check_same_as(src_layout.spec)
    if dst_layout.spec is not spec:
        spec.check_same_as(dst_layout.spec)
    if src_workers is None and dst_workers is None and src_layout.topology.world_size != dst_layout.topology.world_size:
        raise ValueError(
            f"source {src_layout.topology} has {src_layout.topology.world_size} ranks but destination "
            f"{dst_layout.topology} has {dst_layout.topology.world_size}; one model group keeps its "
            "workers (give src_workers/dst_workers to copy between groups)"
        )
    for name, workers in (("src_workers", src_workers), ("dst_workers", dst_workers)):
        if workers is None:
            continue
        if (
            isinstance(workers, (str, bytes))
            or not isinstance(workers, Sequence)
            or any(not is_int(w) or w < 0 for w in workers)
        ):
            raise ValueError(f"{name} must be a sequence of non-negative worker ids, got {workers!r}"[:200])
        repeated = sorted({w for w in workers if list(workers).count(w) > 1})
        if repeated:
            raise ValueError(f"{name} names worker(s) {repeated[:5]} more than once: one worker holds one rank")
    for name, layout, workers in (("src", src_layout, src_workers), ("dst", dst_layout, dst_workers)):
        count = layout.topology.world_size if workers is None else len(workers)
        if workers is None and count > placement.num_workers:
            raise ValueError(
                f"{name} layout {layout.topology} has {count} ranks but placement has {placement.num_workers} workers"
            )
    table = {p.name: (p.shape, p.dtype) for p in spec.params}
    return plan_exchange(
        src_layout.piece_table(list(src_workers) if src_workers is not None else None),
        dst_layout.piece_table(list(dst_workers) if dst_workers is not None else None),
        placement,
        table,
        bucket_bytes=bucket_bytes,
        bandwidths=bandwidths,
    )


# -- validation -----------------------------------------------------------------------------


def _validate(holdings: PieceTable, needs: PieceTable, placement: Placement, params: ParamTable) -> None:
    for name, (_shape, dtype) in params.items():
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"parameter {name!r}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    for what, table in (("holdings", holdings), ("needs", needs)):
        for workers in table.groups:
            if not workers:
                raise ValueError(f"{what}: a group has no workers")
            placement.check_workers(workers, what)
        unknown = [p for p in table.params if p not in params]
        if unknown:
            raise ValueError(f"{what}: unknown parameter {unknown[0]!r}")
        if table.boxes_checked:
            continue
        by_ndim: dict[int, list[str]] = defaultdict(list)
        for param, (_, offsets, _) in table.params.items():
            if offsets.shape[1] != len(params[param][0]):
                _refuse_box(what, param, table, 0, params)
            by_ndim[offsets.shape[1]].append(param)
        for names in by_ndim.values():  # all boxes of one rank of tensor at once
            offsets = np.concatenate([table.params[p][1] for p in names])
            sizes = np.concatenate([table.params[p][2] for p in names])
            counts = [len(table.params[p][1]) for p in names]
            shapes = np.repeat(
                np.array([params[p][0] for p in names], dtype=np.int64).reshape(len(names), -1), counts, axis=0
            )
            bad = np.flatnonzero((offsets < 0).any(1) | (sizes < 1).any(1) | (offsets + sizes > shapes).any(1))
            if bad.size:
                at = int(bad[0])
                k = int(np.searchsorted(np.cumsum(counts), at, side="right"))
                _refuse_box(what, names[k], table, at - sum(counts[:k]), params)


def _refuse_box(what: str, param: str, table: PieceTable, i: int, params: ParamTable) -> None:
    _, offsets, sizes = table.params[param]
    raise ValueError(
        f"{what}: box offsets={tuple(offsets[i].tolist())} sizes={tuple(sizes[i].tolist())} is empty "
        f"or outside {param!r} of shape {tuple(params[param][0])}"
    )
