"""Engine conventions as layout options (realloc/layout/conventions.py): vLLM's vocabulary padding rule and
Megatron-core's fused linear_qkv order, checked against tests/oracle.py.

* layouts: every rank's local tensors (padding included) are the oracle's, under either vocabulary
  rule; under ``qkv_order="megatron"`` the q/k/v region of a layer is exactly the oracle's
  Megatron ``linear_qkv`` tensor (built from full HF q/k/v by reshaping into query groups,
  concatenating and chunking over tp), and the ``linear_fc1`` view the oracle's [gate; up];
* execution: plans between any two of these layouts (vllm-padded <-> megatron-padded,
  megatron qkv <-> HF order, different dp/tp/pp) run in-process bit-exact, source padding poisoned,
  and pass the planner checks of tests/test_planner_properties.py (masks from the oracle);
* the worked examples of docs/conventions.md and the refusals (names, divisibility, kv heads < tp).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from realloc.ckpt.files import build_rank_file
from realloc.ckpt.manifest import CheckpointId, Manifest
from realloc.layout import Layout, Topology
from realloc.layout.conventions import QKV_ORDERS
from realloc.plan import Placement, plan_reallocation
from realloc.shards import ShardStore, allocate_buffers, execute_in_process, fused_views, shard_views
from realloc.spec import VOCAB_PAD_RULES, decoder_spec

try:
    from tests import oracle
    from tests.test_planner_properties import POISON, check_plan, placements, stages_of, topologies
except ImportError:  # pytest put tests/ itself on sys.path
    import oracle
    from test_planner_properties import POISON, check_plan, placements, stages_of, topologies

EMBED = "model.embed_tokens.weight"


# -- the oracle's view of a layout ---------------------------------------------------------


def side_ok(d: oracle.Decoder, topo: Topology, pad: int, rule: str, qkv: str) -> bool:
    """The oracle's own word on whether the engines can take these options."""
    if rule == "vllm":
        try:
            oracle.vllm_padded_vocab(d.vocab, topo.tp, pad)
        except ValueError:
            return False
    if qkv == "hf" or d.kv_heads % topo.tp == 0:
        return True
    # megatron-core 0.16: tp a multiple of the query groups that divides linear_qkv's rows
    return topo.tp % d.kv_heads == 0 and (d.heads + 2 * d.kv_heads) * d.head_dim % topo.tp == 0


def _rank_args(d: oracle.Decoder, layout: Layout, rank: int) -> tuple:
    """The oracle's ``(d, dp, tp, pp, stages, rank, pad_multiple)`` of ``rank`` of ``layout``."""
    t = layout.topology
    return d, t.dp, t.tp, t.pp, stages_of(d, t), rank, layout.vocab_pad_multiple


def expected(d: oracle.Decoder, full, layout: Layout, rank: int, pad_value=0) -> dict[str, torch.Tensor]:
    """Name -> the engine's local tensor on ``rank`` (HF slots, and Megatron's linear_qkv in place of
    q/k/v under qkv_order="megatron"), from the oracle alone."""
    t = layout.topology
    _, *args = _rank_args(d, layout, rank)
    out = oracle.local_tensors(d, full, *args, pad_value=pad_value, pad_rule=layout.vocab_pad_rule)
    if layout.qkv_order == "megatron":
        _, tp_rank, pp_rank = t.coords(rank)
        for layer in stages_of(d, t)[pp_rank]:
            pre = f"model.layers.{layer}."
            for suffix in ("weight", "bias") if d.qkv_bias else ("weight",):
                for x in "qkv":
                    del out[f"{pre}self_attn.{x}_proj.{suffix}"]
                out[f"{pre}self_attn.linear_qkv.{suffix}"] = oracle.megatron_linear_qkv(
                    d, full, layer, t.tp, tp_rank, suffix
                )
    return out


def actual(layout: Layout, rank: int, buffers) -> dict[str, torch.Tensor]:
    """The same names as views of the rank's buffers (padded local tensors)."""
    if layout.qkv_order == "hf":
        return shard_views(layout.at(rank), buffers, padding=True)
    views = fused_views(layout.at(rank), buffers, padding=True, convention="megatron")
    return {name.replace("self_attention.linear_qkv", "self_attn.linear_qkv"): v for name, v in views.items()}


