"""Megatron's fused parameters under sharded data parallelism (``qkv_order="megatron"`` with fsdp > 1).

Megatron's model holds q/k/v as ONE parameter, ``linear_qkv`` (per local query group: its q
heads, its k head, its v head), and gate/up as ONE ``linear_fc1`` (``[gate; up]``), weights and
biases. Megatron-FSDP's FSDP2 chunks those whole tensors on dim 0 (``torch.chunk``: a chunk can cut
through query groups and hold parts of several of the per-group q/k/v boxes), Megatron-DeepSpeed's
ZeRO-3 flattens and partitions them. Checked against tests/oracle.py (``local_tensors(fused=True)``:
the oracle's fused tensors built from full HF tensors, then ``torch.chunk`` / flatten + pad + split):
every rank's buffers, the fused views, and plans to and from other layouts executed bit-exact.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from realloc.layout import Layout, Topology
from realloc.plan import Placement
from realloc.shards import ShardStore, allocate_buffers, flat_views, fused_views, shard_views
from realloc.shards.local_executor import move_in_process

try:
    from tests import oracle
    from tests.test_planner_properties import placements, stages_of, topologies
    from tests.test_zero3 import check_layout_buffers, check_zero3_reallocation, zero3_topologies
except ImportError:  # pytest put tests/ itself on sys.path
    import oracle
    from test_planner_properties import placements, stages_of, topologies
    from test_zero3 import check_layout_buffers, check_zero3_reallocation, zero3_topologies

EMBED = "model.embed_tokens.weight"
GQA = oracle.Decoder(
    hidden=4,
    intermediate=6,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=2,
    vocab=13,
    qkv_bias=True,
    mlp_bias=True,
    dtype="float32",
    norm_dtype="float32",
)
QKV = "model.layers.0.self_attention.linear_qkv.weight"
FC1 = "model.layers.0.mlp.linear_fc1.weight"


@st.composite
def fused_topologies(draw, d: oracle.Decoder, world: int):
    topo = draw(zero3_topologies(d, world))
    assume(d.kv_heads % topo.tp == 0)  # Megatron-core: tp divides the query groups
    return dataclasses.replace(topo, fsdp_split=draw(st.sampled_from(["fsdp2", "zero3"])))


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_random_fused_sharded_layouts_hold_the_engines_tensors(data):
    d = data.draw(oracle.decoders(st, mlp_bias=True))
    world = data.draw(st.sampled_from([12, 8, 6, 4, 3, 2]))
    assume(oracle.factorisations4(d, world))
    check_layout_buffers(d, data.draw(fused_topologies(d, world)), data.draw(st.integers(1, 3)), "megatron")


@st.composite
def fused_reallocations(draw):
    """A fused sharded layout to or from any layout (plain or sharded, HF or Megatron order)."""
    d = draw(oracle.decoders(st, mlp_bias=True))
    world = draw(st.sampled_from([w for w in (8, 6, 4, 3, 2) if oracle.factorisations4(d, w)] or [2]))
    assume(oracle.factorisations4(d, world))
    fused = draw(fused_topologies(d, world))
    other = draw(st.one_of(topologies(d, world), fused_topologies(d, world)))
    other_qkv = draw(st.sampled_from(["hf", "megatron"] if d.kv_heads % other.tp == 0 else ["hf"]))
    pads = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    sides = [(fused, pads[0], "megatron"), (other, pads[1], other_qkv)]
    if draw(st.booleans()):
        sides.reverse()
    (src, src_pad, src_qkv), (dst, dst_pad, dst_qkv) = sides
    workers = list(range(world))
    return (
        d,
        src,
        dst,
        draw(placements(world)),
        draw(st.integers(1024, 4096)),
        workers,
        workers,
        *(
            src_pad,
            dst_pad,
            src_qkv,
            dst_qkv,
        ),
    )


@settings(max_examples=50, deadline=None)
@given(fused_reallocations())
def test_random_reallocations_from_and_to_fused_sharded_layouts(case):
    check_zero3_reallocation(*case)


@pytest.mark.parametrize(
    "src, src_qkv, dst, dst_qkv",
    [
        (Topology(dp=2, fsdp=3), "megatron", Topology(tp=2, dp=3), "hf"),
        (Topology(fsdp=4, fsdp_split="zero3"), "megatron", Topology(fsdp=4), "megatron"),
        (Topology(fsdp=2, tp=2), "megatron", Topology(fsdp=4), "hf"),
        (Topology(dp=2, fsdp=2, tp=2, fsdp_split="zero3"), "megatron", Topology(fsdp=8, fsdp_split="zero3"), "hf"),
    ],
    ids=["fsdp2x3-tp2", "zero3x4-fsdp2x4", "fsdp2tp2-hf-fsdp4", "hsdp-zero3tp2-zero3x8-hf"],
)
def test_chosen_fused_reallocations(src, src_qkv, dst, dst_qkv):
    world = src.world_size
    args = (GQA, src, dst, Placement.blocks(world, 2), 2048, list(range(world)), list(range(world)), 2, 1)
    check_zero3_reallocation(*args, src_qkv, dst_qkv)
    check_zero3_reallocation(GQA, dst, src, *args[3:7], 1, 2, dst_qkv, src_qkv)


def test_fsdp2_chunks_cut_through_query_groups():
    """linear_qkv of 2 groups x (2 q heads + k + v) x head_dim 2 = 16 rows over fsdp=3: chunks of 6
    rows: rank 0 group 0's q (4 rows) and k; rank 1 group 0's v and group 1's q; rank 2 group 1's k
    and v (4 rows). linear_fc1 (12 rows [gate; up]): 4 rows each, rank 1 holds gate rows 4-5 and up
    rows 0-1."""
    lay = Layout(GQA.spec(), Topology(fsdp=3), qkv_order="megatron")
    pre = "model.layers.0."
    got = {}
    for rank in range(3):
        got[rank] = [
            (s.slot.removeprefix(pre), s.offsets[0], s.sizes[0])
            for s in lay.shards(rank)
            if s.slot.startswith(pre) and s.slot.endswith("weight") and "proj" in s.slot and "o_proj" not in s.slot
        ]
    assert got[0][:2] == [("self_attn.q_proj.weight", 0, 4), ("self_attn.k_proj.weight", 0, 2)]
    assert got[1][:2] == [("self_attn.v_proj.weight", 0, 2), ("self_attn.q_proj.weight", 4, 4)]
    assert got[2][:2] == [("self_attn.k_proj.weight", 2, 2), ("self_attn.v_proj.weight", 2, 2)]
    assert got[1][2:4] == [("mlp.gate_proj.weight", 4, 2), ("mlp.up_proj.weight", 0, 2)]
    full = oracle.full_tensors(GQA, seed=4)
    for rank in range(3):
        buffers = allocate_buffers(lay, rank)
        for name, value in oracle.local_tensors(
            GQA, full, 1, 1, 1, stages_of(GQA, lay.topology), rank, fsdp=3, fused=True
        ).items():
            fused_views(lay.at(rank), buffers, convention="megatron")[name].copy_(value)
        views = fused_views(lay.at(rank), buffers, convention="megatron")
        qkv = oracle.megatron_linear_qkv(GQA, full, 0, 1, 0)
        assert torch.equal(views[QKV], qkv.chunk(3)[rank])
        assert torch.equal(views[FC1], oracle.megatron_linear_fc1(full, 0, 1, 0).chunk(3)[rank])
        # what a rank's q/k/v/gate/up boxes hold is their part of the chunk (written via the views)
        for s in lay.shards(rank):
            if s.numel and "self_attn.q_proj.weight" in s.slot:
                start = s.buffer_offset
                flat = buffers[s.dtype][start : start + s.numel].view(s.sizes)
                assert torch.equal(flat, full[s.param][s.offsets[0] : s.offsets[0] + s.sizes[0]])


def test_fused_sharded_views():
    """FSDP2: q/k/v/gate/up have no views of their own (they are parts of chunks), the fused chunks
    do, an empty chunk is FSDP2's 0-row tensor; vLLM's fused views are refused. ZeRO-3: flat_views
    names the fused partitions."""
    d = dataclasses.replace(GQA, qkv_bias=False, mlp_bias=False, heads=2, kv_heads=1, head_dim=1, intermediate=2)
    lay = Layout(d.spec(), Topology(fsdp=6), qkv_order="megatron")  # linear_qkv: 4 rows over 6 ranks
    for rank in range(6):
        buffers = allocate_buffers(lay, rank)
        plain = shard_views(lay.at(rank), buffers)
        assert not any("_proj" in n and "o_proj" not in n and "down_proj" not in n for n in plain)
        views = fused_views(lay.at(rank), buffers, convention="megatron")
        assert views[QKV].shape == ((1, 4) if rank < 4 else (0, 4))
        assert views[FC1].shape == ((1, 4) if rank < 4 else (0, 4))
        with pytest.raises(ValueError, match="convention='megatron'"):
            fused_views(lay.at(rank), buffers)
    zero = Layout(GQA.spec(), Topology(fsdp=4, fsdp_split="zero3"), qkv_order="megatron")
    full = oracle.full_tensors(GQA, seed=6)
    for rank in range(4):
        flat = flat_views(zero.at(rank), allocate_buffers(zero, rank))
        want = oracle.local_tensors(
            GQA, full, 1, 1, 1, stages_of(GQA, zero.topology), rank, fsdp=4, split="zero3", fused=True
        )
        assert list(flat) == list(want)
        assert {n: v.shape for n, v in flat.items()} == {n: v.shape for n, v in want.items()}


def test_megatron_fsdp2_chunks_the_vocabulary_padded_to_a_multiple_of_tp():
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp
    (Megatron-LM's ``_vocab_size_with_padding``, megatron/training/tokenizer/tokenizer.py) even with
    a multiple of 1: V=17 at tp=4 is 20 rows, 5 per tp rank, tp rank 3 holding real rows 15, 16 and
    3 padding rows. Megatron-FSDP (qkv_order='megatron' with fsdp) chunks that padded [5, hidden]
    tensor: chunks of 3 rows, fsdp rank 0 holds rows 15, 16 (and a padding row), fsdp rank 1 only
    padding. The real rows were chunked instead (one row each). Every buffer against the oracle."""
    d = dataclasses.replace(GQA, vocab=17, kv_heads=4, intermediate=8)
    topo = Topology(fsdp=2, tp=4)
    check_layout_buffers(d, topo, 1, "megatron")
    lay = Layout(d.spec(), topo, qkv_order="megatron")
    held = {}
    for rank in (3, 7):  # tp rank 3, fsdp ranks 0 and 1
        [s] = [s for s in lay.shards(rank) if s.slot == EMBED] or [None]
        held[rank] = (s.offsets[0], s.sizes[0], s.local_shape[0]) if s is not None and s.sizes[0] else None
    assert held == {3: (15, 2, 3), 7: None}


