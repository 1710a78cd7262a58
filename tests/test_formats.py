"""Weight formats (casts, block FP8) on random layouts, against tests/oracle.py.

The expected shards are computed from the full tensors alone: the oracle quantizes (or casts) the
FULL tensor, block by block in a Python loop written from vLLM's ``per_block_cast_to_fp8``, and
slices it with its own Megatron / FSDP2 reading; the scales of a rank are the blocks of its slice.
Every destination buffer must equal that, bit for bit, whichever side converted.
"""

from __future__ import annotations

import json
import pickle
import queue
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from actors.wire.executor import Phases, Staging, StepRunner
from actors.wire.shares import PeerView
from realloc.ckpt.hf import check_declared_format, load_shards, match_spec, save_hf_dir, scan_hf_dir
from realloc.layout import Layout, Topology
from realloc.plan import Placement, plan_reallocation
from realloc.plan.formats import conversion
from realloc.plan.slices import slice_plan
from realloc.shards import ShardStore, allocate_buffers, fused_views
from realloc.shards.convert import (
    Converted,
    NonFiniteBlock,
    check_finite_blocks,
    convert_store,
    dequantize_blocks,
    quantize_blocks,
)
from realloc.shards.local_executor import move_in_process
from realloc.shards.synthetic import synthetic_state_dict
from realloc.spec import spec_from_hf_config
from realloc.spec.formats import WEIGHT_FORMATS, formatted, hf_weight_format, quantized, scale_name

try:
    from tests import oracle
    from tests.test_delta_properties import MemoryTransport
except ImportError:  # pytest put tests/ itself on sys.path
    import oracle
    from test_delta_properties import MemoryTransport

B = oracle.FP8_BLOCK
CONFIGS = Path(__file__).parent / "data" / "configs"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear(p: oracle.Param) -> bool:
    return p.name.endswith(".weight") and any(f".{n}." in p.name for n in LINEAR)


def formatted_full(d: oracle.Decoder, full: dict, fmt: "str | None") -> tuple[dict, dict]:
    """``(tensors in the format, scales by weight name)`` of the full model."""
    if fmt is None:
        return dict(full), {}
    fp8, _, cast = fmt.partition("+")
    if fp8 in ("bfloat16", "float16", "float32"):
        fp8, cast = "", fp8
    out, scales = {}, {}
    for p in oracle.params(d):
        if fp8 and is_linear(p):
            out[p.name], scales[p.name] = oracle.fp8_block_quantize(full[p.name])
        elif cast:
            out[p.name] = full[p.name].to(oracle.TORCH_DTYPES[cast])
        else:
            out[p.name] = full[p.name]
    return out, scales


def block_aligned(d: oracle.Decoder, tp: int) -> bool:
    """Every tp rank's slice of every linear weight starts and ends on a block edge (or the end)."""
    for p in oracle.params(d):
        if not is_linear(p):
            continue
        for r in range(tp):
            first, last = local_corners(d, p, tp, r)
            for dim in (0, 1):
                if first[dim] % B or ((last[dim] + 1) % B and last[dim] + 1 != p.shape[dim]):
                    return False
    return True


def local_corners(d, p, tp, r) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global (row, col) of the first and last element of tp rank ``r``'s slice of ``p``."""
    idx = torch.arange(p.numel, dtype=torch.int64).reshape(p.shape)
    local = oracle.tp_slice(d, p, idx, tp, r)
    first, last = int(local.reshape(-1)[0]), int(local.reshape(-1)[-1])
    return divmod(first, p.shape[1]), divmod(last, p.shape[1])


def expected(d, full_fmt, scales, dp, fsdp, tp, pp, rank) -> dict[str, torch.Tensor]:
    """Slot -> local tensor of ``rank`` (scales included) in the oracle's reading."""
    stages = oracle.pipeline_stages(d.layers, pp)
    out = oracle.local_tensors(d, full_fmt, dp, tp, pp, stages, rank, fsdp=fsdp)
    by_name = {p.name: p for p in oracle.params(d)}
    tp_rank = rank % tp
    for name, s in scales.items():
        if name not in out:
            continue
        first, last = local_corners(d, by_name[name], tp, tp_rank)
        out[name + "_scale_inv"] = s[first[0] // B : last[0] // B + 1, first[1] // B : last[1] // B + 1].clone()
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fill(layout: Layout, rank: int, tensors: dict) -> ShardStore:
    store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
    views = store.shard_tensors()
    assert set(views) == set(tensors), set(views) ^ set(tensors)
    for slot, t in views.items():
        t.copy_(tensors[slot])
    return store


@st.composite
def cases(draw):
    d = oracle.Decoder(
        hidden=256,
        intermediate=draw(st.sampled_from([512, 384, 256])),
        layers=draw(st.integers(1, 3)),
        heads=2,
        kv_heads=draw(st.sampled_from([1, 2])),
        head_dim=128,
        vocab=draw(st.integers(40, 300)),
        tied=draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(["bfloat16", "float32"])),
        norm_dtype="float32",
    )
    src_world = draw(st.sampled_from([4, 2, 1]))
    dst_world = draw(st.sampled_from([4, 2, 1]))
    src = draw(st.sampled_from(oracle.factorisations(d, src_world) + oracle.factorisations4(d, src_world)))
    dst = draw(st.sampled_from(oracle.factorisations(d, dst_world)))
    src_fmt = draw(st.sampled_from([None, None, "fp8_block128", "bfloat16"]))
    dst_fmt = draw(st.sampled_from((None,) + WEIGHT_FORMATS))
    return d, src, dst, src_fmt, dst_fmt, draw(st.integers(0, 3))


