"""Lossless deltas of packed buckets: the changed words of a bucket, and a checksum of the whole.

A delta move (issue 24; ``actors/wire/delta.py``, a :class:`DeltaRoute` over :class:`DeltaSides`)
packs every bucket twice on the sender, from its current weights and from the copy of the
weights it last sent (the *base*), and sends only the words that differ. The receiver packs the
same bucket from what it holds (the same base, if nothing went wrong), writes the changed words
in, and checks the result against the sender's checksum of the new bucket; on a mismatch that
bucket is sent whole.

The encoding, chosen from measurements (docs/benchmarks.md, "Delta encodings";
``benchmarks/delta_encoding.py``): the bucket is read as 16-bit words (8-bit when its length is
odd); a delta is the gaps between the changed words' positions, one ``uint16`` each (a gap
longer than 65535 words gets filler entries that rewrite an unchanged word with its own value),
followed by the changed words' new values. 4 bytes per changed bf16 element, so at RL learning
rates (1.7-4.3% of bf16 elements change per AdamW step at lr 1e-6 to 3e-6) a delta is 3.4-8.6%
of the bucket. Every step is a torch operation (compare, ``nonzero``, ``cumsum``, an indexed
write), so it runs where the buffers are, a GPU's included; XOR + zstd was 1.3x smaller here but
runs on a CPU core at 0.5 GB/s. Values rather than XORs travel: applying a delta twice, or to a
base that differs from the sender's in a word the delta rewrites, still gives that word's new
value, and the checksum catches every other difference.

The checksum is xxh3-64 (``xxhash``, 20 GB/s on one core here against crc32's 4) of the bucket's
bytes in host memory.
"""

from __future__ import annotations

import math

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
    idx = torch.ne(new.view(word), base.view(word)).nonzero().view(-1)
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
