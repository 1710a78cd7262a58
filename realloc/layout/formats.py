"""Which layouts can hold a block-FP8 weight format (:mod:`realloc.spec.formats`): the engine's rule.

vLLM's ``Fp8LinearMethod.create_weights`` (``vllm/model_executor/layers/quantization/fp8.py``,
``validate_fp8_block_shape`` in ``.../quantization/utils/fp8_utils.py``) refuses a tensor-parallel
partition that is not a whole number of blocks: a column-parallel layer's output rows per rank
(each fused part of it) and a row-parallel layer's input columns per rank must be multiples of
the block edge, so every block of a weight lies on one rank and its scale travels with it. A
layout of a block format is refused the same way, before any traffic: every rank's box of a
quantized weight must start on a block boundary and end on one (or at the tensor's end), and its
scales' box is then exactly the blocks of that box. (vLLM 0.32 skips that check for a fused layer,
``qkv_proj`` / ``gate_up_proj``, with a part that is not whole blocks:
``ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch`` in ``.../layers/linear.py``; its
scale loader then puts each part's scale rows at ``ceil(offset / 128)``, ``adjust_block_scale_shard``,
so such a part runs past the scale tensor, and the load fails, or shares a block row with the next
part. Such a tp is refused here all the same.)

vLLM's ``FusedMoE`` buffers (``expert_order="vllm"``) need more: an expert ffn per partition,
``moe_intermediate_size / etp``, that is a multiple of the block edge at ANY expert tp, 1 included
(``w13_weight`` stacks gate and up, so a partial last gate block would put its scales into the
up's rows). vLLM 0.32 does not refuse the others: it holds their scales on another grid than the
checkpoint's 128 x 128 blocks (``resolve_fp8_moe_weight_block_shape`` in
``vllm/model_executor/layers/fused_moe/oracle/fp8.py``: ``refine_fp8_moe_block_shape`` re-grids
``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` to ``gcd(128, per partition, hidden)`` blocks, each
checkpoint scale repeated by ``RoutedExperts.weight_loader``; with an explicit ``moe_backend``
whose kernels need 128 blocks, ``pad_tp_shard_to_weight_blocks`` pads each tp shard to whole
blocks), and refuses only when no grid of at least 32 fits (``validate_fp8_block_shape_moe`` in
``.../quantization/utils/fp8_utils.py``, called by ``Fp8MoEMethod.create_weights``). Neither grid
is a box of the checkpoint's scales, so such a layout is refused the same way.
"""

from __future__ import annotations

from realloc.layout.conventions import expert_projection
from realloc.layout.topology import Topology
from realloc.spec import ModelSpec
from realloc.spec.formats import BLOCK, FP8, scale_name

__all__ = ["check_block_layout"]


