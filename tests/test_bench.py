"""``realloc bench``: the lower-bound arithmetic, the owner tables, and one real run on the tiny preset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from realloc.layout import Layout
from realloc.placement import Placement
from realloc.planner import plan_reallocation
from realloc.spec import ModelSpec
from realloc.topology import Topology
from tools.bench import BASELINES, lower_bound, source_owners
from tools.cli import main

ROOT = Path(__file__).resolve().parent.parent  # run the checkout's tools.cli, not an installed one
REQUIRED = {"ours_seconds", "baselines", "speedup_vs", "lower_bound_seconds", "ratio_to_lower_bound",
            "peak_extra_bytes_per_actor", "bucket_bytes", "lower_bound_formula", "transport", "verified", "plan"}


def test_source_owners_tile_every_parameter_once():
    spec = ModelSpec.preset("tiny")  # tied head, GQA kv heads replicated at tp=4
    for topo in (Topology(dp=2, tp=2, pp=2), Topology(tp=4, pp=2), Topology(dp=8)):
        owners = source_owners(Layout(spec, topo))
        for p in spec.params:
            boxes = owners[p.name]
            assert sum(_numel(s) for _, _, s in boxes) == p.numel, (topo, p.name)
            assert len({(o, s) for _, o, s in boxes}) == len(boxes)
            for rank, o, s in boxes:  # the owner holds it, in dp replica 0
                assert topo.coords(rank)[0] == 0
                assert any(sh.param == p.name and sh.offsets == o and sh.sizes == s
                           for sh in Layout(spec, topo).shards(rank))


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def test_lower_bound_formula():
    spec = ModelSpec.preset("small")
    src, dst = Topology(dp=2, tp=2, pp=2), Topology(dp=4, tp=2)
    plan = plan_reallocation(spec, Layout(spec, src), Layout(spec, dst), Placement.blocks(8, 4))
    t = {"gloo_p2p_gbps": 1.0, "gloo_aggregate_gbps": 2.0, "memcpy_1core_gbps": 3.0,
         "memcpy_aggregate_gbps": 5.0, "memcpy_shm_cold_gbps": 1.0}
    lb = lower_bound(plan, t, cores=2, workers=8)
    s = plan.stats
    aggregate = s["bytes_inter_node"] / 2e9 + (s["bytes_intra_node"] + s["bytes_local_copy"]) / 6e9
    assert lb["lower_bound_terms"]["aggregate_seconds"] == pytest.approx(aggregate)
    assert lb["lower_bound_seconds"] >= aggregate > 0
    assert lb["lower_bound_seconds"] == max(lb["lower_bound_terms"]["aggregate_seconds"],
                                            lb["lower_bound_terms"]["critical_rank_seconds"])
    assert "bytes_inter_node" in lb["lower_bound_formula"]


def test_bad_options_are_usage_errors(capsys):
    assert main(["bench", "--skip", "nope"]) == 2
    assert "unknown baselines" in capsys.readouterr().err
    assert main(["bench", "--src", "dp=2", "--dst", "dp=4"]) == 2
    assert main(["bench", "--repeats", "0"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_tiny_end_to_end():
    """8 actors on 2 simulated nodes (a subprocess: its own Ray), every method verified exactly."""
    cmd = [sys.executable, "-m", "tools.cli", "bench", "--model", "tiny", "--json", "--verify", "exact",
           "--repeats", "2", "--probe-mb", "4", "--bucket-mb", "0.0625"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert REQUIRED <= set(report)
    assert set(report["baselines"]) == set(BASELINES) == set(report["speedup_vs"])
    assert report["verified"] == {"ours": True, **{b: True for b in BASELINES}}
    assert report["bucket_bytes"] == 64 << 10
    assert (report["workers"], report["nodes"]) == (8, 2)
    assert len(report["ours"]["forward_seconds"]) == 2
    for key in ("ours_seconds", "lower_bound_seconds", "ratio_to_lower_bound", "peak_extra_bytes_per_actor"):
        assert report[key] > 0, key
    assert all(v > 0 for v in report["baselines"].values())
    assert all(v > 0 for v in report["speedup_vs"].values())
    for key in ("gloo_p2p_gbps", "gloo_aggregate_gbps", "memcpy_1core_gbps", "memcpy_aggregate_gbps"):
        assert report["transport"][key] > 0, key
    assert report["transport"]["gloo_p2p_cross_node"]
