"""Expert parallelism (``Topology.ep``/``etp``) and vLLM's fused expert buffers against the oracle.

Every rank's local tensors, every plan and every fused view is checked against tests/oracle.py's
independent expert rule (Megatron's tp-ep-dp-pp expert mesh, vLLM's contiguous expert map),
never against the layout's own bookkeeping: plans between ep layouts, ep x tp changes, ep <-> no
ep and vLLM's expert order <-> HF's run bit-exact (source padding poisoned), write each needed
element once, send only what senders hold and move inter-node bytes at the lower bound.
"""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import oracle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_layout import check_shards_written_from_full_tensors
from test_plan_scale import large_form
from test_planner_properties import POISON, check_plan, placements

from realloc import Layout, Placement, Topology
from realloc.ckpt.manifest import Manifest
from realloc.layout import PieceTable, expert_range
from realloc.plan import plan_reallocation
from realloc.shards import ShardStore, allocate_buffers, execute_in_process, fused_views
from realloc_tools.offline.plan import main

#: A Qwen2-MoE-style model: dense first layer, 6 routed experts, a shared expert.
TINY = oracle.MoeDecoder(
    hidden=8,
    intermediate=16,
    layers=4,
    heads=4,
    kv_heads=2,
    head_dim=2,
    vocab=23,
    tied=False,
    qkv_bias=True,
    dtype="bfloat16",
    norm_dtype="float32",
    experts=6,
    moe_inter=8,
    shared_inter=8,
    dense_layers=1,
)


def topology_of(dp, tp, pp, ep, etp, layer_split=None) -> Topology:
    return Topology(dp, tp, pp, layer_split, ep=ep, etp=etp)


def stages_of(m: oracle.MoeDecoder, topo: Topology) -> list[list[int]]:
    return oracle.pipeline_stages(m.layers, topo.pp, topo.layer_split, topo.pp_split)


def oracle_tensors(m, full, topo: Topology, rank: int, pad: int, pad_value=0) -> dict[str, torch.Tensor]:
    return oracle.moe_local_tensors(
        m, full, topo.dp, topo.tp, topo.pp, topo.ep, topo.expert_tp, stages_of(m, topo), rank, pad, pad_value
    )


def masks(m, topo: Topology, workers, pad: int) -> dict:
    """Elements each worker holds in ``topo``, from the oracle's slicing of index tensors."""
    shapes = {p.name: p.shape for p in oracle.moe_params(m)}
    index = oracle.moe_full_tensors(m, index=True)
    out = {}
    for rank in range(topo.world_size):
        held: dict[str, np.ndarray] = {}
        for slot, t in oracle_tensors(m, index, topo, rank, pad, pad_value=-1).items():
            name = oracle.storage_of(m, slot)
            flat = t.reshape(-1)
            mask = held.setdefault(name, np.zeros(math.prod(shapes[name]), dtype=bool))
            mask[flat[flat >= 0].numpy()] = True
        out[workers[rank]] = {n: mk.reshape(shapes[n]) for n, mk in held.items() if mk.any()}
    return out


def fill(layout: Layout, rank: int, m, full, pad: int, poison: bool) -> ShardStore:
    """A store of ``rank`` holding the oracle's tensors (padding poisoned when ``poison``)."""
    store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
    want = oracle_tensors(m, full, layout.topology, rank, pad)
    tensors = store.shard_tensors()
    assert sorted(tensors) == sorted(want), f"rank {rank} of {layout}"
    if poison:
        idx = oracle_tensors(m, oracle.moe_full_tensors(m, index=True), layout.topology, rank, pad, pad_value=-1)
    for slot, value in want.items():
        if poison:
            value = torch.where(idx[slot] < 0, torch.tensor(POISON, dtype=value.dtype), value)
        tensors[slot].copy_(value)
    return store


