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
from realloc.spec.model import ParamSpec

__all__ = [
    "FP8_MAX",
    "QUANTIZE_DEVICE_ELEMENTS",
    "QUANTIZE_ROWS",
    "Converted",
    "NonFiniteBlock",
    "block_amax_by_rows",
    "block_amax_padded",
    "block_box",
    "block_scales",
    "check_finite_blocks",
    "convert_rank",
    "convert_store",
    "dequantize_blocks",
    "in_format",
    "quantize_blocks",
    "quantize_into",
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


#: Rows a quantization converts at a time on a CPU (through one float32 buffer of that many
#: rows): a block row's bytes stay in the core's caches between the widening, the scaling and
#: the cast.
QUANTIZE_ROWS = 32
#: Elements a quantization converts at a time on a GPU: whole block rows, few kernel launches (a
#: CPU's row chunks cost a launch each there: measured on an H200, docs/benchmarks.md).
QUANTIZE_DEVICE_ELEMENTS = 1 << 24


def quantize_rows(x: torch.Tensor) -> int:
    """Rows :func:`quantize_into` converts at a time for ``x``: :data:`QUANTIZE_ROWS` on a CPU,
    whole block rows of up to :data:`QUANTIZE_DEVICE_ELEMENTS` elements on a GPU."""
    if x.device.type == "cpu":
        return QUANTIZE_ROWS
    return max(1, QUANTIZE_DEVICE_ELEMENTS // (max(1, x.shape[1]) * BLOCK)) * BLOCK


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """The float32 block scales ``[ceil(m/128), ceil(n/128)]`` of 2-D ``x`` whose element (0, 0)
    starts a block: ``amax(|block|).clamp(1e-4) / 448`` (vLLM's rule; a block of ``inf`` or
    ``NaN`` gets a non-finite scale). On a CPU block row by block row (:func:`block_amax_by_rows`),
    on a GPU in one pass (:func:`block_amax_padded`): the same values."""
    amax = block_amax_by_rows(x) if x.device.type == "cpu" else block_amax_padded(x)
    return amax.float().clamp(1e-4) / FP8_MAX


def block_amax_by_rows(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each block of 2-D ``x``, in its dtype, one block row at a time:
    the band's ``max`` and ``min`` across its rows first (elementwise over whole rows: the vector
    units' reduction; one along 128-element pieces of each row made ``block_scales`` about twice
    as slow, docs/benchmarks.md), then ``max(max, -min)`` per block of the one row left: no ``abs`` copy
    and no float32 copy of the band (the same value as vLLM's ``abs().float().amax()``: all of
    them are exact)."""
    m, n = x.shape
    rows, cols = -(-m // BLOCK), -(-n // BLOCK)
    whole = n // BLOCK
    amax = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    for r in range(rows):
        band = x[r * BLOCK : (r + 1) * BLOCK]
        magnitude = torch.maximum(band.amax(dim=0), band.amin(dim=0).neg())  # n values
        if whole:
            amax[r, :whole] = magnitude[: whole * BLOCK].view(whole, BLOCK).amax(dim=1)
        if whole < cols:  # a last block cut by the tensor's edge
            amax[r, whole] = magnitude[whole * BLOCK :].amax()
    return amax


def block_amax_padded(x: torch.Tensor) -> torch.Tensor:
    """:func:`block_amax_by_rows` in one pass over ``x`` zero-padded to whole blocks (a zero never
    raises a magnitude): few kernel launches, one padded copy of ``x``."""
    m, n = x.shape
    rows, cols = -(-m // BLOCK), -(-n // BLOCK)
    padded = torch.nn.functional.pad(x, (0, cols * BLOCK - n, 0, rows * BLOCK - m))
    return padded.view(rows, BLOCK, cols, BLOCK).abs().amax(dim=(1, 3))


def quantize_into(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, offsets: tuple[int, int] = (0, 0), rows: int | None = None
) -> None:
    """Write ``(x * (1.0 / scale)).to(float8_e4m3fn)`` block by block into ``out`` (float8, ``x``'s
    shape): vLLM's values. ``offsets``: where ``x`` starts in the weight (any box), ``scale`` being
    the scales of the blocks it touches (:func:`block_box`). The product is formed in float32 as
    vLLM's is (a bf16 value widens exactly), ``rows`` rows at a time (:func:`quantize_rows`; above
    a block row, whole block rows scaled by one broadcast multiply: the same products)."""
    m, n = x.shape
    r0, c0 = (o % BLOCK for o in offsets)
    rows = rows or quantize_rows(x)
    inverse = (1.0 / scale.float()).repeat_interleave(BLOCK, 1)[:, c0 : c0 + n]
    wide = torch.empty(min(m, rows), n, dtype=torch.float32, device=x.device)
    r = 0
    while r < m:
        b, within = divmod(r0 + r, BLOCK)
        if within or rows <= BLOCK:  # inside one block row
            k = min(rows, m - r, BLOCK - within)
            chunk = wide[:k]
            chunk.copy_(x[r : r + k])
            chunk.mul_(inverse[b])
        else:  # whole block rows, the last maybe cut by the tensor's edge
            k = min(rows // BLOCK * BLOCK, m - r)
            chunk = wide[:k]
            chunk.copy_(x[r : r + k])
            full = k // BLOCK
            if full:
                chunk[: full * BLOCK].view(full, BLOCK, n).mul_(inverse[b : b + full].unsqueeze(1))
            if k > full * BLOCK:
                chunk[full * BLOCK :].mul_(inverse[b + full])
        out[r : r + k].copy_(chunk)
        r += k


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8 values of x's shape, float32 scales [ceil(m/128), ceil(n/128)])`` of 2-D ``x``."""
    scale = block_scales(x)
    values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    quantize_into(x, scale, values)
    return values, scale


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


class Converted:
    """A rank's store seen in another weight format of the same topology: each box converted from
    the store when it is written out (:meth:`write`), so a sender converts bucket by bucket as it
    packs (``actors/wire/executor.py``) and no converted copy of the rank exists.

    ``have`` / ``want``: each parameter's :class:`~realloc.spec.model.ParamSpec` in the store's
    format and in the other (the layouts' specs, ``spec.by_name``). A quantized weight's block
    scales are computed once per box of blocks asked for (its values' box and its scales' box
    name the same blocks) and kept for the conversion's life: a 4-byte scale per 16,384 values.
    A block of ``inf`` / ``NaN`` to quantize is written (NaN on the FP8 side, as vLLM's rule
    makes it) and its :class:`NonFiniteBlock` appended to ``failed``, once: the caller finishes
    its collectives, then fails."""

    def __init__(self, store: ShardStore, have: dict[str, ParamSpec], want: dict[str, ParamSpec]):
        self.store, self.have, self.want = store, have, want
        # the scales this conversion computes: those of weights it quantizes (not held as such)
        self.weights = {scale_name(n): n for n, p in want.items() if p.dtype == FP8 and scale_name(n) not in have}
        self.failed: list[NonFiniteBlock] = []
        self._scales: dict[tuple, torch.Tensor] = {}

    def converts(self, param: str) -> bool:
        """Whether ``param``'s boxes differ from the store's bytes (not a plain copy)."""
        return param not in self.have or self.have[param].dtype != self.want[param].dtype

    def scales(self, weight: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The block scales of the box of blocks ``(offsets, sizes)`` of ``weight`` (in blocks)."""
        key = (weight, offsets, sizes)
        scale = self._scales.get(key)
        if scale is None:
            shape = self.want[weight].shape
            start = tuple(o * BLOCK for o in offsets)
            extent = tuple(min((o + s) * BLOCK, n) - a for o, s, n, a in zip(offsets, sizes, shape, start))
            scale = self._scales[key] = block_scales(self.store.view(weight, start, extent))
            try:
                check_finite_blocks(scale, weight, start)
            except NonFiniteBlock as e:
                self.failed.append(e)
        return scale

    def write(self, param: str, offsets: tuple[int, ...], sizes: tuple[int, ...], out: torch.Tensor) -> None:
        """Write the box ``(offsets, sizes)`` of ``param`` in the wanted format into ``out`` (a
        tensor of that dtype and the box's sizes)."""
        if param in self.weights:  # a quantized weight's scales
            out.copy_(self.scales(self.weights[param], offsets, sizes))
            return
        value, have, want = self.store.view(param, offsets, sizes), self.have[param].dtype, self.want[param].dtype
        if want == FP8 and have != FP8:
            quantize_into(value, self.scales(param, *block_box(offsets, sizes)), out, offsets)
        elif have == FP8 and want != FP8:
            scale = self.store.view(scale_name(param), *block_box(offsets, sizes))
            out.copy_(dequantize_blocks(value, scale, TORCH_DTYPES[want], offsets))
        else:
            out.copy_(value)


def convert_store(src: Converted, dst: ShardStore) -> int:
    """Write every box ``dst`` holds (every local copy of it) from ``src``, a store of one
    topology seen in ``dst``'s format. Returns the bytes written; blocks that cannot be quantized
    are in ``src.failed``."""
    written = 0
    done: set[tuple] = set()
    for shard in (s for shards in dst.index.by_param.values() for s in shards):
        key = (shard.param, shard.offsets, shard.sizes)
        if key in done or 0 in shard.sizes:
            continue
        done.add(key)
        for view in dst.views(*key):
            src.write(*key, view)
        written += shard.nbytes
    return written


def convert_rank(
    src_layout: Layout,
    dst_layout: Layout,
    rank: int,
    src: ShardStore,
    dst: ShardStore,
    failed: list[NonFiniteBlock] | None = None,
) -> int:
    """:func:`convert_store` for rank ``rank`` of two layouts of one topology (formats may differ).
    A block of ``inf`` / ``NaN`` to quantize raises :class:`NonFiniteBlock` once every box is
    written, or, with ``failed`` a list, is appended there."""
    if src_layout.key[1:] != dst_layout.key[1:]:  # all but the (formatted) spec: the same placement
        raise ValueError(
            f"a conversion keeps the placement (topology, stages, conventions): {src_layout} -> {dst_layout}"
        )
    source = Converted(src, src_layout.spec.by_name, dst_layout.spec.by_name)
    written = convert_store(source, dst)
    if failed is None and source.failed:
        raise source.failed[0]
    if failed is not None:
        failed += source.failed
    return written
