"""A small real Llama, tensor- and pipeline-parallel in plain torch: user code for the workers.

The model holds exactly the shards a rank of a ``realloc`` layout holds, under the Hugging Face
slot names (``model.layers.3.self_attn.q_proj.weight``...), so a worker can bind its parameters to
the views of its shard buffers and train or generate in place; after a reallocation into another
layout the same code runs with the new shards. Only ``torch``, ``torch.distributed`` and
``realloc`` are imported.

Tensor parallelism follows Megatron-LM's conventions (Megatron-core
``megatron/core/tensor_parallel/mappings.py`` for the autograd region functions and
``megatron/core/tensor_parallel/layers.py`` for ``VocabParallelEmbedding``,
``ColumnParallelLinear`` and ``RowParallelLinear``), with the sharding rules of
:func:`realloc.spec.decoder_spec`: q/k/v/gate/up split on dim 0 (whole heads), o/down on dim 1,
embedding and an untied head on vocabulary rows (rank ``r`` holds rows ``[start, stop)`` of the
vocabulary padded up to a multiple of tp, *without* local padding rows), norms replicated.
``fused=True`` names the parameters as vLLM's generation model does
(``vllm/model_executor/models/llama.py``; ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` in ``vllm/model_executor/layers/linear.py``): ``qkv_proj`` is the
rank's ``[q; k; v]`` and ``gate_up_proj`` its ``[gate; up]`` along dim 0.

Process groups are passed in and may be private (unregistered) ``ProcessGroup`` objects, so only
``dist.all_reduce``/``dist.all_gather``/``dist.broadcast`` with ``group=`` and the group's own
``send``/``recv`` are used. ``group=None`` means no parallelism along that dimension.

Example (one process, no parallelism)::

    >>> cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
    ...                   num_heads=4, num_kv_heads=2)
    >>> model = Llama(cfg)
    >>> [n for n, _ in model.named_parameters()][:3]
    ['model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight', 'model.layers.0.self_attn.q_proj.weight']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from realloc import ModelSpec
from realloc.spec import decoder_spec

__all__ = [
    "LlamaConfig",
    "Llama",
    "VocabParallelEmbedding",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelLMHead",
    "RMSNorm",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "gather_from_tp_region",
    "local_state",
    "next_token_loss",
    "greedy_generate",
    "train_step",
    "pipeline_train_step",
]

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def _dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_TORCH_DTYPES)}")
        return dtype
    for name, value in _TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {sorted(_TORCH_DTYPES)}")


# -- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama (HF ``LlamaConfig`` fields under shorter names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{key} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim {self.hidden_size // self.num_heads} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def spec(self, dtype: str = "float32", name: str = "llama") -> ModelSpec:
        """The :class:`realloc.ModelSpec` of this model (same names and tp rules as the model)."""
        return decoder_spec(
            name,
            hidden=self.hidden_size,
            intermediate=self.intermediate_size,
            layers=self.num_layers,
            heads=self.num_heads,
            kv_heads=self.num_kv_heads,
            vocab=self.vocab_size,
            head_dim=self.head_dim,
            tied=self.tie_word_embeddings,
            dtype=_dtype_name(dtype),
        )

    def hf_config(self, dtype: str = "float32", max_position_embeddings: int = 2048) -> dict:
        """A ``transformers.LlamaConfig`` dict (what ``config.json`` of the checkpoint holds)."""
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": max_position_embeddings,
            "initializer_range": 0.02,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": _dtype_name(dtype),
            "use_cache": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": None,
        }


# -- tensor-parallel regions (Megatron-core tensor_parallel/mappings.py) ---------------------------
class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's ``_CopyToModelParallelRegion``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's ``_ReduceFromModelParallelRegion``)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward, own slice backward (``_GatherFromModelParallelRegion``).

    Local sizes may differ between ranks (uneven vocabulary shards): every rank pads its piece to
    the largest size for the collective and the padding is trimmed away.
    """

    @staticmethod
    def forward(ctx, x, group, sizes, rank):
        ctx.rank, ctx.sizes = rank, sizes
        width = max(sizes)
        x = x.contiguous()
        if x.shape[-1] < width:
            x = F.pad(x, (0, width - x.shape[-1]))
        pieces = [torch.empty_like(x) for _ in sizes]
        dist.all_gather(pieces, x, group=group)
        return torch.cat([p[..., :n] for p, n in zip(pieces, sizes)], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[: ctx.rank])
        return grad[..., start : start + ctx.sizes[ctx.rank]].contiguous(), None, None, None


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group, sizes: Sequence[int], rank: int) -> torch.Tensor:
    """Concatenate every tp rank's ``x`` along the last dim (rank ``i`` contributes ``sizes[i]``)."""
    if group is None:
        return x
    if x.shape[-1] != sizes[rank]:
        raise ValueError(f"tp rank {rank} holds {x.shape[-1]} columns, expected {sizes[rank]}")
    return _GatherFromTP.apply(x, group, tuple(int(s) for s in sizes), rank)


