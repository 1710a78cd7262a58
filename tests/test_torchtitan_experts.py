"""Expert parallelism with FSDP as torchtitan composes them (``Topology(fsdp=F, ep=E, etp=1)``).

Every rank's tensors are checked against tests/oracle.py's independent reading of torchtitan
(:func:`oracle.torchtitan_local_tensors`: the global ``w1``/``w3``/``w2`` stacks distributed over
its sparse mesh ``(pp, dp_replicate, efsdp, ep)``, ``Shard(0)`` or ``Shard(1)`` on efsdp), and plans
between such layouts and Megatron/vLLM expert meshes, transformers' stacked experts and plain
layouts run bit-exact and pass the planner checks on the oracle's masks.
"""

from __future__ import annotations

import oracle
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_experts import TINY, check_packed_buffers, check_piece_table, stages_of
from test_layout import check_shards_written_from_full_tensors
from test_planner_properties import placements
from test_stacked_experts import any_format_layout, check_formats, check_rank, engine_views, filled

from realloc import Layout, Placement, Topology


@st.composite
def torchtitan_layouts(draw, m=None, world=None):
    m = m or draw(oracle.moe_decoders(st))
    world = world or draw(st.sampled_from([8, 6, 4, 2]))
    options = oracle.torchtitan_factorisations(m, world)
    assume(options)
    dp, fsdp, tp, pp, ep = draw(st.sampled_from(options))
    split = draw(oracle.layer_splits(st, m.layers, pp))
    order = draw(st.sampled_from(["hf", "torchtitan"]))
    return m, Layout(m.spec(), Topology(dp, tp, pp, split, fsdp=fsdp, ep=ep, etp=1), expert_order=order)


@settings(max_examples=60, deadline=None)
@given(torchtitan_layouts())
def test_every_ranks_tensors_are_torchtitans(case):
    m, layout = case
    t = layout.topology
    full = oracle.moe_full_tensors(m, seed=3)
    check_shards_written_from_full_tensors(
        layout,
        full,
        lambda rank: oracle.torchtitan_local_tensors(m, full, (t.dp, t.fsdp, t.tp, t.pp, t.ep), stages_of(m, t), rank),
    )
    check_packed_buffers(layout)
    if layout.expert_order == "torchtitan":  # the GroupedExperts stacks, one view of the buffer each
        for rank in range(t.world_size):
            store = filled(layout, rank, full, poison=False)
            check_rank(m, layout, rank, store.buffers, full)
            views = engine_views(layout, rank, store.buffers)
            stacks = [v for k, v in views.items() if "inner_experts" in k and v.numel()]  # zero-size: FSDP2's empty
            for v in stacks:
                assert v.untyped_storage().data_ptr() == store.buffers[m.dtype].untyped_storage().data_ptr()
                assert v.is_contiguous()


@settings(max_examples=30, deadline=None)
@given(torchtitan_layouts(), st.data())
def test_piece_table_is_the_layouts_groups(case, data):
    _, layout = case
    check_piece_table(layout, list(data.draw(st.permutations(list(range(layout.topology.world_size))))))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_plans_to_and_from_torchtitan(data):
    m = data.draw(oracle.moe_decoders(st))
    world = data.draw(st.sampled_from([8, 6, 4, 2]))
    _, titan = data.draw(torchtitan_layouts(m, world))
    other = data.draw(st.one_of(any_format_layout(m, world), torchtitan_layouts(m, world).map(lambda c: c[1])))
    src, dst = (titan, other) if data.draw(st.booleans()) else (other, titan)
    check_formats(m, src, dst, data.draw(placements(world)), data.draw(st.integers(1024, 4096)))


@pytest.mark.parametrize(
    "src, dst",
    [
        (("dp=1,fsdp=4,ep=2,etp=1", "hf"), ("dp=2,tp=2,ep=4,etp=1", "vllm")),  # Shard(0) -> vLLM
        (("dp=1,fsdp=4,tp=2,ep=2,etp=1", "hf"), ("dp=1,fsdp=8", "hf_stacked")),  # Shard(1) -> transformers
        (("dp=2,fsdp=2,ep=2,etp=1", "hf"), ("dp=4", "hf")),  # HSDP -> replicated
        (("dp=1,fsdp=2,pp=2,ep=2,etp=1", "hf"), ("dp=2,tp=2,ep=2", "hf")),  # with pp, to Megatron's mesh
        (("dp=1,fsdp=6,ep=3,etp=1", "hf"), ("dp=1,fsdp=6,ep=2,etp=1", "torchtitan")),  # ep 3 -> 2, Shard(1)
        (("dp=1,fsdp=4,ep=2,etp=1", "torchtitan"), ("dp=1,fsdp=4", "hf_stacked")),  # w1/w2/w3 -> gate_up_proj
    ],
)
def test_chosen_plans_to_and_from_torchtitan(src, dst):
    a = Layout(TINY.spec(), Topology.parse(src[0]), expert_order=src[1])
    b = Layout(TINY.spec(), Topology.parse(dst[0]), expert_order=dst[1])
    world = a.topology.world_size
    check_formats(TINY, a, b, Placement.blocks(world, 2))
    check_formats(TINY, b, a, Placement.blocks(world, 2))


