"""ZeRO-3 flat partitions (``Topology(fsdp_split="zero3")``, realloc/layout/zero3.py).

* :func:`realloc.layout.zero3.flat_range_boxes` against a brute force that enumerates elements;
* every rank's buffers of a zero3 layout against tests/oracle.py's ZeRO-3 rule (flatten the
  tp-local tensor, pad, cut into ``fsdp`` equal parts: DeepSpeed's ``ds_tensor``), padding included;
* plans between zero3 and other layouts, both directions, executed in process: destination buffers
  equal the oracle's bit for bit (source padding poisoned), each needed element written once,
  inter-node bytes at the lower bound (the checks of tests/test_planner_properties.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc.boxes import box_index
from realloc.layout import Layout, Topology
from realloc.layout.topology import FSDP_SPLIT_RULES
from realloc.layout.zero3 import flat_range_boxes, zero3_partition, zero3_pieces
from realloc.plan import Placement, plan_reallocation
from realloc.shards import TORCH_DTYPES, ShardStore, execute_in_process, zero_padding

try:
    from tests import oracle
    from tests.test_planner_properties import POISON, check_plan, placements, side_masks, stages_of, topologies
except ImportError:  # pytest put tests/ itself on sys.path
    import oracle
    from test_planner_properties import POISON, check_plan, placements, side_masks, stages_of, topologies


# -- flat_range_boxes ------------------------------------------------------------------------


def brute_elements(offsets, sizes, start, stop) -> list[tuple[int, ...]]:
    """Global indices of flat positions ``[start, stop)`` of the box, row-major (itertools.product)."""
    every = list(itertools.product(*(range(o, o + n) for o, n in zip(offsets, sizes))))
    return every[start:stop]


def box_elements(offsets, sizes) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(o, o + n) for o, n in zip(offsets, sizes))))


def is_box(elements: list[tuple[int, ...]]) -> bool:
    """Do these elements, in this order, form a box listed row-major?"""
    lo = [min(e[d] for e in elements) for d in range(len(elements[0]))]
    hi = [max(e[d] for e in elements) for d in range(len(elements[0]))]
    return elements == box_elements(lo, [high - low + 1 for low, high in zip(lo, hi)])


def fewest_runs(elements: list[tuple[int, ...]]) -> int:
    """Fewest consecutive runs, each a row-major box, that ``elements`` split into (dynamic programming)."""
    best = [0] + [math.inf] * len(elements)
    for j in range(1, len(elements) + 1):
        best[j] = min(best[i] + 1 for i in range(j) if is_box(elements[i:j]))
    return best[-1]


@st.composite
def flat_ranges(draw):
    ndim = draw(st.integers(1, 4))
    sizes = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    offsets = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    total = math.prod(sizes)
    start = draw(st.integers(0, total))
    return offsets, sizes, start, draw(st.integers(start, total))


@settings(max_examples=300, deadline=None)
@given(flat_ranges())
def test_flat_range_boxes_are_the_elements_in_order_as_fewest_boxes(case):
    offsets, sizes, start, stop = case
    boxes = flat_range_boxes(offsets, sizes, start, stop)
    listed = [e for o, s in boxes for e in box_elements(o, s)]
    assert listed == brute_elements(offsets, sizes, start, stop)
    assert all(min(s) >= 1 for _, s in boxes)
    assert len(boxes) <= 2 * len(sizes) - 1
    if start in (0, math.prod(sizes)) or stop in (0, math.prod(sizes)):
        assert len(boxes) <= len(sizes)
    if listed:
        assert len(boxes) == fewest_runs(listed)
    else:
        assert boxes == []


@pytest.mark.parametrize("bad", [(-1, 2), (3, 2), (0, 13)])
def test_flat_range_boxes_refuses_ranges_outside_the_box(bad):
    with pytest.raises(ValueError, match="flat range"):
        flat_range_boxes((0, 0), (3, 4), *bad)


@settings(max_examples=200, deadline=None)
@given(flat_ranges(), st.integers(1, 9), st.data())
def test_zero3_pieces_are_deepspeeds_partition(case, world, data):
    offsets, sizes, _, _ = case
    rank = data.draw(st.integers(0, world - 1))
    pieces = zero3_pieces(offsets, sizes, world, rank)
    numel = math.prod(sizes)
    size = -(-numel // world)
    assert zero3_partition(numel, world, rank)[2] == size
    # the local flat tensor: every piece's local tensor (box at its origin, the rest padding), in order
    index = np.arange(numel).reshape(sizes)
    flat = []
    for (o, s), local in pieces:
        assert len(local) == len(s) and all(a <= b for a, b in zip(s, local))
        part = np.full(local, -1)
        part[tuple(slice(0, n) for n in s)] = index[tuple(slice(a - b, a - b + n) for a, b, n in zip(o, offsets, s))]
        flat += part.reshape(-1).tolist()
    padded = np.concatenate([index.reshape(-1), np.full(world * size - numel, -1)])
    assert flat == padded[rank * size : (rank + 1) * size].tolist()
    assert len(pieces) <= max(1, 2 * len(sizes) - 1)
    assert sum(1 for (_, s), local in pieces if tuple(s) != tuple(local)) <= 1, "padding lives in one piece"


# -- layouts against the oracle ----------------------------------------------------------------


def oracle_buffers(
    d: oracle.Decoder, topo: Topology, rank: int, full, pad_value=0, pad=1, qkv="hf"
) -> dict[str, torch.Tensor]:
    """The rank's flat buffer of each dtype by the oracle: its local tensors (ZeRO-3 partitions for a
    zero3 topology), flattened, one after the other in forward slot order (``pad``: the vocabulary
    padding multiple, Megatron's rule; ``qkv="megatron"``: Megatron's model, fused linear_qkv and
    linear_fc1)."""
    local = oracle.local_tensors(
        d,
        full,
        topo.dp,
        topo.tp,
        topo.pp,
        stages_of(d, topo),
        rank,
        pad,
        pad_value=pad_value,
        fsdp=topo.fsdp,
        split=topo.fsdp_split,
        fused=qkv == "megatron",
    )
    dtypes = {slot: p.dtype for slot, p in oracle.stage_slots(d, stages_of(d, topo), topo.coords4(rank)[3])}
    for slot in local:
        if slot not in dtypes:  # linear_qkv / linear_fc1: the dtype of their parts
            layer, part = slot.split(".")[2], "self_attn.q_proj" if "linear_qkv" in slot else "mlp.gate_proj"
            dtypes[slot] = dtypes[f"model.layers.{layer}.{part}.{slot.rsplit('.', 1)[1]}"]
    out: dict[str, list[torch.Tensor]] = {}
    for slot, t in local.items():
        out.setdefault(dtypes[slot], []).append(t.reshape(-1))
    return {dt: torch.cat(parts) for dt, parts in out.items()}


@st.composite
def zero3_topologies(draw, d: oracle.Decoder, world: int):
    dp, fsdp, tp, pp = draw(st.sampled_from(oracle.factorisations4(d, world)))
    return Topology(
        dp,
        tp,
        pp,
        draw(oracle.layer_splits(st, d.layers, pp)),
        draw(oracle.pp_rules(st, d.layers, pp)),
        fsdp=fsdp,
        fsdp_split="zero3",
    )


def check_layout_buffers(d: oracle.Decoder, topo: Topology, pad: int = 1, qkv: str = "hf") -> None:
    lay = Layout(d.spec(), topo, pad, qkv_order=qkv)
    full = oracle.index_tensors(d)
    for rank in range(topo.world_size):
        want = oracle_buffers(d, topo, rank, full, pad_value=-1, pad=pad, qkv=qkv)
        assert lay.buffer_numels(rank) == {dt: t.numel() for dt, t in want.items()}
        got = {dt: torch.full((n,), -1, dtype=torch.int64) for dt, n in lay.buffer_numels(rank).items()}
        store = ShardStore(lay.shards(rank), got)
        for s in lay.shards(rank):
            if s.numel:
                store.write(s.param, s.offsets, s.sizes, full[s.param][box_index(s.offsets, s.sizes)])
        for dt in want:
            assert torch.equal(got[dt], want[dt]), f"{topo} rank {rank} {dt} buffer differs from ZeRO-3's partitions"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_zero3_layouts_hold_deepspeeds_partitions(data):
    d = data.draw(oracle.decoders(st))
    world = data.draw(st.sampled_from([12, 8, 7, 6, 5, 4, 3, 2]))
    check_layout_buffers(d, data.draw(zero3_topologies(d, world)))


# -- plans to and from zero3 layouts -------------------------------------------------------------


def check_zero3_reallocation(
    d: oracle.Decoder,
    src: Topology,
    dst: Topology,
    placement: Placement,
    bucket_bytes: int = 4096,
    src_workers=None,
    dst_workers=None,
    src_pad: int = 1,
    dst_pad: int = 1,
    src_qkv: str = "hf",
    dst_qkv: str = "hf",
):
    spec = d.spec()
    src_workers = src_workers or list(range(src.world_size))
    dst_workers = dst_workers or list(range(dst.world_size))
    kwargs = (
        {}
        if src_workers == list(range(src.world_size)) and dst_workers == list(range(dst.world_size))
        else dict(src_workers=src_workers, dst_workers=dst_workers)
    )
    src_layout = Layout(spec, src, src_pad, qkv_order=src_qkv)
    dst_layout = Layout(spec, dst, dst_pad, qkv_order=dst_qkv)
    plan = plan_reallocation(spec, src_layout, dst_layout, placement, bucket_bytes=bucket_bytes, **kwargs)
    full = oracle.full_tensors(d, seed=11)
    index = oracle.index_tensors(d)
    src_stores, dst_stores = {}, {}
    for rank, worker in enumerate(src_workers):
        values = oracle_buffers(d, src, rank, full, pad=src_pad, qkv=src_qkv)
        idx = oracle_buffers(d, src, rank, index, pad_value=-1, pad=src_pad, qkv=src_qkv)
        buffers = {dt: torch.where(idx[dt] < 0, torch.tensor(POISON, dtype=v.dtype), v) for dt, v in values.items()}
        src_stores[worker] = ShardStore(src_layout.shards(rank), buffers)
    for rank, worker in enumerate(dst_workers):
        buffers = {
            dt: torch.full((n,), POISON, dtype=TORCH_DTYPES[dt]) for dt, n in dst_layout.buffer_numels(rank).items()
        }
        dst_stores[worker] = ShardStore(dst_layout.shards(rank), buffers)
        zero_padding(dst_stores[worker])  # what a worker does to a reused (not zeroed) buffer
    moved = execute_in_process(plan, src_stores, dst_stores)
    assert moved["bytes_moved"] == plan.stats["bytes_total"]
    for rank, worker in enumerate(dst_workers):
        want = oracle_buffers(d, dst, rank, full, pad=dst_pad, qkv=dst_qkv)
        got = dst_stores[worker].buffers
        assert sorted(got) == sorted(want)
        for dt in want:
            assert torch.equal(got[dt], want[dt]), f"{src} -> {dst}: rank {rank} {dt} buffer differs from the oracle"
    shapes = {p.name: p.shape for p in oracle.params(d)}
    dtypes = {p.name: p.dtype for p in oracle.params(d)}
    hold = side_masks(d, src, src_workers, src_pad, src_qkv == "megatron")
    need = side_masks(d, dst, dst_workers, dst_pad, dst_qkv == "megatron")
    check_plan(plan, shapes, dtypes, placement, hold, need)
    return plan


@st.composite
def zero3_reallocations(draw, disjoint: bool = False):
    """ZeRO-3 to or from any layout (plain, fsdp2, zero3 of another shape) on the same workers, or
    (``disjoint``) between disjoint worker sets of other sizes; uneven and empty partitions come
    from the small model dims over fsdp up to 12. Returns :func:`check_zero3_reallocation`'s args."""
    d = draw(oracle.decoders(st))
    if disjoint:
        worlds = (draw(st.sampled_from([6, 4, 3, 2])), draw(st.sampled_from([5, 4, 2, 1])))
    else:
        worlds = (draw(st.sampled_from([12, 8, 6, 5, 7, 4, 3, 2])),) * 2
    flat = draw(zero3_topologies(d, worlds[0]))
    kind = draw(st.sampled_from(["plain", "fsdp2", "zero3"] if oracle.factorisations4(d, worlds[1]) else ["plain"]))
    if kind == "plain":
        other = draw(topologies(d, worlds[1]))
    else:
        other = dataclasses.replace(draw(zero3_topologies(d, worlds[1])), fsdp_split=kind)
    backwards = draw(st.booleans())
    src, dst = (other, flat) if backwards else (flat, other)
    workers = list(range(sum(worlds))) if disjoint else list(range(worlds[0]))
    if disjoint:
        workers = draw(st.permutations(workers))
    ws = worlds[1] if backwards else worlds[0]
    src_workers, dst_workers = (workers[:ws], workers[ws:]) if disjoint else (workers, workers)
    return d, src, dst, draw(placements(len(workers))), draw(st.integers(1024, 4096)), src_workers, dst_workers


