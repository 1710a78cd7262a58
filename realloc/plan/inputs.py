"""What the exchange planner takes besides holdings and needs: the parameters' shapes and dtypes,
the link speeds of its time estimate, and the default bucket size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from realloc._checks import check_number

__all__ = ["DEFAULT_BUCKET_BYTES", "Bandwidths", "ParamTable"]

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class Bandwidths:
    """Link speeds (bytes/s) for the time estimate. Defaults: H100 nodes, NVLink 4 inside a node,
    one 400 Gb/s NIC per GPU between nodes, HBM3 copies."""

    intra_node: float = 300e9
    inter_node: float = 45e9
    local_copy: float = 1000e9

    def __post_init__(self) -> None:
        for name in ("intra_node", "inter_node", "local_copy"):
            check_number(f"bandwidth {name}", getattr(self, name), positive=True, allowed="positive")


ParamTable = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)
