"""Megatron-core's own MoE model read by ``ShardSource.megatron`` (actors/trainer/source.py), in
two processes on gloo, without Ray or an engine: expert parallelism (ep=2) as Megatron's parallel
state and its ``GPTModel`` (``SequentialMLP``: ``local_experts.N`` per rank) hold it. Every shard
a rank's holdings send is the checkpoint's tensor (Megatron's ``linear_fc1`` is ``[gate; up]``),
loaded into the model from the checkpoint by an independent conversion (by Megatron's names:
tests/user_trainers.py ``megatron_moe_locals``), and a rank's experts are its block of the model's. The engine side of MoE (vLLM's
``FusedMoE``) is tests/test_vllm_backend_ray.py's. Meshes of tp, pp, ep, etp and context
parallelism (cp=2, on 4 processes; dense and MoE) are checked shard by shard against where
Megatron's own ``sharded_state_dict`` places every parameter."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import user_trainers as ut  # noqa: E402
import vllm_models as vm  # noqa: E402
from ports import free_port  # noqa: E402

EP = 2


def _megatron_moe_model(config: dict, experts: int | None, **parallel):
    """Megatron-core's own MoE ``GPTModel`` (local layer spec, ``SequentialMLP`` experts) of HF
    ``config`` with ``experts`` routed experts (None: the dense model, Qwen3), in the parallel state
    initialized (``parallel``: its sizes as ``TransformerConfig`` takes them,
    ``tensor_model_parallel_size=`` and so on).

    Per ``model_type``: Qwen3's and Qwen3-MoE's q/k norms (``qk_layernorm``); Qwen2-MoE's q/k/v biases
    (``add_qkv_bias``) and its shared expert behind a sigmoid gate (``moe_shared_expert_intermediate_size``,
    ``moe_shared_expert_gate``: megatron/core/transformer/moe/shared_experts.py ``SharedExpertMLP``);
    Mixtral's experts of ``intermediate_size``."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    kind = config["model_type"]
    qk_norm = kind in ("qwen3", "qwen3_moe")
    shared = config.get("shared_expert_intermediate_size") if kind == "qwen2_moe" else None
    mcfg = TransformerConfig(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config["num_key_value_heads"],
        kv_channels=config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]),
        ffn_hidden_size=config["intermediate_size"],
        **(
            dict(
                moe_ffn_hidden_size=config.get("moe_intermediate_size", config["intermediate_size"]),
                moe_shared_expert_intermediate_size=shared,
                moe_shared_expert_gate=shared is not None,
                num_moe_experts=experts,
                moe_router_topk=config["num_experts_per_tok"],
            )
            if experts
            else {}
        ),
        **parallel,
        qk_layernorm=qk_norm,
        add_qkv_bias=kind == "qwen2_moe",
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        params_dtype=torch.float32,
    )
    layer_spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk_norm, normalization="RMSNorm"
    )
    return GPTModel(
        mcfg,
        layer_spec,
        vocab_size=config["vocab_size"],
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def _rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from actors.trainer import ShardSource
    from realloc.spec import spec_from_hf_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=EP)
    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    experts = config["num_local_experts"]
    model = _megatron_moe_model(config, experts, expert_model_parallel_size=EP)
    full = {k: v.float() for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    mine = list(range(rank * experts // EP, (rank + 1) * experts // EP))  # Megatron's block, by hand
    by_megatron = ut.megatron_moe_locals(full, config, mine)
    params = dict(model.named_parameters())
    assert set(params) == set(by_megatron), sorted(set(params) ^ set(by_megatron))[:5]
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(by_megatron[name])
    held = ShardSource.megatron(model, spec_from_hf_config(path, dtype="float32")).holdings()
    held.refresh()
    stored = held.store.shard_tensors()
    wrong = sorted(n for n, t in stored.items() if not torch.equal(t, full[n]))
    held_experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in stored if ".experts." in n})
    result = {"layout": str(held.layout.topology), "rank": held.rank, "experts": held_experts, "wrong": wrong}
    with open(out, "w") as f:
        json.dump({**result, "slots": len(stored)}, f)
    dist.destroy_process_group()


def test_megatron_core_expert_parallel_ranks_send_their_own_experts_exactly(tmp_path):
    path = vm.save_llama(tmp_path / "qwen3-moe", vocab=512, arch="qwen3_moe")
    port = free_port()
    outs = [str(tmp_path / f"rank{r}.json") for r in range(EP)]
    torch.multiprocessing.start_processes(
        _main, args=(port, str(path), outs), nprocs=EP, start_method="spawn", join=True
    )
    results = [json.loads(open(o).read()) for o in outs]
    assert [r["layout"] for r in results] == ["dp=2,tp=1,pp=1,ep=2"] * EP, results
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["experts"] for r in results] == [[0, 1], [2, 3]]
    assert all(r["wrong"] == [] and r["slots"] > 0 for r in results), results


