"""Lossless deltas of packed buckets: the changed words of a bucket, and a checksum of the whole.

A delta move (issue 24; ``actors/wire/delta.py``, a :class:`DeltaRoute` over :class:`DeltaSides`)
compares every bucket of the sender's current weights with the copy of the weights it last sent
(the *base*), and sends only the words that differ. The receiver starts from what it holds (the
same base, if nothing went wrong), writes the changed words in, and checks the result against the
sender's checksum of the new bucket; on a mismatch that bucket is sent whole. Both ends work on
the bucket's boxes where they are (the functions below the packed ones: :func:`encode_words`,
:func:`decode`, :func:`scatter_words`, :func:`checksum_boxes`), or, where a bucket's boxes cannot
be seen as 16-bit words, on packed buckets (:func:`encode`, :func:`apply`, :func:`checksum`);
both give the same bytes.

The encoding, chosen from measurements (docs/benchmarks.md, "Delta encodings";
``benchmarks/delta_encoding.py``): the bucket is read as 16-bit words (8-bit when its length is
odd); a delta is the gaps between the changed words' positions, one ``uint16`` each (a gap
longer than 65535 words gets filler entries that rewrite an unchanged word with its own value),
followed by the changed words' new values. 4 bytes per changed bf16 element, so at RL learning
rates (1.7-4.3% of bf16 elements change per AdamW step at lr 1e-6 to 3e-6) a delta is 3.4-8.6%
of the bucket. Every step is a torch operation (compare, ``nonzero``, ``cumsum``, an indexed
write; on a CPU the compare and ``nonzero`` of boxes are numpy's, 2-3 times faster there), so it
runs where the buffers are, a GPU's included; XOR + zstd was 1.3x smaller here but
runs on a CPU core at 0.5 GB/s. Values rather than XORs travel: applying a delta twice, or to a
base that differs from the sender's in a word the delta rewrites, still gives that word's new
value, and the checksum catches every other difference.

The checksum is xxh3-64 (``xxhash``, 20 GB/s on one core here against crc32's 4) of the bucket's
bytes in host memory.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import xxhash

from realloc.plan import Piece, bucket_nbytes
from realloc.spec import DTYPE_BYTES

#: The longest gap one ``uint16`` entry spans; longer ones get filler entries.
MAX_GAP = 0xFFFF
#: Bytes of a gap entry.
GAP_BYTES = 2


def gap_positions(bucket: list[Piece], device: torch.device) -> torch.Tensor:
    """The byte positions of a packed bucket that no piece covers (the alignment gaps between
    pieces, ``realloc/plan/records.py``): a pack leaves whatever an earlier bucket wrote there, so
    a delta and its checksum zero them first (both ends alike)."""
    ranges, end = [], 0
    for p in bucket:
        if p.offset > end:
            ranges.append(torch.arange(end, p.offset))
        end = p.offset + DTYPE_BYTES[p.dtype] * math.prod(p.sizes)
    assert end == bucket_nbytes(bucket)
    return (torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.int64)).to(device)


def word_dtype(nbytes: int) -> torch.dtype:
    """The word a bucket of ``nbytes`` bytes is compared in: 16 bits, or 8 when ``nbytes`` is odd."""
    return torch.int16 if nbytes % 2 == 0 else torch.uint8


def delta_nbytes(entries: int, nbytes: int) -> int:
    """Bytes of a delta of ``entries`` entries of a bucket of ``nbytes`` bytes."""
    return entries * (GAP_BYTES + word_dtype(nbytes).itemsize)


def changed_positions(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The word positions (int64, ascending) where the byte tensors ``new`` and ``base`` differ,
    with filler positions inserted so that no gap between consecutive entries (the first counted
    from -1) exceeds :data:`MAX_GAP`."""
    word = word_dtype(new.numel())
    return with_fillers(torch.ne(new.view(word), base.view(word)).nonzero().view(-1))


def with_fillers(idx: torch.Tensor) -> torch.Tensor:
    """Ascending word positions ``idx`` (int64) with filler positions inserted so that no gap
    between consecutive entries (the first counted from -1) exceeds :data:`MAX_GAP`."""
    if idx.numel() == 0:
        return idx
    prev = torch.cat([idx.new_full((1,), -1), idx[:-1]])
    fill = torch.div(idx - prev - 1, MAX_GAP, rounding_mode="floor")  # fillers before each entry
    total = int(fill.sum())
    if total == 0:
        return idx
    # filler k (1-based) before entry i sits at prev[i] + k * MAX_GAP
    starts = torch.repeat_interleave(prev, fill)
    first = torch.cumsum(fill, 0) - fill  # index of each entry's first filler
    k = torch.arange(total, device=idx.device) - torch.repeat_interleave(first, fill) + 1
    return torch.sort(torch.cat([idx, starts + k * MAX_GAP])).values


