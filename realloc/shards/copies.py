"""Copies between a rank's shards and bucket bytes: what local copies, packing and unpacking do.

Packing a bucket copies the views of its boxes (:meth:`~realloc.shards.store.ShardStore.view`)
into a byte buffer; unpacking copies (or blends) them back. A copy list is planned as
:class:`Copies` and run by :func:`copy_boxes`, which batches boxes of one kind of weight
(:func:`stack_runs`) so a move costs a few kernel launches, not one per box. The in-process
executor and the Ray actors use exactly these functions, on CPU tensors or CUDA tensors alike.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from realloc._checks import check_number
from realloc.plan import Piece, Segment
from realloc.shards.store import TORCH_DTYPES, ShardStore

__all__ = [
    "SMALL_COPY_BYTES",
    "Copies",
    "blend_into",
    "check_eta",
    "copy_boxes",
    "copy_local",
    "grouped_copies",
    "local_copies",
    "pack",
    "pack_copies",
    "piece_view",
    "stack_runs",
    "unpack",
    "unpack_copies",
    "weight_kind",
]


@dataclass
class Copies:
    """Pairs of views to copy, ``outs[k] <- ins[k]``, each labelled with its weight's kind (what
    :func:`stack_runs` stacks by), and the bytes they carry: what a local copy, a pack and an
    unpack plan before :func:`copy_boxes` runs them (or ``realloc.shards.copy_program`` compiles them)."""

    outs: list[torch.Tensor]
    ins: list[torch.Tensor]
    kinds: list[str]
    nbytes: int = 0

    def add(self, out: torch.Tensor, value: torch.Tensor, param: str) -> None:
        self.outs.append(out)
        self.ins.append(value)
        self.kinds.append(weight_kind(param))

    def run(self) -> int:
        """Copy every pair (:func:`copy_boxes`); returns :attr:`nbytes`."""
        if self.outs:
            copy_boxes(self.outs, self.ins, self.kinds)
        return self.nbytes


def local_copies(src: ShardStore, dst: ShardStore, segments: Iterable[Segment]) -> Copies:
    """The copies of boxes a worker holds (or maps: a same-node peer's buffers) from ``src`` into
    every local copy of each box in ``dst``."""
    out = Copies([], [], [])
    for s in segments:
        value = src.view(s.param, s.offsets, s.sizes)
        for view in dst.views(s.param, s.offsets, s.sizes):
            out.add(view, value, s.param)
        out.nbytes += s.nbytes
    return out


def pack_copies(store: ShardStore, bucket: list[Piece], out: torch.Tensor) -> Copies:
    """The copies that pack a bucket's boxes from ``store`` into the byte tensor ``out``."""
    copies = Copies([], [], [], sum(p.nbytes for p in bucket))
    for p in bucket:
        copies.add(piece_view(out, p), store.view(p.param, p.offsets, p.sizes), p.param)
    return copies


def unpack_copies(store: ShardStore, bucket: list[Piece], data: torch.Tensor) -> Copies:
    """The copies that unpack a received byte tensor's boxes into ``store`` (every local copy of
    each box)."""
    copies = Copies([], [], [], sum(p.nbytes for p in bucket))
    for p in bucket:
        value = piece_view(data, p)
        for view in store.views(p.param, p.offsets, p.sizes):
            copies.add(view, value, p.param)
    return copies


def copy_local(src: ShardStore, dst: ShardStore, segments: Iterable[Segment]) -> int:
    """Copy boxes a worker already holds (or maps: a same-node peer's buffers) from ``src`` into
    ``dst`` (:func:`copy_boxes`); returns the bytes."""
    return local_copies(src, dst, segments).run()


def pack(store: ShardStore, bucket: list[Piece], out: torch.Tensor) -> torch.Tensor:
    """Copy a bucket's boxes from ``store`` into the byte tensor ``out`` (:func:`copy_boxes`)."""
    pack_copies(store, bucket, out).run()
    return out


def unpack(store: ShardStore, bucket: list[Piece], data: torch.Tensor) -> None:
    """Copy a received byte tensor's boxes into ``store`` (every local copy of each box)."""
    unpack_copies(store, bucket, data).run()


#: Dense pairs below this many bytes are copied by multi-tensor kernels (``torch._foreach_copy_``'s
#: fast path on CUDA: one launch for many boxes); larger ones by one copy each (a memcpy when dense).
SMALL_COPY_BYTES = 1 << 20


def copy_boxes(outs: list[torch.Tensor], ins: list[torch.Tensor], kinds: list[str] | None = None) -> None:
    """``outs[k].copy_(ins[k])`` for every k, with as few kernels and as wide elements as the
    boxes allow (a move on a GPU is kernel-launch-bound: llama-7b ``fsdp=8 -> tp=8`` is ~1200
    copies per worker, ~9600 kernels on one GPU for 13.5 GB):

    * small dense pairs of one dtype go through ``torch._foreach_copy_`` together (on CUDA its
      fast path packs many of them into each multi-tensor kernel; on CPU it is a C++ loop);
    * every other pair is copied alone, viewed as 8-byte words where its rows allow it (same
      bytes, a quarter of the elements for bf16: a strided copy's cost is per element).

    Pairs that repeat at a constant step in both buffers (the same weight's box in every layer)
    are first stacked into one pair each (:func:`stack_runs`; ``kinds``: one label per pair,
    only pairs of one label are stacked, e.g. :func:`weight_kind` of their parameters).

    The boxes in ``outs`` must not overlap each other (a plan writes each destination cell
    once), so the order of the copies does not matter. Bytes are moved, never converted: the
    pairs must have equal dtypes and shapes."""
    small, rest = grouped_copies(outs, ins, kinds)
    for pairs in (small, rest):
        if pairs:
            torch._foreach_copy_([o for o, _ in pairs], [i for _, i in pairs])


def grouped_copies(
    outs: list[torch.Tensor], ins: list[torch.Tensor], kinds: list[str] | None = None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The copies :func:`copy_boxes` makes, as two lists of ``(out, in)`` view pairs: small dense
    pairs (one ``_foreach_copy_`` together) and the rest (widened to 8-byte words where they
    allow it), after stacking runs (:func:`stack_runs`). Each list is one ``_foreach_copy_``."""
    small, rest = [], []
    for o, i in zip(*stack_runs(outs, ins, kinds)):
        if o.numel() * o.element_size() < SMALL_COPY_BYTES and o.is_contiguous() and i.is_contiguous():
            small.append((o, i))
        else:
            wo, wi = _as_words(o), _as_words(i)
            if wo.shape == wi.shape:  # else one side could not be widened: copy both as they are
                o, i = wo, wi
            rest.append((o, i))
    return small, rest


@functools.lru_cache(maxsize=65536)
def weight_kind(param: str) -> str:
    """A parameter's name with its numbers (layer, expert) replaced by ``#``: the label of "the
    same weight in every layer" that :func:`stack_runs` stacks (``model.layers.#.mlp.up_proj.weight``)."""
    return re.sub(r"\d+", "#", param)


def stack_runs(
    outs: list[torch.Tensor], ins: list[torch.Tensor], kinds: list[str] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The pairs ``(outs[k], ins[k])`` with every run of equal-shaped boxes whose offsets advance
    by one constant step in the destination buffer and another in the source buffer replaced by
    one pair of stacked views (a new leading dimension whose stride is the step).

    A decoder's layers repeat one block of parameters, so a weight's box in layer ``L`` sits at
    ``base + L * block`` in both buffers: llama-7b ``fsdp=8 -> tp=8`` goes from ~1200 copies per
    worker to a few dozen. Exact: the stacked destination view addresses precisely the union of
    the run's boxes (element ``(k, idx)`` is element ``idx`` of box ``k``), and those are
    disjoint, so it never writes a cell twice. Only boxes of one storage, dtype, shape and
    strides on each side (and of one ``kinds`` label, when given: two weights of one shape in a
    layer interleave, and only each one alone advances by a constant step) are stacked, along
    increasing destination offsets with positive steps on both sides."""
    groups: dict[tuple, list[int]] = {}
    for k, (o, i) in enumerate(zip(outs, ins)):
        key = (
            o.untyped_storage().data_ptr(),
            i.untyped_storage().data_ptr(),
            o.dtype,
            i.dtype,
            o.shape,
            o.stride(),
            i.stride(),
            kinds[k] if kinds is not None else None,
        )
        groups.setdefault(key, []).append(k)
    out_o: list[torch.Tensor] = []
    out_i: list[torch.Tensor] = []

    def flush(run: list[int], step_o: int, step_i: int) -> None:
        first_o, first_i = outs[run[0]], ins[run[0]]
        if len(run) == 1:
            out_o.append(first_o)
            out_i.append(first_i)
            return
        shape = (len(run), *first_o.shape)
        out_o.append(first_o.as_strided(shape, (step_o, *first_o.stride()), first_o.storage_offset()))
        out_i.append(first_i.as_strided(shape, (step_i, *first_i.stride()), first_i.storage_offset()))

    for members in groups.values():
        members.sort(key=lambda k: outs[k].storage_offset())
        run, step_o, step_i = members[:1], 0, 0
        for k in members[1:]:
            d_o = outs[k].storage_offset() - outs[run[-1]].storage_offset()
            d_i = ins[k].storage_offset() - ins[run[-1]].storage_offset()
            if len(run) == 1 and d_o > 0 and d_i > 0:
                step_o, step_i = d_o, d_i
                run.append(k)
            elif len(run) > 1 and d_o == step_o and d_i == step_i:
                run.append(k)
            else:
                flush(run, step_o, step_i)
                run = [k]
        flush(run, step_o, step_i)
    return out_o, out_i


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as int64 words when its innermost dimension is contiguous and 8-byte aligned
    (same memory, fewer and wider elements); else ``t`` itself."""
    size = t.element_size()
    if size >= 8 or t.dim() == 0 or t.stride(-1) != 1 or (t.shape[-1] * size) % 8:
        return t
    try:
        return t.view(torch.int64)
    except RuntimeError:  # storage offset or an outer stride not a multiple of 8 bytes
        return t


def check_eta(eta: object) -> float:
    """``eta`` as a float in [0, 1]; ``ValueError`` for anything else (bools and strings included)."""
    return float(check_number("blend eta", eta, minimum=0.0, maximum=1.0, allowed="a number within [0, 1]"))


def blend_into(new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor], eta: float) -> None:
    """``new = eta * new + (1 - eta) * old`` over whole flat buffers, written into ``new``
    (padding is zero in both, so it stays zero). ``old`` is only read: it stays a valid rollback."""
    eta = check_eta(eta)
    for dtype, buf in new.items():
        buf.mul_(eta).add_(old[dtype], alpha=1.0 - eta)


def piece_view(data: torch.Tensor, p: Piece) -> torch.Tensor:
    """Piece ``p``'s box in a bucket's byte tensor ``data``, as a tensor of its dtype and sizes."""
    dtype = TORCH_DTYPES[p.dtype]
    n = dtype.itemsize
    for s in p.sizes:
        n *= s
    return data[p.offset : p.offset + n].view(dtype).view(p.sizes)