def check_block_layout(spec: ModelSpec, topology: Topology, qkv_order: str, expert_order: str) -> None:
    """``ValueError`` unless every rank of ``topology`` holds whole blocks of every quantized weight."""
    fmt = spec.weight_format
    if fmt is None or not fmt.startswith("fp8_block"):
        return
    if topology.fsdp > 1:
        raise ValueError(
            f"weight_format={fmt!r} with fsdp={topology.fsdp}: block-FP8 weights are a serving format "
            "(tensor/expert/pipeline parallel, as vLLM holds them); FSDP/ZeRO-3 chunks would split "
            "blocks from their scales. Use fsdp=1 for the block-FP8 side"
        )
    if qkv_order != "hf":
        raise ValueError(
            f"weight_format={fmt!r} with qkv_order={qkv_order!r}: Megatron-core's block FP8 is not this "
            "format. It holds linear_qkv as Transformer Engine's Float8BlockwiseQTensor "
            "(transformer_engine/pytorch/tensor/float8_blockwise_tensor.py): row-wise FP8 data with a "
            "rowwise_scale_inv whose inner dimension is padded to a multiple of 4 (Float8BlockQuantizer."
            "get_scale_shape), a column-wise (transposed) copy with its own scales, and TE's quantizer "
            "rules (amax_epsilon, force_pow_2_scales), not vLLM's / DeepSeek's per_block_cast_to_fp8 with "
            "one weight_scale_inv per weight, so no layout here holds it bit for bit. Block-FP8 layouts "
            "use qkv_order='hf' (vLLM's qkv_proj); keep Megatron's side in bf16 and let the copy convert"
        )
    if expert_order not in ("hf", "vllm", "hf_stacked"):
        raise ValueError(
            f"weight_format={fmt!r} with expert_order={expert_order!r}: block-FP8 layouts hold experts per "
            "tensor (expert_order='hf'), in vLLM's FusedMoE buffers ('vllm') or in transformers 5's "
            "FP8Experts stacks ('hf_stacked'); torchtitan's stacks are a training layout (FSDP)"
        )
    by_name = spec.by_name
    if expert_order in ("vllm", "hf_stacked"):
        _check_fused_moe_blocks(spec, topology, fmt, expert_order)
    seen: set[tuple] = set()
    for p in spec.params:
        if p.dtype != FP8 or p.tp_dim is None:
            continue
        split = topology.expert_tp if p.expert is not None else topology.tp
        s = by_name[scale_name(p.name)]
        key = (p.shape, p.tp_dim, p.tp_unit, p.replicate_units, s.tp_unit, split)
        if key in seen:
            continue
        seen.add(key)
        size = p.shape[p.tp_dim]
        if p.tp_problem(split) is not None:
            continue  # Topology.check names it
        for rank in range(split):
            start, stop, _ = p.tp_range(split, rank)
            aligned = start % BLOCK == 0 and (stop % BLOCK == 0 or stop == size)
            if aligned and s.tp_problem(split) is None:
                s_start, s_stop, _ = s.tp_range(split, rank)
                if (s_start, s_stop) == (start // BLOCK, -(-stop // BLOCK)):
                    continue
            problem = (
                f"{p.name}: [{start}, {stop}) of dim {p.tp_dim} on rank {rank} of {split} is not whole {BLOCK}-blocks"
            )
            kind = "expert tensor parallel size etp" if p.expert is not None else "tp"
            raise ValueError(
                f"weight_format={fmt!r}: {problem}. vLLM's block FP8 needs every rank's part of a "
                f"quantized weight to be a multiple of {BLOCK} along its split dimension; choose a "
                f"{kind} that splits dim {p.tp_dim} of size {size} into multiples of {BLOCK}"
            )


def _check_fused_moe_blocks(spec: ModelSpec, topology: Topology, fmt: str, order: str = "vllm") -> None:
    """Block-FP8 ``FusedMoE`` as vLLM holds the checkpoint's scales (module docstring): every routed
    expert's gate/up rows per expert-tp partition (``intermediate_size_per_partition``) a multiple
    of the block.
    transformers 5's ``FP8Experts`` (src/transformers/integrations/finegrained_fp8.py) needs the
    same: its ``gate_up_proj_scale_inv`` has ``ceil(2 * inter / 128)`` rows per expert, the gate's
    scale rows then the up's only when the gate is whole blocks."""
    etp = topology.expert_tp
    for p in spec.params:
        if p.expert is None or p.dtype != FP8 or expert_projection(p) == 2:
            continue
        per = p.shape[0] // etp if p.shape[0] % etp == 0 else None
        if per is not None and per % BLOCK == 0:
            continue
        engine = (
            "vLLM's block-FP8 FusedMoE does not hold the checkpoint's block scales for"
            if order == "vllm"
            else "transformers 5's FP8Experts (src/transformers/integrations/finegrained_fp8.py) cannot hold"
        )
        why = (
            " (vLLM 0.32 re-grids them to smaller blocks, each checkpoint scale repeated: "
            "refine_fp8_moe_block_shape in vllm/model_executor/layers/fused_moe/oracle/fp8.py; or pads each tp "
            "shard to whole blocks, or refuses: validate_fp8_block_shape_moe), none of them boxes of the "
            f"checkpoint's {BLOCK} x {BLOCK} scales"
            if order == "vllm"
            else " (the gate_up stack holds gate and up block for block)"
        )
        raise ValueError(
            f"weight_format={fmt!r} with expert_order={order!r}: {p.name} has {p.shape[0]} rows, "
            f"{p.shape[0] / etp:g} per expert tensor parallel rank (etp={etp}); {engine} an expert "
            f"intermediate size per partition that is not a multiple of {BLOCK}, at any etp{why}. Choose an "
            f"etp that splits {p.shape[0]} into multiples of {BLOCK}, or expert_order='hf' (per-expert tensors)"
        )
