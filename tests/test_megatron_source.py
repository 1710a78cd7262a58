"""Megatron-core's own MoE model read by ``ShardSource.megatron`` (actors/trainer/source.py), in
two processes on gloo, without Ray or an engine: expert parallelism (ep=2) as Megatron's parallel
state and its ``GPTModel`` (``SequentialMLP``: ``local_experts.N`` per rank) hold it. Every shard
a rank's holdings send is the checkpoint's tensor (Megatron's ``linear_fc1`` is ``[gate; up]``),
loaded into the model from the checkpoint by an independent conversion (by Megatron's names:
tests/user_trainers.py ``megatron_moe_locals``), and a rank's experts are its block of the model's. The engine side of MoE (vLLM's
``FusedMoE``) is tests/test_vllm_backend_ray.py's."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import user_trainers as ut  # noqa: E402
import vllm_models as vm  # noqa: E402

EP = 2


def _rank(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from safetensors.torch import load_file

    from actors.trainer import ShardSource
    from realloc.spec import spec_from_hf_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=EP)
    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    experts = config["num_local_experts"]
    mcfg = TransformerConfig(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config["num_key_value_heads"],
        kv_channels=config["head_dim"],
        ffn_hidden_size=config["intermediate_size"],
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        num_moe_experts=experts,
        moe_router_topk=config["num_experts_per_tok"],
        expert_model_parallel_size=EP,
        qk_layernorm=True,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec(
        num_experts=experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    model = GPTModel(
        mcfg,
        spec,
        vocab_size=config["vocab_size"],
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