def check_rank(d, full, layout: Layout, rank: int, buffers) -> None:
    want, got = expected(d, full, layout, rank), actual(layout, rank, buffers)
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for name, value in want.items():
        assert got[name].shape == value.shape and torch.equal(got[name], value), f"rank {rank} {name}"
    covered = sum(v.numel() for v in want.values())
    assert covered == sum(buffers[k].numel() for k in buffers), "the engine's tensors must fill the buffers"


def filled(d, full, layout: Layout, rank: int, pad_value=0) -> dict[str, torch.Tensor]:
    """Buffers of ``rank`` written through the engine's own tensors (oracle values, padding = pad_value)."""
    buffers = allocate_buffers(layout, rank)
    views = actual(layout, rank, buffers)
    for name, value in expected(d, full, layout, rank, pad_value).items():
        views[name].copy_(value)
    return buffers


# -- layouts vs the oracle -----------------------------------------------------------------


@st.composite
def conventional_layouts(draw, d: oracle.Decoder, world: int, unlike: Topology | None = None):
    topo = draw(topologies(d, world, unlike))
    rule = draw(st.sampled_from(VOCAB_PAD_RULES))
    pad = draw(st.sampled_from([64, 8, 4, 2, 1] if rule == "vllm" else [1, 2, 3, 64]))
    qkv = draw(st.sampled_from(QKV_ORDERS))
    assume(side_ok(d, topo, pad, rule, qkv))
    return Layout(d.spec(), topo, pad, rule, qkv)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.data())
def test_layouts_hold_the_engines_local_tensors(data):
    d = data.draw(oracle.decoders(st, mlp_bias=True))
    world = data.draw(st.sampled_from([8, 6, 4, 2, 1]))
    assume(oracle.factorisations(d, world))
    layout = data.draw(conventional_layouts(d, world))
    full = oracle.full_tensors(d, seed=3)
    spec = layout.spec
    for rank in range(world):
        buffers = allocate_buffers(layout, rank)
        store = ShardStore(layout.shards(rank), buffers)
        for s in layout.shards(rank):  # the layout's own boxes, filled from the full tensors
            box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
            store.write(s.param, s.offsets, s.sizes, full[s.param][box])
        check_rank(d, full, layout, rank, buffers)
        # Megatron's linear_fc1 / vLLM's gate_up_proj (weight, and bias with mlp_bias) are the
        # oracle's [gate; up], one view of the buffer each
        convention, fc1_name = (
            ("megatron", "linear_fc1") if layout.qkv_order == "megatron" else ("vllm", "gate_up_proj")
        )
        views = fused_views(layout.at(rank), buffers, convention=convention)
        _, tp_rank, pp_rank = layout.topology.coords(rank)
        for layer in layout.stages[pp_rank]:
            for suffix in ("weight", "bias") if d.mlp_bias else ("weight",):
                fc1 = views[f"model.layers.{layer}.mlp.{fc1_name}.{suffix}"]
                want = oracle.megatron_linear_fc1(full, layer, layout.topology.tp, tp_rank, suffix)
                assert torch.equal(fc1, want), (rank, layer, suffix)
                assert fc1.data_ptr() == views[f"model.layers.{layer}.mlp.gate_proj.{suffix}"].data_ptr()
            assert d.mlp_bias == (f"model.layers.{layer}.mlp.{fc1_name}.bias" in views)
    assert pickle.loads(pickle.dumps(layout)) == layout and layout.with_topology(layout.topology) == layout
    assert Layout(spec, layout.topology, **layout.options) == layout


