"""Converting a rank's shards between weight formats (:mod:`realloc.spec.formats`), in place of the rank.

A move between layouts of different formats is a plan between layouts of one format plus this
local conversion on one side (:func:`realloc.plan.formats.conversion` decides which): on the
senders, before sending, when the destination's format is smaller and the source's ranks hold
whole blocks (the wire then carries the smaller format), else on the receivers, after receiving.
Both sides of :func:`convert_store` are stores of one topology, so every box of one is a box of
the other.

Rules followed, bit for bit:

* **Quantize** (:func:`quantize_blocks`): vLLM's ``per_block_cast_to_fp8``
  (``vllm/utils/deep_gemm.py``, taken from DeepGEMM's ``deep_gemm/utils/math.py``; the default
  ``use_ue8m0=False``): per 128 x 128 block, ``amax = |x|.float().amax().clamp(1e-4)``,
  ``scale = amax / 448.0``, values ``(x * (1.0 / scale)).to(float8_e4m3fn)``; the scale is what
  the checkpoint and vLLM store as ``weight_scale_inv``. A box of whole blocks quantizes exactly
  as the full tensor does, then sliced. A block holding an ``inf`` or a ``NaN`` has no finite
  scale (vLLM's rule makes the whole block NaN): :func:`write_box` and :func:`convert_store`
  refuse it with :class:`NonFiniteBlock`, naming the tensor and the block.
* **Dequantize** (:func:`dequantize_blocks`): DeepSeek-V3's ``weight_dequant``
  (``inference/kernel.py``, used by ``inference/fp8_cast_bf16.py``): ``x.float() * scale`` per
  block, stored in the destination dtype.
* **Cast**: ``tensor.to(dtype)`` (``Tensor.copy_`` between dtypes rounds the same way).
"""

from __future__ import annotations

import torch

from realloc.layout import Layout
from realloc.shards.store import TORCH_DTYPES, ShardStore
from realloc.spec.formats import BLOCK, FP8, scale_name

__all__ = [
    "FP8_MAX",
    "NonFiniteBlock",
    "check_finite_blocks",
    "block_box",
    "convert_rank",
    "convert_store",
    "dequantize_blocks",
    "in_format",
    "quantize_blocks",
    "write_box",
]

#: Largest finite float8_e4m3fn value (the scale maps a block's amax to it).
FP8_MAX = 448.0


class NonFiniteBlock(ValueError):
    """A weight to quantize holds ``inf`` or ``NaN`` in a block: its scale would be ``inf`` or
    ``NaN`` and the whole block NaN on the FP8 side. Names the tensor and the block; pickles."""


