"""Deterministic synthetic weights that any box can be generated from independently.

Each element's value is a hash of (seed, parameter name, global linear index), so a worker
makes exactly its own shard, and a verifier makes the expected value of any box, without the
full tensor ever existing anywhere. Used by the demo, the benchmark and the tests.
"""

from __future__ import annotations

import zlib

import torch

from realloc.shards.store import TORCH_DTYPES

_MULT = 2654435761  # Knuth's multiplicative hash constant


#: Elements computed at once: a box is made in slabs along its first axis so the int64
#: temporaries (8 bytes an element, several of them) stay bounded on big shards.
CHUNK_ELEMENTS = 1 << 24


def synthetic_box(
    param: str,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    dtype: str,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Values of box ``(offsets, sizes)`` of the synthetic tensor ``param`` of ``shape``, made on
    ``device`` (the same bits on every device: integer hashing, then one float32 rounding and one
    cast, both round-to-nearest-even).

    Example:
        >>> a = synthetic_box("w", (4, 6), (0, 0), (4, 6), "float32")
        >>> bool((a[1:3, 2:5] == synthetic_box("w", (4, 6), (1, 2), (2, 3), "float32")).all())
        True
    """
    numel = 1
    for n in sizes:
        numel *= n
    if len(sizes) > 1 and numel > CHUNK_ELEMENTS and sizes[0] > 1:
        out = torch.empty(sizes, dtype=TORCH_DTYPES[dtype], device=device)
        rows = max(1, CHUNK_ELEMENTS // max(1, numel // sizes[0]))
        for a in range(0, sizes[0], rows):
            b = min(sizes[0], a + rows)
            out[a:b] = synthetic_box(
                param, shape, (offsets[0] + a, *offsets[1:]), (b - a, *sizes[1:]), dtype, seed, device
            )
        return out
    salt = (zlib.crc32(param.encode()) ^ (seed * 0x9E3779B1)) & 0xFFFFFFFF
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(shape))):
        axis = torch.arange(offsets[d], offsets[d] + sizes[d], dtype=torch.int64, device=device) * stride
        index = index + axis.view([-1] + [1] * (len(shape) - 1 - d))
        stride *= shape[d]
    hashed = (index * _MULT + salt) & 0xFFFFFFFF
    values = hashed.to(torch.float32) / 2.0**32 - 0.5
    return values.to(TORCH_DTYPES[dtype]).reshape(sizes)


def synthetic_state_dict(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full synthetic tensors of every parameter of ``spec`` (small models only)."""
    return {p.name: synthetic_box(p.name, p.shape, (0,) * len(p.shape), p.shape, p.dtype, seed) for p in spec.params}
