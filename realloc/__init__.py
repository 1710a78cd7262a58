"""realloc: plan and execute parameter reallocation between 3D-parallel layouts.

Everything in this package is pure Python (numpy/scipy, torch only for executing plans) and
importable without Ray running.
"""

from realloc.hf_config import spec_from_hf_config
from realloc.layout import Group, Layout, Shard
from realloc.placement import Placement
from realloc.plan import Plan, Segment
from realloc.planner import Bandwidths, plan_exchange, plan_reallocation
from realloc.spec import ModelSpec, ParamSpec, preset
from realloc.topology import Topology

__all__ = [
    "Bandwidths", "Group", "Layout", "ModelSpec", "ParamSpec", "Placement", "Plan", "Segment",
    "Shard", "Topology", "plan_exchange", "plan_reallocation", "preset", "spec_from_hf_config",
]
