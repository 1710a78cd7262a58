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


def test_megatron_fused_padded_sharded_groups_reallocate(cluster):
    """Megatron's model under FSDP2 and ZeRO-3 (qkv_order="megatron": fused linear_qkv/linear_fc1
    sharded whole) with a padded vocabulary, to tp/dp and back, every element checked;
    ``ctx.tensors`` hold the fused chunks / partitions."""
    from realloc import Layout

    spec = ModelSpec.preset("tiny")
    fsdp2 = Layout(spec, Topology(fsdp=4), 8, qkv_order="megatron")
    zero3 = Layout(spec, Topology(fsdp=4, fsdp_split="zero3"), 8, qkv_order="megatron")
    group = ModelGroup.create(spec, fsdp2, name="fused")
    try:
        group.init_synthetic(seed=5)
        assert not any(group.verify_synthetic(seed=5).values())
        for dst in (Layout(spec, Topology(dp=2, tp=2)), zero3, fsdp2, Layout(spec, Topology(fsdp=4)), zero3):
            group.reallocate(dst)
            assert not any(group.verify_synthetic(seed=5).values()), dst
        names = group.run(lambda ctx: sorted(ctx.tensors))
        assert all("model.layers.0.self_attention.linear_qkv.weight" in n for n in names)
        assert not any("model.layers.0.self_attn.q_proj.weight" in n for n in names)
    finally:
        group.shutdown()
