"""``realloc bench-scale``'s pure parts (realloc_tools/bench/scale.py): layouts that grow with the
world, the argument checks (exit 2 before Ray starts), and the per-worker message counts a plan
implies. The Ray run is tests/test_scale_ray.py."""

from __future__ import annotations

import pytest

from realloc import ModelSpec, Placement, Topology, plan_reallocation
from realloc_tools.bench import scale as scale_bench
from realloc_tools.cli import main


def test_scaled_fills_the_world_with_the_star():
    assert scale_bench.scaled("tp=2,pp=2,dp=*", 64) == Topology(dp=16, tp=2, pp=2)
    assert scale_bench.scaled("tp=2,dp=*", 8) == Topology(dp=4, tp=2)
    for text, n in (("tp=2,dp=4", 8), ("tp=*,dp=*", 8), ("tp=4,dp=*", 6)):
        with pytest.raises(ValueError):
            scale_bench.scaled(text, n)


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "8,12"],  # 12 is not a multiple of --nodes-of 8
        ["--workers", "8", "--nodes-of", "0"],
        ["--workers", ""],
        ["--workers", "8", "--src", "tp=8,dp=*"],  # tiny has 12 heads
        ["--workers", "8", "--repeats", "-1"],
        ["--workers", "8", "--timeout-s", "0"],
        ["--workers", "8", "--timeout-s", "nan"],
        ["--workers", "8", "--timeout-s", "inf"],
        ["--workers", "8", "--cpus-per-worker", "0"],
        ["--workers", "8", "--cpus-per-worker", "nan"],
    ],
)
def test_invalid_arguments_exit_2_before_ray_starts(argv, capsys, monkeypatch):
    def no_ray(*args, **kwargs):
        raise AssertionError("bench-scale started Ray with invalid arguments")

    monkeypatch.setattr(scale_bench, "scale_run", no_ray)  # where Ray starts
    assert main(["bench-scale", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("realloc: error:") and err.count("\n") == 1
    named = next((a for a in argv[2:] if a.startswith("--")), None)
    assert named is None or named in err


def test_plan_messages_count_every_routes_buckets_at_both_ends():
    spec = ModelSpec.preset("tiny")
    plan = plan_reallocation(spec, Topology(dp=2, tp=2, pp=2), Topology(dp=4, tp=2), Placement.blocks(8, 4))
    counted = scale_bench.plan_messages(plan, 8)
    routes = list(plan.routes())
    assert sum(counted["data_messages"]) == 2 * sum(len(plan.buckets(seg)) for _, _, _, seg in routes) > 0
    assert counted["control_bound"] <= 7


def test_traffic_delta_and_growth():
    zero = {d: {k: [0, 0] for k in ("data", "control")} for d in ("sent", "received")}
    later = {"sent": {"data": [3, 300], "control": [1, 1]}, "received": {"data": [2, 200], "control": [0, 0]}}
    delta = scale_bench.traffic_delta(zero, later)
    assert (delta["messages"], delta["bytes"], delta["sent_control_bytes"]) == (6, 500, 1)
    assert scale_bench.growth([{"workers": 8}]) is None
