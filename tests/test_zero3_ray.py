"""ZeRO-3 layouts in Ray workers: synthetic weights into a zero3 group, to tp/dp and back,
every element and every (reused, not zeroed) padding checked; ``ctx.tensors`` are the flat partitions."""

from __future__ import annotations

import pytest
from simulated import simulated_cluster

from actors import ModelGroup
from realloc import ModelSpec, Topology
from realloc.layout.zero3 import zero3_partition


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=2) as c:
        yield c


def test_zero3_group_reallocates_to_tp_and_back(cluster):
    spec = ModelSpec.preset("tiny")
    zero3 = Topology(fsdp=4, fsdp_split="zero3")
    group = ModelGroup.create(spec, zero3, name="zero3")
    try:
        group.init_synthetic(seed=3)
        assert not any(group.verify_synthetic(seed=3).values())
        for dst in (Topology(dp=2, tp=2), zero3, Topology(fsdp=4), zero3):
            group.reallocate(dst)
            assert not any(group.verify_synthetic(seed=3).values()), dst
        shapes = group.run(lambda ctx: {slot: tuple(t.shape) for slot, t in ctx.tensors.items()})
        norm = spec.param("model.norm.weight")
        for rank_shapes in shapes:
            assert rank_shapes["model.norm.weight"] == (zero3_partition(norm.numel, 4, 0)[2],)
    finally:
        group.shutdown()