# -- layers (Megatron-core tensor_parallel/layers.py) ----------------------------------------------
def _empty(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, stop)`` of the embedding: masked lookup, then all-reduce over tp."""

    def __init__(self, start: int, stop: int, hidden: int, group=None, *, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.start, self.stop, self.group = start, stop, group
        self.weight = _empty((stop - start, hidden), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.stop - self.start
        if rows == 0:  # a rank past the end of the vocabulary (tiny vocab, large tp)
            out = self.weight.new_zeros(*ids.shape, self.weight.shape[1]) + 0 * self.weight.sum()
        elif self.group is None:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.start) | (ids >= self.stop)
            local = (ids - self.start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.group)


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W_local^T`` with ``W`` split on output rows; the output stays split."""

    def __init__(self, in_features: int, out_local: int, group=None, *, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.group = group
        self.weight = _empty((out_local, in_features), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp_region(x, self.group), self.weight)


class RowParallelLinear(nn.Module):
    """``y = sum over tp of x_local @ W_local^T`` with ``W`` split on input columns (input already split)."""

    def __init__(self, in_local: int, out_features: int, group=None, *, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.group = group
        self.weight = _empty((out_features, in_local), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp_region(F.linear(x, self.weight), self.group)


class ParallelLMHead(nn.Module):
    """Vocabulary-parallel output layer: local logits of rows ``[start, stop)``, gathered to the full vocab."""

    def __init__(
        self,
        sizes: Sequence[int],
        rank: int,
        hidden: int,
        group=None,
        *,
        weight: nn.Parameter | None = None,
        dtype=torch.float32,
        device="cpu",
    ):
        super().__init__()
        self.group, self.sizes, self.rank = group, tuple(sizes), rank
        self.weight = weight if weight is not None else _empty((self.sizes[rank], hidden), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(copy_to_tp_region(x, self.group), self.weight)
        return gather_from_tp_region(local, self.group, self.sizes, self.rank)


class RMSNorm(nn.Module):
    """HF ``LlamaRMSNorm``: float32 variance, ``weight * normed.to(input dtype)``."""

    def __init__(self, hidden: int, eps: float, *, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.eps = eps
        self.weight = _empty((hidden,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(seq: int, head_dim: int, theta: float, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama's default rotary tables for positions ``0..seq-1`` (non-interleaved halves)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(seq, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """Causal GQA self-attention on this rank's heads (q heads split over tp, k/v heads too or replicated)."""

    def __init__(self, config: LlamaConfig, tp_group, tp_size: int, tp_rank: int, fused: bool, dtype, device):
        super().__init__()
        spec = config.spec()
        d, h = config.head_dim, config.hidden_size
        self.config, self.fused, self.group = config, fused, tp_group
        self.heads = config.num_heads // tp_size
        kv_start, kv_stop, _ = spec.param("model.layers.0.self_attn.k_proj.weight").tp_range(tp_size, tp_rank)
        self.kv_heads = (kv_stop - kv_start) // d
        q_out, kv_out = self.heads * d, self.kv_heads * d
        if fused:
            self.qkv_proj = ColumnParallelLinear(h, q_out + 2 * kv_out, tp_group, dtype=dtype, device=device)
        else:
            self.q_proj = ColumnParallelLinear(h, q_out, tp_group, dtype=dtype, device=device)
            self.k_proj = ColumnParallelLinear(h, kv_out, tp_group, dtype=dtype, device=device)
            self.v_proj = ColumnParallelLinear(h, kv_out, tp_group, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(q_out, h, tp_group, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.config.head_dim
        if self.fused:
            qkv = self.qkv_proj(x)
            q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:  # HF repeat_kv: kv head j serves q heads j*rep .. (j+1)*rep-1
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * d**-0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.heads * d)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate/up column-parallel, down row-parallel."""

    def __init__(self, config: LlamaConfig, tp_group, tp_size: int, fused: bool, dtype, device):
        super().__init__()
        h = config.hidden_size
        self.fused = fused
        self.inter = config.intermediate_size // tp_size
        if fused:
            self.gate_up_proj = ColumnParallelLinear(h, 2 * self.inter, tp_group, dtype=dtype, device=device)
        else:
            self.gate_proj = ColumnParallelLinear(h, self.inter, tp_group, dtype=dtype, device=device)
            self.up_proj = ColumnParallelLinear(h, self.inter, tp_group, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(self.inter, h, tp_group, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, tp_group, tp_size: int, tp_rank: int, fused: bool, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, tp_group, tp_size, tp_rank, fused, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = MLP(config, tp_group, tp_size, fused, dtype, device)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


# -- the model ------------------------------------------------------------------------------------
def _check_tp(config: LlamaConfig, tp_size: int, tp_rank: int, tp_group) -> None:
    if not isinstance(tp_size, int) or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank!r} must be in 0..tp_size-1 with tp_size {tp_size!r} >= 1")
    if tp_size > 1 and tp_group is None:
        raise ValueError(f"tp_size {tp_size} needs a tp_group")
    problems = config.spec().tp_problems(tp_size)
    if problems:
        raise ValueError("; ".join(problems))


class Llama(nn.Module):
    """This rank's piece of a Llama: ``named_parameters()`` are the HF slot names of its shards.

    ``layers`` is the range of global layer indices of this pipeline stage (default: all);
    ``first``/``last`` say whether the stage holds the embedding / the final norm and head.
    Parameters are created empty with exactly the rank's shard shapes: the caller binds or fills
    them. ``forward`` takes token ids ``[batch, seq]`` on the first stage (hidden states on the
    others) and returns hidden states, or full-vocabulary logits ``[batch, seq, vocab]`` on the
    last stage.

    When ``tp_size`` exceeds the k/v heads, each k/v head is replicated on ``tp_size // kv_heads``
    ranks (``realloc``'s rule): fine for inference, refused (``ValueError``) for training, whose
    k/v gradients would need a reduction over the replicas.
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        tp_group=None,
        tp_size: int = 1,
        tp_rank: int = 0,
        layers: range | Sequence[int] | None = None,
        first: bool = True,
        last: bool = True,
        fused: bool = False,
        dtype: torch.dtype = torch.float32,
        device="cpu",
    ):
        super().__init__()
        _check_tp(config, tp_size, tp_rank, tp_group)
        layers = range(config.num_layers) if layers is None else layers
        layers = [int(i) for i in layers]
        if any(not 0 <= i < config.num_layers for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"layers {layers} must be distinct indices in 0..{config.num_layers - 1}")
        self.config, self.tp_group, self.tp_size, self.tp_rank = config, tp_group, tp_size, tp_rank
        self.first, self.last, self.fused, self.layer_indices = first, last, fused, tuple(layers)
        self.dtype = dtype
        self.kv_replicated = tp_size > config.num_kv_heads
        spec = config.spec()
        embed = spec.param("model.embed_tokens.weight")
        vocab_ranges = [embed.tp_range(tp_size, r)[:2] for r in range(tp_size)]
        start, stop = vocab_ranges[tp_rank]
        h = config.hidden_size

        self.model = nn.Module()
        if first:
            self.model.embed_tokens = VocabParallelEmbedding(start, stop, h, tp_group, dtype=dtype, device=device)
        self.model.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config, tp_group, tp_size, tp_rank, fused, dtype, device) for i in layers}
        )
        if last:
            self.model.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
            shared = self.model.embed_tokens.weight if (first and config.tie_word_embeddings) else None
            self.lm_head = ParallelLMHead(
                [b - a for a, b in vocab_ranges], tp_rank, h, tp_group, weight=shared, dtype=dtype, device=device
            )

    @property
    def tied_on_stage(self) -> bool:
        """The head reuses the embedding Parameter (tied weights, both on this stage)."""
        return self.first and self.last and self.config.tie_word_embeddings

    def _check_trainable(self) -> None:
        if (
            self.kv_replicated
            and torch.is_grad_enabled()
            and any(p.requires_grad for n, p in self.named_parameters() if "k_proj" in n or "v_proj" in n or "qkv" in n)
        ):
            raise ValueError(
                f"tp_size {self.tp_size} > num_kv_heads {self.config.num_kv_heads}: k/v heads are replicated "
                "over tp ranks, which this model supports for inference only (run under torch.no_grad())"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_trainable()
        if self.first:
            if x.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"the first stage takes token ids, got a {x.dtype} tensor")
            x = self.model.embed_tokens(x)
        seq = x.shape[1]
        cos, sin = rotary_cos_sin(seq, self.config.head_dim, self.config.rope_theta, x.dtype, x.device)
        for layer in self.model.layers.values():
            x = layer(x, cos, sin)
        if self.last:
            x = self.lm_head(self.model.norm(x))
        return x


# -- shards of full tensors -----------------------------------------------------------------------
def local_state(
    config: LlamaConfig,
    full: dict[str, torch.Tensor],
    tp_size: int,
    tp_rank: int,
    layers: range | Sequence[int] | None = None,
    first: bool = True,
    last: bool = True,
    fused: bool = False,
) -> dict[str, torch.Tensor]:
    """The local tensors of a rank, sliced from full HF tensors by the spec's tp rules.

    Keys are the rank model's ``named_parameters()`` names; ``full`` needs no ``lm_head.weight``
    when the weights are tied.
    """
    spec = config.spec()
    layers = range(config.num_layers) if layers is None else layers

    def piece(name: str, source: str | None = None) -> torch.Tensor:
        p = spec.param(name)
        t = full[source or name]
        if tuple(t.shape) != p.shape:
            raise ValueError(f"{source or name}: shape {tuple(t.shape)}, expected {p.shape}")
        if p.tp_dim is None:
            return t.clone()
        start, stop, _ = p.tp_range(tp_size, tp_rank)
        return t.narrow(p.tp_dim, start, stop - start).clone()

    out: dict[str, torch.Tensor] = {}
    if first:
        out["model.embed_tokens.weight"] = piece("model.embed_tokens.weight")
    for i in layers:
        pre = f"model.layers.{i}."
        out[pre + "input_layernorm.weight"] = piece(pre + "input_layernorm.weight")
        q, k, v = (piece(pre + f"self_attn.{x}_proj.weight") for x in "qkv")
        if fused:
            out[pre + "self_attn.qkv_proj.weight"] = torch.cat([q, k, v])
        else:
            out.update(
                {
                    pre + "self_attn.q_proj.weight": q,
                    pre + "self_attn.k_proj.weight": k,
                    pre + "self_attn.v_proj.weight": v,
                }
            )
        out[pre + "self_attn.o_proj.weight"] = piece(pre + "self_attn.o_proj.weight")
        out[pre + "post_attention_layernorm.weight"] = piece(pre + "post_attention_layernorm.weight")
        gate, up = piece(pre + "mlp.gate_proj.weight"), piece(pre + "mlp.up_proj.weight")
        if fused:
            out[pre + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
        else:
            out.update({pre + "mlp.gate_proj.weight": gate, pre + "mlp.up_proj.weight": up})
        out[pre + "mlp.down_proj.weight"] = piece(pre + "mlp.down_proj.weight")
    if last:
        out["model.norm.weight"] = piece("model.norm.weight")
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = piece("lm_head.weight")
        elif not first:  # a tied head on its own stage keeps a copy of the embedding's rows
            out["lm_head.weight"] = piece(
                "model.embed_tokens.weight", "lm_head.weight" if "lm_head.weight" in full else None
            )
    return out


# -- generation and training ----------------------------------------------------------------------
@torch.no_grad()
def greedy_generate(model: Llama, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding on a single-stage model, recomputing the whole sequence each step.

    Returns the tokens ``[batch, len + new_tokens]`` and the logits of each generated step
    ``[batch, new_tokens, vocab]``. Every tp rank gets the same gathered logits, hence the same tokens.
    """
    if not (model.first and model.last):
        raise ValueError("greedy_generate needs a model holding every pipeline stage")
    tokens, steps = prompts, []
    for _ in range(new_tokens):
        logits = model(tokens)[:, -1]
        steps.append(logits)
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True).to(tokens.dtype)], dim=1)
    vocab = model.config.vocab_size
    out = torch.stack(steps, dim=1) if steps else prompts.new_zeros(prompts.shape[0], 0, vocab, dtype=model.dtype)
    return tokens, out


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]`` (float32)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def _refuse_replicated_kv(model: Llama) -> None:
    if model.kv_replicated:
        raise ValueError(
            f"cannot train with tp_size {model.tp_size} > num_kv_heads {model.config.num_kv_heads}: "
            "k/v heads are replicated over tp ranks (inference only)"
        )


def _reduce_grads(model: Llama, dp_group, dp_size: int) -> None:
    if dp_group is None or dp_size == 1:
        return
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=dp_group)
        p.grad.div_(dp_size)


def train_step(
    model: Llama, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, *, dp_group=None, dp_size: int = 1
) -> float:
    """One step on a single-stage model: loss on the local batch, backward, dp gradient mean, optimizer step.

    Replicated parameters (norms) get identical gradients on every tp rank (their inputs are the
    same everywhere and the column layers all-reduce their input gradients), so only dp needs a
    reduction.
    """
    _refuse_replicated_kv(model)
    if not (model.first and model.last):
        raise ValueError("train_step needs a model holding every pipeline stage; use pipeline_train_step")
    loss = next_token_loss(model(tokens), tokens)
    loss.backward()
    _reduce_grads(model, dp_group, dp_size)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def pipeline_train_step(
    model: Llama,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    *,
    pp_group,
    pp_rank: int,
    pp_size: int,
    dp_group=None,
    dp_size: int = 1,
) -> float | None:
    """One GPipe step with a single microbatch over ``pp_size`` stages.

    Every stage gets the token batch (the last one needs the labels). Activations go forward to
    ``pp_rank + 1`` and their gradients come back, through ``pp_group``'s own ``send``/``recv``
    (group ranks are pipeline stages). With tied weights split over stages the first stage's
    embedding gradient and the last stage's head gradient are summed (Megatron's embedding group),
    so both copies stay equal. Returns the loss on the last stage, ``None`` elsewhere.
    """
    _refuse_replicated_kv(model)
    if pp_size == 1:
        return train_step(model, optimizer, tokens, dp_group=dp_group, dp_size=dp_size)
    if pp_group is None:
        raise ValueError("pp_size > 1 needs a pp_group")
    if model.first != (pp_rank == 0) or model.last != (pp_rank == pp_size - 1):
        raise ValueError(f"stage {pp_rank} of {pp_size}: the model's first/last flags do not match")
    b, s = tokens.shape
    if model.first:
        inputs = tokens
    else:
        inputs = torch.empty(b, s, model.config.hidden_size, dtype=model.dtype, device=tokens.device)
        pp_group.recv([inputs], pp_rank - 1, 0).wait()
        inputs.requires_grad_(True)
    out = model(inputs)
    loss = None
    if model.last:
        loss = next_token_loss(out, tokens)
        loss.backward()
    else:
        pp_group.send([out.detach().contiguous()], pp_rank + 1, 0).wait()
        grad = torch.empty_like(out)
        pp_group.recv([grad], pp_rank + 1, 0).wait()
        out.backward(grad)
    if not model.first:
        pp_group.send([inputs.grad.contiguous()], pp_rank - 1, 0).wait()
    if model.config.tie_word_embeddings:
        if model.first:
            w = model.model.embed_tokens.weight
            peer = pp_size - 1
        else:
            w = model.lm_head.weight if model.last else None
            peer = 0
        if w is not None:
            mine = w.grad if w.grad is not None else torch.zeros_like(w)
            other = torch.empty_like(mine)
            if model.first:
                pp_group.send([mine.contiguous()], peer, 0).wait()
                pp_group.recv([other], peer, 0).wait()
            else:
                pp_group.recv([other], peer, 0).wait()
                pp_group.send([mine.contiguous()], peer, 0).wait()
            w.grad = mine + other
    _reduce_grads(model, dp_group, dp_size)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return None if loss is None else float(loss.detach())
