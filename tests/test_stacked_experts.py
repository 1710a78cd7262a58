"""transformers 5's stacked experts (``Layout(expert_order="hf_stacked")``) against the oracle.

Every rank's ``gate_up_proj`` / ``down_proj`` (and every other tensor) replicated, tensor
parallel, FSDP2- and ZeRO-3-sharded is checked against tests/oracle.py's independent reading of
transformers 5 (:func:`oracle.stacked_local_tensors`), never against the layout's bookkeeping;
plans between stacked, per-expert (``"hf"``) and vLLM (``"vllm"``) formats across layout kinds
run bit-exact with poisoned source padding, write each needed element once, send only what
senders hold and move inter-node bytes at the lower bound (tests/test_planner_properties.py's
checks, on masks from the oracle). tests/test_stacked_experts_engine.py checks the same
layouts against transformers' own modules under torch's ``fully_shard``.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import oracle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_experts import (
    TINY,
    check_packed_buffers,
    check_piece_table,
    ep_topologies,
    manifest_of,
    oracle_tensors,
    stages_of,
)
from test_planner_properties import POISON, check_plan, placements

from realloc import Layout, Placement, Topology
from realloc.ckpt.manifest import Manifest
from realloc.layout.stacked import stacked_pieces
from realloc.plan import plan_reallocation
from realloc.shards import ShardStore, allocate_buffers, execute_in_process, fused_views
from realloc.shards.fused import FUSED_PARTS
from realloc.shards.views import flat_views

FUSED = tuple(FUSED_PARTS)


def stacked_oracle(m, layout: Layout, full, rank: int, pad_value=0) -> dict[str, torch.Tensor]:
    t = layout.topology
    return oracle.stacked_local_tensors(
        m, full, t.dp, t.fsdp, t.tp, t.pp, stages_of(m, t), rank, t.fsdp_split, layout.vocab_pad_multiple, pad_value
    )


def engine_views(layout: Layout, rank: int, buffers) -> dict[str, torch.Tensor]:
    """What a worker binds to a transformers 5 module: the stacked experts and every other tensor
    (ZeRO-3: flat partitions); per-expert slots and vLLM's dense fused views left out."""
    at = layout.at(rank)
    if layout.topology.fsdp_split == "zero3":
        views = flat_views(at, buffers)
    else:
        views = fused_views(at, buffers, padding=True)
    spec = layout.spec.by_name
    return {k: v for k, v in views.items() if not k.endswith(FUSED) and (k not in spec or spec[k].expert is None)}


def filled(layout: Layout, rank: int, full, poison: bool) -> ShardStore:
    """A store of ``rank`` written from the global tensors through its boxes (padding poisoned)."""
    store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
    if poison:
        for buffer in store.buffers.values():
            buffer.fill_(POISON)
    for s in layout.shards(rank):
        box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
        store.write(s.param, s.offsets, s.sizes, full[s.param][box])
    return store


def check_rank(m, layout: Layout, rank: int, buffers, full) -> None:
    """The engine views of ``rank`` (stacked experts) are the oracle's, bit for bit."""
    want = format_oracle(m, layout, full, rank)
    got = engine_views(layout, rank, buffers)
    assert sorted(got) == sorted(want), f"rank {rank} of {layout}"
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, (rank, name, got[name].shape, tensor.shape)
        assert torch.equal(got[name], tensor), f"rank {rank} {name} differs from the engine's ({layout})"


# -- strategies ---------------------------------------------------------------------------------


@st.composite
def stacked_topologies(draw, m, world: int):
    dp, fsdp, tp, pp = draw(st.sampled_from(oracle.fsdp_factorisations(m, world)))
    split = draw(st.sampled_from(["fsdp2", "zero3"]))
    return Topology(dp, tp, pp, draw(oracle.layer_splits(st, m.layers, pp)), fsdp=fsdp, fsdp_split=split)


@st.composite
def stacked_layouts(draw):
    m = draw(oracle.moe_decoders(st))
    topo = draw(stacked_topologies(m, draw(st.sampled_from([8, 6, 4, 2, 1]))))
    pad = 1 if topo.fsdp > 1 else draw(st.integers(1, 3))
    return m, Layout(m.spec(), topo, pad, expert_order="hf_stacked")


