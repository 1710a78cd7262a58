"""Layouts against the independent reference slicing of tests/oracle.py.

A rank's shards, filled from the full tensors through ``ShardStore.write`` of each shard's box,
must be exactly the local tensors Megatron would hold (padding rows zero), laid out contiguously
in one buffer per dtype; ranks follow ``rank = tp + tp * (dp + dp * pp)``; the default pipeline
split is the one vLLM and Megatron-core build (the oracle's own reading of their rule); the
byte-balanced split (``pp_split="balanced"``) is contiguous, gives every stage a layer and has the
smallest possible bottleneck.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from realloc.layout import Layout, Topology
from realloc.layout.topology import PP_SPLIT_RULES, balanced_split, pp_layer_counts
from realloc.shards import ShardStore, allocate_buffers
from realloc.spec import ModelSpec, ParamSpec

try:
    from tests import oracle
except ImportError:  # pytest put tests/ itself on sys.path
    import oracle


@st.composite
def layouts(draw, max_world: int = 12):
    """(decoder description, Layout, vocab pad multiple) for a random fitting topology."""
    d = draw(oracle.decoders(st))
    world = draw(st.sampled_from([w for w in (1, 2, 3, 4, 6, 8, 12) if w <= max_world]))
    options = oracle.factorisations(d, world) or [(world, 1, 1)]
    dp, tp, pp = draw(st.sampled_from(options))
    split = draw(oracle.layer_splits(st, d.layers, pp))
    rule = draw(oracle.pp_rules(st, d.layers, pp))
    pad = draw(st.integers(1, 3))
    return d, Layout(d.spec(), Topology(dp, tp, pp, split, rule), pad), pad


def oracle_stages(d, t: Topology) -> list[list[int]]:
    """Explicit splits as given, the engines' rules from the oracle; only a byte-balanced split is
    taken from the topology (its optimality is checked below)."""
    if t.layer_split is None and t.pp_split == "balanced":
        return [list(r) for r in t.stage_layers(d.spec())]  # input to the oracle
    return oracle.pipeline_stages(d.layers, t.pp, t.layer_split, t.pp_split)


def oracle_locals(d, layout, rank, full, pad):
    t = layout.topology
    return oracle.local_tensors(d, full, t.dp, t.tp, t.pp, oracle_stages(d, t), rank, pad, fsdp=t.fsdp)


def test_decoder_spec_has_the_parameters_of_the_description():
    d = oracle.Decoder(
        hidden=6,
        intermediate=12,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=2,
        vocab=11,
        tied=False,
        qkv_bias=True,
        dtype="bfloat16",
        norm_dtype="float32",
    )
    for tied, qk_norm in ((False, False), (True, True)):
        desc = oracle.Decoder(**{**d.__dict__, "tied": tied, "qk_norm": qk_norm})
        spec = desc.spec()
        expected = [(p.name, p.shape, p.dtype) for p in oracle.params(desc)]
        assert [(p.name, p.shape, p.dtype) for p in spec.params] == expected
        assert spec.aliases == ({oracle.HEAD: oracle.EMBED} if tied else {})


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_shards_written_from_full_tensors_are_the_oracle_local_tensors(case):
    d, layout, pad = case
    full = oracle.full_tensors(d, seed=1)
    check_shards_written_from_full_tensors(layout, full, lambda rank: oracle_locals(d, layout, rank, full, pad))


def check_shards_written_from_full_tensors(layout, full, oracle_of_rank) -> None:
    """Every rank's shards, written from the global tensors ``full`` through its boxes, are the
    local tensors ``oracle_of_rank(rank)`` gives (padding zero)."""
    for rank in range(layout.topology.world_size):
        store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
        for s in layout.shards(rank):
            box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
            store.write(s.param, s.offsets, s.sizes, full[s.param][box])
        got = store.shard_tensors()
        want = oracle_of_rank(rank)
        assert sorted(got) == sorted(want), f"rank {rank}: slots differ"
        for slot, tensor in want.items():
            assert got[slot].dtype == tensor.dtype, (rank, slot)
            assert got[slot].shape == tensor.shape, (rank, slot, got[slot].shape, tensor.shape)
            assert torch.equal(got[slot], tensor), f"rank {rank} slot {slot} differs from the oracle"


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_buffers_are_contiguous_and_sized_by_local_numels(case):
    d, layout, pad = case
    for rank in range(layout.topology.world_size):
        by_dtype = defaultdict(list)
        for s in layout.shards(rank):
            by_dtype[s.dtype].append(s)
        numels = layout.buffer_numels(rank)
        assert set(numels) == set(by_dtype)
        for dtype, shards in by_dtype.items():
            shards.sort(key=lambda s: s.buffer_offset)
            end = 0
            for s in shards:  # each shard starts where the previous one ends: no gap, no overlap
                assert s.buffer_offset == end, (rank, dtype, s.slot)
                end += s.local_numel
            assert numels[dtype] == end == sum(s.local_numel for s in shards)
        # the buffer sizes are what the oracle's local tensors need
        dtype_of = {p.name: p.dtype for p in oracle.params(d)}
        want = defaultdict(int)
        for slot, local in oracle_locals(d, layout, rank, oracle.index_tensors(d), pad).items():
            want[dtype_of[oracle.storage_of(d, slot)]] += local.numel()
        assert numels == dict(want)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_rank_order_is_tp_fastest_then_dp_then_pp(dp, tp, pp):
    t = Topology(dp, tp, pp)
    seen = []
    for p, d, r in itertools.product(range(pp), range(dp), range(tp)):
        rank = r + tp * (d + dp * p)
        assert t.rank(d, r, p) == rank
        assert t.coords(rank) == (d, r, p) == oracle.coords(rank, dp, tp, pp)
        seen.append(rank)
    assert seen == list(range(t.world_size))
    with pytest.raises(ValueError):
        t.coords(t.world_size)


def test_tied_head_on_its_own_last_stage_is_a_copy_of_the_embedding_shard():
    d = oracle.Decoder(
        hidden=4, intermediate=12, layers=3, heads=2, kv_heads=1, head_dim=2, vocab=7, tied=True, dtype="float32"
    )
    layout = Layout(d.spec(), Topology(dp=1, tp=2, pp=3, layer_split=(1, 1, 1)))
    for tp_rank in range(2):
        first = {s.slot: s for s in layout.shards_at(tp_rank, 0)}
        last = {s.slot: s for s in layout.shards_at(tp_rank, 2)}
        assert oracle.HEAD not in first and oracle.EMBED in first
        assert last[oracle.HEAD].param == oracle.EMBED
        assert last[oracle.HEAD].box == first[oracle.EMBED].box
        assert last[oracle.HEAD].local_shape == first[oracle.EMBED].local_shape


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_stage_slots_are_in_forward_order(case):
    """CORE BUG (minor, reported to the lead) when the head is tied and pp > 1:
    ``Layout.stage_slots`` documents forward order, but puts the last stage's tied ``lm_head.weight``
    first (it walks ``spec.params``, where the embedding comes first), so that stage's buffer
    starts with the head instead of ending with it."""
    d, layout, _ = case
    stages = oracle_stages(d, layout.topology)
    assert [list(r) for r in layout.stages] == stages
    for pp_rank in range(layout.topology.pp):
        want = [slot for slot, _ in oracle.stage_slots(d, stages, pp_rank)]
        assert [slot for _, slot in layout.stage_slots(pp_rank)] == want, f"stage {pp_rank}"


# -- pipeline split ------------------------------------------------------------------------


def stage_weights(spec: ModelSpec, counts) -> list[int]:
    """Bytes of each stage of a contiguous split (embedding on the first stage; final norm and
    head, including a tied head's copy of the embedding, on the last)."""
    per_layer = [0] * spec.num_layers
    first = last = 0
    for p in spec.params:
        if p.role == "layer":
            per_layer[p.layer] += p.nbytes
        elif p.role == "embed":
            first += p.nbytes
            if spec.aliases and len(counts) > 1:
                last += p.nbytes
        else:
            last += p.nbytes
    loads, start = [], 0
    for n in counts:
        loads.append(sum(per_layer[start : start + n]))
        start += n
    loads[0] += first
    loads[-1] += last
    return loads


def all_splits(layers: int, pp: int):
    for cuts in itertools.combinations(range(1, layers), pp - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def check_balanced(spec: ModelSpec, pp: int) -> None:
    split = balanced_split(spec, pp)
    assert len(split) == pp and all(n >= 1 for n in split) and sum(split) == spec.num_layers
    stages = Topology(pp=pp, pp_split="balanced").stage_layers(spec)
    assert [len(r) for r in stages] == list(split)
    assert [i for r in stages for i in r] == list(range(spec.num_layers)), "stages must be contiguous, in order"
    best = min(max(stage_weights(spec, c)) for c in all_splits(spec.num_layers, pp))
    assert max(stage_weights(spec, split)) == best, f"split {split} is not optimal (best bottleneck {best})"


@settings(max_examples=60, deadline=None)
@given(oracle.decoders(st, max_layers=7), st.data())
def test_balanced_split_of_decoders_is_optimal(d, data):
    pp = data.draw(st.integers(1, d.layers))
    check_balanced(d.spec(), pp)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=8),
    st.integers(0, 200),
    st.integers(0, 200),
    st.booleans(),
    st.data(),
)
def test_balanced_split_with_uneven_layers_is_optimal(layer_sizes, embed, head, tied, data):
    """Layers of different sizes (a hand-made spec), so the bottleneck is a real search."""
    layers = len(layer_sizes)
    ps = [ParamSpec("embed", (embed + 1,), "float32", "embed")]
    ps += [ParamSpec(f"l{i}", (n,), "float32", "layer", layer=i) for i, n in enumerate(layer_sizes)]
    ps.append(ParamSpec("norm", (head + 1,), "float32", "final"))
    spec = ModelSpec("uneven", tuple(ps), layers, {"head": "embed"} if tied else {})
    check_balanced(spec, data.draw(st.integers(1, layers)))


