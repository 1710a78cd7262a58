"""Run a plan on shard stores inside one process (tests, ``realloc plan --verify``)."""

from __future__ import annotations

from typing import Mapping

import torch

from realloc.plan import Plan, bucket_nbytes
from realloc.shards.copies import copy_local, pack, unpack
from realloc.shards.store import ShardStore


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