@st.composite
def any_format_layout(draw, m, world: int):
    """A stacked layout (any kind), or a per-expert / vLLM one (ep, etp)."""
    kind = draw(st.sampled_from(["hf_stacked", "hf_stacked", "hf", "vllm"]))
    if kind == "hf_stacked":
        return Layout(m.spec(), draw(stacked_topologies(m, world)), expert_order=kind)
    return Layout(m.spec(), draw(ep_topologies(m, world)), expert_order=kind)


# -- every rank against transformers' reading -----------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(stacked_layouts())
def test_every_ranks_tensors_are_transformers(case):
    m, layout = case
    full = oracle.moe_full_tensors(m, seed=3)
    for rank in range(layout.topology.world_size):
        store = filled(layout, rank, full, poison=False)
        check_rank(m, layout, rank, store.buffers, full)
    check_packed_buffers(layout)


@settings(max_examples=40, deadline=None)
@given(stacked_layouts(), st.data())
def test_piece_table_is_the_layouts_groups(case, data):
    _, layout = case
    check_piece_table(layout, list(data.draw(st.permutations(list(range(layout.topology.world_size))))))


# -- plans between formats ------------------------------------------------------------------------


def format_oracle(m, layout: Layout, full, rank: int, pad_value=0) -> dict[str, torch.Tensor]:
    """The oracle's tensors of ``rank`` in ``layout``'s engine format: transformers' stacked
    experts, torchtitan's EP + FSDP (per expert), or Megatron's / vLLM's expert mesh."""
    t = layout.topology
    if layout.expert_order == "hf_stacked":
        return stacked_oracle(m, layout, full, rank, pad_value)
    if layout.expert_order == "torchtitan":
        sizes = (t.dp, t.fsdp, t.tp, t.pp, t.ep)
        return oracle.torchtitan_module_tensors(m, full, sizes, stages_of(m, t), rank)
    if t.torchtitan_experts:
        return oracle.torchtitan_local_tensors(m, full, (t.dp, t.fsdp, t.tp, t.pp, t.ep), stages_of(m, t), rank)
    return oracle_tensors(m, full, t, rank, layout.vocab_pad_multiple, pad_value)


def dst_tensors(m, layout: Layout, rank: int, store: ShardStore) -> tuple[dict, dict]:
    """(got, want) of a destination rank: engine views vs the oracle in its format."""
    full = oracle.moe_full_tensors(m, seed=5)
    stacks = layout.expert_order in ("hf_stacked", "torchtitan")
    got = engine_views(layout, rank, store.buffers) if stacks else store.shard_tensors()
    return got, format_oracle(m, layout, full, rank)


def held_masks(m, layout: Layout) -> dict:
    """Rank -> {param: bool mask of the elements it holds}, from the oracle's reading of ``layout``'s
    engine applied to globally numbered index tensors (padding -1): independent of the layout."""
    plist = oracle.moe_params(m)
    bases = np.cumsum([0] + [p.numel for p in plist])
    index = {p.name: torch.arange(p.numel, dtype=torch.int64).reshape(p.shape) + int(b) for p, b in zip(plist, bases)}
    out = {}
    for rank in range(layout.topology.world_size):
        tensors = format_oracle(m, layout, index, rank, pad_value=-1)
        flat = torch.cat([t.reshape(-1) for t in tensors.values()] or [torch.zeros(0, dtype=torch.int64)]).numpy()
        flat = flat[flat >= 0]
        owner = np.searchsorted(bases, flat, side="right") - 1
        masks = {}
        for k in np.unique(owner):
            mask = np.zeros(plist[k].numel, dtype=bool)
            mask[flat[owner == k] - bases[k]] = True
            masks[plist[k].name] = mask.reshape(plist[k].shape)
        out[rank] = masks
    return out