def dims(t):
    """``(dp, fsdp, tp, pp)`` of a 3- or 4-tuple factorisation."""
    return (t[0], 1, t[1], t[2]) if len(t) == 3 else t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_moves_between_formats_match_the_oracle(case):
    d, src_t, dst_t, src_fmt, dst_fmt, seed = case
    spec = d.spec()
    (sdp, sfsdp, stp, spp), (ddp, _, dtp, dpp) = dims(src_t), dims(dst_t)
    src_fp8 = src_fmt is not None and src_fmt.startswith("fp8")
    dst_fp8 = dst_fmt is not None and dst_fmt.startswith("fp8")
    assume(not (src_fp8 and (sfsdp > 1 or not block_aligned(d, stp))))
    src = Layout(spec, Topology(dp=sdp, fsdp=sfsdp, tp=stp, pp=spp), weight_format=src_fmt)
    dst_topology = Topology(dp=ddp, tp=dtp, pp=dpp)
    if dst_fp8 and not block_aligned(d, dtp):  # the engine's rule: refused, naming the weight
        with pytest.raises(ValueError, match="not whole 128-blocks"):
            Layout(spec, dst_topology, weight_format=dst_fmt)
        return
    dst = Layout(spec, dst_topology, weight_format=dst_fmt)
    if (src_fp8 and not block_aligned(d, dtp)) and (dst_fp8 and not block_aligned(d, stp)):
        with pytest.raises(ValueError, match="neither side can hold the other's format"):
            conversion(src, dst)  # each topology splits the other's blocks
        return
    full = oracle.full_tensors(d, seed)
    src_full, src_scales = formatted_full(d, full, src_fmt)
    src_world, dst_world = src.topology.world_size, dst.topology.world_size
    src_stores = {r: fill(src, r, expected(d, src_full, src_scales, sdp, sfsdp, stp, spp, r)) for r in range(src_world)}
    dst_stores = {r: ShardStore(dst.shards(r), allocate_buffers(dst, r)) for r in range(dst_world)}
    workers = {"src_workers": list(range(src_world)), "dst_workers": list(range(src_world, src_world + dst_world))}
    placement = Placement.blocks(src_world + dst_world, 2 if (src_world + dst_world) % 2 == 0 else 1)
    out = move_in_process(
        src,
        dst,
        src_stores,
        {w + src_world: s for w, s in dst_stores.items()},
        placement,
        **workers,
    )
    # what the destination should hold: the source's held values converted element by element
    # (or block by block) into the destination's format, wherever the move converted them
    fp8, _, cast = (dst_fmt or "").partition("+")
    if fp8 in ("bfloat16", "float16", "float32"):
        fp8, cast = "", fp8
    dst_full, dst_scales = {}, {}
    for p in oracle.params(d):
        value = src_full[p.name]
        want = oracle.TORCH_DTYPES[cast or p.dtype]
        if fp8 and is_linear(p):
            if p.name in src_scales:
                dst_full[p.name], dst_scales[p.name] = value, src_scales[p.name]
            else:
                dst_full[p.name], dst_scales[p.name] = oracle.fp8_block_quantize(value)
        elif p.name in src_scales:
            dst_full[p.name] = oracle.fp8_block_dequantize(value, src_scales[p.name], want)
        else:
            dst_full[p.name] = value.to(want)
    for r in range(dst_world):
        want = expected(d, dst_full, dst_scales, ddp, 1, dtp, dpp, r)
        got = dst_stores[r].shard_tensors()
        assert set(got) == set(want)
        for slot in want:
            assert same_bits(got[slot], want[slot]), (slot, r, out)
    assert out["conversion"] == conversion(src, dst).where
    event(f"converted on the {out['conversion']}")


