"""Reference Megatron slicing, written from the model description alone.

Nothing here imports ``realloc.layout`` or calls ``ParamSpec.tp_range``: the local tensor of every
rank is cut out of the FULL tensors with ``narrow``/``chunk`` following Megatron-LM's rules for a
Llama-style decoder:

* embedding and untied lm_head: split on the vocabulary (dim 0) after padding the vocabulary with
  zero rows up to a multiple of ``pad_multiple * tp`` (``make_vocab_size_divisible_by``);
* q (and its bias): column parallel, ``heads / tp`` whole heads per rank;
* k, v (and biases): ``kv_heads / tp`` heads per rank, or when ``tp > kv_heads`` head
  ``tp_rank // (tp // kv_heads)`` (each kv head replicated on ``tp / kv_heads`` ranks);
* gate, up: column parallel (dim 0); o: row parallel by heads (dim 1); down: row parallel (dim 1);
* layer norms, q/k norms and the final norm: whole on every rank;
* pipeline: stage 0 holds the embedding, stage ``s`` the layers listed for it, the last stage the
  final norm and the head; a tied head on a last stage other than stage 0 is its own copy of the
  embedding (slot ``lm_head.weight``);
* which layers a stage holds, when no explicit split is given: the engines' rule
  (:func:`engine_stage_counts`), written from vLLM's ``get_pp_indices`` description
  (vllm/distributed/utils.py) and Megatron-core's ``get_num_layers_to_build``
  (megatron/core/transformer/transformer_block.py), not from ``realloc.layout.topology``;
* rank order: ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``;
* vLLM's vocabulary rule (``pad_rule="vllm"``), written from
  vllm/model_executor/layers/vocab_parallel_embedding.py: ``pad_vocab_size`` rounds the vocabulary
  up to a multiple of the padding size (64 by default), ``divide`` splits that padded size over
  tp exactly (:func:`vllm_padded_vocab`), and rank ``r`` holds padded rows ``[r*per, (r+1)*per)``;
* Megatron-core's fused ``linear_qkv`` (:func:`megatron_linear_qkv`), written from
  megatron/core/transformer/attention.py: the global fused weight is, per query group, the group's
  q heads then its k head then its v head, column-parallel, so a tp rank holds the consecutive
  ``groups / tp`` groups; ``linear_fc1`` (megatron/core/transformer/mlp.py) is the rank's gate
  rows then its up rows;
* sharded data parallelism (FSDP2 ``fully_shard``, HSDP when dp > 1 too), written from
  torch/distributed/fsdp/_fully_shard/_fsdp_param.py and torchtitan's device mesh
  (dims ``pp, dp_replicate, dp_shard, cp, tp``, tp fastest): the rank order becomes
  ``rank = tp_rank + tp * (fsdp_rank + fsdp * (dp_rank + dp * pp_rank))``; FSDP2 shards the
  tp-local tensor with ``torch.chunk(local, fsdp, dim=0)`` and fsdp rank ``i`` holds chunk ``i``,
  or nothing (no slot at all here) when ``torch.chunk`` returned fewer chunks. The tp-local
  embedding / head is Megatron's padded shard (``[P / tp, hidden]``, padding rows included) when
  the vocabulary is padded (``pad_multiple > 1``: Megatron-FSDP), else torchtitan's DTensor local
  tensor, its real rows only.
* ZeRO-3 flat partitions (``fsdp_split="zero3"``), written from DeepSpeed's ``_partition_param``
  (deepspeed/runtime/zero/partition_parameters.py): the same rank order; the tp-local tensor
  (Megatron-DeepSpeed's, vocabulary padding rows included: ``numel`` counts them) is flattened,
  padded to a multiple of ``fsdp`` and cut into ``fsdp`` equal parts; fsdp rank ``i`` holds part
  ``i`` (its ``ds_tensor``), every rank one part of every slot.

* expert parallelism (:class:`MoeDecoder`, :func:`moe_local_tensors`), written from Megatron-core's
  expert mesh (megatron/core/parallel_state.py ``initialize_model_parallel``: a
  ``RankGenerator`` over sizes ``tp=expert_tensor_parallel_size, ep, dp=expert data parallel,
  pp`` in order ``"tp-ep-dp-pp"``, the first name fastest) and vLLM's ``determine_expert_map``
  (vllm/model_executor/layers/fused_moe/layer.py, linear placement: ``global // ep`` experts per
  rank, the ``global % ep`` leftover ones one each to the first ranks, contiguous): a rank's
  expert coordinates are the mixed-radix digits of its rank over ``[etp, ep, edp, pp]``; it
  holds the experts vLLM's expert map gives its ep rank, each cut ``etp`` ways like a dense MLP
  (gate/up by rows, down by columns); everything else is the dense model's slicing. vLLM's fused
  ``w13_weight``/``w2_weight`` (:func:`vllm_w13`, :func:`vllm_w2`, from ``FusedMoE._load_w13`` /
  ``_load_w2``): the local experts stacked, per expert the etp slice of gate then of up.

* block FP8 (:func:`fp8_block_quantize`, :func:`fp8_block_dequantize`), written from vLLM's
  ``per_block_cast_to_fp8`` (vllm/utils/deep_gemm.py, ``use_ue8m0=False``) and DeepSeek-V3's
  ``weight_dequant`` (inference/kernel.py): one 128 x 128 block at a time, in a Python loop.

* transformers 5's stacked experts (:func:`stacked_local_tensors`), written from
  models/qwen3_moe/modeling_qwen3_moe.py (``Qwen3MoeExperts``: ``gate_up_proj`` ``[E, 2*inter,
  hidden]``, ``down_proj`` ``[E, hidden, inter]``, ``gate, up = linear(x, gate_up_proj[e]).chunk(2)``),
  conversion_mapping.py (``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)`` of gate and up),
  distributed/tensor_parallel.py (``gate_up_proj`` ``packed_colwise``: ``_StridedShard(dim=1,
  split_factor=2)``, i.e. dim 1 seen as 2 blocks, each cut tp ways, the rank's pieces concatenated;
  ``down_proj`` ``rowwise``: ``Shard(-1)``), FSDP2 (``torch.chunk(local, fsdp, dim=0)`` of the
  tp-local stacked tensor, a ``(0, ...)`` tensor where the chunk is missing) and ZeRO-3 (the
  tp-local stacked tensor flattened, padded and cut, as :func:`zero3_part`).

* torchtitan's expert parallelism with FSDP (:func:`torchtitan_local_tensors`), written from
  torchtitan/distributed/parallel_dims.py (the sparse mesh ``(pp, dp_replicate, efsdp, ep)``
  unflattens the world, ep fastest), torchtitan/models/common/moe.py (``w1_EFD``, ``w3_EFD``
  ``[E, F, D]``, ``w2_EDF`` ``[E, D, F]``), moe_sharding.py (``Shard(0)`` over ep) and
  torchtitan/distributed/fsdp.py (``fully_shard`` of the ep-local stacks over efsdp, ``Shard(0)``,
  or ``Shard(1)`` when ``efsdp * ep > E``): the global stacks are chunked by the mesh and cut
  back into per-expert tensors.

The only realloc imports are :func:`realloc.spec.decoder_spec` and
:func:`realloc.spec.hf_config.spec_from_hf_config`, to build the spec under test from the same
description (:meth:`Decoder.spec`, :meth:`MoeDecoder.spec`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


@dataclass(frozen=True)
class Decoder:
    """A Llama-style decoder, as a model card would describe it."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm weights
    dtype: str = "bfloat16"
    norm_dtype: str = "float32"
    mlp_bias: bool = False  # Llama's mlp_bias (then qkv_bias is Llama's attention_bias: o_proj too)

    def spec(self, name: str = "oracle-model"):
        from realloc.spec import decoder_spec

        if self.mlp_bias:
            from realloc.spec.hf_config import spec_from_hf_config

            assert not self.qk_norm, "Llama has no q/k norms"
            config = {
                "model_type": "llama",
                "hidden_size": self.hidden,
                "intermediate_size": self.intermediate,
                "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "vocab_size": self.vocab,
                "tie_word_embeddings": self.tied,
                "attention_bias": self.qkv_bias,
                "mlp_bias": True,
            }
            return spec_from_hf_config(config, dtype=self.dtype, norm_dtype=self.norm_dtype, name=name)

        return decoder_spec(
            name,
            hidden=self.hidden,
            intermediate=self.intermediate,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab=self.vocab,
            tied=self.tied,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            dtype=self.dtype,
            norm_dtype=self.norm_dtype,
        )