def check_formats(m, src: Layout, dst: Layout, placement: Placement, bucket_bytes: int = 4096) -> None:
    plan = plan_reallocation(src.spec, src, dst, placement, bucket_bytes=bucket_bytes)
    full = oracle.moe_full_tensors(m, seed=5)
    sources = {r: filled(src, r, full, poison=True) for r in range(src.topology.world_size)}
    targets = {r: ShardStore(dst.shards(r), allocate_buffers(dst, r)) for r in range(dst.topology.world_size)}
    moved = execute_in_process(plan, sources, targets)
    assert moved["bytes_moved"] == plan.stats["bytes_total"]
    for rank, store in targets.items():
        got, want = dst_tensors(m, dst, rank, store)
        assert sorted(got) == sorted(want), f"dst rank {rank} of {dst}"
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"dst rank {rank} {name} ({src} -> {dst})"
    plist = oracle.moe_params(m)
    shapes, dtypes = {p.name: p.shape for p in plist}, {p.name: p.dtype for p in plist}
    check_plan(plan, shapes, dtypes, placement, held_masks(m, src), held_masks(m, dst))


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_random_plans_between_expert_formats(data):
    m = data.draw(oracle.moe_decoders(st))
    world = data.draw(st.sampled_from([8, 6, 4, 2]))
    src = data.draw(any_format_layout(m, world))
    dst = data.draw(any_format_layout(m, world))
    if "hf_stacked" not in (src.expert_order, dst.expert_order):
        dst = Layout(m.spec(), data.draw(stacked_topologies(m, world)), expert_order="hf_stacked")
    check_formats(m, src, dst, data.draw(placements(world)), data.draw(st.integers(1024, 4096)))


@pytest.mark.parametrize(
    "src, dst",
    [
        (("dp=1,fsdp=4", "hf_stacked"), ("dp=2,tp=2,ep=4,etp=1", "vllm")),  # FSDP2 trainer -> vLLM ep
        (("dp=1,fsdp=4,fsdp_split=zero3,tp=2", "hf_stacked"), ("dp=4,tp=2", "hf")),  # ZeRO-3 -> per-expert tp
        (("dp=2,fsdp=2,tp=2", "hf_stacked"), ("dp=1,fsdp=8,fsdp_split=zero3", "hf_stacked")),  # HSDP -> ZeRO-3
        (("dp=8,ep=4,etp=2", "vllm"), ("dp=1,fsdp=8", "hf_stacked")),  # 6 experts over 8: two empty chunks
        (("tp=2,pp=2", "hf_stacked"), ("dp=1,fsdp=2,pp=2,fsdp_split=zero3", "hf_stacked")),
        (("dp=1,fsdp=5,fsdp_split=zero3", "hf_stacked"), ("dp=5", "hf_stacked")),  # partitions cross experts
    ],
)
def test_chosen_plans_between_expert_formats(src, dst):
    a = Layout(TINY.spec(), Topology.parse(src[0]), expert_order=src[1])
    b = Layout(TINY.spec(), Topology.parse(dst[0]), expert_order=dst[1])
    assert a.topology.world_size == b.topology.world_size
    check_formats(TINY, a, b, Placement.blocks(a.topology.world_size, 2))


# -- the geometry, worked examples -----------------------------------------------------------------


def test_fsdp2_chunks_whole_experts():
    """6 experts over fsdp=4: torch.chunk gives 2, 2, 2 and an empty chunk (FSDP2's (0, rows, cols))."""
    layout = Layout(TINY.spec(), Topology.parse("dp=1,fsdp=4"), expert_order="hf_stacked")
    for rank, experts in enumerate([[0, 1], [2, 3], [4, 5], []]):
        held = sorted(
            {s.param.split(".experts.")[1].split(".")[0] for s in layout.shards(rank) if ".experts." in s.param}
        )
        assert held == [str(e) for e in experts]
        views = fused_views(layout.at(rank), allocate_buffers(layout, rank))
        assert views["model.layers.1.mlp.experts.gate_up_proj"].shape == (len(experts), 16, 8)
        assert views["model.layers.1.mlp.experts.down_proj"].shape == (len(experts), 8, 8)
        assert not any("experts.0.gate_proj" in k for k in views) or rank == 0


def test_zero3_partitions_cross_experts():
    """gate_up_proj of 6 experts x 16 x 8 = 768 elements over 5 ranks: 154 each, the last with 2
    of padding; rank 1's partition starts in expert 1's gate rows (154 = 128 + 26)."""
    layout = Layout(TINY.spec(), Topology.parse("dp=1,fsdp=5,fsdp_split=zero3"), expert_order="hf_stacked")
    entries = [e for e in layout._tp_boxes(0, 0) if e[0].layer == 1 and e[0].expert is not None and "down" not in e[1]]
    pieces = stacked_pieces(entries, 5, 1, zero3=True)
    held = [(entries[i][1].split("experts.")[1], p) for i, ps in pieces.items() for p in ps]
    assert held[0] == ("1.gate_proj.weight", (((3, 2), (1, 6)), (1, 6)))  # expert 1 gate, from element 26
    assert sum(np.prod(local) for _, (_, local) in held) == 154
    last = flat_views(layout.at(4), allocate_buffers(layout, 4))
    assert last["model.layers.1.mlp.experts.gate_up_proj"].shape == (154,)
    assert last["model.layers.1.mlp.experts.down_proj"].shape == (77,)