def test_explicit_layer_split_is_used_as_given():
    spec = oracle.Decoder(hidden=4, intermediate=12, layers=5, heads=2, kv_heads=2, head_dim=2, vocab=9).spec()
    assert [list(r) for r in Topology(pp=3, layer_split=(1, 3, 1)).stage_layers(spec)] == [[0], [1, 2, 3], [4]]
    with pytest.raises(ValueError):
        Topology(pp=2, layer_split=(1, 3)).stage_layers(spec)


# -- the engines' pipeline split (the default) ---------------------------------------------


def counts(topology: Topology, spec: ModelSpec) -> tuple[int, ...]:
    return tuple(len(r) for r in topology.stage_layers(spec))


def test_default_split_is_what_the_engines_build():
    """Megatron-core and vLLM both hold 8 / 4 = 2 and 28 / 4 = 7 layers per stage; the old
    byte-balanced default gave (1, 5, 1, 1) and (6, 8, 8, 6): other layers than the engine holds."""
    assert counts(Topology(pp=4), ModelSpec.preset("small")) == (2, 2, 2, 2)
    assert counts(Topology(pp=4), ModelSpec.preset("qwen2.5-7b")) == (7, 7, 7, 7)
    assert counts(Topology(dp=2, tp=4, pp=8), ModelSpec.preset("llama-70b")) == (10,) * 8


