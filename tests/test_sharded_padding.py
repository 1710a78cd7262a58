"""Vocabulary padding under sharded data parallelism (FSDP2 and ZeRO-3), against tests/oracle.py.

Megatron-FSDP and Megatron-DeepSpeed shard Megatron's *padded* tp-local embedding / head
(``[P / tp, hidden]``, padding rows zero): FSDP2 chunks its rows (``torch.chunk(local, fsdp, 0)``),
ZeRO-3 flattens it whole (its ``numel`` counts the padding rows) and cuts equal partitions. The
padding elements are local zeros, never sent. Checked here: every rank's buffers against the
oracle's reading (tests/oracle.py ``local_tensors``), plans between such layouts and others
executed in process bit-exact, and the layouts of chosen small cases element by element.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc.layout import Layout, Topology
from realloc.layout.holdings import PieceTable
from realloc.plan import Placement
from realloc.shards import allocate_buffers, flat_views, shard_views

try:
    from tests import oracle
    from tests.test_planner_properties import placements, topologies
    from tests.test_zero3 import ZERO8, check_layout_buffers, check_zero3_reallocation, zero3_topologies
except ImportError:  # pytest put tests/ itself on sys.path
    import oracle
    from test_planner_properties import placements, topologies
    from test_zero3 import ZERO8, check_layout_buffers, check_zero3_reallocation, zero3_topologies

EMBED = "model.embed_tokens.weight"


@st.composite
def sharded_topologies(draw, d: oracle.Decoder, world: int):
    """A topology with fsdp > 1 cut by FSDP2 or ZeRO-3."""
    return dataclasses.replace(draw(zero3_topologies(d, world)), fsdp_split=draw(st.sampled_from(["zero3", "fsdp2"])))


@settings(max_examples=50, deadline=None)
@given(st.data())
def test_random_padded_sharded_layouts_hold_the_engines_tensors(data):
    d = data.draw(oracle.decoders(st, mlp_bias=True))
    world = data.draw(st.sampled_from([12, 8, 6, 4, 3, 2]))
    check_layout_buffers(d, data.draw(sharded_topologies(d, world)), data.draw(st.integers(1, 5)))


@st.composite
def padded_reallocations(draw):
    """A padded sharded layout to or from a plain, FSDP2 or ZeRO-3 layout (each with its own padding)
    on the same workers; :func:`check_zero3_reallocation`'s args."""
    d = draw(oracle.decoders(st, mlp_bias=True))
    world = draw(st.sampled_from([8, 6, 4, 3, 2]))
    sharded = draw(sharded_topologies(d, world))
    other = draw(st.one_of(topologies(d, world), sharded_topologies(d, world)))
    pads = (draw(st.integers(2, 4)), draw(st.integers(1, 4)))
    if draw(st.booleans()):
        sharded, other, pads = other, sharded, pads[::-1]
    workers = list(range(world))
    return d, sharded, other, draw(placements(world)), draw(st.integers(1024, 4096)), workers, workers, *pads


@settings(max_examples=50, deadline=None)
@given(padded_reallocations())
def test_random_reallocations_from_and_to_padded_sharded_layouts(case):
    check_zero3_reallocation(*case)


@pytest.mark.parametrize(
    "src, dst, src_pad, dst_pad",
    [
        (Topology(fsdp=8), Topology(dp=2, tp=4), 8, 8),
        (Topology(tp=4, dp=2), Topology(fsdp=4, tp=2, fsdp_split="zero3"), 1, 8),
        (Topology(fsdp=4, tp=2, fsdp_split="zero3"), Topology(fsdp=8), 3, 1),
        (Topology(dp=2, fsdp=2, tp=2), Topology(fsdp=8, fsdp_split="zero3"), 5, 5),
    ],
    ids=["fsdp2pad8-dp2tp4", "dp2tp4-zero3tp2pad8", "zero3tp2pad3-fsdp2", "hsdp-pad5-zero3"],
)
def test_chosen_padded_reallocations(src, dst, src_pad, dst_pad):
    check_layout_buffers(ZERO8, src, src_pad)
    check_layout_buffers(ZERO8, dst, dst_pad)
    check_zero3_reallocation(ZERO8, src, dst, Placement.blocks(8, 4), src_pad=src_pad, dst_pad=dst_pad)