def encode(new: torch.Tensor, base: torch.Tensor, out: torch.Tensor) -> int | None:
    """Write the delta that turns byte tensor ``base`` into ``new`` (same length) into the byte
    tensor ``out``; returns its number of entries, or None when the delta would not be smaller
    than ``new`` itself (the bucket travels whole then; ``out`` may have been written)."""
    nbytes = new.numel()
    word = word_dtype(nbytes)
    idx = changed_positions(new, base)
    n = idx.numel()
    if delta_nbytes(n, nbytes) >= nbytes:
        return None
    if n:
        gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
        out[: GAP_BYTES * n].view(torch.int16).copy_(gaps.to(torch.int32).to(torch.int16))  # wraps above 32767
        out[GAP_BYTES * n : delta_nbytes(n, nbytes)].view(word).copy_(new.view(word)[idx])
    return n


def apply(delta: torch.Tensor, entries: int, into: torch.Tensor) -> None:
    """Write a delta of ``entries`` entries (:func:`encode`) into the byte tensor ``into`` (the
    receiver's base of the bucket, turned into the sender's new bucket when the bases agree)."""
    if entries == 0:
        return
    word = word_dtype(into.numel())
    gaps = delta[: GAP_BYTES * entries].view(torch.int16).to(torch.int64) & MAX_GAP
    idx = torch.cumsum(gaps, 0) - 1
    into.view(word)[idx] = delta[GAP_BYTES * entries : delta_nbytes(entries, into.numel())].view(word)


def checksum(data: torch.Tensor) -> int:
    """xxh3-64 of a byte tensor (copied to host memory first when it is on a device), as a signed
    64-bit integer (it travels in an int64 tensor)."""
    host = data if data.device.type == "cpu" else data.cpu()
    value = xxhash.xxh3_64_intdigest(host.numpy())
    return value - (1 << 64) if value >= 1 << 63 else value


# -- a bucket's boxes compared and written where they are (no packed copies) ----------------------
#
# A sender's delta needs no packed bucket: the changed words of each piece are found by comparing
# the piece's view of the weights with its view of the base, and their positions in the packed
# bucket are the piece's word offset plus their row-major index in the box. The receiver writes
# the changed words into its destination's views (after copying its base there, unless the
# destination is the base), and both checksum the views in bucket order with the gaps as zeros.
# The encoding, the checksum and the result are byte for byte those of the packed form above.


def word_view(view: torch.Tensor) -> torch.Tensor | None:
    """A box view as 16-bit words (row-major order of the words is the order of its packed
    bytes), or None where it cannot be one (elements of one byte; a 0-d view; a wider element
    whose last dimension is not contiguous)."""
    size = view.element_size()
    if size == 2:
        return view.view(torch.int16)
    if size % 2 or view.dim() == 0 or view.stride(-1) != 1:
        return None
    try:
        return view.view(torch.int16)
    except RuntimeError:
        return None