def test_quantizer_matches_the_oracle_on_edges_and_tiny_blocks():
    g = torch.Generator().manual_seed(1)
    for shape in [(1, 1), (130, 257), (128, 128), (300, 64)]:
        x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
        x[0, 0] = 0
        values, scales = quantize_blocks(x)
        ref_v, ref_s = oracle.fp8_block_quantize(x)
        assert same_bits(values, ref_v) and same_bits(scales, ref_s)
        back = dequantize_blocks(values, scales, torch.bfloat16)
        assert same_bits(back, oracle.fp8_block_dequantize(ref_v, ref_s, torch.bfloat16))
    zero = torch.zeros(4, 4, dtype=torch.float32)  # amax clamped to 1e-4: zeros stay zero
    values, scales = quantize_blocks(zero)
    assert torch.equal(values.float(), zero) and scales.item() == pytest.approx(1e-4 / 448.0)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 700),
    st.integers(1, 300),
    st.integers(0, 300),
    st.sampled_from([32, 128, 256, 1024]),
    st.sampled_from(["none", "inf", "nan"]),
)
@example(600, 200, 0, 1024, "none")  # several block rows in one chunk
@example(600, 130, 100, 512, "none")  # a head inside a block row, then whole block rows
def test_the_gpus_one_pass_quantizer_gives_the_cpus_bits(m, n, row0, rows, bad):
    """What a GPU runs (block amax in one padded pass, whole block rows scaled at once), run here
    on the CPU: the same bits as the CPU's block-row path and as the oracle, for any box start
    (``row0``: where the box starts in the weight) and chunk of rows, inf and NaN blocks too."""
    from realloc.shards.convert import block_amax_by_rows, block_amax_padded, block_box, block_scales, quantize_into

    g = torch.Generator().manual_seed(m * 1000 + n)
    x = (torch.randn(m, n, generator=g) * 3).to(torch.bfloat16)
    if bad != "none":
        x[m // 2, n // 2] = float(bad)
    by_rows, padded = block_amax_by_rows(x), block_amax_padded(x)
    assert same_bits(by_rows, padded)
    if bad == "none":
        assert same_bits(block_scales(x), oracle.fp8_block_quantize(x)[1])
    # a box of the weight starting at row row0: its blocks' scales, quantized with any chunk of rows
    weight = (torch.randn(row0 + m, n, generator=g) * 3).to(torch.bfloat16)
    scale = block_scales(weight)
    (b0, _), (nb, _) = block_box((row0, 0), (m, n))
    box = weight[row0:]
    want = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    got = torch.empty_like(want)
    quantize_into(box, scale[b0 : b0 + nb], want, (row0, 0), rows=32)
    quantize_into(box, scale[b0 : b0 + nb], got, (row0, 0), rows=rows)
    assert same_bits(got, want)
    assert same_bits(want, oracle.fp8_block_quantize(weight)[0][row0:])


def test_which_parameters_are_quantized():
    spec = oracle.Decoder(256, 512, 2, 2, 2, 128, 100, qkv_bias=True, qk_norm=True).spec()
    names = {p.name for p in spec.params if quantized(p)}
    assert names == {
        f"model.layers.{i}.{m}.{n}.weight"
        for i in range(2)
        for m, ns in (("self_attn", LINEAR[:4]), ("mlp", LINEAR[4:]))
        for n in ns
    }
    fp8 = formatted(spec, "fp8_block128")
    assert all(scale_name(n) in fp8.by_name for n in names)
    assert fp8.by_name["model.embed_tokens.weight"].dtype == spec.by_name["model.embed_tokens.weight"].dtype
    excluded = formatted(spec, "fp8_block128", excluded=("model.layers.1.mlp",))
    assert excluded.by_name["model.layers.1.mlp.up_proj.weight"].dtype == "bfloat16"
    assert pickle.loads(pickle.dumps(fp8)) == fp8


def test_bad_formats_and_layouts_are_refused_before_any_traffic():
    spec = oracle.Decoder(256, 384, 2, 2, 2, 128, 100).spec()
    with pytest.raises(ValueError, match="weight_format 'fp4' is not one of"):
        Layout(spec, Topology(tp=2), weight_format="fp4")
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight: \[0, 192\) of dim 0 on rank 0 of 2"):
        Layout(spec, Topology(tp=2), weight_format="fp8_block128")
    with pytest.raises(ValueError, match="fsdp=2"):
        Layout(spec, Topology(fsdp=2), weight_format="fp8_block128")
    with pytest.raises(ValueError, match="qkv_order"):
        Layout(spec, Topology(tp=1), qkv_order="megatron", weight_format="fp8_block128")
    other = oracle.Decoder(256, 512, 2, 2, 2, 128, 100).spec()
    with pytest.raises(ValueError, match="differ"):
        conversion(Layout(spec, Topology()), Layout(other, Topology(), weight_format="bfloat16"))


def test_the_wire_carries_the_smaller_format_when_the_source_holds_whole_blocks():
    spec = oracle.Decoder(256, 512, 2, 2, 2, 128, 100).spec()
    dst = Layout(spec, Topology(dp=2, tp=2), weight_format="fp8_block128")
    aligned = conversion(Layout(spec, Topology(tp=2, pp=2)), dst)
    assert aligned.where == "source" and aligned.wire.spec == dst.spec
    cut = conversion(Layout(spec, Topology(fsdp=4)), dst)  # FSDP chunks cut blocks: the receivers convert
    assert cut.where == "destination" and cut.wire.topology == dst.topology
    assert conversion(dst, Layout(spec, Topology(dp=4))).where == "destination"  # dequantizing widens


# -- HF checkpoints in block FP8 (DeepSeek-V3's published format) ---------------------------


def fp8_checkpoint(d: oracle.Decoder, full: dict, path) -> dict:
    """A HF directory as DeepSeek-V3 publishes it: linear weights e4m3 with ``weight_scale_inv``
    beside each, the rest bf16 (the oracle's quantizer); returns what it wrote."""
    written = {}
    for p in oracle.params(d):
        if is_linear(p):
            written[p.name], written[p.name + "_scale_inv"] = oracle.fp8_block_quantize(full[p.name])
        else:
            written[p.name] = full[p.name]
    save_hf_dir(written, path, max_shard_bytes=200_000)  # several files: scales apart from weights
    return written


@pytest.mark.parametrize("fmt", [None, "fp8_block128"])
@pytest.mark.parametrize("topology", ["tp=2", "fsdp=3", "dp=2,pp=2"])
def test_an_fp8_checkpoint_imports_into_any_layout(tmp_path, fmt, topology):
    d = oracle.Decoder(256, 512, 2, 2, 2, 128, 100, dtype="bfloat16", norm_dtype="bfloat16")
    spec = d.spec()
    written = fp8_checkpoint(d, oracle.full_tensors(d, 4), tmp_path)
    assert (
        hf_weight_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})[0]
        == "fp8_block128"
    )
    topo = Topology.parse(topology)
    if fmt is not None and topo.fsdp > 1:
        return  # no block-FP8 layout under FSDP (refused: test_bad_formats_...)
    layout = Layout(spec, topo, weight_format=fmt)
    tensors = scan_hf_dir(tmp_path)
    mapping = match_spec(tensors, layout.spec)
    # the destination in the oracle's reading: dequantized (bf16 layouts) or as written (FP8 ones)
    model, scales = {}, {}
    for p in oracle.params(d):
        if p.name + "_scale_inv" in written and fmt is None:
            model[p.name] = oracle.fp8_block_dequantize(written[p.name], written[p.name + "_scale_inv"], torch.bfloat16)
        else:
            model[p.name] = written[p.name]
            if p.name + "_scale_inv" in written:
                scales[p.name] = written[p.name + "_scale_inv"]
    dp, fsdp, tp, pp = topo.dp, topo.fsdp, topo.tp, topo.pp
    for r in range(topo.world_size):
        store = ShardStore(layout.shards(r), allocate_buffers(layout, r))
        load_shards(tmp_path, tensors, mapping, layout.shards(r), store)
        want = expected(d, model, scales, dp, fsdp, tp, pp, r)
        got = store.shard_tensors()
        assert set(got) == set(want)
        for slot in want:
            assert same_bits(got[slot], want[slot]), (slot, r)


def test_a_bf16_checkpoint_imports_quantized_into_an_fp8_layout(tmp_path):
    d = oracle.Decoder(256, 512, 2, 2, 2, 128, 100, dtype="bfloat16", norm_dtype="bfloat16")
    full = oracle.full_tensors(d, 5)
    save_hf_dir(full, tmp_path)
    layout = Layout(d.spec(), Topology(tp=2), weight_format="fp8_block128")
    tensors = scan_hf_dir(tmp_path)
    model, scales = formatted_full(d, full, "fp8_block128")
    for r in range(2):
        store = ShardStore(layout.shards(r), allocate_buffers(layout, r))
        load_shards(tmp_path, tensors, match_spec(tensors, layout.spec), layout.shards(r), store)
        want, got = expected(d, model, scales, 1, 1, 2, 1, r), store.shard_tensors()
        assert set(got) == set(want) and all(same_bits(got[k], want[k]) for k in want)


def test_an_fp8_checkpoint_without_its_scales_is_refused(tmp_path):
    d = oracle.Decoder(256, 512, 1, 2, 2, 128, 100, dtype="bfloat16", norm_dtype="bfloat16")
    written = fp8_checkpoint(d, oracle.full_tensors(d, 6), tmp_path / "a")
    del written["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_hf_dir(written, tmp_path / "b")
    with pytest.raises(ValueError, match=r"up_proj.weight is float8_e4m3fn, but .*weight_scale_inv .* is missing"):
        match_spec(scan_hf_dir(tmp_path / "b"), d.spec())
    with pytest.raises(ValueError, match="not block FP8"):
        hf_weight_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}})