def test_torchtitans_expert_chunks():
    """6 experts, ep=2 (3 each). fsdp=4: efsdp 2, 2 x 2 <= 6, Shard(0): chunks of 2 and 1 experts.
    fsdp=4, tp=2: efsdp 4, 4 x 2 > 6, Shard(1): every expert, 2 of its 8 gate rows per rank."""

    def held(topology: str, rank: int) -> list:
        lay = Layout(TINY.spec(), Topology.parse(topology))
        return [
            (s.param.split("experts.")[1].split(".")[0], s.offsets, s.sizes)
            for s in lay.shards(rank)
            if s.param.startswith("model.layers.1.mlp.experts.") and "gate" in s.param
        ]

    assert [e for e, _, _ in held("dp=1,fsdp=4,ep=2,etp=1", 1)] == ["3", "4"]  # i=1: ep 1, efsdp 0
    assert [e for e, _, _ in held("dp=1,fsdp=4,ep=2,etp=1", 2)] == ["2"]  # i=2: ep 0, efsdp 1
    assert held("dp=1,fsdp=4,tp=2,ep=2,etp=1", 5) == [(str(e), (4, 0), (2, 8)) for e in (3, 4, 5)]


@pytest.mark.parametrize(
    "topology, match",
    [
        ("dp=1,fsdp=2,tp=2,ep=2", "ep > 1 and etp=1"),  # etp defaults to tp
        ("dp=1,fsdp=2,tp=2,etp=1", "ep > 1 and etp=1"),
        ("dp=1,fsdp=2,ep=4,etp=1", "must divide its dp_shard x tp"),
        ("dp=1,fsdp=4,ep=2,etp=1,fsdp_split=zero3", "torchtitan shards with FSDP2"),
        ("dp=1,fsdp=4,ep=4,etp=1", "num_experts divisible by ep"),  # 6 experts
    ],
)
def test_refused(topology, match):
    with pytest.raises(ValueError, match=match):
        Layout(TINY.spec(), Topology.parse(topology))


def test_torchtitan_order_needs_the_composition():
    with pytest.raises(ValueError, match="for its EP \\+ FSDP composition only"):
        Layout(TINY.spec(), Topology.parse("dp=1,fsdp=4"), expert_order="torchtitan")
    dense = oracle.Decoder(hidden=8, intermediate=16, layers=2, heads=4, kv_heads=2, head_dim=2, vocab=10)
    with pytest.raises(ValueError, match="no routed experts"):
        Layout(dense.spec(), Topology(fsdp=2), expert_order="torchtitan")


def test_other_expert_orders_are_refused_with_torchtitan():
    t = Topology.parse("dp=1,fsdp=4,ep=2,etp=1")
    with pytest.raises(ValueError, match="not expert parallel"):
        Layout(TINY.spec(), t, expert_order="hf_stacked")
    with pytest.raises(ValueError, match="vLLM's fused expert buffers are not FSDP shards"):
        Layout(TINY.spec(), t, expert_order="vllm")


def test_layout_values_and_manifests_keep_the_composition():
    import json
    import pickle

    from test_experts import manifest_of

    from realloc.ckpt.manifest import Manifest

    layout = Layout(TINY.spec(), Topology.parse("dp=2,fsdp=2,tp=2,ep=2,etp=1"))
    assert str(layout.topology) == "dp=2,fsdp=2,tp=2,pp=1,ep=2,etp=1"
    assert Topology.parse(str(layout.topology)) == layout.topology and layout.topology.torchtitan_experts
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert layout != Layout(TINY.spec(), Topology.parse("dp=2,fsdp=2,tp=2"))
    data = json.loads(json.dumps(manifest_of(layout).to_json()))
    assert Manifest.from_json(data).layout(layout.spec) == layout
