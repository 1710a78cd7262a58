"""Resident layouts (``reallocate(..., keep=)``, actors/worker/kept.py) in real Ray workers.

What must hold: a move back to a kept layout moves nothing only when the weights did not change
since it was kept (the weight version); otherwise the kept buffers are rewritten in place (same
memory); every result is bit-exact; a failure mid-adoption or mid-refresh leaves every live
worker in the old layout with the old weights and frees the kept layouts the driver no longer
lists; bad ``keep`` values are refused before any traffic.
"""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from simulated import simulated_cluster

from actors import ModelGroup, ReallocationError
from realloc import ModelSpec, Topology
from realloc.shards.synthetic import synthetic_state_dict

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

TINY = ModelSpec.preset("tiny")
TRAIN, GEN = "dp=2,tp=2", "tp=4"


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=4) as c:
        yield c


def make(name: str, topology: str = TRAIN, seed: int = 1, **kwargs) -> ModelGroup:
    kwargs.setdefault("timeout_s", 30)
    g = ModelGroup.create(TINY, Topology.parse(topology), name=name, **kwargs)
    g.init_synthetic(seed)
    return g


def reference(seed: int, sign: int = 1) -> dict[str, torch.Tensor]:
    return {k: v * sign for k, v in synthetic_state_dict(TINY, seed).items()}