def _main(rank: int, port: int, path: str, outs: list[str]) -> None:
    _rank(rank, port, path, outs[rank])


@pytest.mark.parametrize("calling_rank", [0, 1])
def test_a_pipeline_layout_splits_the_layers_as_its_stages_list_them_on_every_rank(calling_rank, monkeypatch):
    """A ``pipeline_model_parallel_layout`` (``[[embedding, decoder x3], [decoder, loss]]``: 3
    layers, then 1) gives the split its stages list, whatever the calling rank. megatron-core
    0.16's ``get_transformer_layer_offset`` drops ``pp_rank=`` for a layout and gives every stage
    the calling rank's offset: the split came out (0, 4) on rank 0 and (0, 1) on rank 1 (found in
    review, 2026-11-28)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from actors.trainer.source import megatron_layer_split

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: calling_rank)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: None)
    stages = [["embedding", "decoder", "decoder", "decoder"], ["decoder", "loss"]]
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    config.pipeline_model_parallel_layout = PipelineParallelLayerLayout(stages, pipeline_model_parallel_size=2)
    assert megatron_layer_split(config, 2) == tuple(stage.count("decoder") for stage in stages) == (3, 1)


# -- every shard as Megatron-core's own sharded_state_dict places it ------------------------------

#: ``(tp, pp, ep, etp, cp)`` on 2 gloo processes (etp None: Megatron's default, tp).
MESHES = [(2, 1, 1, None, 1), (2, 1, 2, 1, 1), (1, 1, 1, 2, 1), (1, 2, 1, None, 1), (1, 1, 2, None, 1)]
TINY_QWEN3_MOE = dict(
    model_type="qwen3_moe",
    hidden_size=16,
    intermediate_size=32,
    moe_intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    vocab_size=256,
)
#: Qwen3 (dense): q/k norms, one MLP per layer.
TINY_QWEN3 = {k: v for k, v in TINY_QWEN3_MOE.items() if "experts" not in k and k != "moe_intermediate_size"}
TINY_QWEN3["model_type"] = "qwen3"
#: Qwen2-MoE: q/k/v biases, one shared expert (intermediate 12, 6 rows of gate and of up per tp
#: rank) behind its sigmoid ``shared_expert_gate``.
TINY_QWEN2_MOE = {
    **{k: v for k, v in TINY_QWEN3_MOE.items() if k != "head_dim"},
    "model_type": "qwen2_moe",
    "shared_expert_intermediate_size": 12,
}
#: Mixtral: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.E.w1/w3/w2`` (experts of
#: ``intermediate_size``).
TINY_MIXTRAL = {
    **{k: v for k, v in TINY_QWEN3_MOE.items() if k not in ("moe_intermediate_size", "num_experts")},
    "model_type": "mixtral",
    "intermediate_size": 8,
    "num_local_experts": 4,
}
#: The local layer spec's ``sharded_state_dict_keys_map`` (megatron/core/models/gpt/
#: gpt_layer_specs.py ``get_gpt_layer_local_spec``): the norms' checkpoint keys.
_NORM_KEYS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _experts_of(config: dict) -> int | None:
    """The routed experts of HF ``config`` (Mixtral's ``num_local_experts``); None: a dense model."""
    return config.get("num_experts") or config.get("num_local_experts")


def _megatron_global(full: dict, config: dict) -> dict:
    """Every tensor of Megatron's distributed checkpoint (``sharded_state_dict`` keys: the layers
    stacked on a first axis, the routed experts on a second) from the HF checkpoint ``full``: the
    whole model as one tp=1 rank holding every expert has it (tests/user_trainers.py
    ``megatron_moe_locals``, an independent conversion: ``linear_qkv`` per query group, every
    ``linear_fc1`` ``[gate; up]``, the ``_w`` and ``_v`` halves of apply_swiglu_sharded_factory,
    megatron/core/transformer/mlp.py; a dense model's MLP as ``mlp.linear_fc1``), stacked."""
    experts = _experts_of(config)
    whole = ut.megatron_moe_locals(full, config, list(range(experts)) if experts else None)
    stacks: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    out = {}
    for name, t in whole.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m is None:
            out[name] = t
            continue
        rest = _NORM_KEYS.get(m[2], m[2])
        e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(.+)", rest)
        key = "decoder.layers." + (f"mlp.experts.experts.{e[2]}" if e else rest)
        stacks.setdefault(key, {})[(int(m[1]),) + ((int(e[1]),) if e else ())] = t
    for key, parts in stacks.items():
        layers = sorted({at[0] for at in parts})
        if ".experts.experts." in key:
            out[key] = torch.stack([torch.stack([parts[at] for at in sorted(parts) if at[0] == i]) for i in layers])
        else:
            out[key] = torch.stack([parts[(i,)] for i in layers])
    return out


def _mesh_rank(rank: int, port: int, out: str, world: int, runs: list) -> None:
    """Each of ``runs`` (``(HF config, (tp, pp, ep, etp, cp))``) on this gloo rank of ``world``:
    Megatron's parallel state and its own ``GPTModel`` of the config, every parameter filled where
    its ``sharded_state_dict`` puts the checkpoint's tensor (NaN first: a parameter left unfilled
    fails), read by ``ShardSource.megatron``; every shard the rank holds is compared to the HF
    checkpoint's box. A refusal is recorded as the error."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from actors.trainer import ShardSource
    from realloc.spec import spec_from_hf_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for config, (tp, pp, ep, etp, cp) in runs:
        spec = spec_from_hf_config(config, dtype="float32")
        gen = torch.Generator().manual_seed(0)
        full = {p.name: torch.randn(p.shape, generator=gen) for p in spec.params}
        glob = _megatron_global(full, config)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        # TransformerConfig's context_parallel_size stays 1: the local spec's core attention
        # (megatron/core/transformer/dot_product_attention.py DotProductAttention) asserts cp == 1
        # ("only supported by TEDotProductAttention", TransformerEngine: not on CPU). cp adds no
        # parameter (it splits the sequence), so the model's are what a cp rank holds.
        model = _megatron_moe_model(
            config,
            _experts_of(config),
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        result = {"mesh": [tp, pp, ep, etp, cp], "global_rank": dist.get_rank()}
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
            for sh in model.sharded_state_dict().values():
                pieces = sh.build() if isinstance(sh, ShardedTensorFactory) else [sh]
                for t in pieces:
                    if not isinstance(t, ShardedTensor):
                        continue
                    n = t.prepend_axis_num
                    box = tuple(t.global_offset[:n]) + tuple(
                        slice(o, o + s) for o, s in zip(t.global_offset[n:], t.local_shape)
                    )
                    t.data.copy_(glob[t.key][box])
        result["unfilled"] = sorted(n for n, p in model.named_parameters() if p.isnan().any())
        result["names"] = sorted(n for n, _ in model.named_parameters())
        try:
            held = ShardSource.megatron(model, spec).holdings()
        except ValueError as err:
            result["refused"] = str(err)
        else:
            held.refresh()
            mine = held.me.shards()
            result["layout"], result["rank"] = str(held.layout.topology), held.rank
            result["experts"] = sorted({spec.by_name[s.param].expert for s in mine} - {None})
            result["checked"] = sorted({s.param for s in mine})
            result["wrong"] = sorted(
                s.slot
                for s in mine
                if not torch.equal(
                    held.store.views(s.param, s.offsets, s.sizes)[0],
                    full[s.param][tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes))],
                )
            )
        results.append(result)
        del model
        ps.destroy_model_parallel()
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _mesh_main(rank: int, port: int, outs: list[str], runs: list) -> None:
    _mesh_rank(rank, port, outs[rank], len(outs), runs)


def _on_meshes(tmp_path, runs: list, world: int = 2) -> list[list[dict]]:
    """:func:`_mesh_rank` on ``world`` gloo processes: each rank's results, one per run, every
    shard of every run checked: each parameter filled from Megatron's sharded_state_dict, none
    left over, none refused, none wrong."""
    port = free_port()
    outs = [str(tmp_path / f"rank{r}.json") for r in range(world)]
    torch.multiprocessing.start_processes(
        _mesh_main, args=(port, outs, runs), nprocs=world, start_method="spawn", join=True
    )
    results = [json.loads(open(out).read()) for out in outs]
    assert [len(rank) for rank in results] == [len(runs)] * world
    for r in (r for rank in results for r in rank):
        assert r["unfilled"] == [], r  # every parameter is where Megatron's sharded_state_dict says
        assert "refused" not in r and r["checked"] and r["wrong"] == [], {
            k: r.get(k) for k in ("mesh", "refused", "wrong")
        }
    return results


def test_megatron_core_experts_are_where_its_sharded_state_dict_puts_them(tmp_path):
    """Expert tensor parallelism (etp = tp = 2; etp = 2 > tp = 1), expert parallelism with etp=1
    beside tp=2, and pipeline stages: every shard a rank sends (routed experts, router, attention,
    norms, embedding, head) is the checkpoint's tensor, the model's local tensors having been
    filled where Megatron-core's own ``sharded_state_dict`` says they sit
    (``SequentialMLP.sharded_state_dict``: the global expert of ``local_experts.j``;
    ``apply_swiglu_sharded_factory``: the gate and up rows of the etp rank)."""
    _on_meshes(tmp_path, [(TINY_QWEN3_MOE, mesh) for mesh in MESHES])


def test_megatron_core_shared_experts_and_their_gate_are_read_exactly(tmp_path):
    """Qwen2-MoE trained by Megatron-core: ``SharedExpertMLP`` (megatron/core/transformer/moe/
    shared_experts.py) holds ``mlp.shared_experts.linear_fc1`` (the rank's gate rows, then its up
    rows: tensor parallel in the dense tp group, whatever etp), ``linear_fc2`` (row parallel) and,
    with ``moe_shared_expert_gate``, ``gate_weight`` ``[1, hidden]`` (replicated): HF's
    ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate``. At tp=2, at tp=2 beside
    ep=2 (etp=1), at etp=2 beside tp=1 (the shared experts whole on each rank: they follow tp, not
    etp) and at pp=2, every shard a rank sends is the checkpoint's. They were refused ("not a GPT
    decoder's that realloc maps")."""
    meshes = [(2, 1, 1, None, 1), (2, 1, 2, 1, 1), (1, 1, 1, 2, 1), (1, 2, 1, None, 1)]
    results = _on_meshes(tmp_path, [(TINY_QWEN2_MOE, mesh) for mesh in meshes])
    parts = {f"shared_expert.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")} | {"shared_expert_gate.weight"}
    for r in (r for rank in results for r in rank):  # Megatron's model has the gate, and the shared experts compared
        assert any(n.endswith(".mlp.shared_experts.gate_weight") for n in r["names"]), r["mesh"]
        assert {n.split(".mlp.")[1] for n in r["checked"] if ".mlp.shared_expert" in n} == parts, r["mesh"]


