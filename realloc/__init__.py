"""realloc: plan and execute parameter reallocation between 3D-parallel layouts.

Everything in this package is pure Python (numpy/scipy, torch only for executing plans) and
importable without Ray running. Its layers, from the bottom: :mod:`realloc.spec` (what a model
is), :mod:`realloc.layout` (where every rank's boxes are), :mod:`realloc.plan` (the exchange
planner and the plan as data), :mod:`realloc.shards` (a rank's buffers as torch tensors) and
:mod:`realloc.ckpt` (checkpoints). The first three import no torch.
"""

from realloc.layout import Group, Layout, PieceTable, RankLayout, Shard, Topology
from realloc.plan import Bandwidths, Placement, Plan, Segment, plan_exchange, plan_reallocation
from realloc.spec import ModelSpec, ParamSpec, preset, spec_from_hf_config

__all__ = [
    "Bandwidths",
    "Group",
    "Layout",
    "ModelSpec",
    "ParamSpec",
    "PieceTable",
    "Placement",
    "Plan",
    "RankLayout",
    "Segment",
    "Shard",
    "Topology",
    "plan_exchange",
    "plan_reallocation",
    "preset",
    "spec_from_hf_config",
]