def check_moe_reallocation(
    m,
    src: Layout,
    dst: Layout,
    placement: Placement,
    pad: int = 1,
    bucket_bytes: int = 4096,
    src_workers=None,
    dst_workers=None,
):
    kwargs = {} if src_workers is None else dict(src_workers=src_workers, dst_workers=dst_workers)
    plan = plan_reallocation(src.spec, src, dst, placement, bucket_bytes=bucket_bytes, **kwargs)
    src_workers = src_workers or list(range(src.topology.world_size))
    dst_workers = dst_workers or list(range(dst.topology.world_size))
    full = oracle.moe_full_tensors(m, seed=5)
    sources = {w: fill(src, r, m, full, pad, poison=True) for r, w in enumerate(src_workers)}
    targets = {w: ShardStore(dst.shards(r), allocate_buffers(dst, r)) for r, w in enumerate(dst_workers)}
    moved = execute_in_process(plan, sources, targets)
    assert moved["bytes_moved"] == plan.stats["bytes_total"]
    for rank, worker in enumerate(dst_workers):
        want = oracle_tensors(m, full, dst.topology, rank, pad)
        got = targets[worker].shard_tensors()
        assert sorted(got) == sorted(want)
        for slot, value in want.items():
            assert torch.equal(got[slot], value), f"dst rank {rank} {slot} differs from the oracle ({dst})"
    shapes = {p.name: p.shape for p in oracle.moe_params(m)}
    dtypes = {p.name: p.dtype for p in oracle.moe_params(m)}
    check_plan(
        plan,
        shapes,
        dtypes,
        placement,
        masks(m, src.topology, src_workers, pad),
        masks(m, dst.topology, dst_workers, pad),
    )
    return plan


# -- strategies ---------------------------------------------------------------------------------


@st.composite
def ep_topologies(draw, m, world: int, expert_only: bool = False):
    options = oracle.ep_factorisations(m, world)
    if expert_only:
        options = [o for o in options if o[3] > 1 or o[4] != o[1]] or options
    dp, tp, pp, ep, etp = draw(st.sampled_from(options))
    return topology_of(dp, tp, pp, ep, etp, draw(oracle.layer_splits(st, m.layers, pp)))


@st.composite
def moe_layouts(draw, world=None, expert_only=True):
    m = draw(oracle.moe_decoders(st))
    world = world or draw(st.sampled_from([8, 6, 4, 2]))
    pad = draw(st.integers(1, 3))
    topo = draw(ep_topologies(m, world, expert_only))
    return m, Layout(m.spec(), topo, pad, expert_order=draw(st.sampled_from(["hf", "vllm"]))), pad


@st.composite
def ep_reallocations(draw):
    """ep -> ep', ep x tp changes, ep <-> no ep (ep=1, etp=tp), hf <-> vllm expert order."""
    m = draw(oracle.moe_decoders(st))
    world = draw(st.sampled_from([8, 6, 4, 2]))
    pad = draw(st.integers(1, 3))
    src = draw(ep_topologies(m, world, expert_only=True))
    dst = draw(ep_topologies(m, world, expert_only=draw(st.booleans())))
    if draw(st.booleans()):
        src, dst = dst, src
    spec = m.spec()
    orders = draw(st.sampled_from([("hf", "vllm"), ("vllm", "hf"), ("vllm", "vllm"), ("hf", "hf")]))
    return (
        m,
        Layout(spec, src, pad, expert_order=orders[0]),
        Layout(spec, dst, pad, expert_order=orders[1]),
        draw(placements(world)),
        pad,
        draw(st.integers(1024, 4096)),
    )


# -- the layout against the oracle --------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(moe_layouts())
def test_every_ranks_tensors_are_the_oracles(case):
    m, layout, pad = case
    full = oracle.moe_full_tensors(m, seed=3)
    check_shards_written_from_full_tensors(
        layout, full, lambda rank: oracle_tensors(m, full, layout.topology, rank, pad)
    )
    check_packed_buffers(layout)


def check_packed_buffers(layout: Layout) -> None:
    """One flat buffer per dtype on every rank, its shards packed without gaps or overlaps."""
    for rank in range(layout.topology.world_size):
        ends: dict[str, int] = {}
        for shard in layout.shards(rank):
            assert shard.buffer_offset == ends.get(shard.dtype, 0)
            ends[shard.dtype] = shard.buffer_offset + shard.local_numel
        assert ends == layout.buffer_numels(rank)