@settings(max_examples=60, deadline=None)
@given(oracle.decoders(st), st.sampled_from([1, 2, 3, 4, 6, 8, 12]), st.sampled_from([1, 2, 8, 64]))
def test_layouts_refuse_exactly_what_the_engines_refuse(d, tp, pad):
    spec = d.spec()
    assume(not spec.tp_problems(tp))
    topo = Topology(tp=tp)
    for rule in VOCAB_PAD_RULES:
        for qkv in QKV_ORDERS:
            if side_ok(d, topo, pad, rule, qkv):
                Layout(spec, topo, pad, rule, qkv)
            else:
                with pytest.raises(ValueError, match="vLLM's VocabParallelEmbedding|num_query_groups divisible by tp"):
                    Layout(spec, topo, pad, rule, qkv)


# -- execution between conventions -----------------------------------------------------------


@st.composite
def conventional_reallocations(draw):
    d = draw(oracle.decoders(st, mlp_bias=True))
    world = draw(st.sampled_from([w for w in (8, 6, 4, 2) if oracle.factorisations(d, w)] or [1]))
    src = draw(conventional_layouts(d, world))
    dst = draw(conventional_layouts(d, world))
    assume(src != dst)
    return d, src, dst, draw(placements(world)), draw(st.integers(1024, 4096))


def masks_of(d: oracle.Decoder, layout: Layout) -> dict:
    t = layout.topology
    shapes = {p.name: p.shape for p in oracle.params(d)}
    out = {}
    for rank in range(t.world_size):
        # Megatron's linear_qkv rows (with tp > kv heads not the HF layout's replicated heads)
        held = oracle.held_indices(
            *_rank_args(d, layout, rank), pad_rule=layout.vocab_pad_rule, fused=layout.qkv_order == "megatron"
        )
        masks = {}
        for param, idx in held.items():
            m = np.zeros(int(np.prod(shapes[param])), dtype=bool)
            m[idx.numpy()] = True
            if m.any():
                masks[param] = m.reshape(shapes[param])
        out[rank] = masks
    return out


def run_and_check(d, src: Layout, dst: Layout, placement: Placement, bucket_bytes: int = 4096):
    spec = src.spec
    plan = plan_reallocation(spec, src, dst, placement, bucket_bytes=bucket_bytes)
    full = oracle.full_tensors(d, seed=11)
    world = src.topology.world_size
    sources = {r: ShardStore(src.shards(r), filled(d, full, src, r, pad_value=POISON)) for r in range(world)}
    targets = {r: ShardStore(dst.shards(r), allocate_buffers(dst, r)) for r in range(world)}
    moved = execute_in_process(plan, sources, targets)
    assert moved["bytes_moved"] == plan.stats["bytes_total"]
    for rank in range(world):
        check_rank(d, full, dst, rank, targets[rank].buffers)
    params = {p.name: p for p in oracle.params(d)}
    check_plan(
        plan,
        {n: p.shape for n, p in params.items()},
        {n: p.dtype for n, p in params.items()},
        placement,
        masks_of(d, src),
        masks_of(d, dst),
    )
    return plan


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(conventional_reallocations())
def test_reallocations_between_conventions_are_bit_exact(case):
    d, src, dst, placement, bucket_bytes = case
    run_and_check(d, src, dst, placement, bucket_bytes)


GQA = oracle.Decoder(
    hidden=8,
    intermediate=24,
    layers=3,
    heads=12,
    kv_heads=4,
    head_dim=2,
    vocab=100,
    qkv_bias=True,
    dtype="float32",
    norm_dtype="float32",
)


@pytest.mark.parametrize(
    "src_opts, dst_opts",
    [
        ((64, "vllm", "hf"), (64, "megatron", "hf")),  # vLLM's padding -> Megatron's
        ((2, "megatron", "megatron"), (64, "vllm", "hf")),  # Megatron trainer -> vLLM engine
        ((64, "vllm", "hf"), (1, "megatron", "megatron")),  # and back
    ],
)
@pytest.mark.parametrize(
    "src_topo, dst_topo", [("tp=4,pp=2", "dp=2,tp=4"), ("dp=2,tp=2,pp=2", "tp=4,pp=2"), ("tp=2,pp=2,dp=2", "dp=4,tp=2")]
)
def test_trainer_and_engine_layouts_exchange_bit_exact(src_opts, dst_opts, src_topo, dst_topo):
    spec = GQA.spec()
    src = Layout(spec, Topology.parse(src_topo), *src_opts)
    dst = Layout(spec, Topology.parse(dst_topo), *dst_opts)
    run_and_check(GQA, src, dst, Placement.blocks(8, 4))


