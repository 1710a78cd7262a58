"""The planner's large-plan forms against its small-plan forms, on random layouts.

Sharded layouts at scale go through array forms that small plans never need: piece tables
computed per ``(tp, pp)`` coordinate (``Layout.piece_table``), steps on the cyclic schedule kept
as a ``StepTable``, segments as runs (``SegmentTable``). Here the array forms are checked
against the plain ones: the piece table against the layout's own groups, and plans forced into
the large form (``LARGE_PLAN_ROUTES = 0``) through the same oracle checks as every plan: bit-exact
execution, each element written once, senders hold what they send, inter-node bytes at the bound.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import oracle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner_properties import (
    FSDP8,
    Case,
    check_reallocation,
    fsdp_reallocations,
    fsdp_topologies,
    make_plan,
    reallocations,
    topologies,
)

import realloc.plan.schedule as schedule
from realloc import Layout, ModelSpec, Placement, Topology
from realloc.layout import PieceTable
from realloc.plan import Plan, StepTable


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_piece_table_is_the_layouts_groups_as_arrays(data):
    d = data.draw(oracle.decoders(st))
    world = data.draw(st.sampled_from([8, 6, 5, 4, 3, 2, 1]))
    sharded = oracle.factorisations4(d, world)
    topo = data.draw(
        st.one_of(topologies(d, world), fsdp_topologies(d, world)) if len(sharded) else topologies(d, world)
    )
    pad = 1 if topo.fsdp > 1 else data.draw(st.integers(1, 3))
    layout = Layout(d.spec(), topo, pad)
    workers = data.draw(st.permutations(list(range(world))))
    got, want = layout.piece_table(list(workers)), PieceTable.of_groups(layout.groups(list(workers)))
    assert got.groups == want.groups
    assert sorted(got.params) == sorted(want.params)
    for name in want.params:
        for a, b in zip(got.params[name], want.params[name]):
            assert np.array_equal(a, b), name


class large_form:
    """Every plan planned inside takes the large-plan form: arrays and the cyclic schedule."""

    def __enter__(self):
        self.patches = [
            mock.patch.object(schedule, "LARGE_PLAN_ROUTES", 0),
            mock.patch.object(schedule, "_cyclic_fits", lambda src, dst, colour: True),
        ]
        for p in self.patches:
            p.start()

    def __exit__(self, *exc):
        for p in reversed(self.patches):
            p.stop()


@settings(max_examples=40, deadline=None)
@given(reallocations())
def test_large_form_plans_execute_bit_exact(case):
    with large_form():
        plan = check_reallocation(case)
    assert isinstance(plan.steps, StepTable) or not plan.steps


@settings(max_examples=30, deadline=None)
@given(fsdp_reallocations())
def test_large_form_fsdp_plans_execute_bit_exact(case):
    with large_form():
        check_reallocation(case)


@settings(max_examples=20, deadline=None)
@given(reallocations())
def test_large_form_plans_survive_json_round_trip(case):
    with large_form():
        plan = make_plan(case)
    back = Plan.from_json(json.loads(plan.dumps()))
    assert back == plan and back.dumps() == plan.dumps()


def test_large_form_and_small_form_move_the_same_bytes():
    case = Case(FSDP8, Topology(fsdp=8), Topology(dp=2, tp=4), Placement.blocks(8, 4))
    small = make_plan(case)
    with large_form():
        large = make_plan(case)
    assert isinstance(large.steps, StepTable) and isinstance(small.steps, list)
    for key in (
        "bytes_total",
        "bytes_inter_node",
        "bytes_intra_node",
        "bytes_local_copy",
        "num_routes",
        "rank_send_bytes",
        "rank_recv_bytes",
        "lower_bound_inter_node_bytes",
    ):
        assert large.stats[key] == small.stats[key], key

    def routes(p):
        return sorted(
            (src, dst, [(s.param, s.offsets, s.sizes) for s in p.segment_list(j)]) for _, src, dst, j in p.routes()
        )

    assert routes(large) == routes(small)


@pytest.mark.parametrize(
    "options",
    [
        dict(vocab_pad_multiple=64, vocab_pad_rule="vllm"),
        dict(qkv_order="megatron"),
        dict(vocab_pad_multiple=4, vocab_pad_rule="megatron", qkv_order="megatron"),
    ],
)
@pytest.mark.parametrize("topology", ["tp=2", "dp=2,tp=2,pp=2"])
def test_piece_table_of_engine_conventions(options, topology):
    layout = Layout(FSDP8.spec(), Topology.parse(topology), **options)
    got, want = layout.piece_table(), PieceTable.of_groups(layout.groups())
    assert got.groups == want.groups and sorted(got.params) == sorted(want.params)
    for name in want.params:
        for a, b in zip(got.params[name], want.params[name]):
            assert np.array_equal(a, b), name


def test_an_rl_loop_alternating_two_layouts_plans_each_direction_once():
    from actors.driver.group import _plan
    from realloc.plan import Bandwidths

    spec = FSDP8.spec()
    train, generate = Layout(spec, Topology(fsdp=8)), Layout(spec, Topology(dp=2, tp=4))
    placement = Placement.blocks(8, 4)
    _plan.cache_clear()
    for _ in range(5):  # equal layout values, not the same objects, each round (as a loop rebuilds them)
        there = _plan(Layout(spec, Topology(fsdp=8)), generate, placement, None, None, 1 << 20, Bandwidths())
        back = _plan(Layout(spec, Topology(dp=2, tp=4)), train, placement, None, None, 1 << 20, Bandwidths())
        assert there is not back
    info = _plan.cache_info()
    assert (info.misses, info.hits) == (2, 8)


def test_cyclic_schedule_only_where_it_costs_few_steps():
    rng = np.random.default_rng(0)
    width = 512
    src = np.repeat(np.arange(width), width - 1)  # everyone to everyone else: dense
    dst = (src + np.tile(np.arange(1, width), width)) % width
    assert schedule.cyclic_suits(src, dst)
    many = 50_000  # each of 50,000 workers sends to the same 4 offsets: degree 4
    sparse_src = np.repeat(np.arange(many), 4)
    sparse_dst = (sparse_src + np.tile(rng.choice(np.arange(1, 1000), 4, replace=False), many)) % many
    assert schedule.cyclic_suits(sparse_src, sparse_dst)  # the same 4 offsets everywhere: 4 colours
    scattered = (sparse_src + rng.integers(1, many, sparse_src.size)) % many  # 4 random peers each
    assert not schedule.cyclic_suits(sparse_src, scattered)


@pytest.mark.parametrize(
    "topology", ["dp=4,tp=2,pp=2,ep=4,etp=1", "dp=4,tp=2,ep=2", "dp=2,tp=4,ep=8,etp=1", "dp=2,tp=2,pp=2"]
)
def test_expert_process_groups_follow_megatrons_expert_mesh(topology):
    """Written from Megatron-core's RankGenerator(tp=etp, ep, dp=edp, pp, order "tp-ep-dp-pp"):
    inside a stage, rank = etp_rank + etp * (ep_rank + ep * edp_rank)."""
    from actors.worker.parallel import GroupRanks
    from realloc.spec import load_spec

    spec = load_spec(str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny-moe.json"))
    t = Topology.parse(topology)
    etp = t.etp or t.tp
    ep, edp, block = t.ep, t.dp * t.tp // (t.ep * etp), t.dp * t.tp
    mesh = {}
    for pp in range(t.pp):
        for d in range(edp):
            for e in range(ep):
                for x in range(etp):
                    mesh[pp * block + x + etp * (e + ep * d)] = (pp, d, e, x)
    layout = Layout(spec, t)
    for rank, (pp, d, e, x) in mesh.items():
        got = GroupRanks.of(layout, rank)
        assert got.ep == tuple(r for r, m in sorted(mesh.items()) if m[0] == pp and m[1] == d and m[3] == x)
        assert got.etp == tuple(r for r, m in sorted(mesh.items()) if m[0] == pp and m[1] == d and m[2] == e)
        assert got.edp == tuple(r for r, m in sorted(mesh.items()) if m[0] == pp and m[2] == e and m[3] == x)


@pytest.mark.parametrize("topology", ["dp=2,fsdp=4,ep=2,etp=1,pp=2", "dp=1,fsdp=2,tp=2,ep=4,etp=1"])
def test_expert_process_groups_follow_torchtitans_sparse_mesh(topology):
    """Written from torchtitan's ParallelDims.build_mesh: the world unflattened as (pp,
    dp_replicate, efsdp, ep), ep fastest; edp: the efsdp x dp_replicate ranks of one ep rank."""
    from actors.worker.parallel import GroupRanks
    from realloc.spec import load_spec

    spec = load_spec(str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny-moe.json"))
    t = Topology.parse(topology)
    efsdp = t.fsdp * t.tp // t.ep
    mesh = {}
    for pp in range(t.pp):
        for d in range(t.dp):
            for f in range(efsdp):
                for e in range(t.ep):
                    mesh[e + t.ep * (f + efsdp * (d + t.dp * pp))] = (pp, d, f, e)
    layout = Layout(spec, t)
    for rank, (pp, d, f, e) in mesh.items():
        got = GroupRanks.of(layout, rank)
        assert got.ep == tuple(r for r, m in sorted(mesh.items()) if m[:3] == (pp, d, f))
        assert got.edp == tuple(r for r, m in sorted(mesh.items()) if m[0] == pp and m[3] == e)
        assert got.etp == (rank,)


@pytest.mark.parametrize("topology", ["dp=2,fsdp=2,tp=2,pp=2", "dp=1,fsdp=4", "dp=2,tp=2"])
def test_expert_process_groups_without_expert_parallelism_hold_the_rank(topology):
    """No expert parallelism (fsdp included): ep is the rank alone, etp its tp group, edp its dp group."""
    from actors.worker.parallel import GroupRanks

    layout = Layout(ModelSpec.preset("tiny"), Topology.parse(topology))
    for rank in range(layout.topology.world_size):
        got = GroupRanks.of(layout, rank)
        assert (got.ep, got.etp, got.edp) == ((rank,), got.tp, got.dp) and rank in got.tp and rank in got.dp