@settings(max_examples=60, deadline=None)
@given(moe_layouts(), st.data())
def test_piece_table_is_the_layouts_groups(case, data):
    m, layout, pad = case
    if data.draw(st.booleans()) and m.kv_heads % layout.topology.tp == 0:
        layout = Layout(layout.spec, layout.topology, pad, qkv_order="megatron", expert_order=layout.expert_order)
    check_piece_table(layout, list(data.draw(st.permutations(list(range(layout.topology.world_size))))))


def check_piece_table(layout: Layout, workers: list[int]) -> None:
    """The piece table is the layout's groups, and members of a group hold the group's boxes."""
    got, want = layout.piece_table(workers), PieceTable.of_groups(layout.groups(workers))
    assert got.groups == want.groups
    assert sorted(got.params) == sorted(want.params)
    for name in want.params:
        for a, b in zip(got.params[name], want.params[name]):
            assert np.array_equal(a, b), name
    for group in layout.groups(workers):  # members of a group hold the group's boxes
        ranks = [workers.index(w) for w in group.workers]
        for param, offsets, sizes in group.pieces:
            for r in ranks:
                assert any(s.param == param and s.offsets == offsets and s.sizes == sizes for s in layout.shards(r)), (
                    param,
                    r,
                )


# -- plans ---------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(ep_reallocations())
def test_random_ep_reallocations(case):
    m, src, dst, placement, pad, bucket_bytes = case
    check_moe_reallocation(m, src, dst, placement, pad, bucket_bytes)


@settings(max_examples=20, deadline=None)
@given(ep_reallocations())
def test_large_form_ep_plans_execute_bit_exact(case):
    m, src, dst, placement, pad, bucket_bytes = case
    with large_form():
        check_moe_reallocation(m, src, dst, placement, pad, bucket_bytes)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_random_ep_copies_between_disjoint_worker_sets(data):
    m = data.draw(oracle.moe_decoders(st))
    ws, wd = data.draw(st.sampled_from([4, 2])), data.draw(st.sampled_from([4, 2, 6]))
    workers = data.draw(st.permutations(list(range(ws + wd))))
    spec = m.spec()
    src = Layout(spec, data.draw(ep_topologies(m, ws, True)))
    dst = Layout(spec, data.draw(ep_topologies(m, wd)), expert_order=data.draw(st.sampled_from(["hf", "vllm"])))
    check_moe_reallocation(
        m, src, dst, data.draw(placements(ws + wd)), src_workers=list(workers[:ws]), dst_workers=list(workers[ws:])
    )


@pytest.mark.parametrize(
    "src, dst, orders",
    [
        ("dp=8,tp=1,ep=4,etp=1", "dp=8,tp=1,ep=2,etp=2", ("hf", "hf")),  # ep -> ep'
        ("dp=8,ep=4", "dp=4,tp=2,ep=4", ("hf", "vllm")),  # ep x tp change, to vLLM's buffers
        ("dp=4,tp=2,ep=4,etp=1", "dp=2,tp=4", ("vllm", "hf")),  # ep -> no ep
        ("dp=2,tp=2,pp=2", "dp=4,tp=1,pp=2,ep=4", ("hf", "vllm")),  # no ep -> ep, with pp
        ("dp=2,tp=2,pp=2,ep=4,etp=1", "dp=2,tp=2,pp=2,ep=2", ("vllm", "vllm")),
        ("dp=5,ep=5", "dp=5", ("vllm", "hf")),  # uneven expert blocks (6 experts over 5 ranks)
    ],
)
def test_chosen_ep_reallocations(src, dst, orders):
    spec = TINY.spec()
    a = Layout(spec, Topology.parse(src), expert_order=orders[0])
    b = Layout(spec, Topology.parse(dst), expert_order=orders[1])
    world = a.topology.world_size
    check_moe_reallocation(TINY, a, b, Placement.blocks(world, 2))