@settings(max_examples=50, deadline=None)
@given(zero3_reallocations())
def test_random_zero3_reallocations(case):
    check_zero3_reallocation(*case)


@settings(max_examples=12, deadline=None)
@given(zero3_reallocations(disjoint=True))
def test_random_zero3_copies_between_disjoint_worker_sets(case):
    assert not check_zero3_reallocation(*case).local_copies


ZERO8 = oracle.Decoder(
    hidden=6,
    intermediate=24,
    layers=4,
    heads=8,
    kv_heads=2,
    head_dim=2,
    vocab=19,
    tied=True,
    qk_norm=True,
    dtype="bfloat16",
    norm_dtype="float32",
)


@pytest.mark.parametrize(
    "src, dst, placement",
    [
        (Topology(fsdp=8, fsdp_split="zero3"), Topology(dp=2, tp=4), Placement.blocks(8, 4)),
        (Topology(dp=2, tp=4), Topology(fsdp=8, fsdp_split="zero3"), Placement.blocks(8, 4)),
        (Topology(fsdp=8, fsdp_split="zero3"), Topology(fsdp=8), Placement.blocks(8, 2)),
        (
            Topology(dp=2, fsdp=3, tp=2, fsdp_split="zero3"),
            Topology(tp=4, pp=3, layer_split=(1, 2, 1)),
            Placement.blocks(12, 4),
        ),
        (Topology(fsdp=7, fsdp_split="zero3"), Topology(fsdp=7, fsdp_split="zero3"), Placement.blocks(7, 3)),
        (
            Topology(fsdp=5, pp=2, fsdp_split="zero3"),
            Topology(fsdp=2, dp=5, fsdp_split="zero3"),
            Placement.blocks(10, 4),
        ),
    ],
    ids=[
        "zero3x8-dp2tp4",
        "dp2tp4-zero3x8",
        "zero3x8-fsdp2x8",
        "hsdp-zero3-tp2-to-tp4pp3",
        "zero3x7-same",
        "zero3x5pp2-zero3x2dp5",
    ],
)
def test_chosen_zero3_reallocations(src, dst, placement):
    check_layout_buffers(ZERO8, src)
    plan = check_zero3_reallocation(ZERO8, src, dst, placement)
    if src == dst:
        assert plan.stats["bytes_total"] == 0


