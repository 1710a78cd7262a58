"""Issue 26, item 2: a move on 32 Ray actors on simulated nodes, both ways, verified bit-exact,
with per-worker costs that do not grow with the world.

What a worker sends and receives, and what the driver ships it, must not grow with the number of
workers: against the same move at 8 workers (same layouts with dp scaled, same 4 workers per
node), the 32-worker move's busiest worker posts no more than twice the messages of the 8-worker
plan's busiest worker, and the largest object the driver ships a worker is no more than twice what
the driver ships for the 8-worker plan. Both are counts and bytes, never times. The 8-worker side
is the pure plan and the driver's own shipping code run without actors, so only the 32 workers
start (about a minute on a 2-core machine).
"""

from __future__ import annotations

import pytest

from realloc.spec import ModelSpec
from realloc_tools.bench import scale as scale_bench
from tests.simulated import simulated_cluster

pytestmark = pytest.mark.slow

WORKERS, REFERENCE, NODES_OF = 32, 8, 4
SRC, DST = "tp=2,pp=2,dp=*", "tp=2,dp=*"


def test_32_workers_move_both_ways_with_flat_per_worker_costs():
    from actors.driver.group import ModelGroup

    spec = ModelSpec.preset("tiny")
    src, dst = scale_bench.scaled(SRC, WORKERS), scale_bench.scaled(DST, WORKERS)
    with simulated_cluster(WORKERS // NODES_OF, NODES_OF):
        group = ModelGroup.create(spec, src, name="scale32", zero_copy=False, timeout_s=300)
        try:
            group.init_synthetic(seed=3)
            planned = scale_bench.plan_messages(group.plan_to(dst), WORKERS)["data_messages"]
            there = scale_bench.timed_move(group, dst, seed=3)
            back = scale_bench.timed_move(group, src, seed=3)
            at_8 = scale_bench.plan_reference(spec, SRC, DST, REFERENCE, NODES_OF)
        finally:
            group.shutdown()
    for move in (there, back):
        assert move["verified"], move["mismatches"]  # every shard of every worker, bit-exact
        assert move["slowest_worker"].startswith("realloc:scale32:rank") and move["trace_json_bytes"] > 0
    # the trace has a step for each end of each route the worker runs over the transport
    assert there["trace_steps"] >= max(1, sum(1 for w in there["per_worker"] if w["sent_data_messages"]))
    assert group.layout.topology == src
    assert sum(planned) > 0  # the move there sends messages (back, every byte is a local copy)

    # the counters count what the group's plan says: every route's buckets, one message at each end
    assert [w["sent_data_messages"] + w["received_data_messages"] for w in there["per_worker"]] == planned

    for move, way in ((there, "there"), (back, "back")):
        busiest = max(w["messages"] for w in move["per_worker"])
        ref = at_8[way]
        assert busiest <= 2 * max(ref["data_messages"]) + ref["control_bound"], (way, busiest, ref)
        assert 0 < move["shipped_max_bytes"] <= 2 * ref["shipped_max_bytes"], (way, move["shipped_max_bytes"], ref)
