"""Tiny random models vLLM loads (transformers ``save_pretrained``, no tokenizer), for the tests
of the vLLM backend, and a vLLM engine on them (``LLM``, token ids in and out)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from realloc_tools.bench import vllm as bench

#: vLLM on this machine: 1 GiB of KV cache, no CPU binding (one NUMA node, tp=2); functions as
#: collective_rpc methods (the tests read the workers' tensors: :func:`padding_rows`)
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


#: The architectures :func:`save_llama` builds.
ARCHS = ("llama", "qwen3", "qwen3_moe")


def save_llama(path: Path, vocab: int = 1000, seed: int = 0, arch: str = "llama", tied: bool = False) -> Path:
    """A 2-layer float32 model of ``arch`` (:data:`ARCHS`: Llama, Qwen3 with its q/k norms, Qwen3-MoE
    with 4 routed experts) with random weights, saved to ``path``; ``tied``: the lm head is the
    embedding (``tie_word_embeddings``, no ``lm_head.weight`` in the checkpoint)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
    elif arch == "qwen3_moe":
        moe = dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True
        )
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=32, **common, **moe))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    model.to(torch.float32).save_pretrained(path)
    return path


def start_llm(path: Path, tp: int, **options):
    """An ``LLM`` on ``path`` with the realloc backend, float32, eager (the bench's:
    ``realloc_tools.bench.vllm.start_llm``; ``options``: more ``LLM`` arguments), in this module's
    environment (:data:`VLLM_ENV`)."""
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    return bench.start_llm(path, tp, **options)


#: The prompts every greedy check generates from, and the greedy run itself (each prompt's tokens,
#: their logprobs and vLLM's weight-version spans): the bench's.
PROMPTS, greedy = bench.PROMPTS, bench.greedy


def transformers_logprobs(path: Path, outs: list) -> list[tuple[list[float], list[float]]]:
    """transformers' own forward of the checkpoint at ``path`` over each prompt of :data:`PROMPTS`
    followed by its generated tokens (``outs``: :func:`greedy`'s): per prompt, the logprob of each
    generated token and the largest logprob at its step (an oracle independent of vLLM)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    result = []
    with torch.no_grad():
        for prompt, (tokens, _, _) in zip(PROMPTS, outs):
            lp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].double(), -1)
            steps = lp[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
            result.append(([float(s[t]) for s, t in zip(steps, tokens)], [float(s.max()) for s in steps]))
    return result


def perturbed(state: dict, seed: int, scale: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}


def save_weights(base: Path, state: dict, out: Path) -> Path:
    """``base``'s model folder with weights ``state`` (for vLLM's own reload: the reference)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(base, out, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def _padding_rows(worker, real: int) -> list[float]:
    """In a vLLM worker: the largest magnitude in the padding rows of its embedding and lm head."""
    model = worker.model_runner.model
    out = []
    for t in (model.model.embed_tokens.weight, model.lm_head.weight):
        start = model.model.embed_tokens.shard_indices.org_vocab_start_index
        rows = max(0, real - start)
        out.append(float(t[rows:].abs().max()) if t.shape[0] > rows else 0.0)
    return out


def _tensors(worker) -> dict[str, torch.Tensor]:
    """In a vLLM worker: a copy of every parameter and buffer of its model, as it serves them."""
    model = worker.model_runner.model
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def worker_tensors(llm) -> list[dict[str, torch.Tensor]]:
    """Per worker, every parameter and buffer of its model (kernel format: what it serves)."""
    return llm.collective_rpc(_tensors)


def padding_rows(llm, vocab: int) -> list[list[float]]:
    """Per worker, the largest magnitude in its embedding's and lm head's padding rows."""
    import functools

    return llm.collective_rpc(functools.partial(_padding_rows, real=vocab))


def _poison(worker) -> None:
    from vllm.model_executor.model_loader.reload import meta

    if getattr(meta, "_realloc_poisoned", False):
        return
    real = meta.materialize_meta_tensor

    def poisoned(t):
        out = real(t)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    meta.materialize_meta_tensor, meta._realloc_poisoned = poisoned, True


def poison_materialized_memory(llm) -> None:
    """Make every tensor vLLM's layerwise reload materializes NaN in the workers (it is
    uninitialized memory, which is often zero by luck): whatever a commit leaves unwritten shows."""
    llm.collective_rpc(_poison)


def _break_commit(worker, broken: bool) -> int:
    """In a vLLM worker: its realloc engine's commit raises (``broken``) or works again; its rank."""
    engine = worker.weight_transfer_engine

    def failing(shadow) -> None:
        raise RuntimeError(f"the commit broke on worker {engine.index} (injected)")

    if broken:
        engine._commit = failing
    else:
        engine.__dict__.pop("_commit", None)
    return engine.index


def break_commit(llm, broken: bool = True) -> list[int]:
    """Every worker's realloc commit raises (or, ``broken=False``, works again): the workers' ranks,
    one reply each, in order (an RPC whose replies are out of step returns another call's)."""
    import functools

    return llm.collective_rpc(functools.partial(_break_commit, broken=broken))


def _unstage(worker) -> int:
    """In a vLLM worker: its open realloc round counts as not staged (as if its transfer had not
    finished), so its commit refuses it before writing anything; its rank."""
    engine = worker.weight_transfer_engine
    engine.round.staged, engine.round.error = False, f"RuntimeError: worker {engine.index} unstaged (injected)"
    return engine.index


def unstage(llm) -> list[int]:
    """Every worker's open realloc round counts as not staged: the next commit is refused by all."""
    return llm.collective_rpc(_unstage)
