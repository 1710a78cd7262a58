"""Placement: which node (and device) each worker sits on.

In the planner it is plain data. The Ray layer fills it from real Ray node ids; the CLI and
tests build it from a workers-per-node count or explicit lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from realloc._checks import check_positive


@dataclass(frozen=True)
class Placement:
    """Node id (and optionally device) of every worker id ``0..len(nodes)-1``.

    Example:
        >>> p = Placement.blocks(16, per_node=8)
        >>> p.nodes[7], p.nodes[8], p.num_nodes
        ('node-0', 'node-1', 2)
    """

    nodes: tuple[str, ...]
    devices: tuple[str | None, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(str(n) for n in self.nodes))
        if not self.nodes:
            raise ValueError("placement has no workers")
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
            if len(self.devices) != len(self.nodes):
                raise ValueError(f"placement has {len(self.nodes)} nodes but {len(self.devices)} devices")

    @staticmethod
    def blocks(num_workers: int, per_node: int) -> "Placement":
        """Workers filled into nodes in order, ``per_node`` each (the usual GPU-cluster packing)."""
        check_positive("num_workers", num_workers)
        check_positive("per_node", per_node)
        return Placement(tuple(f"node-{w // per_node}" for w in range(num_workers)))

    @property
    def num_workers(self) -> int:
        return len(self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def workers_on(self, node: str) -> list[int]:
        return [w for w, n in enumerate(self.nodes) if n == node]

    def per_node(self) -> int:
        """Largest number of workers on one node."""
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n] = counts.get(n, 0) + 1
        return max(counts.values())

    def check_workers(self, workers: Sequence[int], what: str) -> None:
        bad = [w for w in workers if not 0 <= w < len(self.nodes)]
        if bad:
            raise ValueError(f"{what}: worker ids {bad[:5]} are not in the placement (0..{len(self.nodes) - 1})")

    def to_json(self) -> dict:
        return {"nodes": list(self.nodes), "devices": list(self.devices) if self.devices else None}
