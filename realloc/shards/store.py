"""Shard stores: a rank's flat per-dtype buffers, addressed by global boxes.

Executors never see ranks or layouts, only stores: ``store.view(param, offsets, sizes)`` is the
tensor view of that box inside whichever local shard contains it (:mod:`realloc.shards.copies`
packs, unpacks and copies such views).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping

import torch

from realloc.boxes import contains
from realloc.layout import Layout, Shard

__all__ = [
    "TORCH_DTYPES",
    "Address",
    "ShardIndex",
    "ShardStore",
    "allocate_buffers",
    "buffers_nbytes",
    "local_tensor",
    "zero_padding",
]

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def allocate_buffers(layout: Layout, rank: int, device: "str | torch.device" = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed flat buffers (one per dtype) for ``rank`` of ``layout``."""
    return {d: torch.zeros(n, dtype=TORCH_DTYPES[d], device=device) for d, n in layout.buffer_numels(rank).items()}


def buffers_nbytes(buffers: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``buffers`` (flat buffers, kept layouts, spares)."""
    return sum(t.numel() * t.element_size() for t in buffers)


def local_tensor(shard: Shard, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The shard's local tensor (padding included): a view of its dtype's flat buffer."""
    return buffers[shard.dtype][shard.buffer_offset : shard.buffer_offset + shard.local_numel].view(shard.local_shape)


@dataclass(frozen=True)
class Address:
    """Where a box lives in a rank's flat buffers: ``buffers[dtype]``'s elements from ``offset``
    with ``strides`` (row-major inside its shard's local tensor, padding included)."""

    dtype: str
    offset: int
    strides: tuple[int, ...]


class ShardIndex:
    """A rank's shards by param, and the :class:`Address` of every box asked for: pure numbers,
    computed once per box. A worker's stores change buffers every move but not their shards, so
    one index serves every store over the same shards (:meth:`of`).

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> index = ShardIndex(Layout(ModelSpec.preset("tiny"), Topology(tp=2)).shards(1))
        >>> index.by_param["model.layers.0.mlp.down_proj.weight"][0].offsets  # columns 96.. of 192
        (0, 96)
        >>> index.addresses("model.layers.0.mlp.down_proj.weight", (0, 100), (96, 4))
        (Address(dtype='bfloat16', offset=77284, strides=(96, 1)),)
    """

    #: ``of``'s memo: id of a shards tuple -> (the tuple, its index). Layouts hand out the same
    #: tuple for a rank every time; holding it keeps its id from being reused while cached.
    _by_tuple: "OrderedDict[int, tuple[tuple[Shard, ...], ShardIndex]]" = OrderedDict()
    _KEPT = 64
    _lock = threading.Lock()  # stores are built in a worker's threads too (local copies, saves)

    def __init__(self, shards: Iterable[Shard]):
        self.by_param: dict[str, list[Shard]] = {}
        for s in shards:
            self.by_param.setdefault(s.param, []).append(s)
        self._memo: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[Address, ...]] = {}

    @cached_property
    def padded(self) -> tuple[Shard, ...]:
        """The shards whose local tensor is larger than their box (vocabulary padding)."""
        return tuple(s for shards in self.by_param.values() for s in shards if s.sizes != s.local_shape)

    @classmethod
    def of(cls, shards: "Iterable[Shard] | ShardIndex") -> "ShardIndex":
        """The index of ``shards``: itself if it is one, the cached one of a tuple seen before
        (the last 64), else a new one."""
        if isinstance(shards, ShardIndex):
            return shards
        if not isinstance(shards, tuple):
            return cls(shards)
        with cls._lock:
            entry = cls._by_tuple.get(id(shards))
            if entry is not None and entry[0] is shards:
                cls._by_tuple.move_to_end(id(shards))
                return entry[1]
            index = cls(shards)
            cls._by_tuple[id(shards)] = (shards, index)
            while len(cls._by_tuple) > cls._KEPT:
                cls._by_tuple.popitem(last=False)
            return index

    def addresses(self, param: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[Address, ...]:
        """Every local copy of the box (several when the rank holds the param twice); ``KeyError``
        naming the box when no shard contains it."""
        key = (param, tuple(offsets), tuple(sizes))
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = tuple(
                _address(shard, key[1]) for shard in self.by_param.get(param, ()) if contains(shard.box, key[1:])
            )
            if not found:
                raise KeyError(f"this rank holds no shard of {param!r} containing offsets={key[1]} sizes={key[2]}")
        return found


def _address(shard: Shard, offsets: tuple[int, ...]) -> Address:
    """The address of the box at ``offsets`` (global) inside ``shard``'s local tensor."""
    strides = [1] * len(shard.local_shape)
    for d in range(len(strides) - 2, -1, -1):
        strides[d] = strides[d + 1] * shard.local_shape[d + 1]
    offset = shard.buffer_offset + sum((o - so) * st for o, so, st in zip(offsets, shard.offsets, strides))
    return Address(shard.dtype, offset, tuple(strides))


class ShardStore:
    """Boxes of global tensors backed by one rank's flat buffers.

    ``shards``: the rank's shards, or their :class:`ShardIndex` (a tuple of shards seen before
    reuses its index: building a store is then a dict copy).

    Example:
        >>> from realloc import ModelSpec, Topology
        >>> lay = Layout(ModelSpec.preset("tiny"), Topology(tp=2))
        >>> store = ShardStore(lay.shards(0), allocate_buffers(lay, 0))
        >>> store.view("model.norm.weight", (0,), (64,)).shape
        torch.Size([64])
    """

    def __init__(self, shards: "Iterable[Shard] | ShardIndex", buffers: Mapping[str, torch.Tensor]):
        self.buffers = dict(buffers)
        self.index = ShardIndex.of(shards)

    @cached_property
    def by_param(self) -> dict[str, list[tuple[Shard, torch.Tensor]]]:
        """Param -> ``(shard, local tensor)`` of each of its shards here (built when first asked)."""
        return {
            param: [(s, local_tensor(s, self.buffers)) for s in shards] for param, shards in self.index.by_param.items()
        }

    def shard_tensors(self) -> dict[str, torch.Tensor]:
        """Slot name -> local tensor (the rank's model as its code sees it, padding included).

        A slot held as several shards (``Layout(qkv_order="megatron")``'s q/k/v) is left out: it
        is no single tensor (``realloc.shards.fused.fused_views(..., convention="megatron")`` has it)."""
        pairs = [(s.slot, t) for entries in self.by_param.values() for s, t in entries]
        count = Counter(slot for slot, _ in pairs)
        return {slot: t for slot, t in pairs if count[slot] == 1}

    def views(self, param: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[torch.Tensor]:
        """Every local view of the box (several when the rank holds the param twice)."""
        out = []
        for a in self.index.addresses(param, offsets, sizes):
            buf = self.buffers[a.dtype]
            out.append(buf.as_strided(sizes, a.strides, buf.storage_offset() + a.offset))
        return out

    def view(self, param: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        return self.views(param, offsets, sizes)[0]

    def write(self, param: str, offsets: tuple[int, ...], sizes: tuple[int, ...], value: torch.Tensor) -> None:
        """Write a box into every local copy of it."""
        for view in self.views(param, offsets, sizes):
            view.copy_(value)


def zero_padding(store: ShardStore) -> None:
    """Zero every local element outside the shards' boxes (vocabulary padding)."""
    for shard in store.index.padded:
        local = local_tensor(shard, store.buffers)
        for d, (size, full) in enumerate(zip(shard.sizes, shard.local_shape)):
            if full > size:
                local.narrow(d, size, full - size).zero_()