@dataclass(frozen=True)
class Param:
    """One storage tensor. ``rule`` is how tensor parallelism cuts it; ``home`` where it lives in
    the pipeline: ``"first"`` (embedding), ``"last"`` (final norm, head) or a layer index."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    rule: str  # vocab | head_rows | kv_rows | rows | head_cols | cols | whole
    home: "str | int"
    expert: "int | None" = None  # a routed expert's index (MoeDecoder)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


def params(d: Decoder) -> list[Param]:
    """Storage tensors of ``d`` in the engines' module order (HF names): forward order, except that
    with MLP biases the gate and up weights come before their biases (vLLM's
    ``MergedColumnParallelLinear`` registers ``gate_up_proj.weight`` then ``gate_up_proj.bias``,
    vllm/model_executor/layers/linear.py; Megatron's ``linear_fc1`` likewise)."""
    q_rows, kv_rows = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [Param(EMBED, (d.vocab, d.hidden), d.dtype, "vocab", "first")]
    for i in range(d.layers):
        pre = f"model.layers.{i}."
        out.append(Param(pre + "input_layernorm.weight", (d.hidden,), d.norm_dtype, "whole", i))
        out.append(Param(pre + "self_attn.q_proj.weight", (q_rows, d.hidden), d.dtype, "head_rows", i))
        out.append(Param(pre + "self_attn.k_proj.weight", (kv_rows, d.hidden), d.dtype, "kv_rows", i))
        out.append(Param(pre + "self_attn.v_proj.weight", (kv_rows, d.hidden), d.dtype, "kv_rows", i))
        if d.qkv_bias:
            out.append(Param(pre + "self_attn.q_proj.bias", (q_rows,), d.dtype, "head_rows", i))
            out.append(Param(pre + "self_attn.k_proj.bias", (kv_rows,), d.dtype, "kv_rows", i))
            out.append(Param(pre + "self_attn.v_proj.bias", (kv_rows,), d.dtype, "kv_rows", i))
        out.append(Param(pre + "self_attn.o_proj.weight", (d.hidden, q_rows), d.dtype, "head_cols", i))
        if d.mlp_bias and d.qkv_bias:  # Llama's attention_bias: o_proj's bias, added after the all-reduce
            out.append(Param(pre + "self_attn.o_proj.bias", (d.hidden,), d.dtype, "whole", i))
        if d.qk_norm:
            out.append(Param(pre + "self_attn.q_norm.weight", (d.head_dim,), d.norm_dtype, "whole", i))
            out.append(Param(pre + "self_attn.k_norm.weight", (d.head_dim,), d.norm_dtype, "whole", i))
        out.append(Param(pre + "post_attention_layernorm.weight", (d.hidden,), d.norm_dtype, "whole", i))
        out.append(Param(pre + "mlp.gate_proj.weight", (d.intermediate, d.hidden), d.dtype, "rows", i))
        out.append(Param(pre + "mlp.up_proj.weight", (d.intermediate, d.hidden), d.dtype, "rows", i))
        if d.mlp_bias:  # the engines' order: vLLM's gate_up_proj.weight, then gate_up_proj.bias
            out.append(Param(pre + "mlp.gate_proj.bias", (d.intermediate,), d.dtype, "rows", i))
            out.append(Param(pre + "mlp.up_proj.bias", (d.intermediate,), d.dtype, "rows", i))
        out.append(Param(pre + "mlp.down_proj.weight", (d.hidden, d.intermediate), d.dtype, "cols", i))
        if d.mlp_bias:  # row parallel: added once after the all-reduce, whole on every rank
            out.append(Param(pre + "mlp.down_proj.bias", (d.hidden,), d.dtype, "whole", i))
    out.append(Param(FINAL_NORM, (d.hidden,), d.norm_dtype, "whole", "last"))
    if not d.tied:
        out.append(Param(HEAD, (d.vocab, d.hidden), d.dtype, "vocab", "last"))
    return out


def tp_fits(d: Decoder, tp: int) -> bool:
    """Megatron can split ``d`` ``tp`` ways: whole q heads and mlp rows per rank, kv heads split or
    replicated evenly."""
    kv_ok = d.kv_heads % tp == 0 or tp % d.kv_heads == 0
    return d.heads % tp == 0 and d.intermediate % tp == 0 and kv_ok


def coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """``(dp_rank, tp_rank, pp_rank)`` of ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``."""
    assert 0 <= rank < dp * tp * pp
    tp_rank = rank % tp
    dp_rank = (rank // tp) % dp
    pp_rank = rank // (tp * dp)
    return dp_rank, tp_rank, pp_rank


def coords4(rank: int, dp: int, fsdp: int, tp: int, pp: int) -> tuple[int, int, int, int]:
    """``(dp_rank, fsdp_rank, tp_rank, pp_rank)`` of
    ``rank = tp_rank + tp * (fsdp_rank + fsdp * (dp_rank + dp * pp_rank))`` (torchtitan's mesh)."""
    assert 0 <= rank < dp * fsdp * tp * pp
    return (rank // (tp * fsdp)) % dp, (rank // tp) % fsdp, rank % tp, rank // (tp * fsdp * dp)


def fsdp_chunk(local: torch.Tensor, fsdp: int, fsdp_rank: int) -> "torch.Tensor | None":
    """FSDP2's shard of a (tp-local) tensor: ``torch.chunk(local, fsdp, dim=0)[fsdp_rank]``,
    ``None`` where torch.chunk gives fewer chunks (FSDP2's ``_chunk_with_empty`` pads those)."""
    if local.shape[0] == 0:
        return None
    chunks = torch.chunk(local, fsdp, dim=0)
    return chunks[fsdp_rank].clone() if fsdp_rank < len(chunks) else None


def zero3_part(local: torch.Tensor, fsdp: int, fsdp_rank: int, pad_value=0) -> torch.Tensor:
    """DeepSpeed ZeRO-3's ``ds_tensor`` of a (tp-local) tensor: flatten, pad with ``pad_value`` up
    to a multiple of ``fsdp``, cut into ``fsdp`` equal parts, part ``fsdp_rank``."""
    flat = local.reshape(-1)
    pad = torch.full(((-flat.numel()) % fsdp,), pad_value, dtype=flat.dtype)
    return torch.cat([flat, pad]).view(fsdp, -1)[fsdp_rank].clone()


def engine_stage_counts(layers: int, pp: int, rule: str = "vllm") -> tuple[int, ...]:
    """Layers per pipeline stage as the engines build them, stage by stage.

    vLLM: every stage has ``layers // pp``; the ``r = layers % pp`` leftover layers go one each
    to the ``r`` stages just before the last one (never to the last, which also runs the final
    norm and the head; the first only once every other stage but the last has one). Megatron-core
    (no uneven options): ``layers / pp`` each, and pp must divide the layer count, which is where
    the two agree.
    """
    assert 1 <= pp <= layers
    base, r = layers // pp, layers % pp
    if rule == "megatron":
        if r:
            raise ValueError(f"{layers} layers do not split evenly over pp={pp}")
        return tuple(base for _ in range(pp))
    assert rule == "vllm", rule
    return tuple(base + (1 if pp - 1 - r <= s < pp - 1 else 0) for s in range(pp))


def stage_lists(counts) -> list[list[int]]:
    """Contiguous layer indices of each stage from per-stage layer counts."""
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def pipeline_stages(layers: int, pp: int, layer_split=None, rule: str = "vllm") -> list[list[int]]:
    """Layer indices of each stage: the explicit ``layer_split`` as given, else the engines' rule."""
    counts = tuple(layer_split) if layer_split is not None else engine_stage_counts(layers, pp, rule)
    assert len(counts) == pp and sum(counts) == layers and min(counts) >= 1, counts
    return stage_lists(counts)


def padded_vocab(vocab: int, tp: int, pad_multiple: int) -> int:
    block = pad_multiple * tp
    return -(-vocab // block) * block


def vllm_padded_vocab(vocab: int, tp: int, pad_to: int) -> int:
    """vLLM: ``pad_vocab_size(vocab, pad_to)``, and tp must divide it (``divide`` asserts)."""
    padded = (vocab + pad_to - 1) // pad_to * pad_to
    if padded % tp:
        raise ValueError(f"vLLM cannot split {padded} padded rows {tp} ways")
    return padded


def tp_slice(
    d: Decoder,
    p: Param,
    full: torch.Tensor,
    tp: int,
    tp_rank: int,
    pad_multiple: int = 1,
    pad_value=0,
    pad_rule: str = "megatron",
) -> torch.Tensor:
    """The local tensor of ``p`` on tp rank ``tp_rank`` (padding rows filled with ``pad_value``)."""
    assert tp_fits(d, tp), f"tp={tp} does not fit {d}"
    hd = d.head_dim
    if p.rule == "whole":
        return full.clone()
    if p.rule == "vocab":
        rows = (padded_vocab if pad_rule == "megatron" else vllm_padded_vocab)(d.vocab, tp, pad_multiple)
        pad = torch.full((rows - d.vocab,) + tuple(full.shape[1:]), pad_value, dtype=full.dtype)
        return torch.cat([full, pad]).chunk(tp, dim=0)[tp_rank].clone()
    if p.rule == "head_rows":  # q: heads / tp whole heads
        per = d.heads // tp
        return full.narrow(0, tp_rank * per * hd, per * hd).clone()
    if p.rule == "kv_rows":
        if tp <= d.kv_heads:
            per = d.kv_heads // tp
            return full.narrow(0, tp_rank * per * hd, per * hd).clone()
        head = tp_rank // (tp // d.kv_heads)
        return full.narrow(0, head * hd, hd).clone()
    if p.rule == "rows":
        return full.chunk(tp, dim=0)[tp_rank].clone()
    if p.rule == "head_cols":  # o: row parallel over heads
        per = d.heads // tp
        return full.narrow(1, tp_rank * per * hd, per * hd).clone()
    if p.rule == "cols":
        return full.chunk(tp, dim=1)[tp_rank].clone()
    raise AssertionError(p.rule)


def stage_slots(
    d: Decoder, stages: list[list[int]], pp_rank: int, plist: "list[Param] | None" = None
) -> list[tuple[str, Param]]:
    """``(slot name, storage param)`` of pipeline stage ``pp_rank``, forward order (of ``plist``,
    default ``params(d)``)."""
    plist = params(d) if plist is None else plist
    last = len(stages) - 1
    by_name = {p.name: p for p in plist}
    slots = []
    if pp_rank == 0:
        slots.append((EMBED, by_name[EMBED]))
    for p in plist:
        if isinstance(p.home, int) and p.home in stages[pp_rank]:
            slots.append((p.name, p))
    if pp_rank == last:
        slots.append((FINAL_NORM, by_name[FINAL_NORM]))
        if not d.tied:
            slots.append((HEAD, by_name[HEAD]))
        elif pp_rank != 0:
            slots.append((HEAD, by_name[EMBED]))  # own copy of the tied embedding
    return slots


def local_tensors(
    d: Decoder,
    full: dict[str, torch.Tensor],
    dp: int,
    tp: int,
    pp: int,
    stages: list[list[int]],
    rank: int,
    pad_multiple: int = 1,
    pad_value=0,
    fsdp: int = 1,
    split: str = "fsdp2",
    pad_rule: str = "megatron",
    fused: bool = False,
) -> dict[str, torch.Tensor]:
    """Slot name -> local tensor of ``rank`` (``full`` maps storage names to global tensors);
    ``split="zero3"``: the 1-D ZeRO-3 partition of every slot, padding filled with ``pad_value``.

    ``fused`` (with ``fsdp > 1``): the model is Megatron's, whose parameters are the fused
    ``model.layers.N.self_attention.linear_qkv.{weight,bias}`` (:func:`megatron_linear_qkv`) and
    ``model.layers.N.mlp.linear_fc1.{weight,bias}`` (:func:`megatron_linear_fc1`) in place of
    q/k/v and gate/up (at the place of q and of gate), and FSDP2 / ZeRO-3 shard those whole
    tensors, not their parts."""
    assert len(stages) == pp and sorted(i for s in stages for i in s) == list(range(d.layers))
    if fsdp == 1 and not fused:
        _, tp_rank, pp_rank = coords(rank, dp, tp, pp)
        return {
            slot: tp_slice(d, p, full[p.name], tp, tp_rank, pad_multiple, pad_value, pad_rule)
            for slot, p in stage_slots(d, stages, pp_rank)
        }
    _, fsdp_rank, tp_rank, pp_rank = coords4(rank, dp, fsdp, tp, pp)
    out = {}
    for slot, p in stage_slots(d, stages, pp_rank):
        part = slot.rsplit(".", 2)[-2] if fused else None
        if part in ("k_proj", "v_proj", "up_proj"):
            continue  # inside the fused tensor built at q_proj / gate_proj
        if part in ("q_proj", "gate_proj"):
            layer, suffix = p.home, slot.rsplit(".", 1)[1]
            if part == "q_proj":
                slot = f"model.layers.{layer}.self_attention.linear_qkv.{suffix}"
                local = megatron_linear_qkv(d, full, layer, tp, tp_rank, suffix)
            else:
                slot = f"model.layers.{layer}.mlp.linear_fc1.{suffix}"
                local = megatron_linear_fc1(full, layer, tp, tp_rank, suffix)
        else:
            local = tp_slice(d, p, full[p.name], tp, tp_rank, pad_multiple, pad_value, pad_rule)
        if fsdp == 1:  # (fused, without sharded data parallelism: Megatron's tp-local tensors)
            out[slot] = local
            continue
        held = sharded_dp_part(d, p, local, tp_rank, fsdp, fsdp_rank, split, pad_multiple, pad_value, fused)
        if held is not None:
            out[slot] = held
    return out


def sharded_dp_part(
    d: Decoder,
    p: Param,
    local: torch.Tensor,
    tp_rank: int,
    fsdp: int,
    fsdp_rank: int,
    split: str,
    pad_multiple: int,
    pad_value,
    megatron: bool = False,
) -> "torch.Tensor | None":
    """What fsdp rank ``fsdp_rank`` holds of a tp-local tensor: its ZeRO-3 partition, or its FSDP2
    chunk (``None`` where torch.chunk gives none). torchtitan's vocabulary-parallel DTensor (FSDP2,
    no padding multiple) holds the real rows only; Megatron's padded shard (pad_multiple > 1, or
    any multiple for Megatron's own model, ``megatron``: Megatron-LM's ``_vocab_size_with_padding``
    pads to ``make_vocab_size_divisible_by * tp``, so with multiple 1 to a multiple of tp) and
    DeepSpeed's flattened one keep their padding rows."""
    if p.rule == "vocab" and split == "fsdp2" and pad_multiple == 1 and not megatron:
        per = local.shape[0]
        local = local.narrow(0, 0, max(0, min(per, d.vocab - tp_rank * per)))
    if split == "zero3":
        return zero3_part(local, fsdp, fsdp_rank, pad_value)
    return fsdp_chunk(local, fsdp, fsdp_rank)


def storage_of(d: Decoder, slot: str) -> str:
    return EMBED if d.tied and slot == HEAD else slot


def full_tensors(d: Decoder, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random global tensors with no zero element (magnitudes in [1, 2), random signs), so an
    element never written is visible against zero-initialised buffers."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in params(d):
        mag = 1 + torch.rand(p.shape, generator=g, dtype=torch.float64)
        sign = torch.randint(0, 2, p.shape, generator=g, dtype=torch.int64) * 2 - 1
        out[p.name] = (mag * sign).to(TORCH_DTYPES[p.dtype])
    return out


def changed_version(full: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """``full`` with about ``fraction`` of its elements changed (the next weight version, for deltas):
    each chosen element ``x`` becomes ``x * 1.5 + 0.25``, computed in float64 and rounded once."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in full.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        new = t.clone()
        new[mask] = (t[mask].double() * 1.5 + 0.25).to(t.dtype)
        out[name] = new
    return out


def index_tensors(d: Decoder) -> dict[str, torch.Tensor]:
    """Global tensors whose elements are their own flat index (int64)."""
    return {p.name: torch.arange(p.numel, dtype=torch.int64).reshape(p.shape) for p in params(d)}


def held_indices(
    d: Decoder,
    dp: int,
    tp: int,
    pp: int,
    stages: list[list[int]],
    rank: int,
    pad_multiple: int = 1,
    fsdp: int = 1,
    split: str = "fsdp2",
    pad_rule: str = "megatron",
    fused: bool = False,
) -> dict[str, torch.Tensor]:
    """Storage name -> flat global indices of the elements ``rank`` holds (padding excluded).

    Every element of every parameter gets one distinct number (the parameter's offset in the
    concatenation of all of them, plus its flat index), so a fused tensor's elements still say
    which parameter they are of."""
    plist = params(d)
    starts, at = {}, 0
    for p in plist:
        starts[p.name] = at
        at += p.numel
    numbered = {p.name: torch.arange(starts[p.name], starts[p.name] + p.numel).reshape(p.shape) for p in plist}
    local = local_tensors(
        d,
        numbered,
        dp,
        tp,
        pp,
        stages,
        rank,
        pad_multiple,
        pad_value=-1,
        fsdp=fsdp,
        split=split,
        pad_rule=pad_rule,
        fused=fused,
    )
    values = torch.cat([t.reshape(-1) for t in local.values()] + [torch.zeros(0, dtype=torch.int64)])
    values = values[values >= 0]
    bounds = torch.tensor([starts[p.name] for p in plist])
    which = torch.searchsorted(bounds, values, right=True) - 1
    out = {}
    for i, p in enumerate(plist):
        mine = values[which == i]
        if mine.numel():
            out[p.name] = mine - starts[p.name]
    return out


def megatron_linear_qkv(
    d: Decoder, full: dict[str, torch.Tensor], layer: int, tp: int, tp_rank: int, suffix: str = "weight"
) -> torch.Tensor:
    """Megatron-core's local ``linear_qkv.{suffix}`` of tp rank ``tp_rank``, from the full HF q/k/v.

    The full fused tensor is ``[groups, (q_per_group + 2) * head_dim, ...]``: per group its q heads,
    its k head, its v head; column parallelism (``ColumnParallelLinear``: ``divide(rows, tp)``) gives
    rank ``r`` the ``r``-th of ``tp`` equal row ranges: ``groups / tp`` whole groups when tp divides
    them, else (megatron-core 0.16 allows tp a multiple of ``num_query_groups``:
    ``TransformerConfig.__post_init__``, ``Attention.__init__``) rows that cut through a group."""
    rows = (d.heads + 2 * d.kv_heads) * d.head_dim
    assert d.heads % d.kv_heads == 0 and (d.kv_heads % tp == 0 or (tp % d.kv_heads == 0 and rows % tp == 0))
    pre = f"model.layers.{layer}.self_attn."
    q, k, v = (full[f"{pre}{x}_proj.{suffix}"] for x in "qkv")
    groups, per_group, hd = d.kv_heads, d.heads // d.kv_heads, d.head_dim
    rest = tuple(q.shape[1:])
    fused = torch.cat(
        [q.reshape((groups, per_group * hd) + rest), k.reshape((groups, hd) + rest), v.reshape((groups, hd) + rest)],
        dim=1,
    )
    return fused.reshape((groups * (per_group + 2) * hd,) + rest).chunk(tp, dim=0)[tp_rank].clone()


def megatron_linear_fc1(
    full: dict[str, torch.Tensor], layer: int, tp: int, tp_rank: int, suffix: str = "weight"
) -> torch.Tensor:
    """Megatron-core's local ``linear_fc1.{suffix}`` with a gated linear unit: the rank's gate rows,
    then its up rows (vLLM's ``gate_up_proj.{suffix}`` is the same tensor)."""
    pre = f"model.layers.{layer}.mlp."
    return torch.cat(
        [
            full[f"{pre}gate_proj.{suffix}"].chunk(tp, dim=0)[tp_rank],
            full[f"{pre}up_proj.{suffix}"].chunk(tp, dim=0)[tp_rank],
        ]
    )


# -- hypothesis strategies for model descriptions and topologies --------------------------------

#: (heads, kv_heads) pairs: MHA, GQA, MQA, and head counts where tp 4 -> 6 is legal.
#: Richest first: hypothesis favours early choices.
HEAD_CHOICES = [
    (12, 2),
    (48, 12),
    (8, 2),
    (12, 4),
    (6, 2),
    (4, 1),
    (6, 3),
    (4, 2),
    (12, 12),
    (2, 1),
    (4, 4),
    (2, 2),
    (1, 1),
]


def decoders(st, max_layers: int = 5, mlp_bias: bool = False):
    """A hypothesis strategy of small :class:`Decoder` descriptions (``st`` is hypothesis.strategies);
    ``mlp_bias=True``: Llama models with MLP biases half the time."""

    @st.composite
    def build(draw):
        heads, kv = draw(st.sampled_from(HEAD_CHOICES))
        dtype = draw(st.sampled_from(["bfloat16", "float32", "float16"]))
        biased = mlp_bias and draw(st.booleans())
        return Decoder(
            mlp_bias=biased,
            hidden=draw(st.integers(4, 16)),
            intermediate=draw(st.sampled_from([24, 48, 36, 12])),  # divisible by every tp drawn
            layers=draw(st.integers(1, max_layers)),
            heads=heads,
            kv_heads=kv,
            head_dim=draw(st.integers(1, 3)) if heads < 48 else 1,
            vocab=draw(st.integers(3, 61)),
            tied=draw(st.booleans()),
            qkv_bias=draw(st.booleans()),
            qk_norm=draw(st.booleans()) and not biased,
            dtype=dtype,
            norm_dtype=draw(st.sampled_from(["float32", dtype])),
        )

    return build()


def factorisations(d: Decoder, world: int) -> list[tuple[int, int, int]]:
    """Every ``(dp, tp, pp)`` with ``dp * tp * pp == world`` that fits ``d``."""
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) == 0 and tp_fits(d, tp) and pp <= d.layers:
                out.append((world // (tp * pp), tp, pp))
    return sorted(out, key=lambda t: -sum(n > 1 for n in t))  # richest first: hypothesis favours early choices


def factorisations4(d: Decoder, world: int) -> list[tuple[int, int, int, int]]:
    """Every ``(dp, fsdp, tp, pp)`` with ``fsdp > 1`` and product ``world`` that fits ``d``."""
    out = []
    for dp, tp, pp in factorisations(d, world):
        for fsdp in range(2, dp + 1):
            if dp % fsdp == 0:
                out.append((dp // fsdp, fsdp, tp, pp))
    return sorted(out, key=lambda t: -sum(n > 1 for n in t))


def layer_splits(st, layers: int, pp: int):
    """Strategy: ``None`` (the engines' default split, :func:`engine_stage_counts`) or explicit
    counts, >= 1 per stage."""
    if pp == 1:
        return st.just(None)
    explicit = st.lists(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True).map(
        lambda cuts: tuple(b - a for a, b in zip([0] + sorted(cuts), sorted(cuts) + [layers]))
    )
    return st.one_of(st.just(None), explicit)


def pp_rules(st, layers: int, pp: int):
    """Strategy: a ``pp_split`` rule name, the default ("vllm") first since hypothesis favours
    early choices; "megatron" only where pp divides the layers (elsewhere it refuses)."""
    return st.sampled_from(["vllm", "balanced"] + (["megatron"] if layers % pp == 0 else []))


# -- mixture of experts with expert parallelism ---------------------------------------------------


@dataclass(frozen=True)
class MoeDecoder(Decoder):
    """A Qwen2-MoE-style decoder: the first ``dense_layers`` layers have a dense MLP
    (``intermediate``), the others a router over ``experts`` routed experts of ``moe_inter`` rows
    plus one shared expert of ``shared_inter`` rows behind a 1-row sigmoid gate."""

    experts: int = 4
    moe_inter: int = 4
    shared_inter: int = 8
    dense_layers: int = 1

    def config(self) -> dict:
        return {
            "model_type": "qwen2_moe",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "head_dim": self.head_dim,
            "num_key_value_heads": self.kv_heads,
            "vocab_size": self.vocab,
            "num_experts": self.experts,
            "moe_intermediate_size": self.moe_inter,
            "shared_expert_intermediate_size": self.shared_inter,
            "mlp_only_layers": list(range(self.dense_layers)),
            "qkv_bias": self.qkv_bias,
            "tie_word_embeddings": self.tied,
        }

    def spec(self, name: str = "oracle-moe"):
        from realloc.spec import spec_from_hf_config

        return spec_from_hf_config(self.config(), dtype=self.dtype, norm_dtype=self.norm_dtype, name=name)


def moe_params(m: MoeDecoder) -> list[Param]:
    """Storage tensors of ``m`` in forward order: the dense decoder's, with every MoE layer's MLP
    replaced by the router, the routed experts (gate, up, down each) and the shared expert."""
    out = []
    for p in params(m):
        layer = p.home
        if not (isinstance(layer, int) and layer >= m.dense_layers and ".mlp." in p.name):
            out.append(p)
            continue
        if not p.name.endswith("mlp.gate_proj.weight"):
            continue  # the dense MLP's up/down: replaced with the gate below
        pre = f"model.layers.{layer}.mlp."
        out.append(Param(pre + "gate.weight", (m.experts, m.hidden), m.dtype, "whole", layer))
        for e in range(m.experts):
            for proj, shape, rule in (
                ("gate_proj", (m.moe_inter, m.hidden), "rows"),
                ("up_proj", (m.moe_inter, m.hidden), "rows"),
                ("down_proj", (m.hidden, m.moe_inter), "cols"),
            ):
                out.append(Param(f"{pre}experts.{e}.{proj}.weight", shape, m.dtype, rule, layer, expert=e))
        for proj, shape, rule in (
            ("gate_proj", (m.shared_inter, m.hidden), "rows"),
            ("up_proj", (m.shared_inter, m.hidden), "rows"),
            ("down_proj", (m.hidden, m.shared_inter), "cols"),
        ):
            out.append(Param(f"{pre}shared_expert.{proj}.weight", shape, m.dtype, rule, layer))
        out.append(Param(pre + "shared_expert_gate.weight", (1, m.hidden), m.dtype, "whole", layer))
    return out


def moe_tp_fits(m: MoeDecoder, tp: int) -> bool:
    return tp_fits(m, tp) and m.shared_inter % tp == 0


def vllm_expert_map(experts: int, ep: int) -> list[int]:
    """vLLM's linear expert placement as an owner per expert: ep rank ``r`` gets ``experts // ep``
    experts plus one if ``r < experts % ep``, in rank order."""
    owner: list[int] = []
    for r in range(ep):
        owner += [r] * (experts // ep + (1 if r < experts % ep else 0))
    return owner


def local_experts(experts: int, ep: int, ep_rank: int) -> list[int]:
    return [e for e, r in enumerate(vllm_expert_map(experts, ep)) if r == ep_rank]


def expert_mesh_coords(rank: int, dp: int, tp: int, pp: int, ep: int, etp: int) -> tuple[int, int, int, int]:
    """``(etp_rank, ep_rank, edp_rank, pp_rank)``: Megatron's RankGenerator, order tp-ep-dp-pp over
    sizes ``[etp, ep, dp * tp // (ep * etp), pp]``."""
    sizes = [etp, ep, dp * tp // (ep * etp), pp]
    assert math.prod(sizes) == dp * tp * pp
    digits = []
    for n in sizes:
        digits.append(rank % n)
        rank //= n
    return tuple(digits)  # type: ignore[return-value]


def moe_local_tensors(
    m: MoeDecoder,
    full: dict[str, torch.Tensor],
    dp: int,
    tp: int,
    pp: int,
    ep: int,
    etp: int,
    stages: list[list[int]],
    rank: int,
    pad_multiple: int = 1,
    pad_value=0,
) -> dict[str, torch.Tensor]:
    """Slot name -> local tensor of ``rank`` with expert parallelism ``ep``/``etp``."""
    etp_rank, ep_rank, _, pp_rank = expert_mesh_coords(rank, dp, tp, pp, ep, etp)
    _, tp_rank, pp_dense = coords(rank, dp, tp, pp)
    assert pp_dense == pp_rank
    mine = set(local_experts(m.experts, ep, ep_rank))
    out = {}
    for slot, p in stage_slots(m, stages, pp_rank, moe_params(m)):
        if p.expert is None:
            out[slot] = tp_slice(m, p, full[p.name], tp, tp_rank, pad_multiple, pad_value)
        elif p.expert in mine:
            out[slot] = full[p.name].chunk(etp, dim=0 if p.rule == "rows" else 1)[etp_rank].clone()
    return out


def moe_full_tensors(m: MoeDecoder, seed: int = 0, index: bool = False) -> dict[str, torch.Tensor]:
    """As :func:`full_tensors` (``index=True``: :func:`index_tensors`) for the MoE parameters."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in moe_params(m):
        if index:
            out[p.name] = torch.arange(p.numel, dtype=torch.int64).reshape(p.shape)
            continue
        mag = 1 + torch.rand(p.shape, generator=g, dtype=torch.float64)
        sign = torch.randint(0, 2, p.shape, generator=g, dtype=torch.int64) * 2 - 1
        out[p.name] = (mag * sign).to(TORCH_DTYPES[p.dtype])
    return out


def vllm_w13(full: dict[str, torch.Tensor], layer: int, experts: list[int], etp: int, etp_rank: int) -> torch.Tensor:
    """vLLM's ``w13_weight`` of an ep/etp rank: ``[len(experts), 2 * inter / etp, hidden]``, per
    local expert its gate rows' etp slice (``w1``) then its up rows' (``w3``)."""
    pre = f"model.layers.{layer}.mlp.experts."
    return torch.stack(
        [
            torch.cat(
                [
                    full[f"{pre}{e}.gate_proj.weight"].chunk(etp, 0)[etp_rank],
                    full[f"{pre}{e}.up_proj.weight"].chunk(etp, 0)[etp_rank],
                ]
            )
            for e in experts
        ]
    )


def vllm_w2(full: dict[str, torch.Tensor], layer: int, experts: list[int], etp: int, etp_rank: int) -> torch.Tensor:
    """vLLM's ``w2_weight``: ``[len(experts), hidden, inter / etp]``, the down projections' column slices."""
    pre = f"model.layers.{layer}.mlp.experts."
    return torch.stack([full[f"{pre}{e}.down_proj.weight"].chunk(etp, 1)[etp_rank] for e in experts])


def moe_decoders(st, max_layers: int = 4):
    """A hypothesis strategy of small :class:`MoeDecoder` descriptions (dims divisible by 1, 2, 4)."""

    @st.composite
    def build(draw):
        heads, kv = draw(st.sampled_from([(4, 2), (8, 2), (4, 4), (4, 1), (2, 2), (2, 1)]))
        head_dim = draw(st.integers(1, 3))
        dtype = draw(st.sampled_from(["bfloat16", "float32"]))
        layers = draw(st.integers(2, max_layers))
        return MoeDecoder(
            hidden=heads * head_dim,
            intermediate=draw(st.sampled_from([8, 16])),
            layers=layers,
            heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
            vocab=draw(st.integers(5, 40)),
            tied=draw(st.booleans()),
            qkv_bias=draw(st.booleans()),
            dtype=dtype,
            norm_dtype=draw(st.sampled_from(["float32", dtype])),
            experts=draw(st.integers(1, 9)),
            moe_inter=draw(st.sampled_from([4, 8])),
            shared_inter=draw(st.sampled_from([4, 8])),
            dense_layers=draw(st.integers(0, 1)),
        )

    return build()


def ep_factorisations(m: MoeDecoder, world: int) -> list[tuple[int, int, int, int, int]]:
    """Every ``(dp, tp, pp, ep, etp)`` of ``world`` ranks that fits ``m``: ``ep * etp`` divides the
    ``dp * tp`` ranks of a stage, ``ep`` at most the experts, etp splits the expert rows."""
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) or not moe_tp_fits(m, tp) or pp > m.layers:
                continue
            block = world // pp
            for ep in range(1, min(block, m.experts) + 1):
                for etp in range(1, block // ep + 1):
                    if block % (ep * etp) == 0 and m.moe_inter % etp == 0:
                        out.append((block // tp, tp, pp, ep, etp))
    return sorted(out, key=lambda t: (-(t[3] > 1), -sum(n > 1 for n in t)))


FP8_BLOCK = 128


def fp8_block_quantize(full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 values, fp32 scales)`` of a 2-D tensor, block by block: the block's largest
    magnitude in fp32, at least 1e-4, over 448 is its scale; each element times the fp32
    reciprocal of the scale, cast to float8_e4m3fn."""
    rows, cols = full.shape
    nr, nc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    values = torch.empty(full.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty((nr, nc), dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            r, c = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
            block = full[r, c].to(torch.float32)
            amax = torch.maximum(block.abs().max(), torch.tensor(1e-4, dtype=torch.float32))
            scale = amax / torch.tensor(448.0, dtype=torch.float32)
            values[r, c] = (block * (torch.tensor(1.0, dtype=torch.float32) / scale)).to(torch.float8_e4m3fn)
            scales[i, j] = scale
    return values, scales


def fp8_block_dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each 128 x 128 block of ``values`` in fp32 times its scale, then cast to ``dtype``."""
    out = torch.empty(values.shape, dtype=dtype)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            r, c = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
            out[r, c] = (values[r, c].to(torch.float32) * scales[i, j]).to(dtype)
    return out


# -- transformers 5's stacked experts ------------------------------------------------------------


def hf_stacked_full(m: MoeDecoder, full: dict[str, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 5's global ``(gate_up_proj, down_proj)`` of a MoE layer from the checkpoint
    tensors: per expert ``cat([gate, up], dim=0)``, stacked on a new dim 0 (conversion_mapping.py)."""
    pre = f"model.layers.{layer}.mlp.experts."
    gate = torch.stack([full[f"{pre}{e}.gate_proj.weight"] for e in range(m.experts)])
    up = torch.stack([full[f"{pre}{e}.up_proj.weight"] for e in range(m.experts)])
    down = torch.stack([full[f"{pre}{e}.down_proj.weight"] for e in range(m.experts)])
    return torch.cat([gate, up], dim=1), down


def strided_shard(t: torch.Tensor, dim: int, split_factor: int, world: int, rank: int) -> torch.Tensor:
    """DTensor's ``_StridedShard(dim, split_factor)`` local tensor: ``t`` along ``dim`` as
    ``split_factor`` blocks, each cut ``world`` ways; rank ``rank``'s piece of every block, in order."""
    return torch.cat([block.chunk(world, dim)[rank] for block in t.chunk(split_factor, dim)], dim)


def moe_dense_locals(
    m: MoeDecoder, full: dict[str, torch.Tensor], sizes: tuple[int, int, int, int], stages, rank: int, **options
) -> dict[str, torch.Tensor]:
    """Slot -> local tensor of every slot of ``rank`` that is not a routed expert, ``sizes`` being
    ``(dp, fsdp, tp, pp)``: tp, then FSDP2 (option ``empty_chunks``, default True: a ``(0, ...)``
    tensor where torch.chunk gives none, as FSDP2 keeps; else absent) or ZeRO-3 (option
    ``split="zero3"``: the flat partition); options ``pad_multiple`` and ``pad_value`` as in
    :func:`tp_slice`."""
    dp, fsdp, tp, pp = sizes
    split, empty_chunks = options.get("split", "fsdp2"), options.get("empty_chunks", True)
    pad_multiple, pad_value = options.get("pad_multiple", 1), options.get("pad_value", 0)
    _, fsdp_rank, tp_rank, pp_rank = coords4(rank, dp, fsdp, tp, pp)
    out = {}
    for slot, p in stage_slots(m, stages, pp_rank, moe_params(m)):
        if p.expert is not None:
            continue
        local = tp_slice(m, p, full[p.name], tp, tp_rank, pad_multiple, pad_value)
        if fsdp == 1:
            out[slot] = local
            continue
        held = sharded_dp_part(m, p, local, tp_rank, fsdp, fsdp_rank, split, pad_multiple, pad_value)
        if held is not None:
            out[slot] = held
        elif empty_chunks:
            out[slot] = local[:0].clone()
    return out


def stacked_local_tensors(
    m: MoeDecoder,
    full: dict[str, torch.Tensor],
    dp: int,
    fsdp: int,
    tp: int,
    pp: int,
    stages: list[list[int]],
    rank: int,
    split: str = "fsdp2",
    pad_multiple: int = 1,
    pad_value=0,
) -> dict[str, torch.Tensor]:
    """What a transformers 5 MoE model holds on ``rank`` (tp, then FSDP2 or ZeRO-3): name -> local
    tensor, the routed experts as ``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj``, every
    other slot as :func:`local_tensors` gives it (ZeRO-3: every tensor its flat partition)."""
    _, fsdp_rank, tp_rank, pp_rank = coords4(rank, dp, fsdp, tp, pp)
    out = moe_dense_locals(
        m, full, (dp, fsdp, tp, pp), stages, rank, split=split, pad_multiple=pad_multiple, pad_value=pad_value
    )
    for layer in stages[pp_rank]:
        if layer < m.dense_layers:
            continue
        gate_up, down = hf_stacked_full(m, full, layer)
        pre = f"model.layers.{layer}.mlp.experts."
        for name, local in (
            (pre + "gate_up_proj", strided_shard(gate_up, 1, 2, tp, tp_rank)),
            (pre + "down_proj", down.chunk(tp, -1)[tp_rank]),
        ):
            if fsdp == 1:
                out[name] = local.clone()
            elif split == "zero3":
                out[name] = zero3_part(local, fsdp, fsdp_rank, pad_value)
            else:
                chunks = torch.chunk(local, fsdp, dim=0)
                out[name] = chunks[fsdp_rank].clone() if fsdp_rank < len(chunks) else local[:0].clone()
    return out


def fsdp_factorisations(m: MoeDecoder, world: int) -> list[tuple[int, int, int, int]]:
    """Every ``(dp, fsdp, tp, pp)`` of ``world`` ranks fitting ``m`` (fsdp 1 included), the expert
    rows split by tp too."""
    out = []
    for dp, tp, pp in factorisations(m, world):
        if not moe_tp_fits(m, tp) or m.moe_inter % tp:
            continue
        for fsdp in range(1, dp + 1):
            if dp % fsdp == 0:
                out.append((dp // fsdp, fsdp, tp, pp))
    return sorted(out, key=lambda t: -sum(n > 1 for n in t))


# -- torchtitan: expert parallelism with FSDP -----------------------------------------------------


def torchtitan_expert_stacks(
    m: MoeDecoder, full: dict[str, torch.Tensor], sizes: tuple[int, int, int, int, int], stages, rank: int
) -> list[tuple[int, str, torch.Tensor, list[int]]]:
    """``(layer, proj, local stack, its experts)`` of every MoE layer on ``rank`` under torchtitan's
    EP + FSDP, ``sizes = (dp, fsdp, tp, pp, ep)``: the global stack of ``proj`` (``gate_proj`` is
    ``w1``, ``up_proj`` ``w3``, ``down_proj`` ``w2``) distributed ``Shard(0)`` over ep, then
    ``torch.chunk`` over efsdp on dim 0 (``efsdp * ep <= E``) or dim 1 (a zero-size stack where
    torch.chunk gives no chunk)."""
    dp, fsdp, tp, pp, ep = sizes
    _, fsdp_rank, tp_rank, pp_rank = coords4(rank, dp, fsdp, tp, pp)
    i = tp_rank + tp * fsdp_rank  # the sparse mesh: efsdp x ep over the same fsdp x tp ranks
    ep_rank, efsdp_rank, efsdp = i % ep, i // ep, fsdp * tp // ep
    dim = 0 if efsdp * ep <= m.experts else 1
    ids = torch.arange(m.experts).chunk(ep)[ep_rank]
    if dim == 0:
        parts = ids.chunk(efsdp)
        ids = parts[efsdp_rank] if efsdp_rank < len(parts) else ids[:0]
    out = []
    for layer in stages[pp_rank]:
        if layer < m.dense_layers:
            continue
        pre = f"model.layers.{layer}.mlp.experts."
        for proj in ("gate_proj", "down_proj", "up_proj"):
            stack = torch.stack([full[f"{pre}{e}.{proj}.weight"] for e in range(m.experts)])
            local = stack.chunk(ep, 0)[ep_rank]
            parts = local.chunk(efsdp, dim)
            mine = parts[efsdp_rank] if efsdp_rank < len(parts) else local.narrow(dim, 0, 0)
            out.append((layer, proj, mine.clone(), ids.tolist()))
    return out


def torchtitan_local_tensors(
    m: MoeDecoder, full: dict[str, torch.Tensor], sizes: tuple[int, int, int, int, int], stages, rank: int
) -> dict[str, torch.Tensor]:
    """Slot name -> local tensor of ``rank`` under torchtitan's EP + FSDP (``sizes = (dp, fsdp,
    tp, pp, ep)``): dense slots as FSDP2 holds them (empty chunks absent), routed experts cut out
    of :func:`torchtitan_expert_stacks` per expert (a piece with no rows is absent)."""
    out = moe_dense_locals(m, full, sizes[:4], stages, rank, empty_chunks=False)
    for layer, proj, mine, ids in torchtitan_expert_stacks(m, full, sizes, stages, rank):
        for k, e in enumerate(ids):
            if mine[k].shape[0]:
                out[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = mine[k].clone()
    return out


def torchtitan_module_tensors(
    m: MoeDecoder, full: dict[str, torch.Tensor], sizes: tuple[int, int, int, int, int], stages, rank: int
) -> dict[str, torch.Tensor]:
    """What torchtitan's modules hold on ``rank``: FSDP2's dense local tensors (zero-size where the
    chunk is empty) and the ``GroupedExperts`` stacks under torchtitan's FQNs
    (``layers.N.moe.routed_experts.inner_experts.w1_EFD`` / ``w2_EDF`` / ``w3_EFD``, its
    state_dict_adapter's names)."""
    out = moe_dense_locals(m, full, sizes[:4], stages, rank)
    kinds = {"gate_proj": "w1_EFD", "down_proj": "w2_EDF", "up_proj": "w3_EFD"}
    for layer, proj, mine, _ in torchtitan_expert_stacks(m, full, sizes, stages, rank):
        out[f"layers.{layer}.moe.routed_experts.inner_experts.{kinds[proj]}"] = mine
    return out


def torchtitan_factorisations(m: MoeDecoder, world: int) -> list[tuple[int, int, int, int, int]]:
    """Every ``(dp, fsdp, tp, pp, ep)`` of ``world`` ranks torchtitan runs for ``m``: fsdp > 1,
    ep > 1 dividing fsdp x tp and the expert count."""
    out = []
    for dp, fsdp, tp, pp in fsdp_factorisations(m, world):
        for ep in range(2, fsdp * tp + 1):
            if fsdp > 1 and (fsdp * tp) % ep == 0 and m.experts % ep == 0:
                out.append((dp, fsdp, tp, pp, ep))
    return out