def check_finite_blocks(scale: torch.Tensor, name: str, offsets: tuple[int, ...] = (0, 0)) -> None:
    """:class:`NonFiniteBlock` unless every block scale of ``name`` is finite; ``scale``: the
    scales of the blocks of a box of the weight starting at ``offsets`` (whole blocks)."""
    bad = ~torch.isfinite(scale)
    if not bool(bad.any()):
        return
    count = int(bad.sum())
    row, col = (int(i) for i in bad.nonzero()[0])
    r0, c0 = offsets[0] // BLOCK + row, offsets[1] // BLOCK + col
    raise NonFiniteBlock(
        f"{name}: block ({r0}, {c0}) (rows [{r0 * BLOCK}, {(r0 + 1) * BLOCK}), columns [{c0 * BLOCK}, "
        f"{(c0 + 1) * BLOCK})) holds inf or NaN ({count} such block(s) in this box): its block-FP8 scale would be "
        f"{float(scale[row, col])} and the whole {BLOCK} x {BLOCK} block NaN. Nothing was converted into "
        "the FP8 weights; fix the source weights (a diverged step?) before copying them"
    )


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` (2-D) zero-padded to whole blocks, seen as ``[rows/B, B, cols/B, B]``."""
    m, n = x.shape
    rows, cols = -(-m // BLOCK), -(-n // BLOCK)
    padded = x
    if (rows * BLOCK, cols * BLOCK) != (m, n):
        padded = torch.zeros((rows * BLOCK, cols * BLOCK), dtype=x.dtype, device=x.device)
        padded[:m, :n] = x
    return padded.view(rows, BLOCK, cols, BLOCK), m, n


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8 values of x's shape, float32 scales [ceil(m/128), ceil(n/128)])`` of 2-D ``x``."""
    view, m, n = _blocks(x)
    # vLLM takes abs().float().amax(): the largest magnitude is the same taken before the exact
    # widening to fp32, without an fp32 copy of the whole block (22% faster on a CPU core)
    amax = view.abs().amax(dim=(1, 3), keepdim=True).float().clamp(1e-4)
    scale = amax / FP8_MAX
    values = (view * (1.0 / scale)).to(torch.float8_e4m3fn)
    values = values.view(view.size(0) * BLOCK, view.size(2) * BLOCK)[:m, :n]
    return values, scale.view(view.size(0), view.size(2))


def dequantize_blocks(
    values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, offsets: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """Float8 ``values`` (2-D) times their block ``scale``, in ``dtype``. ``offsets``: where the
    values start in the weight (any box, not only whole blocks), ``scale`` then being the scales
    of the blocks it touches (:func:`block_box`)."""
    rows, cols = (o % BLOCK for o in offsets)
    m, n = values.shape
    wide = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[rows : rows + m, cols : cols + n]
    return (values.float() * wide).to(dtype)


def block_box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of a weight's block scales that a box of it touches (for a box of whole blocks, its
    blocks; it may end at the tensor's edge)."""
    return tuple(o // BLOCK for o in offsets), tuple(-(-(o + s) // BLOCK) - o // BLOCK for o, s in zip(offsets, sizes))


def in_format(value: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A box of a model's tensor as a layout holding it as ``dtype`` does: ``(float8 values, their
    block scales)`` for a quantized weight (the box is whole blocks), else ``(value cast, None)``."""
    if dtype == FP8 and value.dtype != torch.float8_e4m3fn:
        return quantize_blocks(value)
    return value.to(TORCH_DTYPES[dtype]), None


def write_box(
    store: ShardStore,
    param: str,
    offsets,
    sizes,
    value: torch.Tensor,
    dtype: str,
    failed: list[NonFiniteBlock] | None = None,
) -> None:
    """Write a box of a model's tensor into ``store``, which holds ``param`` as ``dtype``
    (:func:`in_format`: a quantized weight's scales with it). A quantized box with a block of
    ``inf`` / ``NaN`` raises :class:`NonFiniteBlock` before anything is written, or, when
    ``failed`` is a list, is written and its error appended there (for a caller that must finish
    a collective before it fails)."""
    value, scale = in_format(value, dtype)
    if scale is not None:
        try:
            check_finite_blocks(scale, param, tuple(offsets))
        except NonFiniteBlock as e:
            if failed is None:
                raise
            failed.append(e)
        store.write(scale_name(param), *block_box(offsets, sizes), scale)
    store.write(param, offsets, sizes, value)


def convert_store(
    src: ShardStore,
    dst: ShardStore,
    dtypes: dict[str, str],
    src_dtypes: dict[str, str],
    failed: list[NonFiniteBlock] | None = None,
) -> int:
    """Write every box ``dst`` holds from the same box of ``src`` (one topology, another format).

    ``dtypes`` / ``src_dtypes``: each parameter's dtype on either side (the layouts' specs). A
    quantized weight's scales are written with it. Returns the bytes written into ``dst``. A
    weight with ``inf`` / ``NaN`` in a block it quantizes raises :class:`NonFiniteBlock` (or, with
    ``failed`` a list, is collected there: :func:`write_box`).
    """
    written = 0
    done: set[tuple] = set()
    for shard in (s for shards in dst.index.by_param.values() for s in shards):
        key = (shard.param, shard.offsets, shard.sizes)
        if key in done or 0 in shard.sizes:
            continue
        done.add(key)
        param, offsets, sizes = key
        if param not in src_dtypes:
            continue  # the scales of a weight quantized here: written with the weight
        have, want = src_dtypes[param], dtypes[param]
        value = src.view(param, offsets, sizes)
        if have == FP8 and want != FP8:
            scale = src.view(scale_name(param), *block_box(offsets, sizes))
            value = dequantize_blocks(value, scale, TORCH_DTYPES[want])
        write_box(dst, param, offsets, sizes, value, want, failed)
        written += value.numel() * TORCH_DTYPES[want].itemsize
    return written


def convert_rank(
    src_layout: Layout,
    dst_layout: Layout,
    rank: int,
    src: ShardStore,
    dst: ShardStore,
    failed: list[NonFiniteBlock] | None = None,
) -> int:
    """:func:`convert_store` for rank ``rank`` of two layouts of one topology (formats may differ)."""
    if src_layout.key[1:] != dst_layout.key[1:]:  # all but the (formatted) spec: the same placement
        raise ValueError(
            f"a conversion keeps the placement (topology, stages, conventions): {src_layout} -> {dst_layout}"
        )
    return convert_store(
        src,
        dst,
        {p.name: p.dtype for p in dst_layout.spec.params},
        {p.name: p.dtype for p in src_layout.spec.params},
        failed,
    )
