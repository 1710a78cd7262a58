"""realloc's block-FP8 vLLM layout against vLLM's own FP8 layers and weight loaders, in this process.

The layout of a block-FP8 (``fp8_block128``) model in a vLLM engine (:func:`actors.driver.vllm.vllm_layout`
of a :func:`realloc.spec.formats.formatted` spec; ``expert_order="vllm"`` for MoE) is checked rank by rank
against the layers vLLM builds with ``Fp8Config(weight_block_size=[128, 128])``
(vllm/model_executor/layers/quantization/fp8.py ``Fp8LinearMethod.create_weights``,
``Fp8MoEMethod.create_weights``; utils/fp8_utils.py ``validate_fp8_block_shape``,
``create_fp8_scale_parameter``):

* dense: ``QKVParallelLinear`` (kv heads split and replicated), ``MergedColumnParallelLinear``
  (gate_up) and ``RowParallelLinear`` (o_proj, down_proj), each ``weight`` (e4m3) and
  ``weight_scale_inv`` (float32, one per 128 x 128 block) loaded by vLLM's own ``weight_loader``
  (linear.py ``weight_loader_v2``: ``adjust_block_scale_shard`` for the scales);
* MoE: ``FusedMoE`` (layer.py ``FusedMoEFactory``; routed_experts.py ``RoutedExperts.weight_loader``,
  ``_load_w13`` / ``_load_w2``) under tensor parallelism and under expert parallelism
  (``enable_expert_parallel``: linear placement, expert_map_manager.py ``determine_expert_map``),
  ``w13_weight`` / ``w2_weight`` and their ``_weight_scale_inv``.

Each vLLM parameter loaded from the full checkpoint tensors (quantized by vLLM's own
``per_block_cast_to_fp8``, vllm/utils/deep_gemm.py) must equal, bit for bit, realloc's tensors of
that rank (its buffers filled from the same full tensors, seen through ``fused_views``), and the
boxes vLLM's loaders read (``FakeRDTTensor`` stand-ins, as actors/vllm/bake.py records them) must
be the layout's boxes, as the driver's ``check_derived`` demands.

Only vLLM's tp group (``get_tp_group``) and the model config's dtype are stood in for; the layers,
their parameters and their loaders are vLLM's. No engine, no processes.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from actors.driver.vllm import vllm_layout  # noqa: E402
from actors.vllm.bake import chain_box  # noqa: E402
from realloc.layout import Layout, Topology  # noqa: E402
from realloc.shards import allocate_buffers, fused_views  # noqa: E402
from realloc.shards.convert import quantize_blocks  # noqa: E402
from realloc.shards.store import TORCH_DTYPES, local_tensor  # noqa: E402
from realloc.spec import decoder_spec, spec_from_hf_config  # noqa: E402
from realloc.spec.formats import FP8, formatted, scale_name  # noqa: E402

FP8_FORMAT = "fp8_block128"


@contextmanager
def vllm_rank(tp: int, rank: int, expert_parallel: bool = False):
    """vLLM's layers built (and loading) as tp rank ``rank`` of ``tp``, with a model config of bf16."""
    import vllm.distributed.parallel_state as ps
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.config import VllmConfig, set_current_vllm_config

    cfg = VllmConfig()
    cfg.parallel_config.enable_expert_parallel = expert_parallel
    model = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))
    group = SimpleNamespace(rank_in_group=rank, world_size=tp)
    with (
        mock.patch.object(ps, "get_tp_group", return_value=group),
        mock.patch.object(fp8, "get_current_vllm_config", return_value=model),
        set_current_vllm_config(cfg),
    ):
        yield


def _quant_config():
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    return Fp8Config(weight_block_size=[128, 128])


def _checkpoint(spec, seed: int) -> dict[str, torch.Tensor]:
    """A block-FP8 checkpoint of ``spec`` (formatted): every quantized weight through vLLM's own
    ``per_block_cast_to_fp8``, its scales beside it; the other tensors random in their dtype."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in spec.params:
        if p.dtype == FP8:
            full = (torch.randn(p.shape, generator=g) * 0.05).to(torch.bfloat16)
            full[: min(128, p.shape[0]), : min(128, p.shape[1])] = 0  # an all-zero block: amax clamped to 1e-4
            out[p.name], out[scale_name(p.name)] = per_block_cast_to_fp8(full, [128, 128])
            assert torch.equal(quantize_blocks(full)[1], out[scale_name(p.name)])  # realloc's quantizer: same scales
        elif p.name not in out:
            out[p.name] = torch.randn(p.shape, generator=g).to(TORCH_DTYPES[p.dtype])
    return out


def _realloc_views(layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's tensors as realloc holds them (every shard's box of the full tensors, in the rank's
    buffers) through vLLM's fused names."""
    buffers = {k: b.zero_() for k, b in allocate_buffers(layout, rank).items()}
    me = layout.at(rank)
    for s in me.shards():
        box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
        local_tensor(s, buffers)[tuple(slice(0, n) for n in s.sizes)] = full[s.param][box]
    return fused_views(me, buffers)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.contiguous().view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _layout_boxes(layout, rank: int, name: str) -> list:
    return sorted((s.offsets, s.sizes) for s in layout.shards(rank) if s.param == name)


