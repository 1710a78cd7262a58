"""Run a plan on shard stores inside one process (tests, ``realloc plan --verify``)."""

from __future__ import annotations

from typing import Mapping

import torch

from realloc.layout import Layout
from realloc.plan import Placement, Plan, bucket_nbytes, plan_reallocation
from realloc.plan.formats import conversion
from realloc.shards.convert import convert_rank
from realloc.shards.copies import copy_local, pack, unpack
from realloc.shards.store import ShardStore, allocate_buffers


def execute_in_process(plan: Plan, src: Mapping[int, ShardStore], dst: Mapping[int, ShardStore]) -> dict:
    """Apply ``plan``: ``src[w]`` holds worker ``w``'s current shards, ``dst[w]`` receives.

    Runs the same bucket packing and unpacking as the Ray actors, step by step, after
    :func:`check_fits` (``ValueError`` naming the first thing a plan from elsewhere, say
    ``Plan.from_json`` of an edited file, gets wrong about these stores; nothing is written then).

    Example:
        >>> from realloc import ModelSpec, Topology, Placement, Layout, plan_reallocation
        >>> from realloc.shards import allocate_buffers
        >>> spec = ModelSpec.preset("tiny")
        >>> a, b = Layout(spec, Topology(tp=2)), Layout(spec, Topology(dp=2))
        >>> plan = plan_reallocation(spec, a, b, Placement.blocks(2, 1))
        >>> src = {r: ShardStore(a.shards(r), allocate_buffers(a, r)) for r in range(2)}
        >>> dst = {r: ShardStore(b.shards(r), allocate_buffers(b, r)) for r in range(2)}
        >>> execute_in_process(plan, src, dst)["bytes_moved"] == plan.stats["bytes_total"]
        True
    """
    check_fits(plan, src, dst)
    local = moved = 0
    for worker, j in plan.local_copies:
        local += copy_local(src[worker], dst[worker], plan.segment_list(j))
    cache: dict[int, list] = {}
    for s, step in enumerate(plan.steps):
        senders = dst if plan.reads_destination(s) else src
        for sender, receiver, j in step:
            if j not in cache:
                cache[j] = plan.buckets(j)
            for bucket in cache[j]:
                data = torch.empty(bucket_nbytes(bucket), dtype=torch.uint8)
                pack(senders[sender], bucket, data)
                unpack(dst[receiver], bucket, data)
            moved += plan.list_bytes(j)
    return {"bytes_local": local, "bytes_moved": moved}


def check_fits(plan: Plan, src: Mapping[int, ShardStore], dst: Mapping[int, ShardStore]) -> None:
    """``ValueError`` unless ``plan`` is consistent (:meth:`Plan.validate`) and every segment a
    worker copies, sends or receives is a box its store holds, in the segment's dtype."""
    plan.validate()
    uses = [(src, "source", w, j) for w, j in plan.local_copies]
    uses += [(dst, "destination", w, j) for w, j in plan.local_copies]
    for s, step in enumerate(plan.steps):
        senders, role = (dst, "destination") if plan.reads_destination(s) else (src, "source")
        for sender, receiver, j in step:
            uses += [(senders, role, sender, j), (dst, "destination", receiver, j)]
    checked = set()
    for stores, role, worker, j in uses:
        if (role, worker, j) in checked:
            continue
        checked.add((role, worker, j))
        if worker not in stores:
            raise ValueError(
                f"the plan uses worker {worker} as a {role}, but only workers {sorted(stores)} have {role} stores"
            )
        for seg in plan.segment_list(j):
            try:
                found = stores[worker].index.addresses(seg.param, seg.offsets, seg.sizes)
            except KeyError as exc:
                raise ValueError(
                    f"the plan's segment list {j} does not fit worker {worker}'s {role} store: {exc.args[0]}"
                ) from None
            if any(a.dtype != seg.dtype for a in found):
                raise ValueError(
                    f"the plan's segment list {j} names {seg.param} {seg.box} as {seg.dtype}, but worker "
                    f"{worker}'s {role} store holds it as {found[0].dtype}"
                )


def move_in_process(
    src_layout: Layout,
    dst_layout: Layout,
    src: Mapping[int, ShardStore],
    dst: Mapping[int, ShardStore],
    placement: Placement,
    **plan_options,
) -> dict:
    """Move ``src_layout``'s stores (by rank) into ``dst_layout``'s, formats converted where
    :func:`realloc.plan.formats.conversion` says; ``plan_options`` go to ``plan_reallocation``
    (``src_workers``/``dst_workers``: the stores are then keyed by worker). Returns
    :func:`execute_in_process`'s counts plus ``conversion`` (where) and ``wire_bytes`` (what the
    plan moves between workers)."""
    conv = conversion(src_layout, dst_layout)
    plan_src, plan_dst = conv.plan_sides(src_layout, dst_layout)
    plan = plan_reallocation(plan_src.spec, plan_src, plan_dst, placement, **plan_options)
    ranks = {
        side: dict(
            zip(plan_options.get(f"{side}_workers") or range(lay.topology.world_size), range(lay.topology.world_size))
        )
        for side, lay in (("src", src_layout), ("dst", dst_layout))
    }
    if conv.where == "source":
        wire = {w: ShardStore(conv.wire.shards(r), allocate_buffers(conv.wire, r)) for w, r in ranks["src"].items()}
        for w, r in ranks["src"].items():
            convert_rank(src_layout, conv.wire, r, src[w], wire[w])
        src = wire
    target = dst
    if conv.where == "destination":
        dst = {w: ShardStore(conv.wire.shards(r), allocate_buffers(conv.wire, r)) for w, r in ranks["dst"].items()}
    counts = execute_in_process(plan, src, dst)
    if conv.where == "destination":
        for w, r in ranks["dst"].items():
            convert_rank(conv.wire, dst_layout, r, dst[w], target[w])
    return {**counts, "conversion": conv.where, "wire_bytes": plan.stats["bytes_total"]}