def test_fsdp2_chunks_megatrons_padded_rows():
    """V=17 (ZERO8 but 17 rows), pad 8, tp=1: P=24, chunks of 6 rows over fsdp=4: rank 2 holds real
    rows 12..16 and one padding row, rank 3 padding rows only (a shard of 0 rows, local 6 rows)."""
    d = dataclasses.replace(ZERO8, vocab=17)
    lay = Layout(d.spec(), Topology(fsdp=4), 8)
    got = {}
    for rank in range(4):
        [s] = [s for s in lay.shards(rank) if s.slot == EMBED]
        got[rank] = (s.offsets, s.sizes, s.local_shape)
        views = shard_views(lay.at(rank), allocate_buffers(lay, rank), padding=True)
        assert views[EMBED].shape == (6, 6)  # FSDP2's chunk of Megatron's [24, hidden] tensor
    assert got == {
        0: ((0, 0), (6, 6), (6, 6)),
        1: ((6, 0), (6, 6), (6, 6)),
        2: ((12, 0), (5, 6), (6, 6)),
        3: ((17, 0), (0, 6), (6, 6)),
    }
    assert not any(g.pieces and g.pieces[0][0] == EMBED and g.pieces[0][2][0] == 0 for g in lay.groups())


def test_zero3_flattens_megatrons_padded_tp_shard():
    """Defect fix: V=19 over tp=2 (Megatron's rule, multiple 1) is padded to 20, so tp rank 1's local
    embedding is [10, 6] with 9 real rows. Megatron-DeepSpeed flattens that tensor: 60 elements, 15
    per rank of fsdp=4 on BOTH tp ranks; the old layout flattened the 54 real ones (14 per rank)."""
    lay = Layout(ZERO8.spec(), Topology(fsdp=4, tp=2, fsdp_split="zero3"))
    full = oracle.index_tensors(ZERO8)
    padded = torch.cat([full[EMBED], torch.full((1, 6), -1)])  # Megatron's padded vocabulary
    for rank in range(8):
        tp_rank, fsdp_rank = rank % 2, rank // 2
        part = flat_views(lay.at(rank), allocate_buffers(lay, rank))[EMBED]
        assert part.numel() == 15, (rank, part.numel())
        local = padded.chunk(2)[tp_rank].reshape(-1)  # [10, 6] -> 60 elements
        want = local[fsdp_rank * 15 : (fsdp_rank + 1) * 15]
        got = [(o, z) for s in lay.shards(rank) if s.slot == EMBED for o, z in [(s.offsets, s.sizes)]]
        held = torch.cat([full[EMBED][o[0] : o[0] + z[0], o[1] : o[1] + z[1]].reshape(-1) for o, z in got])
        assert torch.equal(held, want[want >= 0]), rank


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_piece_tables_of_padded_fsdp2_layouts_are_their_groups(data):
    """The array piece table (FSDP2 chunks of the padded rows) lists what the shard table holds;
    padding-only chunks are not planner input."""
    d = data.draw(oracle.decoders(st))
    topo = data.draw(zero3_topologies(d, data.draw(st.sampled_from([8, 6, 4, 3]))))
    lay = Layout(d.spec(), dataclasses.replace(topo, fsdp_split="fsdp2"), data.draw(st.integers(1, 5)))
    groups = lay.groups()
    assert all(all(all(z) for _, _, z in g.pieces) for g in groups)
    table, want = lay.piece_table(), PieceTable.of_groups(groups)
    assert table.groups == want.groups and sorted(table.params) == sorted(want.params)
    for name in want.params:
        assert table.boxes(name) == want.boxes(name), name