def test_uneven_expert_blocks_follow_vllm():
    """6 experts over ep=4: vLLM's determine_expert_map gives 2, 2, 1, 1 (Megatron refuses)."""
    assert [list(expert_range(6, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4], [5]]
    assert [oracle.local_experts(6, 4, r) for r in range(4)] == [[0, 1], [2, 3], [4], [5]]
    lay = Layout(TINY.spec(), Topology.parse("dp=4,ep=4"))
    held = {s.param.split(".experts.")[1].split(".")[0] for s in lay.shards(2) if ".experts." in s.param}
    assert held == {"4"}


# -- vLLM's fused expert buffers -----------------------------------------------------------------


@pytest.mark.parametrize(
    "topology",
    [
        "dp=4,tp=2,ep=4,etp=2",
        "dp=6,ep=6,etp=1",
        "dp=4,tp=2,ep=2,etp=2",
        "dp=2,tp=2,pp=2,ep=4,etp=1",
        "tp=2",
        "dp=4,tp=2,ep=2,etp=1",
    ],
)
def test_vllm_fused_buffers_are_the_oracles(topology):
    topo = Topology.parse(topology)
    layout = Layout(TINY.spec(), topo, expert_order="vllm")
    full = oracle.moe_full_tensors(TINY, seed=11)
    for rank in range(topo.world_size):
        store = fill(layout, rank, TINY, full, 1, poison=False)
        views = fused_views(layout.at(rank), store.buffers)
        etp_rank, ep_rank, _, pp_rank = oracle.expert_mesh_coords(
            rank, topo.dp, topo.tp, topo.pp, topo.ep, topo.expert_tp
        )
        experts = oracle.local_experts(TINY.experts, topo.ep, ep_rank)
        layers = [layer for layer in stages_of(TINY, topo)[pp_rank] if layer >= TINY.dense_layers]
        for layer in layers:
            w13 = views[f"model.layers.{layer}.mlp.experts.w13_weight"]
            w2 = views[f"model.layers.{layer}.mlp.experts.w2_weight"]
            assert torch.equal(w13, oracle.vllm_w13(full, layer, experts, topo.expert_tp, etp_rank))
            assert torch.equal(w2, oracle.vllm_w2(full, layer, experts, topo.expert_tp, etp_rank))
            buffer = store.buffers[TINY.dtype]
            for view in (w13, w2):  # views of the buffer, not copies
                assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                assert view.is_contiguous()
        assert sorted(k for k in views if k.endswith("w13_weight")) == sorted(
            f"model.layers.{layer}.mlp.experts.w13_weight" for layer in layers
        )


def test_hf_expert_order_has_no_fused_expert_views():
    layout = Layout(TINY.spec(), Topology.parse("dp=2,ep=2,etp=1"))
    views = fused_views(layout.at(0), allocate_buffers(layout, 0))
    assert not any("w13_weight" in k for k in views) and "model.layers.1.mlp.experts.0.up_proj.weight" in views


def test_vllm_expert_order_needs_routed_experts():
    dense = oracle.Decoder(hidden=8, intermediate=16, layers=2, heads=4, kv_heads=2, head_dim=2, vocab=10)
    with pytest.raises(ValueError, match="no routed experts"):
        Layout(dense.spec(), Topology(tp=2), expert_order="vllm")
    with pytest.raises(ValueError, match="expert_order must be one of 'hf', 'vllm'"):
        Layout(TINY.spec(), Topology(tp=2), expert_order="sglang")


# -- topology, layout values, manifests, refusals ------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "dp=8,ep=8",
        "dp=4,tp=2,ep=4",
        "dp=4,tp=2,ep=8,etp=1",
        "dp=2,tp=4,pp=2,ep=2,etp=2",
        "dp=2,tp=2,etp=1",
        "dp=4,tp=2,pp=3,layer_split=1/1/2,ep=2,pp_split=megatron",
    ],
)
def test_topology_round_trip(text):
    t = Topology.parse(text)
    assert Topology.parse(str(t)) == t and hash(Topology.parse(str(t))) == hash(t)