def test_megatron_core_mixtral_reads_into_block_sparse_moe(tmp_path):
    """Mixtral trained by Megatron-core: ``mlp.router`` is the checkpoint's ``block_sparse_moe.gate``,
    a routed expert's ``linear_fc1`` its ``[w1; w3]`` and ``linear_fc2`` its ``w2`` (at tp=2, the
    rows of the tp rank; at ep=2, the rank's block of experts). The router was refused as
    ``mlp.gate``, which the Mixtral spec does not have."""
    results = _on_meshes(tmp_path, [(TINY_MIXTRAL, mesh) for mesh in [(2, 1, 1, None, 1), (1, 1, 2, None, 1)]])
    for r in (r for rank in results for r in rank):
        assert "model.layers.0.block_sparse_moe.gate.weight" in r["checked"]
        assert any(n.endswith(".w1.weight") for n in r["checked"]) and any(
            n.endswith(".w2.weight") for n in r["checked"]
        )


#: ``(tp, pp, ep, etp, cp)`` with context parallelism on 4 gloo processes: dp=2 beside cp=2, tp=2
#: beside it, pipeline stages; of the MoE model, expert parallelism (ep=2, with etp=1 beside tp=2)
#: and expert tensor parallelism (etp=2 > tp=1: Megatron's etp groups are cp pairs)
CP_MESHES = [(1, 1, 1, None, 2), (2, 1, 1, None, 2), (1, 2, 1, None, 2)]
CP_MOE_MESHES = [(1, 1, 2, None, 2), (2, 1, 2, 1, 2), (1, 2, 2, None, 2), (1, 1, 1, 2, 2)]