def test_a_bf16_checkpoint_with_stale_scales_is_refused_naming_them(tmp_path):
    """A bf16 checkpoint that still carries ``*_scale_inv`` tensors of an earlier FP8 export: read
    into an FP8 layout, its weights were quantized with their own scales and then those scales
    overwritten with the stale ones (weights served 3x too large, no error). The checkpoint's
    dtypes say the weights are not quantized, so the scales beside them are refused, named, by
    the driver's check (before any traffic), for any layout."""
    d = oracle.Decoder(256, 512, 1, 2, 2, 128, 100, dtype="bfloat16", norm_dtype="bfloat16")
    full = oracle.full_tensors(d, 7)
    stale = dict(full)
    name = "model.layers.0.self_attn.o_proj.weight"
    stale[name + "_scale_inv"] = oracle.fp8_block_quantize(full[name] * 3)[1]
    save_hf_dir(stale, tmp_path)
    tensors = scan_hf_dir(tmp_path)
    for spec in (d.spec(), formatted(d.spec(), "fp8_block128")):
        with pytest.raises(ValueError, match=rf"{name}_scale_inv' beside '{name}' \(bfloat16\)") as err:
            match_spec(tensors, spec)
        assert pickle.loads(pickle.dumps(err.value)).args == err.value.args


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("src_topology", ["tp=2", "fsdp=2"])
def test_an_inf_or_nan_in_a_weight_to_quantize_is_refused_naming_the_block(bad, src_topology):
    """One inf/NaN in a weight quantized to block FP8 made its whole 128 x 128 block NaN (scale
    inf or NaN) with no error. The quantizer refuses it naming the tensor and the block (global
    block indices, whichever rank's box holds it), on the senders (tp=2 holds whole blocks) and
    on the receivers (FSDP chunks cut blocks); the pure quantizer too."""
    d = oracle.Decoder(256, 512, 1, 2, 2, 128, 100, dtype="bfloat16", norm_dtype="float32")
    spec, name = d.spec(), "model.layers.0.mlp.gate_proj.weight"
    full = oracle.full_tensors(d, 2)
    full[name][300, 200] = bad  # rows 256.. are tp rank 1's: block (2, 1) of the weight
    src = Layout(spec, Topology.parse(src_topology))
    t = src.topology
    stores = {r: fill(src, r, oracle.local_tensors(d, full, t.dp, t.tp, t.pp, [[0]], r, fsdp=t.fsdp)) for r in range(2)}
    dst = Layout(spec, Topology(dp=2), weight_format="fp8_block128")
    dst_stores = {r + 2: ShardStore(dst.shards(r), allocate_buffers(dst, r)) for r in range(2)}
    block = rf"{name}: block \(2, 1\) \(rows \[256, 384\), columns \[128, 256\)\) holds inf or NaN"
    with pytest.raises(NonFiniteBlock, match=block) as err:
        move_in_process(src, dst, stores, dst_stores, Placement.blocks(4, 2), src_workers=[0, 1], dst_workers=[2, 3])
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)
    with pytest.raises(NonFiniteBlock, match=r"^w: block \(2, 1\)"):
        check_finite_blocks(quantize_blocks(full[name])[1], "w")
    if t.tp == 2:  # a sender collects them instead, writing on (it must finish its routes, then fail)
        wire = Layout(spec, t, weight_format="fp8_block128")
        out, source = ShardStore(wire.shards(1), allocate_buffers(wire, 1)), Converted(stores[1], *specs(src, wire))
        assert convert_store(source, out) > 0
        assert [str(e) for e in source.failed] == [str(err.value)]


def specs(src: Layout, dst: Layout) -> tuple[dict, dict]:
    return src.spec.by_name, dst.spec.by_name


def test_a_checkpoint_whose_config_and_dtypes_disagree_is_refused(tmp_path):
    """A checkpoint is read as the format its config.json and its dtypes both say: a bf16 re-export
    that kept DeepSeek-V3's FP8 quantization_config, or FP8 weights under a config without one, are
    refused naming a tensor; agreeing ones (or no config.json) pass."""
    d = oracle.Decoder(256, 512, 1, 2, 2, 128, 100, dtype="bfloat16", norm_dtype="bfloat16")
    full, spec = oracle.full_tensors(d, 8), d.spec()
    fp8_config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    save_hf_dir(full, tmp_path / "bf16", extra={"config.json": fp8_config})
    with pytest.raises(
        ValueError, match=r"declares fp8_block128 .* e\.g\. 'model\.layers\.0\.self_attn\.q_proj\.weight'"
    ):
        check_declared_format(tmp_path / "bf16", scan_hf_dir(tmp_path / "bf16"), spec)
    written = fp8_checkpoint(d, full, tmp_path / "fp8")
    save_hf_dir(written, tmp_path / "fp8", extra={"config.json": {"model_type": "llama"}})
    with pytest.raises(ValueError, match=r"declares no quantization_config, but .* float8_e4m3fn"):
        check_declared_format(tmp_path / "fp8", scan_hf_dir(tmp_path / "fp8"), formatted(spec, "fp8_block128"))
    save_hf_dir(written, tmp_path / "ok", extra={"config.json": fp8_config})
    check_declared_format(tmp_path / "ok", scan_hf_dir(tmp_path / "ok"), spec)
    save_hf_dir(full, tmp_path / "plain", extra={"config.json": {"model_type": "llama"}})
    check_declared_format(tmp_path / "plain", scan_hf_dir(tmp_path / "plain"), spec)


MOE = oracle.MoeDecoder(256, 256, 2, 2, 2, 128, 64, experts=4, moe_inter=256, shared_inter=256, dense_layers=1)


def moe_into(dst: Layout, seed: int) -> tuple[dict, dict, dict, dict]:
    """MOE's weights (seed) moved from a bf16 tp=2 trainer into ``dst`` in process: ``(quantized
    full tensors, their scales by weight, the destination buffers by rank, move_in_process's counts)``."""
    full = oracle.moe_full_tensors(MOE, seed)
    quant, scales = {}, {}
    for p in oracle.moe_params(MOE):
        if is_linear(p):
            quant[p.name], scales[p.name] = oracle.fp8_block_quantize(full[p.name])
        else:
            quant[p.name] = full[p.name]
    src = Layout(MOE.spec(), Topology(tp=2))
    src_stores = {r: ShardStore(src.shards(r), allocate_buffers(src, r)) for r in range(2)}
    for r, store in src_stores.items():
        locals_ = oracle.moe_local_tensors(MOE, full, 1, 2, 1, 1, 2, [[0, 1]], r)
        for slot, view in store.shard_tensors().items():
            view.copy_(locals_[slot])
    world = dst.topology.world_size
    bufs = {r: allocate_buffers(dst, r) for r in range(world)}
    out = move_in_process(
        src,
        dst,
        src_stores,
        {r + 2: ShardStore(dst.shards(r), bufs[r]) for r in range(world)},
        Placement.blocks(2 + world, 2),
        src_workers=[0, 1],
        dst_workers=list(range(2, 2 + world)),
    )
    return quant, scales, bufs, out