def test_a_rank_holds_several_boxes_of_one_parameter():
    lay = Layout(GQA.spec(), Topology(tp=2), qkv_order="megatron")
    q = [s for s in lay.shards(1) if s.param == "model.layers.0.self_attn.q_proj.weight"]
    k = [s for s in lay.shards(1) if s.param == "model.layers.0.self_attn.k_proj.weight"]
    # rank 1 holds query groups 2 and 3: q heads 6..8 and 9..11, k heads 2 and 3
    assert [(s.offsets[0], s.sizes[0]) for s in q] == [(12, 6), (18, 6)]
    assert [(s.offsets[0], s.sizes[0]) for s in k] == [(4, 2), (6, 2)]
    assert q[0].buffer_offset + q[0].local_numel == k[0].buffer_offset  # q, k, v of group 2, then group 3
    assert sum(1 for g in lay.groups() for p in g.pieces if p[0] == q[0].param) == 4
    views = fused_views(lay.at(1), allocate_buffers(lay, 1), convention="megatron")
    assert tuple(views["model.layers.0.self_attention.linear_qkv.weight"].shape) == (2 * (3 + 2) * 2, 8)
    assert tuple(views["model.layers.0.self_attention.linear_qkv.bias"].shape) == (20,)
    assert "model.layers.0.self_attn.q_proj.weight" not in views  # no single tensor
    with pytest.raises(ValueError, match="held as several"):
        fused_views(lay.at(1), allocate_buffers(lay, 1))
    hf = Layout(GQA.spec(), Topology(tp=2))
    with pytest.raises(ValueError, match="build the layout with qkv_order='megatron'"):
        fused_views(hf.at(0), allocate_buffers(hf, 0), convention="megatron")
    one_group = Layout(GQA.spec(), Topology(tp=4))  # one query group per rank: [q; k; v] is linear_qkv
    assert "model.layers.0.self_attention.linear_qkv.weight" in fused_views(
        one_group.at(0), allocate_buffers(one_group, 0), convention="megatron"
    )


# -- worked examples (docs/conventions.md) and the option as one value -----------------------


def embed_rows(vocab: int, tp: int, pad: int, rule: str) -> list[tuple[int, int]]:
    """(padded rows, real rows) of every tp rank's embedding shard."""
    spec = decoder_spec("v", hidden=8, intermediate=24, layers=1, heads=24, head_dim=1, vocab=vocab)
    lay = Layout(spec, Topology(tp=tp), pad, rule)
    return [(s.local_shape[0], s.sizes[0]) for r in range(tp) for s in lay.shards(r) if s.param == EMBED]


@pytest.mark.parametrize(
    "vocab, pad, rule, per, last_real",
    [
        (32000, 64, "vllm", 4000, 4000),
        (32000, 64, "megatron", 4032, 3776),
        (32000, 128, "megatron", 4096, 3328),
        (50257, 64, "vllm", 6288, 6241),
        (50257, 64, "megatron", 6336, 5905),
        (50257, 128, "megatron", 6400, 5457),
    ],
)
def test_worked_examples(vocab, pad, rule, per, last_real):
    rows = embed_rows(vocab, 8, pad, rule)
    assert rows == [(per, per)] * 7 + [(per, last_real)]


