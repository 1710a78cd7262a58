"""Trainers as RL frameworks run them, for the tests: the FSDP2 trainer of
examples/fsdp2_vllm.py (plain Ray actors, no realloc actor, a gloo process group of their own;
``TrainerRank.init_transfer`` and ``send`` are the integration with vLLM's trainer API), so the
tests run the code the example gives users to copy."""

from __future__ import annotations

import os
import sys

import ray

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import fsdp2_vllm  # noqa: E402

ray.cloudpickle.register_pickle_by_value(fsdp2_vllm)
start_trainer = fsdp2_vllm.start_trainer

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors below: workers cannot import tests/


@ray.remote(num_cpus=0)
class MegatronRank:
    """One rank of a Megatron-core trainer (``GPTModel`` with the local layer spec, float32, CPU,
    gloo), tensor parallel over ``world`` ranks, the HF Llama of ``config`` (a dict)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.model, self.sync = rank, world, None, None

    def setup(self, port: int, config: dict) -> dict:
        """Join the group, Megatron's parallel state (tp = world), build the model; its parameter shapes."""
        import torch
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        fsdp2_vllm.join_trainer_group(self.rank, self.world, port)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.world)
        heads = config["num_attention_heads"]
        mcfg = TransformerConfig(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_attention_heads=heads,
            num_query_groups=config["num_key_value_heads"],
            ffn_hidden_size=config["intermediate_size"],
            kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
            use_cpu_initialization=True,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            normalization="RMSNorm",
            add_bias_linear=False,
            tensor_model_parallel_size=self.world,
            params_dtype=torch.float32,
        )
        self.model = GPTModel(
            mcfg,
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=config["vocab_size"],
            max_sequence_length=config["max_position_embeddings"],
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        )
        return {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def load(self, local: dict) -> None:
        """Set every parameter to ``local[name]`` (this rank's tensors, made by the caller)."""
        import torch

        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(local[name])

    def holdings_error(self, path: str, **declared) -> str:
        """The refusal of a declaration the tensors contradict (the text of the ValueError)."""
        from actors.trainer import ShardSource
        from realloc.spec import spec_from_hf_config

        try:
            ShardSource(self.model, spec=spec_from_hf_config(path), naming="megatron", **declared).holdings()
        except ValueError as err:
            return str(err)
        return ""

    def init_transfer(self, client, timeout_s: float, path: str) -> str:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from actors.trainer import ReallocTrainerInitInfo, ShardSource
        from realloc.spec import spec_from_hf_config

        self.sync = WeightTransferTrainerFactory.trainer_init(
            ReallocTrainerInitInfo(rank=self.rank, name="megatron", timeout_s=timeout_s),
            client=client,
            source=ShardSource.megatron(self.model, spec_from_hf_config(path)),
        )
        return str(self.sync.holdings.layout.topology)

    def send(self) -> dict:
        version = self.sync.send_weights()
        return {"version": version, "sent_bytes": self.sync.sent_bytes}


def megatron_locals(full: dict, config: dict, tp: int, tp_rank: int) -> dict:
    """Megatron-core's local tensors of tp rank ``tp_rank`` from the HF state dict ``full``, by the
    oracle's rules (tests/oracle.py ``megatron_linear_qkv``/``megatron_linear_fc1``; row and column
    parallel splits), independent of realloc's layouts."""
    import oracle

    heads = config["num_attention_heads"]
    d = oracle.Decoder(
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab=config["vocab_size"],
    )
    out = {
        "embedding.word_embeddings.weight": full["model.embed_tokens.weight"].chunk(tp)[tp_rank],
        "output_layer.weight": full["lm_head.weight"].chunk(tp)[tp_rank],
        "decoder.final_layernorm.weight": full["model.norm.weight"],
    }
    for i in range(d.layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[mg + "input_layernorm.weight"] = full[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = full[hf + "post_attention_layernorm.weight"]
        out[mg + "self_attention.linear_qkv.weight"] = oracle.megatron_linear_qkv(d, full, i, tp, tp_rank)
        out[mg + "self_attention.linear_proj.weight"] = full[hf + "self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank]
        out[mg + "mlp.linear_fc1.weight"] = oracle.megatron_linear_fc1(full, i, tp, tp_rank)
        out[mg + "mlp.linear_fc2.weight"] = full[hf + "mlp.down_proj.weight"].chunk(tp, dim=1)[tp_rank]
    return {k: v.contiguous() for k, v in out.items()}


def start_megatron(config: dict, world: int) -> list:
    ranks = [MegatronRank.remote(r, world) for r in range(world)]
    port = fsdp2_vllm.free_port()
    ray.get([r.setup.remote(port, config) for r in ranks], timeout=180)
    return ranks


def sparse_step(rank, seed: int, fraction: float = 0.02) -> None:
    """In a trainer rank: ``fraction`` of the elements of each of its local shards changed."""
    import torch
    from torch.distributed.tensor import DTensor

    g = torch.Generator().manual_seed(seed + rank.rank)
    with torch.no_grad():
        for p in rank.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            mask = torch.rand(local.shape, generator=g) < fraction
            local[mask] += 0.1
