"""examples/async_rl.py: a rollout fleet generating while the trainer trains, staged updates
switched in at safe points mid-sequence, every token checked against the reference of its version.

Real Ray actors on two simulated nodes (trainer dp=2, two tp=2 replicas: 6 workers).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import ray
from simulated import simulated_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import async_rl

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

pytestmark = pytest.mark.slow

ARGS = ["--steps", "4", "--every", "2", "--replicas", "2", "--tp", "2", "--train", "dp=2", "--new-tokens", "16"]


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=3) as c:
        yield c


@pytest.fixture(scope="module")
def run(cluster):
    """One run of the example's main (in this process, on the module's Ray): exit code, rollout, summary."""
    result: dict = {}
    code = async_rl.main(ARGS, result=result)
    return code, result["rollout"], result["summary"]


def test_async_loop_swaps_mid_sequence_and_matches_the_reference(run, capsys):
    code, rollout, summary = run
    assert code == 0, summary.failures
    assert summary.ok
    assert summary.updates == 2 and summary.versions == [1, 3, 5]
    assert summary.swaps_mid_sequence >= 1
    assert summary.tokens_checked == sum(r.tokens.shape[0] * len(r.versions) for r in rollout.records) > 0
    assert set(summary.tokens_per_version) <= set(summary.versions)
    assert summary.max_abs_diff <= async_rl.ATOL < summary.min_other_version_diff
    # every token of a call after a swap carries the new version: switched_at names the steps
    for rec in rollout.records:
        changes = [i for i in range(1, len(rec.versions)) if rec.versions[i] != rec.versions[i - 1]]
        assert changes == rec.switched_at


def test_checker_reports_a_corrupted_snapshot(run):
    """The check can fail: one weight of one version's reference perturbed -> mismatches, exit status 1."""
    _, rollout, summary = run
    version = max(summary.tokens_per_version, key=summary.tokens_per_version.get)  # a version with tokens
    corrupt = copy.copy(rollout)
    corrupt.snapshots = dict(rollout.snapshots)
    corrupt.snapshots[version] = dict(rollout.snapshots[version])
    weight = corrupt.snapshots[version]["model.layers.0.mlp.down_proj.weight"].clone()
    weight[0, 0] += 0.5
    corrupt.snapshots[version]["model.layers.0.mlp.down_proj.weight"] = weight
    bad = async_rl.check(corrupt)
    assert not bad.ok
    assert bad.mismatches >= 1 and bad.max_abs_diff > async_rl.ATOL
    assert any(f"(version {version})" in f for f in bad.failures)
    assert async_rl.check(rollout).ok  # the original snapshot untouched


def test_checker_reports_a_wrong_version_label(run):
    """A token recorded under the wrong version is caught (the versions' logits are far apart)."""
    _, rollout, _ = run
    relabelled = copy.copy(rollout)
    rec = next(r for r in rollout.records if r.switched_at)
    step = rec.switched_at[0]
    wrong = copy.copy(rec)
    wrong.versions = list(rec.versions)
    wrong.versions[step] = rec.versions[step - 1]  # the old version for the first token after the swap
    relabelled.records = [wrong if r is rec else r for r in rollout.records]
    bad = async_rl.check(relabelled)
    assert not bad.ok and bad.mismatches >= rec.tokens.shape[0]