def test_topology_defaults_and_dp_inference():
    assert Topology.parse("ep=8,tp=1") == Topology(dp=8, ep=8)
    assert Topology.parse("ep=4,tp=2") == Topology(dp=4, tp=2, ep=4) and Topology(dp=4, tp=2, ep=4).expert_tp == 2
    assert Topology.parse("ep=2,tp=4,etp=1").dp == 1
    assert Topology(tp=2, etp=2) == Topology(tp=2) and str(Topology(tp=2, etp=2)) == "dp=1,tp=2,pp=1"
    assert str(Topology(dp=2, tp=2)) == "dp=2,tp=2,pp=1" and not Topology(dp=2, tp=2).expert_parallel
    spec = TINY.spec()
    a, b = Layout(spec, Topology(dp=2, tp=2)), Layout(spec, Topology(dp=2, tp=2, ep=1, etp=2))
    assert a == b and a.key == b.key and all(a.shards(r) == b.shards(r) for r in range(4))
    assert Layout(spec, Topology(dp=2, tp=2, ep=2)) != a
    assert Layout(spec, Topology(dp=2, tp=2, ep=2), expert_order="vllm") != Layout(spec, Topology(dp=2, tp=2, ep=2))


def test_expert_mesh_matches_vllm_with_etp_1():
    """etp=1, ep=dp*tp: ep_rank = dp_rank * tp + tp_rank (vLLM's FusedMoEParallelConfig)."""
    t = Topology.parse("dp=4,tp=2,pp=2,ep=8,etp=1")
    for rank in range(t.world_size):
        dp_rank, tp_rank, pp_rank = t.coords(rank)
        assert t.expert_coords(rank) == (0, dp_rank * 2 + tp_rank, 0, pp_rank)
        assert oracle.expert_mesh_coords(rank, 4, 2, 2, 8, 1) == (0, dp_rank * 2 + tp_rank, 0, pp_rank)


