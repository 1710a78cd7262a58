"""Byte counts as people read them, shared by the command line's printouts and pictures."""

from __future__ import annotations


def decimal_size(nbytes: int) -> str:
    """Decimal units, matching the GB/s of the bandwidth options (exact counts are in --json).

    >>> decimal_size(68_977_000_000), decimal_size(999)
    ('68.977 GB', '999 B')
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f} {unit}"
    return f"{nbytes} B"