def test_padding_only_ranks_hold_a_partition_of_zeros():
    """q_norm has head_dim=2 elements: over fsdp=8, ranks 0 and 1 hold one each, ranks 2..7 a
    partition of padding only (DeepSpeed's ds_tensor there has partition_size elements too)."""
    lay = Layout(ZERO8.spec(), Topology(fsdp=8, fsdp_split="zero3"))
    name = "model.layers.0.self_attn.q_norm.weight"
    for rank in range(8):
        [s] = [s for s in lay.shards(rank) if s.slot == name]
        assert s.local_shape == (1,)
        assert s.sizes == ((1,) if rank < 2 else (0,)) and s.numel == (1 if rank < 2 else 0)


# -- the option itself -----------------------------------------------------------------------------


def test_fsdp_split_option_parses_prints_and_compares():
    assert FSDP_SPLIT_RULES[0] == "fsdp2"
    t = Topology.parse("fsdp=8,fsdp_split=zero3")
    assert (t.fsdp, t.fsdp_split) == (8, "zero3")
    assert str(t) == "dp=1,fsdp=8,tp=1,pp=1,fsdp_split=zero3" and Topology.parse(str(t)) == t
    assert str(Topology(fsdp=8)) == "dp=1,fsdp=8,tp=1,pp=1"
    assert Topology(fsdp=8) != t and hash(Topology(fsdp=8, fsdp_split="fsdp2")) == hash(Topology(fsdp=8))
    one = Topology(dp=2, fsdp_split="zero3")  # one fsdp rank: both rules are the same layout
    assert one == Topology(dp=2) and str(one) == "dp=2,tp=1,pp=1"
    spec = ZERO8.spec()
    assert Layout(spec, t) != Layout(spec, Topology(fsdp=8))
    assert Layout(spec, t).key != Layout(spec, Topology(fsdp=8)).key
    assert "zero3" in str(Layout(spec, t))
    for bad in ("zero2", "", 3, None):
        with pytest.raises(ValueError, match="fsdp_split.*fsdp2, zero3"):
            Topology(fsdp=2, fsdp_split=bad)
    with pytest.raises(ValueError, match="fsdp_split"):
        Topology.parse("fsdp=2,fsdp_split=deepspeed")
    assert Layout(spec, t, 2) != Layout(spec, t)  # vocabulary padding: tests/test_sharded_padding.py


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from(["vllm", "megatron", "balanced"]),
    st.sampled_from(FSDP_SPLIT_RULES),
)
def test_topology_strings_round_trip_with_fsdp_split(dp, fsdp, tp, pp, pp_split, fsdp_split):
    t = Topology(dp, tp, pp, None, pp_split, fsdp, fsdp_split)
    assert Topology.parse(str(t)) == t and hash(Topology.parse(str(t))) == hash(t)
    assert t.fsdp_split == (fsdp_split if fsdp > 1 else "fsdp2")
    assert ("fsdp_split=zero3" in str(t)) == (fsdp > 1 and fsdp_split == "zero3")


