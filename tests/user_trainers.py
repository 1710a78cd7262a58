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


def module_of(tensors: dict):
    """A module whose ``named_parameters()`` are ``tensors`` (dotted names as nested modules)."""
    import torch

    root = torch.nn.Module()
    for name, t in tensors.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        m.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def megatron_moe_locals(full: dict, config: dict, layer_experts: list[int] | None) -> dict:
    """Megatron-core's local tensors (``GPTModel`` with ``SequentialMLP`` experts, tp=1, pp=1) of a
    rank holding routed experts ``layer_experts`` of every layer, from the HF checkpoint ``full``
    by Megatron's names, independent of realloc's layouts: q/k/v (and their biases) fused per query
    group, ``[gate; up]`` per expert as ``local_experts.{j}``, the router as ``mlp.router``; q/k norms
    where the checkpoint has them; the shared expert (Qwen2-MoE's ``mlp.shared_expert``, DeepSeek's
    ``mlp.shared_experts``) as ``mlp.shared_experts.linear_fc1`` ``[gate; up]`` and ``linear_fc2``,
    Qwen2-MoE's ``mlp.shared_expert_gate`` as its ``gate_weight`` (megatron/core/transformer/moe/
    shared_experts.py ``SharedExpertMLP``); Mixtral's ``block_sparse_moe`` with ``w1``/``w3``/``w2``.
    ``layer_experts=None``: a dense model (Qwen3), its MLP ``[gate; up]`` as ``mlp.linear_fc1``."""
    import torch

    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    per = heads // groups
    mixtral = config["model_type"] == "mixtral"
    dense = ("gate_proj", "up_proj", "down_proj")
    moe, experts = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", dense)

    def fc(x: str, names: tuple[str, str, str] = dense):
        """An MLP's ``linear_fc1`` ``[gate; up]`` and ``linear_fc2`` from its HF tensors under ``x``
        (``names``: its gate, up and down projections)."""
        gate, up, down = (full[f"{x}{n}.weight"] for n in names)
        return torch.cat([gate, up]), down

    out = {
        "embedding.word_embeddings.weight": full["model.embed_tokens.weight"],
        "output_layer.weight": full["lm_head.weight"],
        "decoder.final_layernorm.weight": full["model.norm.weight"],
    }
    for i in range(config["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for suffix in ("weight", "bias"):
            if f"{hf}self_attn.q_proj.{suffix}" not in full:
                continue
            q, k, v = (full[f"{hf}self_attn.{x}_proj.{suffix}"] for x in "qkv")
            rest = tuple(q.shape[1:])
            qkv = torch.cat(
                [q.reshape((groups, per * hd) + rest), k.reshape((groups, hd) + rest), v.reshape((groups, hd) + rest)],
                1,
            )
            out[f"{mg}self_attention.linear_qkv.{suffix}"] = qkv.reshape((-1,) + rest)
        out[mg + "self_attention.linear_proj.weight"] = full[hf + "self_attn.o_proj.weight"]
        for x in "qk":
            if f"{hf}self_attn.{x}_norm.weight" in full:
                out[f"{mg}self_attention.{x}_layernorm.weight"] = full[f"{hf}self_attn.{x}_norm.weight"]
        out[mg + "input_layernorm.weight"] = full[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = full[hf + "post_attention_layernorm.weight"]
        if layer_experts is None:
            out[mg + "mlp.linear_fc1.weight"], out[mg + "mlp.linear_fc2.weight"] = fc(hf + "mlp.")
            continue
        out[mg + "mlp.router.weight"] = full[f"{hf}{moe}.gate.weight"]
        for j, e in enumerate(layer_experts):
            x = f"{mg}mlp.experts.local_experts.{j}."
            out[x + "linear_fc1.weight"], out[x + "linear_fc2.weight"] = fc(f"{hf}{moe}.experts.{e}.", experts)
        for shared in ("mlp.shared_expert.", "mlp.shared_experts."):
            if hf + shared + "gate_proj.weight" in full:
                x = mg + "mlp.shared_experts."
                out[x + "linear_fc1.weight"], out[x + "linear_fc2.weight"] = fc(hf + shared)
        if hf + "mlp.shared_expert_gate.weight" in full:
            out[mg + "mlp.shared_experts.gate_weight"] = full[hf + "mlp.shared_expert_gate.weight"]
    return out