def _baked_boxes(module, param, pname: str, name: str, full: torch.Tensor, *args) -> list:
    """The boxes of checkpoint tensor ``name`` that ``param``'s loader copies, as actors/vllm/bake.py
    records them (vLLM's data-less stand-in, realloc's chain_box)."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor

    sink = BakeSink()
    sink.current = (module, pname)
    fake = FakeRDTTensor(name, full.shape, full.dtype, torch.device("cpu"), sink=sink)
    param.weight_loader(param, fake, *args)
    copies = sink.copies_by_layer.get(module, [])
    return sorted(chain_box(tuple(full.shape), full.dtype, c.src[1]) for c in copies)


#: (hidden, heads, kv heads, head dim, intermediate, tp): kv heads split, one per rank, replicated on
#: 2 and 4 ranks; 64-row heads two to a block; a hidden size that ends in a partial block
DENSE = [
    (256, 4, 2, 128, 512, 1),
    (256, 4, 2, 128, 512, 2),
    (256, 4, 2, 128, 512, 4),
    (256, 8, 1, 128, 1024, 8),
    (256, 8, 4, 64, 512, 2),
    (320, 4, 2, 128, 384, 1),
    (320, 4, 2, 128, 768, 2),
]


@pytest.mark.parametrize("hidden, heads, kv, hd, inter, tp", DENSE)
def test_every_rank_holds_vllms_fp8_dense_layers(hidden, heads, kv, hd, inter, tp):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    spec = decoder_spec(
        "fp8", hidden=hidden, intermediate=inter, layers=1, heads=heads, kv_heads=kv, head_dim=hd, vocab=64
    )
    fp8 = formatted(spec, FP8_FORMAT)
    layout, full = vllm_layout(fp8, tp), _checkpoint(fp8, tp)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    qc = _quant_config()
    for rank in range(tp):
        with vllm_rank(tp, rank):
            kw = {"bias": False, "params_dtype": torch.bfloat16, "quant_config": qc}
            qkv = QKVParallelLinear(hidden, hd, heads, kv, prefix=a + "qkv_proj", **kw)
            o = RowParallelLinear(heads * hd, hidden, prefix=a + "o_proj", **kw)
            gate_up = MergedColumnParallelLinear(hidden, [inter, inter], prefix=m + "gate_up_proj", **kw)
            down = RowParallelLinear(inter, hidden, prefix=m + "down_proj", **kw)
            loads = [(qkv, a + f"{x}_proj.weight", (x,)) for x in "qkv"]
            loads += [(gate_up, m + f"{x}_proj.weight", (i,)) for i, x in enumerate(("gate", "up"))]
            loads += [(o, a + "o_proj.weight", ()), (down, m + "down_proj.weight", ())]
            for module, weight, shard in loads:
                for pname, name in (("weight", weight), ("weight_scale_inv", scale_name(weight))):
                    param = getattr(module, pname)
                    param.weight_loader(param, full[name], *shard)
                    baked = _baked_boxes(module, param, pname, name, full[name], *shard)
                    assert baked == _layout_boxes(layout, rank, name), (name, tp, rank)
        views = _realloc_views(layout, rank, full)
        for module, fused, parts in (
            (qkv, a + "qkv_proj", [a + f"{x}_proj" for x in "qkv"]),
            (gate_up, m + "gate_up_proj", [m + "gate_proj", m + "up_proj"]),
            (o, a + "o_proj", [a + "o_proj"]),
            (down, m + "down_proj", [m + "down_proj"]),
        ):
            weight = views[fused + ".weight"]
            assert same(weight, module.weight.data), (fused, tp, rank)
            scales = torch.cat([views[p + ".weight_scale_inv"] for p in parts])
            assert same(scales, module.weight_scale_inv.data), (fused, tp, rank)


def _moe_spec(hidden: int, moe_inter: int, experts: int):
    return spec_from_hf_config(
        {
            "model_type": "qwen3_moe",
            "hidden_size": hidden,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 64,
            "num_experts": experts,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": moe_inter,
            "torch_dtype": "bfloat16",
        }
    )


def _fused_moe(tp: int, rank: int, hidden: int, inter: int, experts: int, ep: bool = False):
    """vLLM's block-FP8 ``FusedMoE`` of tp rank ``rank`` (its ``RoutedExperts``: the parameters and loader)."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    with vllm_rank(tp, rank, expert_parallel=ep):
        runner = FusedMoEFactory(
            num_experts=experts,
            top_k=2,
            hidden_size=hidden,
            intermediate_size=inter,
            params_dtype=torch.bfloat16,
            quant_config=_quant_config(),
            prefix="model.layers.0.mlp.experts",
            tp_size=tp,
            dp_size=1,
            pcp_size=1,
        )
    return runner.routed_experts