MOE = oracle.MoeDecoder(256, 256, 2, 2, 2, 128, 64, experts=4, moe_inter=256, shared_inter=256, dense_layers=1)


@pytest.mark.parametrize("topology", ["fsdp=2", "fsdp=4", "fsdp=3,fsdp_split=zero3"])
def test_megatron_fsdp_shards_each_experts_linear_fc1_whole(topology):
    """Megatron's MoE layer holds ONE linear_fc1 [gate; up] per routed expert (SequentialMLP,
    megatron/core/transformer/moe/experts.py) and for the shared experts (SharedExpertMLP,
    .../moe/shared_experts.py). Under Megatron-FSDP / ZeRO-3 (qkv_order='megatron' with fsdp) the
    fsdp ranks cut those fused tensors, as they cut the dense linear_fc1; gate and up were sharded
    as two tensors (fsdp=2: rank 0 held gate[:128] and up[:128] instead of the whole gate).
    Moved from a tp=1 layout in process; every expert's fused chunk / partition against the oracle."""
    spec, full = MOE.spec(), oracle.moe_full_tensors(MOE, 2)
    src = Layout(spec, Topology())
    store = ShardStore(src.shards(0), allocate_buffers(src, 0))
    for slot, view in store.shard_tensors().items():
        view.copy_(full[slot])
    dst = Layout(spec, Topology.parse(topology), qkv_order="megatron")
    t = dst.topology
    bufs = {r: allocate_buffers(dst, r) for r in range(t.world_size)}
    move_in_process(
        src,
        dst,
        {0: store},
        {r + 1: ShardStore(dst.shards(r), bufs[r]) for r in range(t.world_size)},
        Placement.blocks(1 + t.world_size, 1),
        src_workers=[0],
        dst_workers=list(range(1, 1 + t.world_size)),
    )
    pre = "model.layers.1.mlp."
    fc1 = {f"{pre}experts.local_experts.{e}.linear_fc1.weight": f"{pre}experts.{e}." for e in range(MOE.experts)}
    fc1[f"{pre}shared_experts.linear_fc1.weight"] = f"{pre}shared_expert."
    for r in range(t.world_size):
        flat = flat_views(dst.at(r), bufs[r])
        views = None if t.fsdp_split == "zero3" else fused_views(dst.at(r), bufs[r], convention="megatron")
        for name, part in fc1.items():
            local = torch.cat([full[part + "gate_proj.weight"], full[part + "up_proj.weight"]])
            if t.fsdp_split == "zero3":
                assert torch.equal(flat[name], oracle.zero3_part(local, t.fsdp, r)), (r, name)
                continue
            want = oracle.fsdp_chunk(local, t.fsdp, r)
            assert torch.equal(views[name], want), (r, name)
            assert part + "gate_proj.weight" not in views  # a part of linear_fc1, no view of its own