@pytest.mark.parametrize("dst_topology", ["dp=2,ep=2", "tp=2,ep=2,etp=1", "dp=2,tp=2,ep=4,etp=1"])
def test_moe_experts_and_shared_experts_quantize_under_expert_parallelism(dst_topology):
    """A Qwen2-MoE (routed experts, a shared expert, a router, a dense layer) from a bf16 tp=2
    trainer into block-FP8 expert-parallel generators: routed and shared experts quantized (their
    scales with them, cut by etp), the router and the shared expert's gate not."""
    dst = Layout(MOE.spec(), Topology.parse(dst_topology), weight_format="fp8_block128")
    quant, scales, bufs, out = moe_into(dst, 3)
    assert any(".experts.0." in n for n in scales) and any("shared_expert." in n for n in scales)
    assert not any(n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) for n in scales)
    assert out["conversion"] == "source"
    t, index = dst.topology, oracle.moe_full_tensors(MOE, index=True)
    for r in range(t.world_size):
        args = (t.dp, t.tp, t.pp, t.ep, t.expert_tp, [[0, 1]], r)
        want = oracle.moe_local_tensors(MOE, quant, *args)
        where = oracle.moe_local_tensors(MOE, index, *args)
        for name, s in scales.items():
            if name in where:  # the blocks of the rank's slice, from its first and last element
                cols = index[name].shape[1]
                (r0, c0), (r1, c1) = (
                    divmod(int(where[name].reshape(-1)[0]), cols),
                    divmod(int(where[name].reshape(-1)[-1]), cols),
                )
                want[name + "_scale_inv"] = s[r0 // B : r1 // B + 1, c0 // B : c1 // B + 1]
        got = ShardStore(dst.shards(r), bufs[r]).shard_tensors()
        assert set(got) == set(want)
        for slot in want:
            assert same_bits(got[slot], want[slot]), (dst_topology, r, slot)


@pytest.mark.parametrize("dst_topology", ["dp=2,ep=2,etp=1", "tp=2,ep=1,etp=2"])
def test_vllm_fused_fp8_expert_buffers(dst_topology):
    """``expert_order="vllm"`` in block FP8: FusedMoE's ``w13_weight`` / ``w2_weight`` (e4m3) and
    ``w13_weight_scale_inv`` ``[experts, 2 * ceil(inter / etp / 128), ceil(hidden / 128)]`` /
    ``w2_weight_scale_inv`` as vLLM's Fp8MoEMethod creates them (per expert the gate's scales, then
    the up's), each one view of the rank's buffers, equal to the oracle's vLLM stacks of the
    quantized tensors and of their scales."""
    dst = Layout(MOE.spec(), Topology.parse(dst_topology), expert_order="vllm", weight_format="fp8_block128")
    quant, scales, bufs, _ = moe_into(dst, 5)
    t = dst.topology
    pre = "model.layers.1.mlp.experts."
    for r in range(t.world_size):
        etp_rank, ep_rank, _, _ = oracle.expert_mesh_coords(r, t.dp, t.tp, t.pp, t.ep, t.expert_tp)
        experts = oracle.local_experts(MOE.experts, t.ep, ep_rank)
        views = fused_views(dst.at(r), bufs[r])
        for name, stack, source in (
            ("w13_weight", oracle.vllm_w13, quant),
            ("w13_weight_scale_inv", oracle.vllm_w13, scales),
            ("w2_weight", oracle.vllm_w2, quant),
            ("w2_weight_scale_inv", oracle.vllm_w2, scales),
        ):
            assert same_bits(views[pre + name], stack(source, 1, experts, t.expert_tp, etp_rank)), (r, name)
        assert views[pre + "w13_weight_scale_inv"].shape == (len(experts), 2 * -(-256 // t.expert_tp // 128), 2)


@pytest.mark.parametrize("topology", ["tp=1", "dp=2,ep=2,etp=1", "tp=2,ep=1,etp=2"])
def test_fused_moe_fp8_refuses_an_expert_ffn_that_is_not_whole_blocks_at_any_etp(topology):
    """vLLM 0.32 holds a block-FP8 FusedMoE whose moe_intermediate_size / etp is not a multiple of
    128, even at etp=1 (192 rows here), with its scales on another grid than the checkpoint's
    (refine_fp8_moe_block_shape, vllm/model_executor/layers/fused_moe/oracle/fp8.py; checked against
    vLLM's own FusedMoE in tests/test_vllm_fp8_layers_pure.py): refused. Per-expert tensors
    (expert_order='hf') stay accepted where every rank holds whole blocks."""
    moe = oracle.MoeDecoder(256, 256, 2, 2, 2, 128, 64, experts=4, moe_inter=192, shared_inter=256, dense_layers=1)
    topo = Topology.parse(topology)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight has 192 rows.*multiple of 128, at any etp"):
        Layout(moe.spec(), topo, expert_order="vllm", weight_format="fp8_block128")
    if topo.expert_tp == 1:
        Layout(moe.spec(), topo, weight_format="fp8_block128")
    Layout(moe.spec(), topo, expert_order="vllm")  # bf16 FusedMoE has no such rule


DEEPSEEK_V3 = {  # a small DeepSeek-V3 (MLA with q LoRA, a dense layer, routed + shared experts, router bias)
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "n_routed_experts": 2,
    "n_shared_experts": 1,
    "num_experts_per_tok": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 1,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "torch_dtype": "bfloat16",
}


def test_deepseek_mla_kv_a_proj_with_mqa_is_quantized_as_vllm_and_the_checkpoint_hold_it(tmp_path):
    """vLLM builds ``kv_a_proj_with_mqa`` with the quant config (a ReplicatedLinear, or part of
    ``fused_qkv_a_proj``: vllm/model_executor/models/deepseek_v2.py) and DeepSeek-V3's published
    checkpoint holds it in e4m3 with ``weight_scale_inv`` [ceil(576/128), 56]; it was left in bf16.
    A DeepSeek-V3-style FP8 checkpoint now imports into an FP8 layout as written, its scales too."""
    spec = spec_from_hf_config(DEEPSEEK_V3)
    fp8 = formatted(spec, "fp8_block128")
    attn = "model.layers.0.self_attn."
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert fp8.by_name[f"{attn}{proj}.weight"].dtype == "float8_e4m3fn", proj
        assert fp8.by_name[f"{attn}{proj}.weight_scale_inv"].shape == tuple(
            -(-n // B) for n in spec.by_name[f"{attn}{proj}.weight"].shape
        )
    assert fp8.by_name[attn + "kv_a_layernorm.weight"].dtype == "bfloat16"
    published = formatted(spec_from_hf_config(json.loads((CONFIGS / "DeepSeek-V3.json").read_text())), "fp8_block128")
    assert published.by_name[scale_name(attn + "kv_a_proj_with_mqa.weight")].shape == (5, 56)
    written, full = {}, synthetic_state_dict(spec, 3)
    for p in spec.params:  # the published format: every quantized weight e4m3 with its scales
        t = full[p.name]
        if quantized(p):
            written[p.name], written[scale_name(p.name)] = oracle.fp8_block_quantize(t)
        else:
            written[p.name] = t
    save_hf_dir(written, tmp_path)
    layout = Layout(spec, Topology(), weight_format="fp8_block128")
    tensors = scan_hf_dir(tmp_path)
    store = ShardStore(layout.shards(0), allocate_buffers(layout, 0))
    load_shards(tmp_path, tensors, match_spec(tensors, layout.spec), layout.shards(0), store)
    got = store.shard_tensors()
    assert set(got) == set(written)
    assert all(same_bits(got[n], written[n]) for n in written)


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", "fp8_block128+bfloat16"])
def test_cast_formats_keep_deepseek_v3s_router_bias_in_float32(fmt):
    """transformers keeps ``e_score_correction_bias`` in float32 (``_keep_in_fp32_modules_strict``,
    models/deepseek_v3/modeling_deepseek_v3.py) and vLLM creates it float32
    (vllm/model_executor/models/deepseek_v2.py): a cast format casts every other floating tensor."""
    spec = spec_from_hf_config({**DEEPSEEK_V3, "torch_dtype": "float32"})
    out = formatted(spec, fmt)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert spec.by_name[bias].dtype == out.by_name[bias].dtype == "float32"
    cast = fmt.rpartition("+")[2]
    assert out.by_name["model.layers.1.mlp.gate.weight"].dtype == cast
    assert out.by_name["model.norm.weight"].dtype == cast


@pytest.mark.parametrize("src_fmt,dst_fmt", [(None, "fp8_block128"), ("fp8_block128", None)])
def test_moves_between_formats_with_balanced_pipeline_stages(src_fmt, dst_fmt):
    """``pp_split="balanced"`` splits by bytes, so the same rule gives other stages in another
    format (3/3/2 for float32, 2/4/2 in FP8 here): the wire layout took the rule again and the
    move raised KeyError. The wire now keeps the converting side's own stages; every shard equals
    the oracle's, read with each side's own stages."""
    d = oracle.Decoder(256, 512, 8, 2, 2, 128, 1000, dtype="float32", norm_dtype="float32")
    spec = d.spec()
    src = Layout(spec, Topology(pp=3, pp_split="balanced"), weight_format=src_fmt)
    dst = Layout(spec, Topology(pp=3, pp_split="balanced"), weight_format=dst_fmt)
    assert src.layer_counts != dst.layer_counts  # the case: other stages in the other format
    full = oracle.full_tensors(d, 1)
    src_full, src_scales = formatted_full(d, full, src_fmt)
    dst_full, dst_scales = formatted_full(d, full, dst_fmt)
    if src_fmt is not None:  # FP8 -> float32: what the FP8 side holds, dequantized
        dst_full = {
            n: oracle.fp8_block_dequantize(t, src_scales[n], torch.float32) if n in src_scales else t
            for n, t in src_full.items()
        }
    stages = {id(lay): [list(r) for r in lay.stages] for lay in (src, dst)}

    def local(lay, tensors, scales, r):
        out = oracle.local_tensors(d, tensors, 1, 1, 3, stages[id(lay)], r)
        out.update({n + "_scale_inv": s for n, s in scales.items() if n in out})
        return out

    src_stores = {r: fill(src, r, local(src, src_full, src_scales, r)) for r in range(3)}
    dst_stores = {r + 3: ShardStore(dst.shards(r), allocate_buffers(dst, r)) for r in range(3)}
    out = move_in_process(
        src, dst, src_stores, dst_stores, Placement.blocks(6, 3), src_workers=[0, 1, 2], dst_workers=[3, 4, 5]
    )
    assert out["conversion"] == conversion(src, dst).where
    assert conversion(src, dst).wire.layer_counts == (src if out["conversion"] == "source" else dst).layer_counts
    for r in range(3):
        want, got = local(dst, dst_full, dst_scales, r), dst_stores[r + 3].shard_tensors()
        assert set(got) == set(want)
        for slot in want:
            assert same_bits(got[slot], want[slot]), (r, slot)


def test_fused_views_of_an_fp8_layout_with_float32_biases():
    """A Llama with MLP and q/k/v biases in float32, served in block FP8: the biases share the
    float32 buffer with the scales, and ``gate_proj.bias`` sat between the up weight's scales and
    ``up_proj.bias`` (fused_views raised). Now vLLM's ``gate_up_proj.bias`` and ``qkv_proj.bias``
    are one view each, ``[gate; up]`` / ``[q; k; v]`` of the rank, and the scales of gate and up
    stay adjacent too."""
    llama = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "attention_bias": True,
        "mlp_bias": True,
        "torch_dtype": "float32",
    }
    layout = Layout(spec_from_hf_config(llama), Topology(tp=2), weight_format="fp8_block128")
    for r in range(2):
        bufs = allocate_buffers(layout, r)
        for t in bufs.values():
            t.view(torch.uint8).copy_(torch.randint(0, 255, (t.view(torch.uint8).numel(),), dtype=torch.uint8))
        views = fused_views(layout.at(r), bufs)
        pre = "model.layers.0."
        for fused, parts in (
            ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
            ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ):
            bias = views[pre + fused + ".bias"]
            assert bias.dtype == torch.float32 and bias.data_ptr() == views[pre + parts[0] + ".bias"].data_ptr()
            assert same_bits(bias, torch.cat([views[pre + p + ".bias"] for p in parts]))
            assert same_bits(views[pre + fused + ".weight"], torch.cat([views[pre + p + ".weight"] for p in parts]))
        gate_s, up_s = views[pre + "mlp.gate_proj.weight_scale_inv"], views[pre + "mlp.up_proj.weight_scale_inv"]
        assert up_s.data_ptr() == gate_s.data_ptr() + gate_s.numel() * 4  # [gate; up] scales adjacent


def test_fused_views_of_deepseek_mla_without_q_lora():
    """DeepSeek-V2-Lite (``q_lora_rank=None``): ``q_proj`` beside ``kv_a_proj_with_mqa``, no k/v.
    vLLM has no qkv_proj there (deepseek_v2.py: q_proj is its own ColumnParallelLinear) nor Megatron
    a linear_qkv; fused_views raised for the missing k/v. The dense layer's gate_up_proj remains."""
    lite = {
        "model_type": "deepseek_v2",
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 2,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
    }
    layout = Layout(spec_from_hf_config(lite), Topology(tp=2))
    for convention, fc1 in (("vllm", "mlp.gate_up_proj.weight"), ("megatron", "mlp.linear_fc1.weight")):
        views = fused_views(layout.at(1), allocate_buffers(layout, 1), convention=convention)
        assert not any("qkv" in n for n in views)
        gate, up = views["model.layers.0.mlp.gate_proj.weight"], views["model.layers.0.mlp.up_proj.weight"]
        assert views["model.layers.0." + fc1].shape == (gate.shape[0] + up.shape[0], 32)


def test_expert_views_with_megatron_qkv_and_vllm_experts():
    """``qkv_order="megatron"`` with ``expert_order="vllm"``: the vLLM convention cannot give
    qkv_proj (a slot held as several per-group shards) and the Megatron one gave no expert views.
    The Megatron convention now gives linear_qkv and FusedMoE's w13_weight / w2_weight, equal to
    the oracle's vLLM stacks."""
    dst = Layout(MOE.spec(), Topology.parse("dp=2,ep=2,etp=1"), qkv_order="megatron", expert_order="vllm")
    _, _, bufs, _ = moe_into(dst, 6)
    full = oracle.moe_full_tensors(MOE, 6)
    t = dst.topology
    for r in range(t.world_size):
        with pytest.raises(ValueError, match="use convention='megatron'"):
            fused_views(dst.at(r), bufs[r])
        views = fused_views(dst.at(r), bufs[r], convention="megatron")
        etp_rank, ep_rank, _, _ = oracle.expert_mesh_coords(r, t.dp, t.tp, t.pp, t.ep, t.expert_tp)
        experts = oracle.local_experts(MOE.experts, t.ep, ep_rank)
        pre = "model.layers.1.mlp.experts."
        assert same_bits(views[pre + "w13_weight"], oracle.vllm_w13(full, 1, experts, t.expert_tp, etp_rank))
        assert same_bits(views[pre + "w2_weight"], oracle.vllm_w2(full, 1, experts, t.expert_tp, etp_rank))
        assert "model.layers.1.self_attention.linear_qkv.weight" in views


@pytest.mark.parametrize("dst_topology", ["tp=1", "tp=2", "dp=2,tp=2"])
def test_transformers_fp8_experts_stacks(dst_topology):
    """FP8 with ``expert_order="hf_stacked"`` was refused, though transformers 5 runs it:
    ``FP8Experts`` (src/transformers/integrations/finegrained_fp8.py) holds ``gate_up_proj``
    ``[E, 2 * inter, hidden]`` and ``down_proj`` in e4m3 beside ``gate_up_proj_scale_inv``
    ``[E, ceil(2 * inter / 128), ceil(hidden / 128)]`` and ``down_proj_scale_inv``. Moved from a bf16
    trainer, each is one view of the rank's buffers equal to the oracle's stacks of the quantized
    tensors and of their scales (per expert its gate rows then its up rows; tp: the rank's rows)."""
    dst = Layout(MOE.spec(), Topology.parse(dst_topology), expert_order="hf_stacked", weight_format="fp8_block128")
    quant, scales, bufs, out = moe_into(dst, 9)
    assert out["conversion"] == "source"
    t, pre, experts = dst.topology, "model.layers.1.mlp.experts.", range(MOE.experts)
    for r in range(t.world_size):
        views = fused_views(dst.at(r), bufs[r])
        tp_rank = r % t.tp
        for name, stack, source in (
            ("gate_up_proj", oracle.vllm_w13, quant),
            ("gate_up_proj_scale_inv", oracle.vllm_w13, scales),
            ("down_proj", oracle.vllm_w2, quant),
            ("down_proj_scale_inv", oracle.vllm_w2, scales),
        ):
            assert same_bits(views[pre + name], stack(source, 1, experts, t.tp, tp_rank)), (r, name)
        inter = 256 // t.tp
        assert views[pre + "gate_up_proj_scale_inv"].shape == (MOE.experts, -(-2 * inter // B), 2)
    moe = oracle.MoeDecoder(256, 256, 2, 2, 2, 128, 64, experts=4, moe_inter=192, shared_inter=256, dense_layers=1)
    with pytest.raises(ValueError, match="FP8Experts .* cannot hold an expert intermediate size per partition"):
        Layout(moe.spec(), Topology(), expert_order="hf_stacked", weight_format="fp8_block128")


def test_megatron_block_fp8_is_refused_saying_why():
    """Megatron-core's block FP8 is Transformer Engine's Float8BlockwiseQTensor (padded scales, a
    transposed copy, TE's quantizer): not this format; the refusal says so and what to do."""
    spec = oracle.Decoder(256, 512, 2, 2, 2, 128, 100).spec()
    with pytest.raises(ValueError, match=r"Float8BlockwiseQTensor.*padded to a multiple of 4.*qkv_order='hf'"):
        Layout(spec, Topology(), qkv_order="megatron", weight_format="fp8_block128")


# -- conversions in the bucket pipeline: senders that convert message by message ---------------


def run_converting(plan, peers, held, out, sources, read: bool) -> tuple[dict, dict]:
    """Run ``plan`` with one :class:`StepRunner` per worker (threads, an in-memory transport):
    senders hold ``held[w]`` and convert with ``sources[w]``; ``read``: same-node receivers map the
    senders' ``held`` stores and convert what they read. Returns each worker's timeline and its
    ``conversion_failures()``."""
    boxes = {(i, j): queue.Queue() for i in range(len(peers)) for j in range(len(peers))}
    timelines = {w: Phases() for w in range(len(peers))}
    failures, errors = {}, []

    def worker(w: int) -> None:
        try:
            share = slice_plan(plan, [w])[0]
            assert not share.local  # two groups: every box crosses the transport
            runner = StepRunner(
                MemoryTransport(boxes, w),
                torch.device("cpu"),
                share,
                w,
                peers,
                held.get(w),
                out.get(w),
                open_peer=(lambda view, forward: held[view.world_rank]) if read else None,
                staging=Staging(torch.device("cpu")),
                convert=sources.get(w),
                timeline=timelines[w],
            )
            for s, routes in share.routes_by_step().items():
                runner.run_step(s, routes)
            failures[w] = runner.conversion_failures()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append((w, err))

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(len(peers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    return timelines, failures


def test_a_reader_that_converts_fails_on_a_block_it_cannot_quantize():
    """A receiver that reads a converting sender's buffers where they are converts what it reads;
    a block of inf there is its failure to raise (after its routes), as it is a sender's that
    converts as it packs; the sender, whose buffers were read, reports none."""
    d = oracle.Decoder(hidden=256, intermediate=512, layers=1, heads=2, kv_heads=2, head_dim=128, vocab=100)
    spec = d.spec()
    src = Layout(spec, Topology(tp=2))
    dst = Layout(spec, Topology(dp=1), weight_format="fp8_block128")
    conv = conversion(src, dst)
    assert conv.where == "source"
    plan = plan_reallocation(
        conv.wire.spec,
        conv.wire,
        dst,
        Placement.blocks(3, 3),
        bucket_bytes=1 << 20,
        src_workers=[0, 1],
        dst_workers=[2],
    )
    full = oracle.full_tensors(d, 0)
    held = {r: fill(src, r, expected(d, full, {}, 1, 1, 2, 1, r)) for r in range(2)}
    name = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: rank 1 holds columns 128-255
    held[1].view(name, (0, 128), (256, 128))[130, 5] = float("inf")
    out = {2: ShardStore(dst.shards(0), allocate_buffers(dst, 0))}
    peers = [PeerView(w, plan.nodes[w], conv.wire.at(w), None, shared=True, held=src.at(w)) for w in range(2)]
    peers.append(PeerView(2, plan.nodes[2], None, dst.at(0)))
    sources = {w: Converted(held[w], src.spec.by_name, conv.wire.spec.by_name) for w in held}
    timelines, failures = run_converting(plan, peers, held, out, sources, True)
    assert sum(step[5] == "read" for step in timelines[2].steps) == 2  # both senders read, none sent
    assert not failures[0] and not failures[1]
    assert [(e.args[0].split(":")[0]) for e in failures[2]] == [name]
    assert "block (1, 1)" in str(failures[2][0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from([1024, 3000, 4096, 70_000, 1 << 22]), st.booleans())
def test_senders_convert_message_by_message_into_the_oracles_format(case, bucket_bytes, read):
    """A plan whose sources are the wire layout (the senders' topology in the destination's
    format) run by one :class:`StepRunner` per worker (threads, an in-memory transport) whose
    sender holds its own format and converts each message as it packs it
    (:class:`~realloc.shards.convert.Converted`): no converted copy of any shard. Buckets as small
    as 1 KiB cut quantized weights mid-block (a piece's scales are then computed from the
    whole blocks it touches); every destination shard must equal the oracle's quantizer (or cast)
    applied to the full tensors, bit for bit. ``read``: the senders share their buffers
    (``PeerView.held``: what they hold), so a receiver on a sender's node reads them where they
    are and converts what it reads, with the same bits."""

    d, src_t, dst_t, _, dst_fmt, seed = case
    assume(dst_fmt is not None)
    spec = d.spec()
    (sdp, sfsdp, stp, spp), (ddp, _, dtp, dpp) = dims(src_t), dims(dst_t)
    assume(sfsdp == 1 and block_aligned(d, stp) and block_aligned(d, dtp))
    src = Layout(spec, Topology(dp=sdp, tp=stp, pp=spp))
    dst = Layout(spec, Topology(dp=ddp, tp=dtp, pp=dpp), weight_format=dst_fmt)
    conv = conversion(src, dst)
    assume(conv.where == "source")
    n_src, n_dst = src.topology.world_size, dst.topology.world_size
    one_node = read and seed % 2  # every route a read; else reads only where a sender shares a node
    per_node = n_src + n_dst if one_node else 2 if (n_src + n_dst) % 2 == 0 else 1
    placement = Placement.blocks(n_src + n_dst, per_node)
    workers = {"src_workers": list(range(n_src)), "dst_workers": list(range(n_src, n_src + n_dst))}
    plan = plan_reallocation(conv.wire.spec, conv.wire, dst, placement, bucket_bytes=bucket_bytes, **workers)
    full = oracle.full_tensors(d, seed)
    held = {r: fill(src, r, expected(d, full, {}, sdp, 1, stp, spp, r)) for r in range(n_src)}
    out = {n_src + r: ShardStore(dst.shards(r), allocate_buffers(dst, r)) for r in range(n_dst)}
    peers = [
        PeerView(w, plan.nodes[w], conv.wire.at(w), None, shared=read, held=src.at(w) if read else None)
        for w in range(n_src)
    ]
    peers += [PeerView(w, plan.nodes[w], None, dst.at(w - n_src)) for w in range(n_src, n_src + n_dst)]
    sources = {w: Converted(held[w], src.spec.by_name, conv.wire.spec.by_name) for w in held}
    timelines, failures = run_converting(plan, peers, held, out, sources, read)
    assert not any(failures.values()), failures
    same_node = any(plan.nodes[a] == plan.nodes[b] for _, a, b, _ in plan.routes() if a < n_src)
    reads = sum(step[5] == "read" for t in timelines.values() for step in t.steps)
    assert (reads > 0) == (read and same_node), (reads, read, same_node)
    dst_full, dst_scales = formatted_full(d, full, dst_fmt)
    for r in range(n_dst):
        want = expected(d, dst_full, dst_scales, ddp, 1, dtp, dpp, r)
        got = out[n_src + r].shard_tensors()
        assert set(got) == set(want)
        for slot in want:
            assert same_bits(got[slot], want[slot]), (slot, r)
    event(f"{dst_fmt}, {len(plan.buckets(0)) if plan.routes() else 0} buckets in the first list")
    event(f"read where they are: {reads > 0} (read={read}, one node={bool(one_node)})")