def test_vllm_rule_leaves_the_last_ranks_without_real_rows():
    assert embed_rows(100, 8, 64, "vllm") == [(16, 16)] * 6 + [(16, 4), (16, 0)]
    with pytest.raises(ValueError, match=r"padded to a multiple of 64 is 128 rows, which tp=3 does not divide"):
        embed_rows(100, 3, 64, "vllm")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(vocab_pad_rule="sglang"), r"vocab_pad_rule must be one of 'megatron', 'vllm', got 'sglang'"),
        (dict(vocab_pad_rule=None), r"vocab_pad_rule must be one of 'megatron', 'vllm', got None"),
        (dict(qkv_order="vllm"), r"qkv_order must be one of 'hf', 'megatron', got 'vllm'"),
    ],
)
def test_bad_option_names(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(GQA.spec(), Topology(tp=2), **kwargs)


def test_megatron_qkv_with_tp_a_multiple_of_the_query_groups():
    """vLLM replicates each kv head on 2 ranks; megatron-core 0.16 cuts linear_qkv's 32 rows (per
    group: 2 q heads, k, v of 2 rows each) into 8 ranges of 4 rows: q rows of one group on one
    rank, its k and v on the next. Refused where Megatron refuses, and with fsdp (not laid out)."""
    spec = oracle.Decoder(hidden=8, intermediate=24, layers=1, heads=8, kv_heads=4, head_dim=2, vocab=64).spec()
    Layout(spec, Topology(tp=8))
    lay = Layout(spec, Topology(tp=8), qkv_order="megatron")
    qkv = [
        [(s.slot.split(".")[-2], s.offsets[0], s.sizes[0]) for s in lay.shards(r) if "_proj.weight" in s.slot][:2]
        for r in (0, 1, 7)
    ]
    assert qkv == [
        [("q_proj", 0, 4), ("o_proj", 0, 8)],
        [("k_proj", 0, 2), ("v_proj", 0, 2)],
        [("k_proj", 6, 2), ("v_proj", 6, 2)],
    ]
    with pytest.raises(ValueError, match="with fsdp=2 and tp=8 > 4 query groups"):
        Layout(spec, Topology(fsdp=2, tp=8), qkv_order="megatron")
    odd = oracle.Decoder(hidden=8, intermediate=24, layers=1, heads=12, kv_heads=4, head_dim=2, vocab=64).spec()
    with pytest.raises(ValueError, match="4 units along dim 0 cannot be split 6 ways"):
        Layout(odd, Topology(tp=6), qkv_order="megatron")  # neither divides the other
    rows = oracle.Decoder(hidden=8, intermediate=24, layers=1, heads=8, kv_heads=2, head_dim=1, vocab=64).spec()
    with pytest.raises(ValueError, match="divides linear_qkv's 12 rows"):
        Layout(rows, Topology(tp=8), qkv_order="megatron")
    # with fsdp: Megatron's fused parameters, sharded whole (tests/test_sharded_fused.py)
    assert Layout(GQA.spec(), Topology(fsdp=2), qkv_order="megatron").fused_sharded


def test_options_are_part_of_the_layout_value():
    spec = GQA.spec()
    base = Layout(spec, Topology(tp=2), 64)
    vllm = Layout(spec, Topology(tp=2), 64, "vllm")
    mqkv = Layout(spec, Topology(tp=2), 64, qkv_order="megatron")
    assert len({base, vllm, mqkv}) == 3 and base.key != vllm.key
    assert str(vllm) == "dp=1,tp=2,pp=1 vocab pad 64 vocab rule vllm" and str(mqkv).endswith(" qkv megatron")
    moved = mqkv.with_topology(Topology(tp=4))
    assert (moved.vocab_pad_rule, moved.qkv_order, moved.vocab_pad_multiple) == ("megatron", "megatron", 64)
    for lay in (vllm, mqkv):
        assert pickle.loads(pickle.dumps(lay)) == lay
        data, manifest = build_rank_file(CheckpointId("run", 3, 1), lay, allocate_buffers(lay, 1), "n0")
        again = Manifest.loads(manifest.dumps())
        assert again == manifest and again.check_layout(spec) == lay
    _, plain = build_rank_file(CheckpointId("run", 3, 1), base, allocate_buffers(base, 1), "n0")
    assert "vocab_pad_rule" not in plain.to_json() and "qkv_order" not in plain.to_json()
    with pytest.raises(ValueError, match="is not the saved"):
        Manifest.loads(manifest.dumps()).check_records(base)


def test_hf_checkpoint_loads_straight_into_megatron_linear_qkv(tmp_path):
    from realloc.ckpt.hf import load_shards, match_spec, save_hf_dir, scan_hf_dir
    from realloc.shards.synthetic import synthetic_state_dict

    spec = GQA.spec()
    state = synthetic_state_dict(spec)
    save_hf_dir(state, tmp_path)
    lay = Layout(spec, Topology(tp=2, pp=2), 64, "vllm", "megatron")
    tensors = scan_hf_dir(tmp_path)
    full = {p.name: state[p.name] for p in spec.params}
    for rank in range(lay.topology.world_size):
        store = ShardStore(lay.shards(rank), allocate_buffers(lay, rank))
        load_shards(tmp_path, tensors, match_spec(tensors, spec), lay.shards(rank), store)
        check_rank(GQA, full, lay, rank, store.buffers)


BIASED = oracle.Decoder(
    hidden=8, intermediate=12, layers=2, heads=4, kv_heads=2, head_dim=2, vocab=20, qkv_bias=True, mlp_bias=True
)


@pytest.mark.parametrize("topo", ["tp=2", "tp=2,pp=2", "fsdp=2,tp=2"])
def test_gate_up_biases_sit_after_both_weights_and_fuse(topo):
    """vLLM's MergedColumnParallelLinear holds gate_up_proj.weight and gate_up_proj.bias, Megatron's
    linear_fc1 .weight and .bias: a layer's buffer has gate.w, up.w, then gate.b, up.b (HF's forward
    order gate.w, gate.b, up.w, up.b would leave no fused view of either)."""
    lay = Layout(BIASED.spec(), Topology.parse(topo))
    full = oracle.full_tensors(BIASED, seed=2)
    for rank in range(lay.topology.world_size):
        pp_rank = lay.topology.coords(rank)[2]
        layer = lay.stages[pp_rank][0]
        pre = f"model.layers.{layer}.mlp."
        slots = [s.slot.removeprefix(pre) for s in lay.shards(rank) if s.slot.startswith(pre)]
        assert slots == ["gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias"] + [
            "down_proj.weight",
            "down_proj.bias",
        ]
        if lay.topology.fsdp > 1:
            continue
        buffers = filled(BIASED, full, lay, rank)
        tp_rank = lay.topology.coords(rank)[1]
        for convention, name in (("vllm", "gate_up_proj"), ("megatron", "linear_fc1")):
            views = fused_views(lay.at(rank), buffers, convention=convention)
            for suffix in ("weight", "bias"):
                want = oracle.megatron_linear_fc1(full, layer, lay.topology.tp, tp_rank, suffix)
                assert torch.equal(views[f"{pre}{name}.{suffix}"], want), (rank, convention, suffix)


TIED_GQA = oracle.Decoder(
    hidden=8,
    intermediate=24,
    layers=3,
    heads=8,
    kv_heads=2,
    head_dim=2,
    vocab=100,
    qkv_bias=True,
    tied=True,
    dtype="float32",
    norm_dtype="float32",
)


@pytest.mark.parametrize("src_topo", ["dp=2,tp=2,pp=2", "dp=4,pp=2", "tp=4,pp=2", "tp=8"])
def test_a_megatron_trainer_and_a_vllm_engine_replicating_kv_heads_exchange_bit_exact(src_topo):
    """vLLM at tp=8 holds each of the 2 kv heads on 4 ranks and 100 vocabulary rows padded to 128,
    16 per rank (rank 6 four real rows, rank 7 none); the trainer is Megatron's (linear_qkv order,
    vocabulary padded to 16 * tp, the tied head's copy on its last stage; at tp 4 and 8, more
    ranks than query groups: linear_qkv's 24 rows cut 4 or 8 ways through the groups). Both ways."""
    spec = TIED_GQA.spec()
    megatron = Layout(spec, Topology.parse(src_topo), 16, "megatron", "megatron")
    vllm = Layout(spec, Topology(tp=8), 64, "vllm", "hf")
    run_and_check(TIED_GQA, megatron, vllm, Placement.blocks(8, 4))
    run_and_check(TIED_GQA, vllm, megatron, Placement.blocks(8, 4))
