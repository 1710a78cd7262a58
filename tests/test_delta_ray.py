"""Delta moves with real Ray actors and gloo (actors/wire/delta.py, issue 24): only the elements that
changed travel, checksummed, and the destination is bit-identical to the source after every
move, also when someone tried to make it otherwise: a destination changed behind the driver's
back, a skipped version, a restarted worker, a worker killed during a delta move."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from simulated import simulated_cluster, wait_for_dead_workers

from actors import ModelGroup, ReallocationError, ShardWorker
from realloc import ModelSpec, Topology
from realloc.boxes import box_index

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

SPEC = ModelSpec.preset("tiny")
BUCKET = 8192  # many buckets, so a sparse change leaves most of them unchanged


class Trainer(ShardWorker):
    def nudge(self, seed: int, fraction: float) -> None:
        """An optimizer step's worth of change: a random ``fraction`` of the elements move a little
        (the same on every replica of a shard: seeded by the seed and the shard's box)."""
        ctx = self.context()
        for name, t in sorted(ctx.tensors.items()):
            g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)) + ctx.tp_rank)
            mask = torch.rand(t.shape, generator=g) < fraction
            t[mask] = (t[mask].float() * 1.01 + 0.001).to(t.dtype)


class Gen(ShardWorker):
    def corrupt(self) -> None:
        """Change weights without telling anyone (a bug elsewhere, a bad DMA)."""
        for t in self.context().tensors.values():
            t.view(-1)[:: max(1, t.numel() // 3)] += 1


def exact(source: ModelGroup, dest: ModelGroup) -> None:
    """Every element every worker of ``dest`` holds equals the source's, bit for bit."""
    full = source.state_dict()
    for rank, boxes in dest.shard_boxes(list(range(dest.num_workers))).items():
        for param, offsets, sizes, tensor in boxes:
            want = full[param][box_index(offsets, sizes)]
            assert torch.equal(tensor.view(torch.uint8), want.contiguous().view(torch.uint8)), (rank, param)


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=4) as c:
        yield c


def _groups(name: str, anchor_every: int = 10, timeout_s: float = 20):
    trainer = ModelGroup.create(
        SPEC,
        Topology(tp=2),
        name=f"{name}-trainer",
        worker_cls=Trainer,
        bucket_bytes=BUCKET,
        zero_copy=False,
        delta="host",
        delta_anchor_every=anchor_every,
        timeout_s=timeout_s,
    )
    gen = ModelGroup.create(
        SPEC,
        Topology(tp=2, dp=2),
        name=f"{name}-gen",
        worker_cls=Gen,
        bucket_bytes=BUCKET,
        zero_copy=False,
        timeout_s=timeout_s,
    )
    trainer.init_synthetic(seed=1)
    return trainer, gen


def test_delta_copies_are_exact_and_carry_a_fraction_of_the_bytes(cluster):
    trainer, gen = _groups("dc", anchor_every=4)
    try:
        modes = []
        for step in range(6):
            stats = trainer.copy_to(gen, delta=True)
            modes.append(stats.delta["mode"])
            exact(trainer, gen)
            assert gen.version == trainer.version
            if stats.delta["mode"] == "delta":
                d = stats.delta
                assert d["repaired"] == 0 and d["delta"] > 0
                assert d["wire_bytes"] < 0.25 * d["bytes"], d  # 1% changed
                assert d["base_bytes_per_actor"] > 0
            trainer.call("nudge", step, 0.01)
        # the first move has no base; then every 4th is a full copy
        assert modes == ["anchor", "delta", "delta", "delta", "anchor", "delta"]
        # the staged form: the bytes arrive while gen serves, commit switches them in
        update = trainer.copy_to(gen, stage=True, delta=True)
        update.commit()
        assert update.stats.delta["mode"] == "delta" and update.stats.delta["repaired"] == 0
        exact(trainer, gen)
        # a plain copy leaves no base behind: the next delta=True is an anchor
        trainer.call("nudge", 99, 0.01)
        trainer.copy_to(gen)
        trainer.call("nudge", 100, 0.01)
        assert trainer.copy_to(gen, delta=True).delta["mode"] == "anchor"
        exact(trainer, gen)
    finally:
        trainer.shutdown()
        gen.shutdown()


def test_corrupted_destination_and_skipped_version_end_exact(cluster):
    trainer, gen = _groups("dk")
    other = ModelGroup.create(SPEC, Topology(tp=2), name="dk-other", bucket_bytes=BUCKET, zero_copy=False)
    try:
        trainer.copy_to(gen, delta=True)
        trainer.call("nudge", 1, 0.01)
        gen.call("corrupt", writes=False)  # behind the driver's back: it still believes gen holds the copy
        stats = trainer.copy_to(gen, delta=True)
        assert stats.delta["mode"] == "delta" and stats.delta["repaired"] > 0, stats.delta
        exact(trainer, gen)
        # a skipped version: the trainer's base moves on with a copy elsewhere; gen is one behind
        trainer.call("nudge", 2, 0.01)
        trainer.copy_to(other, delta=True)
        trainer.call("nudge", 3, 0.01)
        stats = trainer.copy_to(gen, delta=True)
        assert stats.delta["mode"] == "anchor"
        exact(trainer, gen)
        # a write into gen the driver knows of: no longer the copy, an anchor
        trainer.call("nudge", 4, 0.01)
        trainer.copy_to(gen, delta=True)
        gen.call("corrupt")
        assert trainer.copy_to(gen, delta=True).delta["mode"] == "anchor"
        exact(trainer, gen)
    finally:
        for g in (trainer, gen, other):
            g.shutdown()


def test_restarted_workers_and_a_worker_killed_mid_delta(cluster):
    trainer, gen = _groups("dr", timeout_s=8)  # survivors of each death wait in gloo until it: short
    try:
        trainer.copy_to(gen, delta=True)
        trainer.call("nudge", 1, 0.02)
        assert trainer.copy_to(gen, delta=True).delta["mode"] == "delta"
        # a receiver dies during a delta move: gen's live workers keep the old version
        trainer.call("nudge", 2, 0.02)
        before = ray.get([a.source_digest.remote() for a in gen.actors])
        version = gen.version
        ray.get(gen.actors[3].inject_fault.remote("exit_after_buckets", 2))
        with pytest.raises(ReallocationError, match="dr-gen:rank3"):
            trainer.copy_to(gen, delta=True)
        assert gen.version == version
        assert ray.get([gen.actors[r].source_digest.remote() for r in (0, 1, 2)], timeout=60) == before[:3]
        wait_for_dead_workers(gen)
        gen.replace_dead_workers()  # the fresh worker holds nothing: the next copy is an anchor
        assert trainer.copy_to(gen, delta=True).delta["mode"] == "anchor"
        exact(trainer, gen)
        # a sender dies during a delta move, then comes back without its base
        trainer.call("nudge", 3, 0.02)
        before = ray.get([a.source_digest.remote() for a in gen.actors])
        ray.get(trainer.actors[1].inject_fault.remote("exit_after_buckets", 2))
        with pytest.raises(ReallocationError, match="dr-trainer:rank1"):
            trainer.copy_to(gen, delta=True)
        assert ray.get([a.source_digest.remote() for a in gen.actors], timeout=60) == before
        wait_for_dead_workers(trainer)
        trainer.replace_dead_workers()
        trainer.init_synthetic(seed=5)
        assert trainer.copy_to(gen, delta=True).delta["mode"] == "anchor"
        exact(trainer, gen)
        trainer.call("nudge", 4, 0.02)
        assert trainer.copy_to(gen, delta=True).delta["mode"] == "delta"
        exact(trainer, gen)
    finally:
        trainer.shutdown()
        gen.shutdown()


def test_refreshing_a_kept_layout_sends_only_what_changed(cluster):
    """The colocated loop: train in tp=2 (dp=2), generate in tp=4 kept in place; moving back to
    the stale kept layout is a delta, and every layout holds exactly the trained weights."""
    g = ModelGroup.create(
        SPEC,
        Topology(tp=2, dp=2),
        name="dkept",
        worker_cls=Trainer,
        bucket_bytes=BUCKET,
        zero_copy=False,
        delta="host",
        timeout_s=20,
    )
    try:
        g.init_synthetic(seed=3)
        train, gen = Topology(tp=2, dp=2), Topology(tp=4)
        first = g.reallocate(gen, keep="in_place", delta=True)
        assert first.delta["mode"] == "anchor"
        g.reallocate(train, keep="in_place", delta=True)  # the kept train layout is fresh: adopted
        for step in range(3):
            g.call("nudge", step, 0.01)
            want = g.state_dict()
            stats = g.reallocate(gen, keep="in_place", delta=True)
            assert stats.resident_use == "refreshed"
            assert stats.delta["mode"] == "delta" and stats.delta["repaired"] == 0, stats.delta
            assert stats.delta["wire_bytes"] < 0.3 * stats.delta["bytes"]
            got = g.state_dict()
            assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
            back = g.reallocate(train, keep="in_place", delta=True)
            assert back.resident_use == "adopted"
    finally:
        g.shutdown()


def test_delta_needs_an_opted_in_group(cluster):
    a = ModelGroup.create(SPEC, Topology(tp=2), name="dn-a")
    b = ModelGroup.create(SPEC, Topology(tp=2), name="dn-b")
    try:
        with pytest.raises(ValueError, match="GroupConfig\\(delta='host'\\)"):
            a.copy_to(b, delta=True)
        with pytest.raises(ValueError, match="delta must be True or False"):
            a.copy_to(b, delta="yes")
        assert a.version == 0 and b.version == 0
    finally:
        a.shutdown()
        b.shutdown()


def test_a_blend_is_no_copy(cluster):
    """A defect found here: ``copy_to(eta=...)`` marked the destination as an unchanged copy of its
    source, so the next plain copy of the same source version kept the destination's version
    although it rewrote every weight, and a layout kept in between (holding the blend) was then
    adopted as fresh: the blend came back instead of the copy. (A delta trusts the same mark.)"""
    src = ModelGroup.create(SPEC, Topology(tp=2), name="db-src", worker_cls=Trainer)
    dst = ModelGroup.create(SPEC, Topology(tp=2), name="db-dst")
    try:
        src.init_synthetic(seed=1)
        src.call("nudge", 1, 0.5)
        src.call("nudge", 2, 0.5)
        dst.init_synthetic(seed=2)
        src.copy_to(dst, eta=0.5)
        dst.reallocate(Topology(dp=2), keep="in_place")  # keeps the blend, tagged with dst's version
        src.copy_to(dst)
        stats = dst.reallocate(Topology(tp=2))
        assert stats.resident_use != "adopted"
        exact(src, dst)
        # a blend into a group that holds the source's very weights changes bits too: its version
        # moves on, and the layout kept before it is not adopted as fresh (it kept its version:
        # found in review, 2026-11-28)
        while src.version <= dst.version:
            src.call("nudge", 3, 0.5)
        src.copy_to(dst)  # dst now holds src's very weights, of src's version
        assert dst.origin == (src.name, src.version) and dst.version == src.version
        dst.reallocate(Topology(dp=2), keep="in_place")  # kept: the copy's bits, tagged with its version
        copied = dst.version
        dst.reallocate(Topology(tp=2))
        blended = src.copy_to(dst, eta=0.1)
        assert blended.version == dst.version > copied
        assert dst.reallocate(Topology(dp=2)).resident_use != "adopted"
    finally:
        src.shutdown()
        dst.shutdown()
