"""realloc.shards.bind: shard views, vLLM's fused views and module binding, all zero-copy.

Oracles: a shard view must equal the global tensor sliced with the shard's box (and, padded,
Megatron's padded vocabulary chunk); a fused view must equal ``torch.cat`` of the slices vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` load on that tp rank, computed here from
heads / kv heads / tp as vLLM does (vllm/model_executor/layers/linear.py), not from the layout.
Every view must live inside the rank's flat buffer, and writing through a view (a fused view, a
bound module's optimizer step) must change the buffer.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from realloc.layout import Layout, Topology
from realloc.shards import (
    BindReport,
    ShardStore,
    allocate_buffers,
    bind_module,
    fused_views,
    layer_name_map,
    shard_views,
)
from realloc.spec import ModelSpec, ParamSpec, decoder_spec

DTYPES = ["float32", "bfloat16", "float16", "float64"]
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


# -- helpers -------------------------------------------------------------------------------


def full_tensors(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        p.name: (torch.randn(p.shape, generator=gen, dtype=torch.float64) + 3.0).to(TORCH[p.dtype]) for p in spec.params
    }


def filled_buffers(layout: Layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    buffers = allocate_buffers(layout, rank)
    store = ShardStore(layout.shards(rank), buffers)
    for s in layout.shards(rank):
        store.write(s.param, s.offsets, s.sizes, box(full[s.param], s.offsets, s.sizes))
    return buffers


def box(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def inside(view: torch.Tensor, buf: torch.Tensor) -> bool:
    """``view`` lies within ``buf``'s memory (same storage, pointer range)."""
    if view.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        return False
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    last = view.data_ptr() + (sum((n - 1) * st for n, st in zip(view.shape, view.stride())) + 1) * view.element_size()
    return start <= view.data_ptr() and last <= end


def module_from(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], fill: float = 7.0) -> nn.Module:
    """An nn.Module whose parameters carry exactly the given dotted names."""
    root = nn.Module()
    for name, (shape, dtype) in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, nn.Parameter(torch.full(shape, fill, dtype=dtype)))
    return root


def shapes_of(views: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(t.shape), t.dtype) for n, t in views.items()}


