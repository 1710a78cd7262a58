"""Your Megatron-core trainer, in your own Ray actors, updating a vLLM engine shard to shard.

The trainer's ranks are plain Ray actors holding a Megatron-core ``GPTModel`` (the local layer
spec: a Llama's layers) with tensor parallelism over them, on a gloo process group of their own;
the generator is examples/fsdp2_vllm.py's vLLM actor. The weights move through vLLM's trainer API
with realloc's engine: ``ShardSource.megatron(model, spec)`` reads what the rank holds from
Megatron's parallel state, and each rank sends its ``linear_qkv`` (per query group: q heads, k, v)
and ``linear_fc1`` (``[gate; up]``) as Megatron holds them: only the boxes the engine's workers
need, never a gathered tensor, no conversion on the trainer.

Megatron-core 0.16's forward needs CUDA (its RoPE and attention paths), so on a CPU machine each
"training step" here is a seeded change of every rank's local tensors standing in for the
optimizer step; on GPUs, train as usual between the updates.

Checked, exit status 1 on any failure: after each update, every token the engine generates has the
logprob that a single-process transformers reference gives it with the trainer's weights
(exported from Megatron's tensors to HF names by :func:`to_hf`, for this check only; within
``--tol``), and vLLM labels it with the version the trainer sent.

Run it directly (starts a local Ray and the engine; about a minute on 2 cores) or on a cluster::

    python examples/megatron_vllm.py
    python examples/megatron_vllm.py --world 4 --pp 2      # 2 pipeline stages of tp=2
    RAY_ADDRESS=http://127.0.0.1:8265 ray job submit --working-dir . -- python examples/megatron_vllm.py

Needs vLLM (``pip install -e ".[vllm]"``) and megatron-core (``pip install megatron-core``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp2_vllm  # noqa: E402  (its vLLM actor, its model and its check)

ray.cloudpickle.register_pickle_by_value(fsdp2_vllm)


@ray.remote(num_cpus=0)
class MegatronRank:
    """One rank of the framework's Megatron-core trainer: ``GPTModel`` with the local layer spec,
    float32 on CPU, ``world`` ranks in ``pp`` pipeline stages of ``cp`` context-parallel groups of
    ``world // (pp * cp)`` tensor parallel ranks each, the Llama of HF ``config`` (a dict)."""

    def __init__(self, rank: int, world: int, pp: int = 1, cp: int = 1):
        self.rank, self.world, self.pp, self.cp, self.model, self.sync = rank, world, pp, cp, None, None

    def setup(self, port: int, config: dict) -> dict:
        """Join the trainer's group and Megatron's parallel state (tp = world / (pp * cp)), build
        this stage's model (Megatron's own initialization, seeded); its parameters' local shapes.
        With cp > 1 the ``TransformerConfig`` keeps ``context_parallel_size=1``: the local spec's
        attention (megatron/core/transformer/dot_product_attention.py) has no cp (on GPUs,
        TransformerEngine's ``TEDotProductAttention`` has; set it there). cp adds no parameter, and
        this example runs no forward."""
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        fsdp2_vllm.join_trainer_group(self.rank, self.world, port)
        tp = self.world // (self.pp * self.cp)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=self.pp, context_parallel_size=self.cp
        )
        torch.manual_seed(0)
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
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=self.pp,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,  # what travels between stages
        )
        self.model = GPTModel(
            mcfg,
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=config["vocab_size"],
            max_sequence_length=config["max_position_embeddings"],
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
            pre_process=parallel_state.is_pipeline_first_stage(),  # the embedding: the first stage's
            post_process=parallel_state.is_pipeline_last_stage(),  # the final norm and the head: the last's
        )
        return {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def step(self, seed: int, scale: float = 0.02) -> None:
        """The stand-in for an optimizer step (see the module's docstring): every local tensor
        changed by a seeded amount; a tensor every tp rank holds whole (a norm) changed alike on
        all of them, as the same all-reduced gradient would (realloc reads it from any of them); a
        split tensor alike on the cp ranks of its tp rank and stage."""
        from megatron.core import parallel_state as ps

        shard = ps.get_tensor_model_parallel_rank() + ps.get_tensor_model_parallel_world_size() * (
            ps.get_pipeline_model_parallel_rank()
        )
        with torch.no_grad():
            for i, p in enumerate(self.model.parameters()):
                split = getattr(p, "tensor_model_parallel", False)  # Megatron's mark of a tp-split tensor
                g = torch.Generator().manual_seed(1000 * seed + 10 * i + (shard if split else 0))
                p.add_(scale * torch.randn(p.shape, generator=g))

    def local_state(self) -> dict:
        """This rank's tensors by Megatron's names (for the check's export only)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    # -- the integration: vLLM's trainer API with realloc's engine, on every rank -------------------
    def init_transfer(self, client, timeout_s: float, model_dir: str, name: str = "megatron") -> str:
        """``client``: vLLM's weight-sync client of the engine; ``model_dir``: the HF model the
        trainer trains (its config gives realloc the model). The layout realloc read."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from actors.trainer import ReallocTrainerInitInfo, ShardSource
        from realloc.spec import spec_from_hf_config

        self.sync = WeightTransferTrainerFactory.trainer_init(
            ReallocTrainerInitInfo(rank=self.rank, name=name, timeout_s=timeout_s),
            client=client,
            source=ShardSource.megatron(self.model, spec_from_hf_config(model_dir)),
        )
        return str(self.sync.holdings.layout.topology)

    def send(self) -> dict:
        """``send_weights()`` (every rank, each step): the version served and the bytes this rank sent."""
        version = self.sync.send_weights()
        return {"version": version, "sent_bytes": self.sync.sent_bytes}


def start_trainer(config: dict, world: int, pp: int = 1, cp: int = 1) -> list:
    """The framework's Megatron trainer: ``world`` :class:`MegatronRank` actors in ``pp`` stages
    (and ``cp`` context-parallel ranks per tp rank), set up."""
    ranks = [MegatronRank.remote(r, world, pp, cp) for r in range(world)]
    port = fsdp2_vllm.free_port()
    ray.get([r.setup.remote(port, config) for r in ranks], timeout=180)
    return ranks


def to_hf(locals_: list[dict], config: dict, pp: int = 1) -> dict:
    """The HF state dict of a ``GPTModel`` from every rank's local tensors (in rank order: tp
    fastest, then the ``pp`` stages, each holding an equal share of the layers, numbered from 0):
    ``linear_qkv`` split per query group into q, k and v, ``linear_fc1`` into gate and up,
    column-parallel tensors joined by rows and row-parallel ones by columns."""
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    per = heads // groups
    tp, layers = len(locals_) // pp, config["num_hidden_layers"]
    stages = [locals_[s * tp : (s + 1) * tp] for s in range(pp)]
    out = {
        "model.embed_tokens.weight": torch.cat([t["embedding.word_embeddings.weight"] for t in stages[0]]),
        "lm_head.weight": torch.cat([t["output_layer.weight"] for t in stages[-1]]),
        "model.norm.weight": stages[-1][0]["decoder.final_layernorm.weight"],
    }
    for i in range(layers):
        stage, local = divmod(i, layers // pp)
        first = stages[stage][0]
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[hf + "input_layernorm.weight"] = first[mg + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = first[mg + "pre_mlp_layernorm.weight"]
        qs, ks, vs, gates, ups = [], [], [], [], []
        for t in stages[stage]:
            qkv = t[mg + "self_attention.linear_qkv.weight"]
            qkv = qkv.reshape(-1, per + 2, hd, qkv.shape[-1])  # local query groups
            qs.append(qkv[:, :per].reshape(-1, qkv.shape[-1]))
            ks.append(qkv[:, per].reshape(-1, qkv.shape[-1]))
            vs.append(qkv[:, per + 1].reshape(-1, qkv.shape[-1]))
            gate, up = t[mg + "mlp.linear_fc1.weight"].chunk(2)
            gates.append(gate)
            ups.append(up)
        out[hf + "self_attn.q_proj.weight"] = torch.cat(qs)
        out[hf + "self_attn.k_proj.weight"] = torch.cat(ks)
        out[hf + "self_attn.v_proj.weight"] = torch.cat(vs)
        out[hf + "mlp.gate_proj.weight"] = torch.cat(gates)
        out[hf + "mlp.up_proj.weight"] = torch.cat(ups)
        out[hf + "self_attn.o_proj.weight"] = torch.cat(
            [t[mg + "self_attention.linear_proj.weight"] for t in stages[stage]], 1
        )
        out[hf + "mlp.down_proj.weight"] = torch.cat([t[mg + "mlp.linear_fc2.weight"] for t in stages[stage]], 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    fsdp2_vllm.common_arguments(parser)
    parser.add_argument("--world", type=int, default=2, help="trainer ranks (tensor parallel x pipeline stages)")
    parser.add_argument("--pp", type=int, default=1, help="Megatron's pipeline stages (default 1)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

    path, generator = fsdp2_vllm.start_engine("megatron-vllm-", args.tp)
    config = json.loads((path / "config.json").read_text())
    if args.pp < 1 or args.world % args.pp or config["num_hidden_layers"] % args.pp:
        parser.error(f"--pp must divide --world ({args.world}) and the model's {config['num_hidden_layers']} layers")
    ranks = start_trainer(config, args.world, args.pp)
    layout = ray.get([r.init_transfer.remote(RayVLLMWeightSyncClient(generator), 60.0, str(path)) for r in ranks])[0]
    print(f"trainer {layout} (Megatron-core GPTModel, {args.world} plain Ray actors) -> vLLM tp={args.tp}")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    failures = []
    for step in range(1, args.steps + 1):
        ray.get([r.step.remote(step) for r in ranks])
        sent = ray.get([r.send.remote() for r in ranks])
        outputs = ray.get(generator.generate.remote(fsdp2_vllm.PROMPTS))
        state = to_hf(ray.get([r.local_state.remote() for r in ranks]), config, args.pp)  # for the check only
        bad = fsdp2_vllm.mismatches(reference, state, outputs, sent[0]["version"], args.tol)
        failures += bad
        summary = {"step": step, "version": sent[0]["version"], "sent_bytes_per_rank": [s["sent_bytes"] for s in sent]}
        print(json.dumps({**summary, "mismatches": len(bad)}))
    return fsdp2_vllm.verdict(failures)


if __name__ == "__main__":
    sys.exit(main())