def test_zero3_manifest_records_the_rule():
    from realloc.ckpt.files import build_rank_file
    from realloc.ckpt.manifest import CheckpointId, Manifest
    from realloc.shards import allocate_buffers

    lay = Layout(ZERO8.spec(), Topology(dp=2, fsdp=4, pp=2, fsdp_split="zero3"))
    _, man = build_rank_file(CheckpointId("r", 1, 3), lay, allocate_buffers(lay, 3), "n0")
    back = Manifest.from_json(man.to_json())
    assert back.topology.fsdp_split == "zero3" and back == man
    assert back.check_layout(lay.spec) == lay
    plain = Layout(ZERO8.spec(), Topology(dp=2, fsdp=4, pp=2))
    _, man2 = build_rank_file(CheckpointId("r", 1, 3), plain, allocate_buffers(plain, 3), "n0")
    assert "fsdp_split" not in man2.to_json()["topology"]


# -- binding ---------------------------------------------------------------------------------------


def test_binding_a_zero3_layout_points_to_the_flat_partitions():
    from realloc.shards import allocate_buffers, flat_views, fused_views, shard_views

    topo = Topology(dp=2, fsdp=3, tp=2, fsdp_split="zero3")
    lay = Layout(ZERO8.spec(), topo)
    for rank in (0, 5, 11):
        buffers = allocate_buffers(lay, rank)
        for views in (shard_views, fused_views):
            with pytest.raises(ValueError, match="flat_views"):
                views(lay.at(rank), buffers)
        want = oracle.local_tensors(
            ZERO8,
            oracle.full_tensors(ZERO8),
            topo.dp,
            topo.tp,
            topo.pp,
            stages_of(ZERO8, topo),
            rank,
            fsdp=topo.fsdp,
            split="zero3",
        )
        flat = flat_views(lay.at(rank), buffers)
        assert list(flat) == list(want), "every slot, in forward order"
        for slot, value in want.items():
            flat[slot].copy_(value)
        for _dt, buf in buffers.items():  # the views are the buffers: concatenated, they are all of it
            assert torch.equal(buf, torch.cat([want[s].reshape(-1) for s in want if want[s].dtype == buf.dtype]))