def snapshot(module: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    return {n: (p.data_ptr(), p.detach().clone()) for n, p in module.named_parameters()}


def unchanged(module: nn.Module, before: dict[str, tuple[int, torch.Tensor]]) -> bool:
    return all(
        p.data_ptr() == before[n][0] and torch.equal(p.detach(), before[n][1]) for n, p in module.named_parameters()
    )


def vllm_qkv_rows(heads: int, kv_heads: int, head_dim: int, tp: int, tp_rank: int):
    """(q rows, k rows) ranges vLLM's QKVParallelLinear loads on ``tp_rank`` (its weight_loader)."""
    num_heads = heads // tp
    if tp >= kv_heads:
        num_kv, replicas = 1, tp // kv_heads
    else:
        num_kv, replicas = kv_heads // tp, 1
    q = (tp_rank * num_heads * head_dim, num_heads * head_dim)
    kv = ((tp_rank // replicas) * num_kv * head_dim, num_kv * head_dim)
    return q, kv


def vllm_fused(full, layer: int, d: dict, tp: int, tp_rank: int) -> dict[str, torch.Tensor]:
    pre = f"model.layers.{layer}."
    (q0, qn), (k0, kn) = vllm_qkv_rows(d["heads"], d["kv_heads"], d["head_dim"], tp, tp_rank)
    out = {
        pre + "self_attn.qkv_proj.weight": torch.cat(
            [
                full[pre + "self_attn.q_proj.weight"][q0 : q0 + qn],
                full[pre + "self_attn.k_proj.weight"][k0 : k0 + kn],
                full[pre + "self_attn.v_proj.weight"][k0 : k0 + kn],
            ]
        )
    }
    if d["qkv_bias"]:
        out[pre + "self_attn.qkv_proj.bias"] = torch.cat(
            [
                full[pre + "self_attn.q_proj.bias"][q0 : q0 + qn],
                full[pre + "self_attn.k_proj.bias"][k0 : k0 + kn],
                full[pre + "self_attn.v_proj.bias"][k0 : k0 + kn],
            ]
        )
    shard = d["intermediate"] // tp  # MergedColumnParallelLinear: [gate shard; up shard]
    out[pre + "mlp.gate_up_proj.weight"] = torch.cat(
        [
            full[pre + "mlp.gate_proj.weight"][tp_rank * shard : (tp_rank + 1) * shard],
            full[pre + "mlp.up_proj.weight"][tp_rank * shard : (tp_rank + 1) * shard],
        ]
    )
    return out


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    d = dict(
        heads=heads,
        kv_heads=draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0])),
        head_dim=draw(st.sampled_from([1, 2, 4])),
        hidden=draw(st.integers(2, 8)),
        intermediate=draw(st.sampled_from([4, 6, 8, 12])),
        layers=draw(st.integers(1, 3)),
        vocab=draw(st.integers(1, 23)),
        qkv_bias=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
        tied=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
    )
    d["norm_dtype"] = draw(st.sampled_from([d["dtype"], "float32"]))
    spec = decoder_spec("t", **d)
    tp = draw(st.sampled_from([t for t in range(1, 5) if not spec.tp_problems(t)]))
    pp = draw(st.integers(1, min(2, d["layers"])))
    dp = draw(st.integers(1, 2))
    layout = Layout(spec, Topology(dp=dp, tp=tp, pp=pp), draw(st.integers(1, 3)))
    return d, spec, layout, draw(st.integers(0, 2**16))