def test_vllm_rule_gives_the_remainder_to_the_stages_before_the_last():
    """Expected tuples worked out by hand from ``get_pp_indices`` in vllm/distributed/utils.py
    (vllm-project/vllm): ``L // pp`` each, then ``partitions[-i] += 1`` for i = 2 .. L % pp + 1."""
    spec = oracle.Decoder(hidden=4, intermediate=12, layers=30, heads=2, kv_heads=2, head_dim=2, vocab=9).spec()
    assert counts(Topology(pp=4), spec) == (7, 8, 8, 7)  # 30 = 4 * 7 + 2: stages 2 and 1 take one more
    assert pp_layer_counts(30, 4) == pp_layer_counts(30, 4, "vllm") == (7, 8, 8, 7)
    assert pp_layer_counts(61, 4) == (15, 15, 16, 15)  # 61 = 4 * 15 + 1: stage 2 only
    assert pp_layer_counts(7, 4) == (2, 2, 2, 1)  # remainder pp - 1: every stage but the last
    assert pp_layer_counts(5, 4) == (1, 1, 2, 1)
    assert pp_layer_counts(3, 2) == (2, 1)
    assert pp_layer_counts(30, 1) == (30,)
    assert pp_layer_counts(30, 30) == (1,) * 30


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.data())
def test_count_rules_match_the_oracle(layers, data):
    pp = data.draw(st.integers(1, min(layers, 64)))
    want = oracle.engine_stage_counts(layers, pp, "vllm")
    assert pp_layer_counts(layers, pp, "vllm") == want
    assert len(want) == pp and sum(want) == layers and min(want) >= 1
    if layers % pp == 0:
        assert pp_layer_counts(layers, pp, "megatron") == want == (layers // pp,) * pp
    else:
        with pytest.raises(ValueError, match=rf"{layers} layers do not split evenly over pp={pp}"):
            pp_layer_counts(layers, pp, "megatron")


def test_megatron_rule_needs_pp_to_divide_the_layers():
    spec = oracle.Decoder(hidden=4, intermediate=12, layers=30, heads=2, kv_heads=2, head_dim=2, vocab=9).spec()
    assert counts(Topology(pp=3, pp_split="megatron"), spec) == (10, 10, 10)
    with pytest.raises(
        ValueError,
        match=r"oracle-model: pp_split='megatron' needs pp to divide the layer count, "
        r"but 30 layers do not split evenly over pp=4; .*layer_split=7/8/8/7",
    ):
        Topology(pp=4, pp_split="megatron").stage_layers(spec)
    # the suggested split is one Megatron-core's first/last-stage options can express: equal middle stages
    assert counts(Topology(pp=4, layer_split=(7, 8, 8, 7), pp_split="megatron"), spec) == (7, 8, 8, 7)
    with pytest.raises(ValueError, match=r"layer_split=14/16/16/15"):
        pp_layer_counts(61, 4, "megatron")
    with pytest.raises(ValueError, match=r"layer_split=1/1/1/2"):
        pp_layer_counts(5, 4, "megatron")
    with pytest.raises(ValueError, match=r"layer_split=2/3"):
        pp_layer_counts(5, 2, "megatron")


def test_balanced_rule_is_still_available_by_name():
    small = ModelSpec.preset("small")
    assert counts(Topology(pp=4, pp_split="balanced"), small) == balanced_split(small, 4) == (1, 5, 1, 1)
    assert counts(Topology(pp=4, pp_split="balanced"), ModelSpec.preset("qwen2.5-7b")) == (6, 8, 8, 6)
    with pytest.raises(ValueError, match=r"depends on parameter sizes.*balanced_split"):
        pp_layer_counts(8, 4, "balanced")


def test_explicit_split_overrides_every_rule():
    small = ModelSpec.preset("small")
    for rule in PP_SPLIT_RULES:
        assert counts(Topology(pp=3, layer_split=(3, 3, 2), pp_split=rule), small) == (3, 3, 2)


@st.composite
def any_topologies(draw):
    dp, tp, pp = (draw(st.integers(1, 9)) for _ in range(3))
    split = draw(st.none() | st.lists(st.integers(1, 99), min_size=pp, max_size=pp).map(tuple))
    return Topology(dp, tp, pp, split, draw(st.sampled_from(PP_SPLIT_RULES)))


@settings(max_examples=200, deadline=None)
@given(any_topologies())
def test_topology_strings_round_trip(t):
    assert Topology.parse(str(t)) == t
    assert ("pp_split=" in str(t)) == (t.pp_split != "vllm")


def test_topology_strings():
    assert str(Topology(dp=2, pp=4)) == "dp=2,tp=1,pp=4"  # as before the rule existed
    t = Topology.parse(" dp=2 , pp=4 , pp_split=balanced ")
    assert t == Topology(dp=2, pp=4, pp_split="balanced") and str(t) == "dp=2,tp=1,pp=4,pp_split=balanced"
    t = Topology.parse("pp_split=megatron,layer_split=2/3/3,pp=3")
    assert t == Topology(pp=3, layer_split=(2, 3, 3), pp_split="megatron")
    assert str(t) == "dp=1,tp=1,pp=3,layer_split=2/3/3,pp_split=megatron"
    assert Topology.parse("pp=4,pp_split=vllm") == Topology(pp=4)


# -- sharded data parallelism (FSDP2 / HSDP) ---------------------------------------------------


@st.composite
def fsdp_layouts(draw, max_world: int = 12):
    """(decoder, Layout, 1) with fsdp > 1 (dp > 1 too: HSDP), tp and pp: uneven and empty chunks
    come from the small dims (kv rows, biases, q/k norms) over fsdp up to 12."""
    d = draw(oracle.decoders(st))
    world = draw(st.sampled_from([w for w in (12, 8, 6, 4, 7, 5, 3, 2) if w <= max_world]))
    options = oracle.factorisations4(d, world) or [(1, world, 1, 1)]
    dp, fsdp, tp, pp = draw(st.sampled_from(options))
    split = draw(oracle.layer_splits(st, d.layers, pp))
    rule = draw(oracle.pp_rules(st, d.layers, pp))
    pad = draw(st.integers(1, 3))  # > 1: FSDP2 chunks Megatron's padded vocabulary shard
    return d, Layout(d.spec(), Topology(dp, tp, pp, split, rule, fsdp=fsdp), pad), pad


@settings(max_examples=60, deadline=None)
@given(fsdp_layouts())
def test_fsdp_shards_are_the_oracle_chunks(case):
    test_shards_written_from_full_tensors_are_the_oracle_local_tensors.hypothesis.inner_test(case)


@settings(max_examples=40, deadline=None)
@given(fsdp_layouts())
def test_fsdp_buffers_are_contiguous_and_sized_by_the_chunks(case):
    test_buffers_are_contiguous_and_sized_by_local_numels.hypothesis.inner_test(case)


@settings(max_examples=40, deadline=None)
@given(fsdp_layouts())
def test_fsdp_groups_are_coordinates_with_dp_replicas(case):
    _, layout, _ = case
    t = layout.topology
    groups = layout.groups()
    assert len(groups) == t.fsdp * t.tp * t.pp
    assert sorted(w for g in groups for w in g.workers) == list(range(t.world_size))
    for g in groups:
        assert len(g.workers) == t.dp
        coords = {t.coords4(w)[1:] for w in g.workers}
        assert len(coords) == 1  # one (fsdp, tp, pp) coordinate, its dp replicas
        assert {t.coords4(w)[0] for w in g.workers} == set(range(t.dp))
        shards = layout.shards(g.workers[0])
        assert g.pieces == tuple((s.param, s.offsets, s.sizes) for s in shards if s.numel)
        for s in shards:  # no empty chunk; padding only in chunks of a padded vocabulary shard
            padded = layout.vocab_pad_multiple > 1 and layout.spec.by_name[s.param].pad_to_tp
            assert (s.numel > 0 and s.local_shape == s.sizes) or padded, s
        for w in g.workers:
            assert layout.shards(w) == shards
    assert all(layout.at(r).buffer_numels() == layout.buffer_numels(r) for r in range(t.world_size))


def test_fsdp_chunks_follow_torch_chunk_with_empty_last_ranks():
    """k_proj of 2 kv heads x head_dim 1 = 2 rows over fsdp=3: ceil(2/3) = 1 row each, rank 2 empty;
    q_proj 4 rows over fsdp=3 -> chunks of 2: rows 0-1, 2-3 and nothing (torch.chunk gives 2)."""
    d = oracle.Decoder(hidden=5, intermediate=12, layers=1, heads=4, kv_heads=2, head_dim=1, vocab=7)
    lay = Layout(d.spec(), Topology(fsdp=3))
    rows = {r: {s.slot: (s.offsets[0], s.sizes[0]) for s in lay.shards(r)} for r in range(3)}
    k, q, norm = (
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.input_layernorm.weight",
    )
    assert [rows[r].get(k) for r in range(3)] == [(0, 1), (1, 1), None]
    assert [rows[r].get(q) for r in range(3)] == [(0, 2), (2, 2), None]
    assert [rows[r].get(norm) for r in range(3)] == [(0, 2), (2, 2), (4, 1)]
    assert [rows[r].get(oracle.EMBED) for r in range(3)] == [(0, 3), (3, 3), (6, 1)]
    # with tp=2 the chunks cut each tp box: the embedding's real rows 0-3 / 4-6 (tp pads 7 to 8)
    lay = Layout(d.spec(), Topology(fsdp=2, tp=2))
    t = lay.topology
    emb = {
        t.coords4(r)[1:3]: [(s.offsets, s.sizes, s.local_shape) for s in lay.shards(r) if s.slot == oracle.EMBED]
        for r in range(4)
    }
    assert emb[0, 0] == [((0, 0), (2, 5), (2, 5))] and emb[1, 0] == [((2, 0), (2, 5), (2, 5))]
    assert emb[0, 1] == [((4, 0), (2, 5), (2, 5))] and emb[1, 1] == [((6, 0), (1, 5), (1, 5))]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
def test_rank_order_is_torchtitans_mesh(dp, fsdp, tp, pp):
    t = Topology(dp, tp, pp, fsdp=fsdp)
    seen = []
    for p, d, f, r in itertools.product(range(pp), range(dp), range(fsdp), range(tp)):
        rank = r + tp * (f + fsdp * (d + dp * p))
        assert t.rank(d, r, p, f) == rank
        assert t.coords4(rank) == (d, f, r, p) == oracle.coords4(rank, dp, fsdp, tp, pp)
        assert t.coords(rank) == (d, r, p)
        seen.append(rank)
    assert seen == list(range(t.world_size)) and t.world_size == dp * fsdp * tp * pp
    with pytest.raises(ValueError):
        t.coords4(t.world_size)


def test_fsdp_topology_strings_and_layout_values():
    assert str(Topology.parse("fsdp=8")) == "dp=1,fsdp=8,tp=1,pp=1"
    t = Topology.parse("dp=2,fsdp=4,tp=2")
    assert (t.dp, t.fsdp, t.tp, t.pp, t.world_size) == (2, 4, 2, 1, 16) and Topology.parse(str(t)) == t
    assert str(Topology.parse("fsdp=1,tp=2")) == "dp=1,tp=2,pp=1"  # fsdp=1 prints as before
    for bad in ("fsdp=0", "fsdp=-2", "fsdp=x", "fsdp=2,fsdp=2"):
        with pytest.raises(ValueError, match="fsdp"):
            Topology.parse(bad)
    with pytest.raises(ValueError, match="topology fsdp must be a positive integer"):
        Topology(fsdp=True)
    spec = ModelSpec.preset("tiny")
    a, b = Layout(spec, Topology(dp=4)), Layout(spec, Topology(fsdp=4))
    assert (
        a != b and a.key != b.key and Layout(spec, Topology(fsdp=4)) == b and hash(b) == hash(Layout(spec, b.topology))
    )
    assert Layout(spec, Topology(dp=2, fsdp=2)) not in (a, b)
    assert "fsdp=4" in str(b)
    assert Layout(spec, Topology(fsdp=4), 64) != b  # FSDP2 of the padded vocabulary shard


def test_fsdp_layout_costs_its_coordinates():
    """2048-rank FSDP over llama-70b: every rank distinct, every element on exactly one rank. (Its
    cost is the planning benchmarks' to check, not a timed test's: `realloc plan`, docs/benchmarks.md.)"""
    spec = ModelSpec.preset("llama-70b")
    lay = Layout(spec, Topology(fsdp=2048))
    total = sum(sum(s.numel for s in lay.shards(r)) for r in range(2048))
    assert total == sum(p.numel for p in spec.params)  # every element on exactly one rank (untied)
    assert len(lay.groups()) == 2048
    hsdp = Layout(spec, Topology(dp=8, fsdp=256))
    assert len(hsdp.groups()) == 256 and hsdp.shards(0) == hsdp.shards(256 * 7)