def test_fsdp2_empty_chunks_bind_as_empty_tensors():
    """q_norm/k_norm (2 rows) over fsdp=8: ranks 2..7 hold an empty chunk. FSDP2's local tensor
    there has 0 rows and the other dims of the tp shard (torch's _get_dim_chunked_size)."""
    from torch import nn

    from realloc.shards import allocate_buffers, bind_module, shard_views

    d = oracle.Decoder(
        hidden=6,
        intermediate=24,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=2,
        vocab=7,
        qk_norm=True,
        dtype="bfloat16",
        norm_dtype="float32",
    )
    topo = Topology(fsdp=8)
    lay = Layout(d.spec(), topo)
    full = oracle.full_tensors(d)
    for rank in range(8):
        views = shard_views(lay.at(rank), allocate_buffers(lay, rank))
        slots = [slot for _, slot in lay.stage_slots(0)]
        assert list(views) == slots, "every slot of the stage, in forward order"
        for slot in slots:
            param = oracle.storage_of(d, slot)
            local = full[param]
            chunks = list(torch.chunk(local, 8, dim=0))
            chunks += [chunks[0].new_empty(0)] * (8 - len(chunks))  # FSDP2's _chunk_with_empty
            chunk = chunks[rank]
            shape = chunk.shape if chunk.numel() else (0,) + tuple(local.shape[1:])
            assert tuple(views[slot].shape) == tuple(shape) and views[slot].dtype == full[param].dtype, (rank, slot)
        module = nn.Module()
        names = {}
        for i, (slot, view) in enumerate(views.items()):
            module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(view.shape, dtype=view.dtype)))
            names[f"p{i}"] = slot
        report = bind_module(module, views, name_map=names, strict=True)
        assert len(report.bound) == len(slots) and not report.unbound
    assert any(v.numel() == 0 for v in shard_views(lay.at(7), allocate_buffers(lay, 7)).values())