# -- properties ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_views_fused_and_binding_alias_the_buffers(case):
    d, spec, layout, seed = case
    full = full_tensors(spec, seed)
    tp, pad = layout.topology.tp, layout.vocab_pad_multiple
    for rank in range(layout.topology.world_size):
        _, tp_rank, pp_rank = layout.topology.coords(rank)
        rank_layout = layout.at(rank)
        buffers = filled_buffers(layout, rank, full)
        views = shard_views(rank_layout, buffers)
        padded = shard_views(rank_layout, buffers, padding=True)
        shards = {s.slot: s for s in rank_layout.shards()}
        assert list(views) == list(shards) == list(padded)

        # shard views: the real boxes, inside the buffer; padding invisible, and zero
        for slot, s in shards.items():
            view, local, buf = views[slot], padded[slot], buffers[s.dtype]
            assert tuple(view.shape) == s.sizes and tuple(local.shape) == s.local_shape
            assert torch.equal(view, box(full[s.param], s.offsets, s.sizes))
            assert view.numel() == 0 or inside(view, buf)
            assert inside(local, buf) and (view.numel() == 0 or view.data_ptr() == local.data_ptr())
            assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
            if slot in (EMBED, HEAD):  # Megatron's padded vocabulary chunk, computed independently
                rows = -(-d["vocab"] // (pad * tp)) * pad * tp
                zeros = torch.zeros((rows - d["vocab"], d["hidden"]), dtype=local.dtype)
                assert torch.equal(local, torch.cat([full[s.param], zeros]).chunk(tp)[tp_rank])
                assert not local[s.sizes[0] :].any()
            else:
                assert view.shape == local.shape
        if d["tied"] and pp_rank == layout.topology.pp - 1 and pp_rank > 0:
            assert HEAD in views and EMBED not in views  # a tied head's own copy

        # fused views: vLLM's tensors of every layer of the stage, one view each
        fused = fused_views(rank_layout, buffers)
        expected: dict[str, torch.Tensor] = {}
        for layer in layout.stages[pp_rank]:
            expected.update(vllm_fused(full, layer, d, tp, tp_rank))
        assert set(fused) == set(views) | set(expected)
        for name, want in expected.items():
            got = fused[name]
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
            assert got.is_contiguous() and inside(
                got, buffers[spec.param(name.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")).dtype]
            )
        for name in views:
            assert fused[name].data_ptr() == views[name].data_ptr() and fused[name].shape == views[name].shape

        # writing through a fused view changes its parts
        for name in expected:
            fv = fused[name]
            new = torch.randn(fv.shape, generator=torch.Generator().manual_seed(seed + 1)).to(fv.dtype)
            fv.copy_(new)
            pre, suffix = ".".join(name.split(".")[:3]) + ".", name.split(".")[-1]  # model.layers.N.
            if "qkv_proj" in name:
                parts = [pre + f"self_attn.{p}_proj.{suffix}" for p in "qkv"]
            else:
                parts = [pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"]
            at = 0
            for part in parts:
                n = views[part].shape[0]
                assert torch.equal(views[part], new[at : at + n]), part
                at += n
            assert at == new.shape[0]

        # binding: the module's parameters become the views; an optimizer step writes the buffer
        for padding in (False, True):
            tensors = shard_views(rank_layout, buffers, padding=padding)
            module = module_from(shapes_of(tensors))
            tied_here = d["tied"] and EMBED in tensors and pp_rank == layout.topology.pp - 1
            if tied_here:  # pp=1: the head is the embedding itself
                module.add_module("lm_head", nn.Module())
                module.lm_head.weight = module.model.embed_tokens.weight  # tied: one Parameter
            params = dict(module.named_parameters())
            assert set(params) == set(tensors)
            report = bind_module(module, tensors)
            assert report == BindReport(tuple(params), (), ())  # tied head once
            for name, p in module.named_parameters():
                assert p is params[name] and p.data_ptr() == tensors[name].data_ptr()
                assert p.numel() == 0 or inside(p.detach(), buffers[shards[name].dtype])
            if tied_here:
                assert HEAD not in tensors and module.lm_head.weight is params[EMBED]
            before = {n: t.clone() for n, t in tensors.items()}
            for p in params.values():
                p.grad = torch.ones_like(p)
            torch.optim.SGD(params.values(), lr=1.0).step()
            again = shard_views(rank_layout, buffers, padding=padding)
            for name, t in before.items():
                assert torch.equal(again[name], t - torch.ones_like(t)), name
                assert torch.equal(params[name].detach(), again[name])


# -- binding: rebinds, name maps, errors ---------------------------------------------------


def small_layout(**topology) -> Layout:
    spec = decoder_spec(
        "small",
        hidden=8,
        intermediate=8,
        layers=4,
        heads=4,
        kv_heads=2,
        vocab=13,
        qkv_bias=True,
        dtype="float32",
        norm_dtype="float64",
    )
    return Layout(spec, Topology(**topology), 2)


def test_rebind_keeps_parameters_and_optimizer_state():
    layout = small_layout(tp=2)
    full = full_tensors(layout.spec, 0)
    first = filled_buffers(layout, 1, full)
    views = shard_views(layout.at(1), first)
    module = module_from(shapes_of(views))
    bind_module(module, views)
    params = list(module.parameters())
    opt = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert set(opt.state) == set(params)
    stepped = {n: t.clone() for n, t in views.items()}

    # the same rank of another layout value (dp changed): new buffers, same shapes
    other = layout.with_topology(Topology(dp=2, tp=2))
    second = filled_buffers(other, 3, full_tensors(layout.spec, 1))
    new_views = shard_views(other.at(3), second)
    report = bind_module(module, new_views)
    assert sorted(report.bound) == sorted(new_views)
    assert list(module.parameters()) == params and all(a is b for a, b in zip(module.parameters(), params))
    before = {n: t.clone() for n, t in new_views.items()}
    opt.step()  # momentum buffers still keyed by the same Parameters
    assert set(opt.state) == set(params)
    for name, t in new_views.items():
        assert not torch.equal(t, before[name])
        assert torch.equal(views[name], stepped[name])  # the old buffers are left alone


def test_layer_name_map_binds_megatron_local_numbering():
    layout = small_layout(tp=2, pp=2, layer_split=(1, 3))
    rank = layout.at(3)  # tp rank 1 of stage 1: layers 1..3
    buffers = filled_buffers(layout, 3, full_tensors(layout.spec, 2))
    views = shard_views(rank, buffers)
    name_map = layer_name_map(rank)
    local = {}
    for slot, shape in shapes_of(views).items():
        if slot.startswith("model.layers."):
            i, rest = slot[len("model.layers.") :].split(".", 1)
            slot = f"model.layers.{int(i) - 1}.{rest}"
        local[slot] = shape
    assert "model.layers.0.mlp.up_proj.weight" in local and "model.layers.3.mlp.up_proj.weight" not in local
    module = module_from(local)
    report = bind_module(module, views, name_map=name_map)
    assert len(report.bound) == len(views) and report.unused_slots == ()
    assert (
        module.model.layers._modules["0"].mlp.up_proj.weight.data_ptr()
        == views["model.layers.1.mlp.up_proj.weight"].data_ptr()
    )
    assert name_map("model.layers.2.self_attn.o_proj.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert name_map("model.norm.weight") == "model.norm.weight"
    megatron = layer_name_map(rank, "decoder.layers.")
    assert megatron("decoder.layers.1.x") == "model.layers.2.x"

    # a module built for another split: local layer 3 does not exist on this stage
    wrong = module_from({**local, "model.layers.3.mlp.up_proj.weight": local["model.layers.0.mlp.up_proj.weight"]})
    before = snapshot(wrong)
    with pytest.raises(ValueError, match="local layer 3"):
        bind_module(wrong, views, name_map=name_map)
    assert unchanged(wrong, before)


@pytest.fixture
def bound_case():
    layout = small_layout(tp=2, pp=2)
    rank = layout.at(2)  # stage 1 holds layers 2, 3, the final norm and the head
    views = shard_views(rank, filled_buffers(layout, 2, full_tensors(layout.spec, 3)))
    return views


def test_shape_dtype_device_mismatch_change_nothing(bound_case):
    views = bound_case
    last = list(views)[-1]
    for bad, match in (
        (
            (tuple(s + 1 for s in views[last].shape), views[last].dtype),
            r"lm_head\.weight: module shape \(9, 9\), shard shape \(8, 8\)",
        ),
        ((tuple(views[last].shape), torch.float16), "module dtype torch.float16, shard dtype torch.float32"),
    ):
        module = module_from({**shapes_of(views), last: bad})
        before = snapshot(module)
        with pytest.raises(ValueError, match=match):
            bind_module(module, views)
        assert unchanged(module, before)  # nothing bound, not even the parameters before it
        with pytest.raises(ValueError, match=match):
            bind_module(module, views, strict=False)  # a mismatch is never skipped
        assert unchanged(module, before)
    meta = module_from(shapes_of(views))
    meta.model.norm.weight = nn.Parameter(
        torch.empty(views["model.norm.weight"].shape, dtype=torch.float64, device="meta")
    )
    with pytest.raises(ValueError, match="model.norm.weight: module device meta, shard device cpu"):
        bind_module(meta, views)


def test_unknown_missing_and_excluded_names(bound_case):
    views = bound_case
    extra = module_from({**shapes_of(views), "adapter.weight": ((2, 2), torch.float32)})
    before = snapshot(extra)
    with pytest.raises(ValueError, match=r"no shard tensor for parameters \['adapter.weight'\]"):
        bind_module(extra, views)
    assert unchanged(extra, before)
    report = bind_module(extra, views, strict=False)
    assert report.unbound == ("adapter.weight",) and sorted(report.bound) == sorted(views)
    assert report.unused_slots == ()
    assert extra.adapter.weight.data_ptr() == before["adapter.weight"][0]

    # explicitly not from the shards: allowed under strict
    fresh = module_from({**shapes_of(views), "adapter.weight": ((2, 2), torch.float32)})
    report = bind_module(fresh, views, name_map=lambda n: None if n.startswith("adapter.") else n)
    assert report.unbound == ("adapter.weight",) and len(report.bound) == len(views)

    # a name map pointing at a slot the rank does not hold
    module = module_from(shapes_of(views))
    before = snapshot(module)
    with pytest.raises(ValueError, match=r"model.norm.weight \(-> model.final_norm.weight\)"):
        bind_module(module, views, name_map={"model.norm.weight": "model.final_norm.weight"})
    assert unchanged(module, before)

    # a module holding fewer parameters than the rank: the rest reported unused
    part = {n: v for n, v in shapes_of(views).items() if "mlp" not in n}
    report = bind_module(module_from(part), views)
    assert report.unused_slots == tuple(n for n in views if "mlp" in n) and report.unbound == ()  # in slot order

    # a renamed head through a mapping (other names keep their own)
    renamed = module_from({("output.weight" if n == HEAD else n): v for n, v in shapes_of(views).items()})
    report = bind_module(renamed, views, name_map={"output.weight": HEAD})
    assert "output.weight" in report.bound and renamed.output.weight.data_ptr() == views[HEAD].data_ptr()

    with pytest.raises(ValueError, match="nn.Module"):
        bind_module(views, views)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name_map"):
        bind_module(module_from(shapes_of(views)), views, name_map=3)  # type: ignore[arg-type]


def test_fused_views_refuse_what_is_not_one_view():
    def spec_of(order, k_dtype="float32"):
        shapes = {"q": (4, 2), "k": (2, 2), "v": (2, 2), "o": (2, 4)}
        params = [
            ParamSpec(
                f"model.layers.0.self_attn.{p}_proj.weight",
                shapes[p],
                k_dtype if p == "k" else "float32",
                "layer",
                layer=0,
                tp_dim=0 if p != "o" else 1,
            )
            for p in order
        ]
        return ModelSpec("custom", tuple(params), 1)

    for spec, match in (
        (spec_of("qokv"), "not right after model.layers.0.self_attn.q_proj.weight"),
        (spec_of("qkvo", "float64"), "k_proj.weight is float64"),
        (spec_of("qko"), r"not \['model.layers.0.self_attn.v_proj.weight'\]"),
    ):
        layout = Layout(spec, Topology(tp=2))
        with pytest.raises(ValueError, match=match):
            fused_views(layout.at(0), allocate_buffers(layout, 0))
    layout = Layout(spec_of("qkvo"), Topology(tp=2))
    buffers = allocate_buffers(layout, 1)
    fused = fused_views(layout.at(1), buffers)
    assert fused["model.layers.0.self_attn.qkv_proj.weight"].shape == (4, 2)
    assert "model.layers.0.mlp.gate_up_proj.weight" not in fused  # no gate/up in this model


def test_shard_views_check_the_buffers():
    layout = small_layout(tp=2)
    rank = layout.at(0)
    good = allocate_buffers(layout, 0)
    with pytest.raises(ValueError, match="no float64 buffer"):
        shard_views(rank, {"float32": good["float32"]})
    with pytest.raises(ValueError, match="has dtype torch.float16"):
        shard_views(rank, {**good, "float32": good["float32"].half()})
    with pytest.raises(ValueError, match="layout needs"):
        shard_views(rank, {**good, "float32": good["float32"][:-1]})
    with pytest.raises(ValueError, match="flat contiguous"):
        shard_views(rank, {**good, "float32": torch.zeros(2 * good["float32"].numel())[::2]})
    with pytest.raises(ValueError, match="RankLayout"):
        shard_views(layout, good)  # type: ignore[arg-type]
