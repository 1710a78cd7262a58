"""Run a plan on shard stores inside one process (tests, ``realloc plan --verify``)."""

from __future__ import annotations

from typing import Mapping

import torch

from realloc.plan import Plan, bucket_nbytes
from realloc.shards.copies import copy_local, pack, unpack
from realloc.shards.store import ShardStore


def execute_in_process(plan: Plan, src: Mapping[int, ShardStore], dst: Mapping[int, ShardStore]) -> dict:
    """Apply ``plan``: ``src[w]`` holds worker ``w``'s current shards, ``dst[w]`` receives.

    Runs the same bucket packing and unpacking as the Ray actors, step by step.

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