def test_mixtral_stacked_views_use_transformers_names():
    from realloc.spec import spec_from_hf_config

    mixtral = spec_from_hf_config(
        {
            "model_type": "mixtral",
            "hidden_size": 8,
            "intermediate_size": 4,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 16,
            "num_local_experts": 3,
        }
    )
    assert any(".block_sparse_moe.experts.2.w3." in p.name for p in mixtral.params)  # checkpoint names
    for s, experts in ((TINY.spec(), 6), (mixtral, 3)):
        layout = Layout(s, Topology(tp=2), expert_order="hf_stacked")
        views = fused_views(layout.at(1), allocate_buffers(layout, 1))
        stacked = sorted(k for k in views if k.endswith(("experts.gate_up_proj", "experts.down_proj")))
        layers = sorted({p.layer for p in s.params if p.expert is not None})
        assert stacked == sorted(
            f"model.layers.{n}.mlp.experts.{k}" for n in layers for k in ("down_proj", "gate_up_proj")
        )
        assert views[stacked[0]].shape[0] == experts


# -- values and refusals ----------------------------------------------------------------------------


def test_layout_value_keeps_the_stacked_order():
    spec = TINY.spec()
    a = Layout(spec, Topology.parse("dp=2,fsdp=2"), expert_order="hf_stacked")
    b = Layout(spec, Topology.parse("dp=2,fsdp=2"))
    assert a != b and "experts hf_stacked" in str(a) and a.options["expert_order"] == "hf_stacked"
    assert pickle.loads(pickle.dumps(a)) == a and a.with_topology(Topology(tp=2)).expert_order == "hf_stacked"
    manifest = manifest_of(a)
    data = json.loads(json.dumps(manifest.to_json()))
    assert data["expert_order"] == "hf_stacked" and Manifest.from_json(data).layout(spec) == a


def test_refusals_name_what_is_allowed():
    dense = oracle.Decoder(hidden=8, intermediate=16, layers=2, heads=4, kv_heads=2, head_dim=2, vocab=10)
    with pytest.raises(ValueError, match="no routed experts to stack"):
        Layout(dense.spec(), Topology(fsdp=2), expert_order="hf_stacked")
    with pytest.raises(ValueError, match="not expert parallel.*expert_order='vllm'"):
        Layout(TINY.spec(), Topology.parse("dp=4,ep=4"), expert_order="hf_stacked")
    with pytest.raises(ValueError, match="not expert parallel"):
        Layout(TINY.spec(), Topology.parse("dp=2,tp=2,ep=1,etp=1"), expert_order="hf_stacked")
    with pytest.raises(ValueError, match="no engine holds Megatron's linear_qkv"):
        Layout(TINY.spec(), Topology(tp=2), qkv_order="megatron", expert_order="hf_stacked")
    with pytest.raises(ValueError, match="expert_order must be one of 'hf', 'vllm', 'hf_stacked'"):
        Layout(TINY.spec(), Topology(tp=2), expert_order="stacked")
    # Megatron's padded vocabulary under FSDP2 is a layout since issue 25 (tests/test_sharded_padding.py)
    assert Layout(TINY.spec(), Topology(fsdp=2), 64, expert_order="hf_stacked").sharded_padding


def test_fsdp2_views_of_a_tp_rank_without_vocabulary_rows():
    """5 vocabulary rows over tp=4 (torch.chunk: 2, 2, 1, 0): tp rank 3 holds none, so no fsdp rank
    does and FSDP2's local tensor is (0, hidden); shard_views gave a KeyError there."""
    from realloc.shards import shard_views

    d = oracle.Decoder(hidden=4, intermediate=8, layers=2, heads=4, kv_heads=2, head_dim=1, vocab=5)
    layout = Layout(d.spec(), Topology(fsdp=2, tp=4))
    for rank in (3, 7):
        views = shard_views(layout.at(rank), allocate_buffers(layout, rank))
        assert views["model.embed_tokens.weight"].shape == (0, 4)