#: (hidden, moe intermediate, experts, tp, expert parallel): experts tensor parallel (etp = tp)
#: and expert parallel (ep = tp, etp = 1: vLLM's enable_expert_parallel), an expert count ep does
#: not divide (linear placement: the first ranks one more), a hidden size with a partial block
MOE = [
    (256, 256, 4, 1, False),
    (256, 256, 4, 2, False),
    (256, 512, 4, 4, False),
    (320, 256, 4, 2, False),
    (256, 256, 4, 2, True),
    (256, 256, 5, 2, True),
    (320, 256, 6, 4, True),
]


@pytest.mark.parametrize("hidden, inter, experts, tp, ep", MOE)
def test_every_rank_holds_vllms_fp8_fused_moe(hidden, inter, experts, tp, ep):
    fp8 = formatted(_moe_spec(hidden, inter, experts), FP8_FORMAT)
    topology = Topology(tp=tp, ep=tp, etp=1) if ep else Topology(tp=tp)
    layout = Layout(fp8, topology, vocab_pad_multiple=64, vocab_pad_rule="vllm", expert_order="vllm")
    if not ep:
        assert layout.key == vllm_layout(fp8, tp).key
    full = _checkpoint(fp8, 7)
    pre = "model.layers.0.mlp.experts."
    for rank in range(tp):
        moe = _fused_moe(tp, rank, hidden, inter, experts, ep)
        for e in range(experts):
            for proj, shard, stack in (("gate_proj", "w1", "w13"), ("up_proj", "w3", "w13"), ("down_proj", "w2", "w2")):
                for suffix, pname in (("weight", f"{stack}_weight"), ("weight_scale_inv", f"{stack}_weight_scale_inv")):
                    name = f"{pre}{e}.{proj}.{suffix}"
                    param = getattr(moe, pname)
                    with vllm_rank(tp, rank, expert_parallel=ep):
                        moe.weight_loader(param, full[name], f"{pre}{e}.{proj}.{suffix}", shard, e)
                        baked = _baked_boxes(moe, param, pname, name, full[name], f"{pre}{e}.{proj}.{suffix}", shard, e)
                    assert baked == _layout_boxes(layout, rank, name), (name, tp, ep, rank)
        views = _realloc_views(layout, rank, full)
        for pname in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
            assert same(views[pre + pname], getattr(moe, pname).data), (pname, tp, ep, rank)


@pytest.mark.parametrize("inter, tp, refined", [(192, 1, 64), (768, 4, 64), (768, 8, 32)])
def test_an_expert_ffn_per_partition_of_partial_blocks_is_refused_as_vllm_regrids_its_scales(inter, tp, refined):
    """vLLM 0.32 does not refuse a block-FP8 FusedMoE whose intermediate size per partition is not a
    multiple of 128 (the layout's refusal said it did): ``refine_fp8_moe_block_shape``
    (vllm/model_executor/layers/fused_moe/oracle/fp8.py) holds ``w13_weight_scale_inv`` /
    ``w2_weight_scale_inv`` on a ``gcd(128, per partition, hidden)`` grid (Qwen3-30B-A3B's 768 at tp=8:
    32), which is no box of the checkpoint's 128 x 128 scales, so the layout is still refused, saying so."""
    hidden, experts, per = 256, 4, inter // tp
    scales = _fused_moe(tp, 0, hidden, inter, experts).w13_weight_scale_inv
    assert tuple(scales.shape) == (experts, 2 * per // refined, hidden // refined)  # vLLM's refined grid
    assert tuple(scales.shape) != (experts, 2 * -(-per // 128), -(-hidden // 128))  # not the checkpoint's blocks
    fp8 = formatted(_moe_spec(hidden, inter, experts), FP8_FORMAT)
    with pytest.raises(
        ValueError, match=rf"has {inter} rows.*does not hold the checkpoint's block scales.*refine_fp8_moe_block_shape"
    ):
        vllm_layout(fp8, tp)
