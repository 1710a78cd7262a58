"""The exchange planner and the plan as data: from who holds and who needs which boxes, on
which nodes, to a :class:`Plan` of steps every executor runs the same way. Pure: no torch."""

from realloc.plan.inputs import DEFAULT_BUCKET_BYTES, Bandwidths
from realloc.plan.placement import Placement
from realloc.plan.planner import plan_exchange, plan_reallocation
from realloc.plan.records import (
    BUCKET_ALIGN,
    PLAN_FORMAT,
    Piece,
    Plan,
    Route,
    Segment,
    bucket_count,
    bucket_nbytes,
    buckets,
)
from realloc.plan.tables import IndexChain, SegmentTable, StepTable

__all__ = [
    "BUCKET_ALIGN",
    "DEFAULT_BUCKET_BYTES",
    "PLAN_FORMAT",
    "Bandwidths",
    "IndexChain",
    "Piece",
    "Placement",
    "Plan",
    "Route",
    "Segment",
    "SegmentTable",
    "StepTable",
    "bucket_count",
    "bucket_nbytes",
    "buckets",
    "plan_exchange",
    "plan_reallocation",
]