def test_megatron_core_context_parallel_ranks_send_what_megatron_places_there(tmp_path):
    """cp=2 (megatron/core/parallel_state.py ``initialize_model_parallel(context_parallel_size=2)``),
    refused before (ValueError for cp > 1). Dense (Qwen3): cp is folded into dp (the dp-cp group's
    rank), realloc's rank is Megatron's global rank, every shard the checkpoint's as Megatron's
    sharded_state_dict places it. MoE (Qwen3-MoE): Megatron's expert mesh folds cp into expert dp
    (its expert RankGenerator has cp=1), so global rank 1 (cp rank 1, dp rank 0; tp=1, ep=2) holds
    experts 2 and 3; realloc gives it the same, on every mesh."""
    runs = [(TINY_QWEN3, mesh) for mesh in CP_MESHES] + [(TINY_QWEN3_MOE, mesh) for mesh in CP_MOE_MESHES]
    from actors.trainer.engine import refusal

    results = _on_meshes(tmp_path, runs, world=4)
    layouts = [[r["layout"] for r in rank] for rank in results]
    dense = ["dp=4,tp=1,pp=1", "dp=2,tp=2,pp=1", "dp=2,tp=1,pp=2"]
    moe = ["dp=4,tp=1,pp=1,ep=2", "dp=2,tp=2,pp=1,ep=2,etp=1", "dp=2,tp=1,pp=2,ep=2", "dp=4,tp=1,pp=1,etp=2"]
    assert layouts == [dense + moe] * 4, layouts
    assert all(r["rank"] == r["global_rank"] for rank in results for r in rank), results
    for i in range(len(runs)):  # the trainer engine's check at trainer_init: one layout, each rank once
        descs = [
            {"rank": g, "error": None, "layout": rank[i]["layout"], "realloc_rank": rank[i]["rank"]}
            for g, rank in enumerate(results)
        ]
        assert refusal(descs, 4) is None, descs
    # global rank g: tp=1: ep rank g % 2; tp=2, etp=1: g % 2 as well; pp=2 (ranks 0, 1 stage 0): g % 2
    for g, rank in enumerate(results):
        block = [0, 1] if g % 2 == 0 else [2, 3]
        assert [r["experts"] for r in rank] == [[]] * 3 + [block] * 3 + [[0, 1, 2, 3]], (g, rank)


