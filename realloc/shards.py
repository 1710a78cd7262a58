"""Shard stores: a rank's flat per-dtype buffers, addressed by global boxes.

Executors never see ranks or layouts, only stores: ``store.view(param, offsets, sizes)`` is the
tensor view of that box inside whichever local shard contains it. Packing a bucket copies such
views into a byte buffer; unpacking copies (or blends) them back. The in-process executor and
the Ray actors use exactly these functions, on CPU tensors or CUDA tensors alike.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

import torch

from realloc.boxes import Box, contains
from realloc.layout import Layout, Shard
from realloc.plan import Piece, Segment

TORCH_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
}


def allocate_buffers(layout: Layout, rank: int, device: "str | torch.device" = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed flat buffers (one per dtype) for ``rank`` of ``layout``."""
    return {d: torch.zeros(n, dtype=TORCH_DTYPES[d], device=device) for d, n in layout.buffer_numels(rank).items()}


def buffers_nbytes(buffers: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``buffers`` (flat buffers, kept layouts, spares)."""
    return sum(t.numel() * t.element_size() for t in buffers)


def local_tensor(shard: Shard, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The shard's local tensor (padding included): a view of its dtype's flat buffer."""
    return buffers[shard.dtype][shard.buffer_offset:shard.buffer_offset + shard.local_numel].view(shard.local_shape)


class ShardStore:
    """Boxes of global tensors backed by one rank's flat buffers.

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> lay = Layout(ModelSpec.preset("tiny"), Topology(tp=2))
        >>> store = ShardStore(lay.shards(0), allocate_buffers(lay, 0))
        >>> store.view("model.norm.weight", (0,), (64,)).shape
        torch.Size([64])
    """

    def __init__(self, shards: Iterable[Shard], buffers: Mapping[str, torch.Tensor]):
        self.buffers = dict(buffers)
        self.by_param: dict[str, list[tuple[Shard, torch.Tensor]]] = {}
        for s in shards:
            self.by_param.setdefault(s.param, []).append((s, local_tensor(s, self.buffers)))

    def shard_tensors(self) -> dict[str, torch.Tensor]:
        """Slot name -> local tensor (the rank's model as its code sees it, padding included).

        A slot held as several shards (``Layout(qkv_order="megatron")``'s q/k/v) is left out: it
        is no single tensor (``realloc.binding.fused_views(..., convention="megatron")`` has it)."""
        pairs = [(s.slot, t) for entries in self.by_param.values() for s, t in entries]
        count = Counter(slot for slot, _ in pairs)
        return {slot: t for slot, t in pairs if count[slot] == 1}

    def views(self, param: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[torch.Tensor]:
        """Every local view of the box (several when the rank holds the param twice)."""
        box: Box = (tuple(offsets), tuple(sizes))
        out = []
        for shard, local in self.by_param.get(param, ()):
            if contains(shard.box, box):
                index = tuple(slice(o - so, o - so + n) for o, so, n in zip(offsets, shard.offsets, sizes))
                out.append(local[index])
        if not out:
            raise KeyError(f"this rank holds no shard of {param!r} containing offsets={box[0]} sizes={box[1]}")
        return out

    def view(self, param: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        return self.views(param, offsets, sizes)[0]

    def write(self, param: str, offsets: tuple[int, ...], sizes: tuple[int, ...], value: torch.Tensor) -> None:
        """Write a box into every local copy of it."""
        for view in self.views(param, offsets, sizes):
            view.copy_(value)


def zero_padding(store: ShardStore) -> None:
    """Zero every local element outside the shards' boxes (vocabulary padding)."""
    for entries in store.by_param.values():
        for shard, local in entries:
            for d, (size, full) in enumerate(zip(shard.sizes, shard.local_shape)):
                if full > size:
                    local.narrow(d, size, full - size).zero_()


def pack(store: ShardStore, bucket: list[Piece], out: torch.Tensor) -> torch.Tensor:
    """Copy a bucket's boxes from ``store`` into the byte tensor ``out``."""
    for p in bucket:
        _piece_view(out, p).copy_(store.view(p.param, p.offsets, p.sizes))
    return out


def unpack(store: ShardStore, bucket: list[Piece], data: torch.Tensor) -> None:
    """Copy a received byte tensor's boxes into ``store``."""
    for p in bucket:
        store.write(p.param, p.offsets, p.sizes, _piece_view(data, p))


def copy_local(src: ShardStore, dst: ShardStore, segments: Iterable[Segment]) -> int:
    """Copy boxes a worker already holds from its source store into its destination store."""
    total = 0
    for s in segments:
        dst.write(s.param, s.offsets, s.sizes, src.view(s.param, s.offsets, s.sizes))
        total += s.nbytes
    return total


def check_eta(eta: object) -> float:
    """``eta`` as a float in [0, 1]; ``ValueError`` for anything else (bools and strings included)."""
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0.0 <= eta <= 1.0:
        raise ValueError(f"blend eta must be a number within [0, 1], got {eta!r}")
    return float(eta)


def blend_into(new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor], eta: float) -> None:
    """``new = eta * new + (1 - eta) * old`` over whole flat buffers, written into ``new``
    (padding is zero in both, so it stays zero). ``old`` is only read: it stays a valid rollback."""
    eta = check_eta(eta)
    for dtype, buf in new.items():
        buf.mul_(eta).add_(old[dtype], alpha=1.0 - eta)


def _piece_view(data: torch.Tensor, p: Piece) -> torch.Tensor:
    dtype = TORCH_DTYPES[p.dtype]
    n = dtype.itemsize
    for s in p.sizes:
        n *= s
    return data[p.offset:p.offset + n].view(dtype).view(p.sizes)
