"""Compiled copies: a worker's box copies for one plan, kept as numbers and replayed on new buffers.

Every copy a move makes inside a worker (a local copy, a zero-copy read of a same-node peer's
buffers, packing a message into staging, unpacking one) is planned box by box
(``realloc/shards/copies.py``): a view per box and side, the same weight's boxes in every layer stacked
into one view, small dense pairs grouped into one ``_foreach_copy_``, the rest widened to 8-byte
words. That planning is Python per box. An RL loop runs the same plans again and again on
buffers of the same sizes, so a worker plans each copy list once: a :class:`CopyProgram` holds
the outcome as pure geometry (which buffer, element type, shape, strides, byte offset of every
view) and :meth:`CopyProgram.run` rebuilds those views on whatever buffers the next move hands
it (one ``as_strided`` per view) and copies. No Python runs per box after the first move.

The contract: a program compiled for a copy list between two sides (each a mapping from buffer
key to flat buffer: a store's per-dtype buffers, or a staging buffer) may be run on buffers of
the *same layouts* (the caller's key says so: the plan's segment list and the sides' rank
layouts). :meth:`CopyProgram.run` checks what the geometry itself needs (each buffer is there,
large enough, and starts at an offset that keeps every view's elements aligned) and raises
:class:`ProgramMismatch` before copying anything when it is not; :class:`ProgramCache`
recompiles then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping

import torch

from realloc.shards.copies import Copies, grouped_copies

Buffers = Mapping[str, torch.Tensor]


class ProgramMismatch(ValueError):
    """The buffers given to :meth:`CopyProgram.run` cannot hold the views it was compiled for."""


@dataclass(frozen=True)
class ViewGeometry:
    """One view of a compiled copy: ``buffers[buffer]``'s memory seen as ``dtype`` elements with
    ``shape`` and ``stride`` (in elements), its first element ``byte_offset`` bytes after the
    buffer's first byte."""

    buffer: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int

    @property
    def end(self) -> int:
        """Bytes from the buffer's first byte to the end of the view's last element."""
        if any(n == 0 for n in self.shape):
            return self.byte_offset
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return self.byte_offset + (last + 1) * self.dtype.itemsize


@dataclass(frozen=True)
class BufferNeed:
    """What a side's buffer must offer every view of a program on it: ``nbytes`` bytes at least,
    and a first byte whose storage offset modulo ``align`` is ``phase`` (the views' element
    offsets then stay whole numbers of their elements)."""

    nbytes: int
    align: int
    phase: int


def _start(buf: torch.Tensor) -> int:
    """Byte offset of a buffer's first element in its storage."""
    return buf.storage_offset() * buf.element_size()


def _side_geometry(
    views: list[torch.Tensor], buffers: Buffers, side: str
) -> tuple[list[ViewGeometry], dict[str, BufferNeed]]:
    """Each view as a geometry on the buffer it lies in (the buffer of its storage whose bytes
    hold its first element: checkpoint files read into memory hold several dtypes' buffers in
    one storage), and what the views need of each buffer."""
    by_storage: dict[int, list[tuple[int, int, str]]] = {}
    for key, buf in buffers.items():
        start = _start(buf)
        by_storage.setdefault(buf.untyped_storage().data_ptr(), []).append(
            (start, start + buf.numel() * buf.element_size(), key)
        )
    article = "an" if side == "out" else "a"
    out = []
    for v in views:
        first = v.storage_offset() * v.element_size()
        spans = by_storage.get(v.untyped_storage().data_ptr(), ())
        key = next((k for lo, hi, k in spans if lo <= first < hi), None)
        if key is None and v.numel() == 0:  # an empty view may sit at a buffer's very end
            key = next((k for lo, hi, k in spans if lo <= first <= hi), None)
        if key is None:
            raise ValueError(
                f"{article} {side} view is on none of the {side} buffers ({', '.join(map(repr, buffers))})"
            )
        if any(s < 0 for s in v.stride()):
            raise ValueError(f"{article} {side} view has a negative stride {v.stride()}")
        out.append(ViewGeometry(key, v.dtype, tuple(v.shape), tuple(v.stride()), first - _start(buffers[key])))
    by_buffer: dict[str, list[ViewGeometry]] = {}
    for g in out:
        by_buffer.setdefault(g.buffer, []).append(g)
    needs = {}
    for key, on in by_buffer.items():
        align = max(g.dtype.itemsize for g in on)
        needs[key] = BufferNeed(max(g.end for g in on), align, _start(buffers[key]) % align)
    return out, needs