def test_context_parallel_ranks_are_given_the_experts_megatron_gives_them(monkeypatch):
    """tp=1, cp=2, dp=2, ep=2, global rank 1 (cp rank 1, dp rank 0, dp-cp rank 1). Megatron's expert
    mesh (megatron/core/parallel_state.py ``initialize_model_parallel``: the expert RankGenerator has
    cp=1 and edp = world / (etp * ep * pp), so cp is folded into expert dp) gives it ep rank 1,
    experts 2 and 3. ``ShardSource.megatron`` once numbered it by dp alone (realloc rank 0, ep rank 0)
    and read its ``local_experts.0``/``.1`` as experts 0 and 1 (found in review), then refused cp;
    now cp is part of dp: realloc rank 1 of dp=4, its experts 2 and 3."""
    from megatron.core import parallel_state as ps

    from actors.trainer import ShardSource
    from realloc import Layout
    from realloc.spec import spec_from_hf_config

    _parallel_state(
        monkeypatch,
        get_context_parallel_world_size=2,
        get_data_parallel_world_size=2,
        get_data_parallel_group=_Group(4, 1),
        get_expert_model_parallel_world_size=2,
        get_expert_model_parallel_rank=1,  # g = ep_rank + ep * edp_rank, g = cp_rank + cp * dp_rank = 1
    )
    spec = spec_from_hf_config(TINY_QWEN3_MOE, dtype="float32")
    src = ShardSource.megatron(torch.nn.Module(), spec)
    assert (str(src.declared), src.declared_rank) == ("dp=4,tp=1,pp=1,ep=2", 1)
    me = Layout(spec, src.declared, qkv_order="megatron").at(src.declared_rank)
    experts = sorted({e for s in me.shards() if (e := spec.by_name[s.param].expert) is not None})
    assert experts == [2, 3], f"Megatron's ep rank 1 holds experts [2, 3]; the source reads this rank as {experts}"
    # a parallel state whose ep rank is not the one the dp-cp numbering gives (another order): refused
    monkeypatch.setattr(ps, "get_expert_model_parallel_rank", lambda: 0)
    with pytest.raises(ValueError, match=r"expert-parallel rank 0 .*\(dp=2 x cp=2 as dp"):
        ShardSource.megatron(torch.nn.Module(), spec)
    # a data-parallel size set by hand (set_data_parallel_world_size: the same with cp or without) is refused
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda with_context_parallel=False: 4)
    with pytest.raises(ValueError, match=r"dp-cp group of 4 ranks, not dp\*cp = 4\*2"):
        ShardSource.megatron(torch.nn.Module(), spec)


