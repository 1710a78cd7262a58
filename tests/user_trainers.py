"""Trainers as RL frameworks run them, for the tests: the FSDP2 trainer of examples/fsdp2_vllm.py
and the Megatron-core trainer of examples/megatron_vllm.py (plain Ray actors, no realloc actor, a
gloo process group of their own; their ``init_transfer`` and ``send`` are the integration with
vLLM's trainer API), so the tests run the code the examples give users to copy; and what the tests
do inside those actors (``actor.__ray_call__``)."""

from __future__ import annotations

import os
import sys

import ray

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import fsdp2_vllm  # noqa: E402
import megatron_vllm  # noqa: E402

ray.cloudpickle.register_pickle_by_value(fsdp2_vllm)
ray.cloudpickle.register_pickle_by_value(megatron_vllm)
start_trainer = fsdp2_vllm.start_trainer
start_megatron = megatron_vllm.start_trainer

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors below: workers cannot import tests/


def load_locals(actor, local: dict) -> None:
    """In a Megatron rank (examples/megatron_vllm.py ``MegatronRank``): every parameter set to ``local[name]``."""
    import torch

    with torch.no_grad():
        for name, p in actor.model.named_parameters():
            p.copy_(local[name])


def holdings_error(actor, path: str, **declared) -> str:
    """In a Megatron rank: the refusal of a declaration its tensors contradict (the ValueError's text)."""
    from actors.trainer import ShardSource
    from realloc.spec import spec_from_hf_config

    try:
        ShardSource(actor.model, spec=spec_from_hf_config(path), naming="megatron", **declared).holdings()
    except ValueError as err:
        return str(err)
    return ""


def megatron_locals(full: dict, config: dict, tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0) -> dict:
    """Megatron-core's local tensors of tp rank ``tp_rank`` of pipeline stage ``pp_rank`` (of
    ``pp`` equal stages, its layers numbered from 0; the embedding on the first, the final norm and
    the head on the last) from the HF state dict ``full``, by the oracle's rules (tests/oracle.py
    ``megatron_linear_qkv``/``megatron_linear_fc1``; row and column parallel splits), independent
    of realloc's layouts."""
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
    out = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = full["model.embed_tokens.weight"].chunk(tp)[tp_rank]
    if pp_rank == pp - 1:
        out["output_layer.weight"] = full["lm_head.weight"].chunk(tp)[tp_rank]
        out["decoder.final_layernorm.weight"] = full["model.norm.weight"]
    per = d.layers // pp
    for local, i in enumerate(range(pp_rank * per, (pp_rank + 1) * per)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[mg + "input_layernorm.weight"] = full[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = full[hf + "post_attention_layernorm.weight"]
        out[mg + "self_attention.linear_qkv.weight"] = oracle.megatron_linear_qkv(d, full, i, tp, tp_rank)
        out[mg + "self_attention.linear_proj.weight"] = full[hf + "self_attn.o_proj.weight"].chunk(tp, dim=1)[tp_rank]
        out[mg + "mlp.linear_fc1.weight"] = oracle.megatron_linear_fc1(full, i, tp, tp_rank)
        out[mg + "mlp.linear_fc2.weight"] = full[hf + "mlp.down_proj.weight"].chunk(tp, dim=1)[tp_rank]
    return {k: v.contiguous() for k, v in out.items()}


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


def megatron_moe_locals(full: dict, config: dict, layer_experts: list[int] | None) -> dict:
    """Megatron-core's local tensors (``GPTModel`` with ``SequentialMLP`` experts, tp=1, pp=1) of a
    rank holding routed experts ``layer_experts`` of every layer, from the HF checkpoint ``full``
    by Megatron's names, independent of realloc's layouts: q/k/v fused per query group,
    ``[gate; up]`` per expert as ``local_experts.{j}``, the router as ``mlp.router``.
    ``layer_experts=None``: a dense model (Qwen3), its MLP ``[gate; up]`` as ``mlp.linear_fc1``."""
    import torch

    heads, groups, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per = heads // groups
    out = {
        "embedding.word_embeddings.weight": full["model.embed_tokens.weight"],
        "output_layer.weight": full["lm_head.weight"],
        "decoder.final_layernorm.weight": full["model.norm.weight"],
    }
    for i in range(config["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (full[f"{hf}self_attn.{x}_proj.weight"] for x in "qkv")
        h = q.shape[1]
        qkv = torch.cat([q.reshape(groups, per * hd, h), k.reshape(groups, hd, h), v.reshape(groups, hd, h)], 1)
        out[mg + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, h)
        out[mg + "self_attention.linear_proj.weight"] = full[hf + "self_attn.o_proj.weight"]
        out[mg + "self_attention.q_layernorm.weight"] = full[hf + "self_attn.q_norm.weight"]
        out[mg + "self_attention.k_layernorm.weight"] = full[hf + "self_attn.k_norm.weight"]
        out[mg + "input_layernorm.weight"] = full[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = full[hf + "post_attention_layernorm.weight"]
        if layer_experts is None:
            out[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [full[hf + "mlp.gate_proj.weight"], full[hf + "mlp.up_proj.weight"]]
            )
            out[mg + "mlp.linear_fc2.weight"] = full[hf + "mlp.down_proj.weight"]
            continue
        out[mg + "mlp.router.weight"] = full[hf + "mlp.gate.weight"]
        for j, e in enumerate(layer_experts):
            x = f"{hf}mlp.experts.{e}."
            fc1 = torch.cat([full[x + "gate_proj.weight"], full[x + "up_proj.weight"]])
            out[f"{mg}mlp.experts.local_experts.{j}.linear_fc1.weight"] = fc1
            out[f"{mg}mlp.experts.local_experts.{j}.linear_fc2.weight"] = full[x + "down_proj.weight"]
    return out