def assert_weights(group: ModelGroup, expected: dict[str, torch.Tensor], ranks=None) -> None:
    ranks = range(group.num_workers) if ranks is None else ranks
    for r in ranks:
        for param, offsets, sizes, tensor in ray.get(group.actors[r].get_boxes.remote(), timeout=60):
            want = expected[param][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            assert torch.equal(tensor, want), f"rank {r} {param} {offsets}"


def storage(ctx) -> dict[str, int]:
    return {d: t.data_ptr() for d, t in ctx.buffers.items()}


def negate(ctx) -> None:
    """A 'training step' that changes every weight (padding stays zero)."""
    for t in ctx.buffers.values():
        t.neg_()


def layouts_of(group: ModelGroup, ranks=None) -> list[str]:
    ranks = range(group.num_workers) if ranks is None else ranks
    return [p["layout"] for p in ray.get([group.actors[r].ping.remote() for r in ranks], timeout=30)]


def kept_bytes(group: ModelGroup, ranks=None) -> list[dict]:
    ranks = range(group.num_workers) if ranks is None else ranks
    return ray.get([group.actors[r].resident_bytes.remote() for r in ranks], timeout=30)


def test_the_rl_loop_moves_once_per_iteration_and_keeps_storage(cluster):
    g = make("loop")
    try:
        train_storage = g.run(storage, writes=False)
        to_gen = g.reallocate(GEN, keep="in_place")
        assert to_gen.resident_use is None and to_gen.resident_in_place_bytes_per_actor > 0
        assert to_gen.bytes_intra_node + to_gen.bytes_inter_node + to_gen.bytes_local > 0
        gen_storage = g.run(storage, writes=False)
        assert_weights(g, reference(1))
        # generation does not change the weights: the way back adopts the kept layout
        back = g.reallocate(TRAIN, keep="in_place")
        assert back.resident_use == "adopted"
        assert back.bytes_intra_node == back.bytes_inter_node == back.bytes_local == 0
        assert g.run(storage, writes=False) == train_storage  # the very buffers training had
        assert_weights(g, reference(1))
        assert [r.layout.topology for r in g.resident_layouts()] == [Topology.parse(GEN)]
        # training changes them: the next move refreshes the kept generation buffers in place
        g.run(negate)
        assert [r.fresh for r in g.resident_layouts()] == [False]
        again = g.reallocate(GEN, keep="in_place")
        assert again.resident_use == "refreshed" and again.bytes_intra_node + again.bytes_inter_node > 0
        assert g.run(storage, writes=False) == gen_storage
        assert_weights(g, reference(1, -1))
        assert layouts_of(g) == [str(g.layout.at(r)) for r in range(4)]
        back = g.reallocate(TRAIN)
        assert back.resident_use == "adopted" and g.run(storage, writes=False) == train_storage
        assert_weights(g, reference(1, -1))
        # without keep the generation layout is not kept again
        assert g.resident_layouts() == [] and all(b == {"in_place": 0, "host": 0} for b in kept_bytes(g))
        moved = g.reallocate(GEN, keep="in_place")
        assert moved.resident_use is None and moved.bytes_intra_node + moved.bytes_inter_node > 0
        assert_weights(g, reference(1, -1))
        assert g.trim_memory() == 0  # the move kept what it left: no rollback to free ...
        assert [r.layout.topology for r in g.resident_layouts()] == [Topology.parse(TRAIN)]  # ... and trim keeps it
        g.release_resident()
        assert g.resident_layouts() == [] and all(b == {"in_place": 0, "host": 0} for b in kept_bytes(g))
        assert g.reallocate(TRAIN).resident_use is None
        assert g.trim_memory() > 0 and g.trim_memory() == 0  # the rollback of that move, once
        assert_weights(g, reference(1, -1))
    finally:
        g.shutdown()


def test_a_write_in_the_kept_layouts_absence_is_never_lost(cluster):
    """The defect this guards against: adopting a kept layout although the weights changed."""
    g = make("stale")
    try:
        g.reallocate(GEN, keep="in_place")
        g.run(negate)  # e.g. an update applied in the generation layout
        back = g.reallocate(TRAIN)
        assert back.resident_use == "refreshed"
        assert_weights(g, reference(1, -1))
        # writes=False keeps the kept layout current
        g.reallocate(GEN, keep="in_place")
        assert g.run(lambda ctx: sorted(ctx.tensors)[:1], writes=False)
        assert g.reallocate(TRAIN).resident_use == "adopted"
        assert_weights(g, reference(1, -1))
        # a fill is a change of the weights too
        g.reallocate(GEN, keep="in_place")
        g.init_synthetic(7)
        assert g.reallocate(TRAIN).resident_use == "refreshed"
        assert_weights(g, reference(7))
    finally:
        g.shutdown()


def test_keep_on_host_frees_the_device_buffers_and_copies_back(cluster):
    g = make("host")
    try:
        to_gen = g.reallocate(GEN, keep="host")
        assert to_gen.resident_host_bytes_per_actor > 0 and to_gen.resident_in_place_bytes_per_actor == 0
        assert all(b["host"] > 0 and b["in_place"] == 0 for b in kept_bytes(g))
        back = g.reallocate(TRAIN)
        assert back.resident_use == "adopted" and back.bytes_local > 0
        assert back.bytes_intra_node == back.bytes_inter_node == 0
        assert_weights(g, reference(1))
        assert all(b == {"in_place": 0, "host": 0} for b in kept_bytes(g))
    finally:
        g.shutdown()


def test_copy_into_a_group_makes_its_kept_layouts_stale(cluster):
    policy, ref = make("policy", seed=3), make("reference", seed=4)
    try:
        ref.reallocate(GEN, keep="in_place")
        policy.copy_to(ref)
        assert ref.reallocate(TRAIN).resident_use == "refreshed"
        assert_weights(ref, reference(3))
    finally:
        policy.shutdown()
        ref.shutdown()


def test_bad_keep_is_refused_before_any_traffic(cluster):
    g = make("badkeep")
    try:
        before = g.activity()
        for bad in ("gpu", True, 1, "IN_PLACE"):
            with pytest.raises(ValueError, match="in_place"):
                g.reallocate(GEN, keep=bad)
        with pytest.raises(ValueError, match="writes must be True or False"):
            g.run(negate, writes="no")
        with pytest.raises(ValueError, match="keeps no layout"):
            g.release_resident([GEN])
        assert g.activity() == before and g.layout.topology == Topology.parse(TRAIN)
    finally:
        g.shutdown()


def test_a_death_during_adoption_leaves_the_survivors_in_the_current_layout(cluster):
    g = make("adopt-fault", timeout_s=8)  # survivors of the death wait in gloo until it (ShardWorker's timeout): short
    try:
        g.reallocate(GEN, keep="in_place")
        ray.get(g.actors[1].inject_fault.remote("exit_in_commit", 0))
        with pytest.raises(ReallocationError) as err:
            g.reallocate(TRAIN)
        assert err.value.dead == [g.actor_names[1]] and "stays in layout dp=1,tp=4,pp=1" in str(err.value)
        assert g.layout.topology == Topology.parse(GEN)
        survivors = [0, 2, 3]
        assert layouts_of(g, survivors) == [str(g.layout.at(r)) for r in survivors]
        assert_weights(g, reference(1), survivors)
        assert g.resident_layouts() == []  # no longer whole: dropped, and freed on the survivors
        assert all(b == {"in_place": 0, "host": 0} for b in kept_bytes(g, survivors))
        assert g.replace_dead_workers() == [1]
        g.init_synthetic(2)
        assert g.reallocate(TRAIN).resident_use is None
        assert_weights(g, reference(2))
    finally:
        g.shutdown()


def test_a_death_during_a_refresh_leaves_the_old_layout_and_frees_the_half_written_one(cluster):
    g = make(
        "refresh-fault", bucket_bytes=4096, zero_copy=False, timeout_s=8
    )  # survivors of the death wait in gloo until it (ShardWorker's timeout): short
    try:
        g.reallocate(GEN, keep="in_place")
        g.reallocate(TRAIN, keep="in_place")  # adopted; the generation layout is kept now
        g.run(negate)
        ray.get(g.actors[2].inject_fault.remote("exit_after_buckets", 2))
        with pytest.raises(ReallocationError) as err:
            g.reallocate(GEN, keep="in_place")
        assert err.value.dead == [g.actor_names[2]] and "Rolled back" in str(err.value)
        survivors = [0, 1, 3]
        assert g.layout.topology == Topology.parse(TRAIN)
        assert layouts_of(g, survivors) == [str(g.layout.at(r)) for r in survivors]
        assert_weights(g, reference(1, -1), survivors)
        assert g.resident_layouts() == []
        assert all(b == {"in_place": 0, "host": 0} for b in kept_bytes(g, survivors))
    finally:
        g.shutdown()