def test_realloc_plan_verify_from_and_to_zero3(capsys):
    from realloc_tools.offline.plan import main

    for src, dst in (("fsdp=4,fsdp_split=zero3", "tp=2,dp=2"), ("tp=2,dp=2", "fsdp=4,fsdp_split=zero3")):
        assert main(["plan", "--verify", "--model", "tiny", "--src", src, "--dst", dst, "--gpus-per-node", "2"]) == 0
        out = capsys.readouterr().out
        assert "verified                yes" in out and "fsdp_split=zero3" in out


@pytest.mark.parametrize("name", ["hpz", "zero3_hpz", "HPZ", "zero++"])
def test_hpz_is_refused_with_what_it_pads_and_what_is_allowed(name):
    """ZeRO++ hpZ's secondary partition pads numel to the whole world W and gives ceil(n/W)*W/g
    elements per rank of a group of g (DeepSpeed's Init._partition_param_sec): not dp x fsdp."""
    for make in (lambda: Topology(fsdp=8, fsdp_split=name), lambda: Topology.parse(f"fsdp=8,fsdp_split={name}")):
        with pytest.raises(
            ValueError, match=r"hpZ.*fsdp=W,fsdp_split=zero3.*multiple of W.*Allowed fsdp_split: fsdp2, zero3"
        ):
            make()


def test_mics_is_refused():
    with pytest.raises(ValueError, match="MiCS was removed.*allowed fsdp_split: fsdp2, zero3"):
        Topology.parse("dp=2,fsdp=4,fsdp_split=mics")