class _Group:
    """A process group's size and this rank in it, as Megatron's parallel state hands them out."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _parallel_state(monkeypatch, **given) -> None:
    """Megatron's parallel state as one rank sees it (megatron/core/parallel_state.py): one of
    everything unless ``given`` (a getter's name and what it answers, whatever its arguments)."""
    from megatron.core import parallel_state as ps

    state = dict(
        get_virtual_pipeline_model_parallel_world_size=None,
        get_tensor_model_parallel_world_size=1,
        get_tensor_model_parallel_rank=0,
        get_context_parallel_world_size=1,
        get_data_parallel_world_size=1,
        get_data_parallel_rank=0,
        get_data_parallel_group=_Group(1, 0),
        get_pipeline_model_parallel_world_size=1,
        get_pipeline_model_parallel_rank=0,
        get_expert_model_parallel_world_size=1,
        get_expert_model_parallel_rank=0,
        get_expert_tensor_parallel_world_size=1,
        get_expert_tensor_parallel_rank=0,
    )
    for name, value in {**state, **given}.items():
        monkeypatch.setattr(ps, name, lambda value=value, **_: value)


def test_a_data_parallel_rank_set_by_hand_does_not_merge_two_context_parallel_ranks(monkeypatch):
    """tp=1, cp=2, dp=2: global ranks 0 and 1 are cp ranks 0 and 1 of dp rank 0. A dp rank set by
    hand (``set_data_parallel_rank(0)``) is what ``get_data_parallel_rank`` answers with or without
    ``with_context_parallel`` (megatron/core/parallel_state.py), so reading it gave both ranks
    realloc rank 0. The dp-cp group's own rank tells them apart: realloc ranks 0 and 1."""
    from megatron.core import parallel_state as ps

    from actors.trainer import ShardSource
    from realloc.spec import spec_from_hf_config

    _parallel_state(
        monkeypatch, get_context_parallel_world_size=2, get_data_parallel_rank=0
    )  # the rank set by hand: the same answer on every rank, with cp or without
    monkeypatch.setattr(  # the size is not set by hand: the groups' own
        ps, "get_data_parallel_world_size", lambda with_context_parallel=False: 4 if with_context_parallel else 2
    )
    spec = spec_from_hf_config(TINY_QWEN3, dtype="float32")
    ranks = []
    for cp_rank in (0, 1):
        monkeypatch.setattr(ps, "get_data_parallel_group", lambda cp_rank=cp_rank, **_: _Group(4, cp_rank))
        src = ShardSource.megatron(torch.nn.Module(), spec)
        ranks.append((str(src.declared), src.declared_rank))
    assert ranks == [("dp=4,tp=1,pp=1", 0), ("dp=4,tp=1,pp=1", 1)]


@pytest.mark.parametrize("held", [(0, 0), (1, 1)])
def test_an_expert_rank_megatron_numbers_otherwise_is_refused(monkeypatch, held):
    """tp=2, etp=1, ep=2 (world 2): Megatron's default order gives tp rank 1 ep rank 1, etp rank 0;
    a parallel state saying otherwise (another rank order) is refused, not read as other experts."""

    from actors.trainer import ShardSource
    from realloc.spec import spec_from_hf_config

    state = dict(
        get_tensor_model_parallel_world_size=2,
        get_tensor_model_parallel_rank=1,
        get_expert_model_parallel_world_size=2,
        get_expert_model_parallel_rank=held[0],
        get_expert_tensor_parallel_rank=held[1],
    )
    _parallel_state(monkeypatch, **state)
    spec = spec_from_hf_config(TINY_QWEN3_MOE, dtype="float32")
    with pytest.raises(ValueError, match=rf"expert-parallel rank {held[0]} and expert tensor-parallel rank {held[1]}"):
        ShardSource.megatron(torch.nn.Module(), spec)
    _parallel_state(monkeypatch, **{**state, "get_expert_model_parallel_rank": 1, "get_expert_tensor_parallel_rank": 0})
    assert ShardSource.megatron(torch.nn.Module(), spec).declared_rank == 1


@pytest.mark.parametrize(
    ("extra", "checkpoint"),
    [
        ("decoder.layers.1.mlp.shared_experts.gate_weight", "model.layers.1.mlp.shared_expert_gate.weight"),
        (
            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
            "model.layers.0.mlp.shared_experts.linear_fc1.weight",
        ),
    ],
)
def test_a_megatron_parameter_the_model_does_not_have_is_refused_naming_it(extra, checkpoint):
    """Megatron's shared experts read with the spec of a model without them (Qwen3-MoE): refused,
    naming the parameter and the checkpoint tensor the spec lacks, before any byte moves. (A name
    realloc maps that the spec does not have is a wrong spec, not a tensor another rank holds.)"""
    from actors.trainer import ShardSource
    from realloc.spec import spec_from_hf_config

    spec = spec_from_hf_config(TINY_QWEN3_MOE, dtype="float32")
    full = {p.name: torch.zeros(p.shape) for p in spec.params}
    local = ut.megatron_moe_locals(full, TINY_QWEN3_MOE, list(range(_experts_of(TINY_QWEN3_MOE))))
    ShardSource(ut.module_of(local), spec=spec, topology="dp=1", rank=0, naming="megatron").holdings()
    module = ut.module_of({**local, extra: torch.zeros(1, TINY_QWEN3_MOE["hidden_size"])})
    with pytest.raises(
        ValueError, match=rf"{re.escape(extra)} is checkpoint tensor {re.escape(checkpoint)}, which model"
    ):
        ShardSource(module, spec=spec, topology="dp=1", rank=0, naming="megatron").holdings()