def bucket_words(views: list[list[torch.Tensor]], bucket: list[Piece]) -> tuple[list[torch.Tensor], list[int]] | None:
    """A bucket's pieces as word views (``views[k]``: every local view of piece ``k``; exactly one
    is needed) and their word offsets in the packed bucket, or None where the bucket cannot be
    compared in place: an odd length (8-bit words), a piece at an odd offset or of one-byte
    elements, a box held twice."""
    if bucket_nbytes(bucket) % 2:
        return None
    words, starts = [], []
    for p, vs in zip(bucket, views):
        w = word_view(vs[0]) if len(vs) == 1 and p.offset % 2 == 0 else None
        if w is None:
            return None
        if starts and p.offset // 2 < starts[-1] + words[-1].numel():
            return None  # the boxes must come in bucket order
        words.append(w)
        starts.append(p.offset // 2)
    return words, starts


def _ranges(positions: torch.Tensor, words: list[torch.Tensor], starts: list[int]) -> list[tuple[int, int]]:
    """For each box, the slice of the ascending ``positions`` that falls inside it."""
    bounds = torch.tensor([b for w, s in zip(words, starts) for b in (s, s + w.numel())], dtype=torch.int64)
    cut = torch.searchsorted(positions, bounds.to(positions.device)).tolist()
    return list(zip(cut[0::2], cut[1::2]))


def _span(view: torch.Tensor) -> torch.Tensor:
    """A 1-d tensor over ``view``'s memory from its first element to its last (strides kept in
    :func:`_offsets`): gathers and scatters through it are ``index_select``/``index_copy_``,
    several times faster on a CPU than indexing the view."""
    extent = 1 + sum((n - 1) * st for n, st in zip(view.shape, view.stride())) if view.numel() else 0
    return view.as_strided((extent,), (1,))


def _offsets(view: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Row-major element indices ``local`` of ``view`` as offsets into :func:`_span` of it."""
    if view.is_contiguous():
        return local
    out = torch.zeros_like(local)
    rest = local
    for n, st in zip(reversed(view.shape), reversed(view.stride())):
        out += (rest % n) * st
        rest = torch.div(rest, n, rounding_mode="floor")
    return out


def gather_words(words: list[torch.Tensor], starts: list[int], positions: torch.Tensor) -> torch.Tensor:
    """The words at ascending bucket ``positions`` of the boxes ``words`` (at word offsets
    ``starts``, ascending, not overlapping); a position between boxes (a gap) reads 0."""
    device = words[0].device if words else positions.device
    out = torch.zeros(positions.numel(), dtype=torch.int16, device=device)
    if positions.numel():
        for w, s, (lo, hi) in zip(words, starts, _ranges(positions, words, starts)):
            if lo < hi:
                out[lo:hi] = _span(w).index_select(0, _offsets(w, positions[lo:hi] - s))
    return out


def scatter_words(
    words: list[torch.Tensor | None], starts: list[int], positions: torch.Tensor, values: torch.Tensor
) -> None:
    """Write ``values`` at ascending bucket ``positions`` into the boxes ``words`` (None: a box
    left as it is); positions between boxes are skipped."""
    if not positions.numel():
        return
    present = [(w, s) for w, s in zip(words, starts) if w is not None]
    ranges = _ranges(positions, [w for w, _ in present], [s for _, s in present])
    for (w, s), (lo, hi) in zip(present, ranges):
        if lo < hi:
            _span(w).index_copy_(0, _offsets(w, positions[lo:hi] - s), values[lo:hi])


def _differing(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Row-major indices (int64) of the elements where two views of one shape differ (numpy's
    compare and ``flatnonzero`` on a CPU, 2-3 times faster here than torch's ``ne`` and
    ``nonzero``; strided views compared where they are)."""
    if new.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(new.numpy() != base.numpy()))
    return torch.ne(new, base).reshape(-1).nonzero().view(-1)


def changed_words(new: list[torch.Tensor], base: list[torch.Tensor], starts: list[int]) -> torch.Tensor:
    """Bucket word positions (ascending, without fillers) where boxes ``new`` and ``base`` (the
    same boxes, at word offsets ``starts``) differ."""
    found = [_differing(n, b) + s for n, b, s in zip(new, base, starts)]
    return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)


def encode_words(
    new: list[torch.Tensor], base: list[torch.Tensor], starts: list[int], nbytes: int, out: torch.Tensor
) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """:func:`encode` of the bucket of ``nbytes`` bytes whose pieces are the word boxes ``new``
    against ``base`` (at word offsets ``starts``), computed from the boxes where they are:
    ``(entries, positions, values)`` with the delta written into ``out`` (positions and values
    include the fillers), or None when the delta would not be smaller than the bucket."""
    idx = changed_words(new, base, starts)
    if delta_nbytes(idx.numel(), nbytes) >= nbytes:
        return None
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
    if gaps.numel() and int(gaps.max()) > MAX_GAP:
        idx = with_fillers(idx)
        gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
    n = idx.numel()
    if delta_nbytes(n, nbytes) >= nbytes:
        return None
    values = gather_words(new, starts, idx)
    if n:
        out[: GAP_BYTES * n].view(torch.int16).copy_(gaps.to(torch.int16))  # wraps above 32767
        out[GAP_BYTES * n : delta_nbytes(n, nbytes)].view(torch.int16).copy_(values)
    return n, idx, values


def decode(delta: torch.Tensor, entries: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A delta of ``entries`` entries of a bucket of ``nbytes`` (even) bytes as ``(positions,
    values)``: the word positions, ascending, and the 16-bit words written there."""
    values = delta[GAP_BYTES * entries : delta_nbytes(entries, nbytes)].view(torch.int16)
    if delta.device.type == "cpu":
        gaps = delta[: GAP_BYTES * entries].numpy().view(np.uint16)
        return torch.from_numpy(np.cumsum(gaps, dtype=np.int64) - 1), values
    gaps = delta[: GAP_BYTES * entries].view(torch.int16).to(torch.int64) & MAX_GAP
    return torch.cumsum(gaps, 0) - 1, values


def checksum_boxes(views: list[torch.Tensor], bucket: list[Piece]) -> int:
    """:func:`checksum` of the bucket packed from ``views`` (piece ``k``'s box, any dtype and
    strides) with its gaps zeroed, streamed box by box without packing (a strided box is copied
    contiguous first)."""
    h = xxhash.xxh3_64()
    at = 0
    for p, v in sorted(zip(bucket, views), key=lambda pv: pv[0].offset):
        if p.offset > at:
            h.update(bytes(p.offset - at))
        data = v if v.is_contiguous() else v.contiguous()
        data = data.reshape(-1).view(torch.uint8)
        h.update((data if data.device.type == "cpu" else data.cpu()).numpy())
        at = p.offset + p.nbytes
    end = bucket_nbytes(bucket)
    if end > at:
        h.update(bytes(end - at))
    value = h.intdigest()
    return value - (1 << 64) if value >= 1 << 63 else value
