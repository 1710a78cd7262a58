"""A tiny mixture-of-experts model through every operation, on a simulated multi-node Ray cluster.

The model (`examples/configs/tiny-moe.json`, a DeepSeek-V3-style config shrunk to 332,160
parameters) has what the big ones have: MLA attention, a dense first layer, 8 routed experts per
MoE layer with a router and its `e_score_correction_bias`, and a shared expert. Every check is
against the synthetic weights: bit-exact after reallocations, a cross-model copy, a checkpoint
save and a resharding load, and a restore after a node is lost.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from simulated import lose_node, simulated_cluster

from actors.driver.checkpoint import CheckpointManager
from actors.wire.zero_copy import sweep_stale_buffers
from realloc import Topology
from realloc.spec import load_spec

SPEC = load_spec(str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "tiny-moe.json"))
TRAIN = Topology(dp=2, tp=2, pp=2)
SEED, OTHER = 3, 77


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from actors import ModelGroup

    with simulated_cluster(nodes=3, cpus_per_node=4) as cluster:
        group = ModelGroup.create(SPEC, TRAIN, name="moe", timeout_s=60)
        group.init_synthetic(SEED)
        manager = CheckpointManager(group, root=tmp_path_factory.mktemp("moe-ckpt"), run_id="moe", factor=2)
        yield SimpleNamespace(group=group, manager=manager, **vars(cluster))
        group.shutdown()
        sweep_stale_buffers()


def test_the_model_has_what_moe_models_have():
    names = [p.name for p in SPEC.params]
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names


@pytest.mark.parametrize(
    "route",
    [
        ["dp=1,tp=4,pp=2", "dp=8,tp=1,pp=1", "dp=2,tp=4,pp=1", "dp=1,tp=2,pp=4"],
        # expert parallelism: ep 2 -> 4 -> 8, ep x tp changes, vLLM's ep = dp*tp with etp=1, ep with pp
        ["dp=4,tp=2,ep=2,etp=2", "dp=4,tp=2,ep=4", "ep=8,tp=1", "dp=2,tp=4,ep=8,etp=1", "dp=2,tp=2,pp=2,ep=2"],
    ],
    ids=["tp-pp", "ep"],
)
def test_reallocations_are_bit_exact(env, route):
    g = env.group
    for topo in route + [str(TRAIN)]:
        g.reallocate(Topology.parse(topo))
        assert g.verify_synthetic(SEED) == {}, topo


def test_cross_model_copy_into_a_reference_in_another_layout(env):
    from actors import ModelGroup

    reference = ModelGroup.create(SPEC, Topology.parse("dp=1,tp=4,ep=4,etp=1"), name="moe-ref", timeout_s=60)
    try:
        reference.init_synthetic(OTHER)
        env.group.copy_to(reference)
        assert reference.verify_synthetic(SEED) == {}
    finally:
        reference.shutdown()


def test_checkpoint_save_and_resharding_load(env):
    g, m = env.group, env.manager
    m.save(1)
    g.reallocate(Topology.parse("dp=4,tp=2,ep=4"))  # into an expert-parallel layout
    g.init_synthetic(OTHER)
    stats = m.load()
    assert stats.method == "reshard" and g.verify_synthetic(SEED) == {}
    g.reallocate(TRAIN)
    g.init_synthetic(OTHER)
    assert m.load().method != "reshard" and g.verify_synthetic(SEED) == {}


@pytest.mark.slow
def test_restore_after_node_loss(env):
    g, m = env.group, env.manager
    g.init_synthetic(SEED)
    m.save(2)
    lose_node(env, g.placement.nodes[0], g)
    g.replace_dead_workers()
    stats = m.load()
    assert stats.method == "restore" and g.verify_synthetic(SEED) == {}
