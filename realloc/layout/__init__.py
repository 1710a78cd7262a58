"""Where every rank's boxes are: topologies, engine conventions, the layout value, and the
planner's input (who holds which boxes). Pure: no torch."""

from realloc.layout._layout import Layout, RankLayout, Shard, expert_range
from realloc.layout.holdings import Group, PieceTable
from realloc.layout.topology import Topology

__all__ = ["Group", "Layout", "PieceTable", "RankLayout", "Shard", "Topology", "expert_range"]