@pytest.mark.parametrize(
    "text, kwargs, match",
    [
        ("dp=3,ep=2", {}, "ep=2 x etp=1 = 2 must divide dp x tp = 3"),
        ("dp=2,tp=2,ep=4", {}, "must divide dp x tp = 4"),
        (
            "dp=2,fsdp=2,tp=2,ep=2",
            {},
            "fsdp=2 with ep=2, etp=2",
        ),  # torchtitan: etp=1 (tests/test_torchtitan_experts.py)
        ("dp=2,fsdp=2,tp=2,etp=1", {}, "fsdp=2 with ep=1, etp=1"),
    ],
)
def test_refused_topologies(text, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology.parse(text)


def test_refused_layouts():
    spec = TINY.spec()
    with pytest.raises(ValueError, match="ep=8 is larger than the 6 routed experts"):
        Layout(spec, Topology.parse("dp=8,ep=8"))
    with pytest.raises(ValueError, match="etp=16 does not fit the experts"):
        Layout(spec, Topology.parse("dp=16,ep=1,etp=16"))
    dense = oracle.Decoder(hidden=8, intermediate=16, layers=2, heads=4, kv_heads=2, head_dim=2, vocab=10)
    with pytest.raises(ValueError, match="has no routed experts"):
        Layout(dense.spec(), Topology.parse("dp=2,ep=2"))
    assert main(["plan", "--model", "tiny", "--src", "ep=2", "--dst", "dp=2"]) == 2


def manifest_of(layout: Layout) -> Manifest:
    """A checkpoint manifest of rank 0 of ``layout`` (its options recorded as a saver records them)."""
    from realloc.ckpt.files import saved_topology
    from realloc.ckpt.manifest import CheckpointId, ShardRecord

    spec = layout.spec
    return Manifest(
        id=CheckpointId("run", 1, 0),
        world_size=layout.topology.world_size,
        topology=saved_topology(layout),
        vocab_pad_multiple=layout.vocab_pad_multiple,
        spec_name=spec.name,
        params={p.name: (p.shape, p.dtype) for p in spec.params},
        buffers=layout.buffer_numels(0),
        shards=tuple(
            ShardRecord(s.param, s.slot, s.offsets, s.sizes, s.local_shape, s.dtype, s.buffer_offset, 0)
            for s in layout.shards(0)
        ),
        file_bytes=0,
        sha256="0" * 64,
        written_on="node",
        vocab_pad_rule=layout.vocab_pad_rule,
        qkv_order=layout.qkv_order,
        expert_order=layout.expert_order,
    )


def test_layout_pickles_and_manifests_keep_expert_options():
    spec = TINY.spec()
    lay = Layout(spec, Topology.parse("dp=4,tp=2,ep=4,etp=1"), 2, expert_order="vllm")
    back = pickle.loads(pickle.dumps(lay))
    assert back == lay and back.options == lay.options and back.options["expert_order"] == "vllm"
    assert Layout(spec, lay.topology, **lay.options) == lay
    assert str(lay) == "dp=4,tp=2,pp=1 vocab pad 2 ep 4 etp 1 experts vllm"
    data = manifest_of(lay).to_json()
    assert data["topology"]["ep"] == 4 and data["topology"]["etp"] == 1 and data["expert_order"] == "vllm"
    again = Manifest.from_json(json.loads(json.dumps(data)))
    assert again == manifest_of(lay) and again.layout(spec) == lay
    plain = manifest_of(Layout(spec, Topology(dp=2, tp=2))).to_json()
    assert "ep" not in plain["topology"] and "etp" not in plain["topology"] and "expert_order" not in plain


# -- the command line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst, extra",
    [
        ("ep=4,tp=2", "dp=2,tp=4", ["--src-expert-order", "vllm"]),
        ("dp=4,tp=2,pp=2,ep=4,etp=1", "dp=2,tp=4,pp=2,ep=2", ["--dst-expert-order", "vllm"]),
        ("dp=8,ep=4,etp=2", "ep=2,tp=4", []),
    ],
)
def test_plan_verify_on_a_tiny_moe(capsys, tmp_path, src, dst, extra):
    (tmp_path / "config.json").write_text(json.dumps(TINY.config()))
    assert (
        main(
            ["plan", "--model", str(tmp_path), "--src", src, "--dst", dst, "--gpus-per-node", "4", "--verify", "--json"]
            + extra
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["verified"] and report["bytes_inter_node"] == report["lower_bound_inter_node_bytes"]


def test_plan_qwen3_moe_ep_to_ep_times_tp(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "tests/data/configs/Qwen3-30B-A3B.json",
                "--src",
                "ep=8,tp=1",
                "--dst",
                "ep=4,tp=2",
                "--gpus-per-node",
                "1",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_inter_node"] == report["lower_bound_inter_node_bytes"] > 0


def test_mixtral_fused_expert_views_use_its_module_names():
    from realloc.spec import spec_from_hf_config

    spec = spec_from_hf_config(
        {
            "model_type": "mixtral",
            "hidden_size": 8,
            "intermediate_size": 12,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 20,
            "num_local_experts": 6,
        }
    )
    layout = Layout(spec, Topology.parse("dp=2,tp=2,ep=2"), expert_order="vllm")  # etp=2: 3 experts, half rows
    views = fused_views(layout.at(3), allocate_buffers(layout, 3))
    assert tuple(views["model.layers.1.block_sparse_moe.experts.w13_weight"].shape) == (3, 12, 8)
    assert tuple(views["model.layers.1.block_sparse_moe.experts.w2_weight"].shape) == (3, 8, 6)
    w1 = views["model.layers.1.block_sparse_moe.experts.4.w1.weight"]  # expert 4 is the rank's second
    w3 = views["model.layers.1.block_sparse_moe.experts.4.w3.weight"]
    w13 = views["model.layers.1.block_sparse_moe.experts.w13_weight"]
    assert w1.data_ptr() == w13[1].data_ptr() and w3.data_ptr() == w13[1, 6:].data_ptr()