class _Side:
    """A side's buffers during one run: checked against the program's needs, with one alias per
    (buffer, element type) that views are cut from."""

    def __init__(self, buffers: Buffers, needs: Mapping[str, BufferNeed], side: str):
        for key, need in needs.items():
            buf = buffers.get(key)
            if buf is None:
                raise ProgramMismatch(f"{side} buffer {key!r} is missing")
            if buf.numel() * buf.element_size() < need.nbytes:
                raise ProgramMismatch(
                    f"{side} buffer {key!r} has {buf.numel() * buf.element_size()} bytes, the "
                    f"compiled views reach {need.nbytes}"
                )
            if _start(buf) % need.align != need.phase:
                raise ProgramMismatch(
                    f"{side} buffer {key!r} starts at byte {_start(buf)} of its storage: "
                    f"the compiled views need {need.phase} modulo {need.align}"
                )
        self.buffers = buffers
        self._aliases: dict[tuple[str, torch.dtype], tuple[torch.Tensor, int]] = {}

    def view(self, g: ViewGeometry) -> torch.Tensor:
        entry = self._aliases.get((g.buffer, g.dtype))
        if entry is None:
            buf = self.buffers[g.buffer]
            alias = (
                buf
                if buf.dtype == g.dtype
                else torch.empty(0, dtype=g.dtype, device=buf.device).set_(buf.untyped_storage())
            )
            entry = self._aliases[g.buffer, g.dtype] = (alias, _start(buf))
        alias, start = entry
        # as_strided checks the view against its storage's size: never a write past it
        return alias.as_strided(g.shape, g.stride, (start + g.byte_offset) // g.dtype.itemsize)


@dataclass(frozen=True)
class CopyProgram:
    """A copy list compiled to geometry: ``groups`` are the ``_foreach_copy_`` calls of
    :func:`realloc.shards.copy_boxes`, each a tuple of ``(out, in)`` view geometries; ``needs``
    what each side's buffers must offer; ``nbytes`` the bytes the list carries."""

    groups: tuple[tuple[tuple[ViewGeometry, ViewGeometry], ...], ...]
    out_needs: Mapping[str, BufferNeed]
    in_needs: Mapping[str, BufferNeed]
    nbytes: int

    @classmethod
    def compile(cls, copies: Copies, outs: Buffers, ins: Buffers) -> "CopyProgram":
        """The program of ``copies``, whose views lie on the buffers ``outs`` (written) and ``ins``
        (read). ``ValueError`` if a view lies on none of its side's buffers."""
        groups = [g for g in grouped_copies(copies.outs, copies.ins, copies.kinds) if g]
        out_geo, out_needs = _side_geometry([o for g in groups for o, _ in g], outs, "out")
        in_geo, in_needs = _side_geometry([i for g in groups for _, i in g], ins, "in")
        compiled, k = [], 0
        for g in groups:
            compiled.append(tuple(zip(out_geo[k : k + len(g)], in_geo[k : k + len(g)])))
            k += len(g)
        return cls(tuple(compiled), out_needs, in_needs, copies.nbytes)

    def run(self, outs: Buffers, ins: Buffers) -> int:
        """Copy, on these buffers; returns the bytes. :class:`ProgramMismatch`, before any copy,
        when a buffer cannot hold the compiled views."""
        o, i = _Side(outs, self.out_needs, "out"), _Side(ins, self.in_needs, "in")
        for group in self.groups:
            torch._foreach_copy_([o.view(a) for a, _ in group], [i.view(b) for _, b in group])
        return self.nbytes


class ProgramCache:
    """Compiled copy lists by the caller's key (which must name everything the views depend on
    besides the buffers: the segment list and both sides' layouts). :meth:`run` compiles on a
    key's first use, and again when the buffers no longer fit the program."""

    def __init__(self) -> None:
        self.programs: dict[Hashable, CopyProgram] = {}

    def run(self, key: Hashable, plan: Callable[[], Copies], outs: Buffers, ins: Buffers) -> int:
        program = self.programs.get(key)
        if program is not None:
            try:
                return program.run(outs, ins)
            except ProgramMismatch:
                pass
        program = self.programs[key] = CopyProgram.compile(plan(), outs, ins)
        return program.run(outs, ins)

    def __len__(self) -> int:
        return len(self.programs)
