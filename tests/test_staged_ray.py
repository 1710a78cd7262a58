"""Staged updates with real Ray actors (actors/driver/staged.py): the generator serves while the next
weights arrive, switches them in between two calls or at safe points inside one, and carries
weight versions. Faults: tests/test_staged_faults_ray.py; the fleet: tests/test_fleet_ray.py."""

from __future__ import annotations

import os
import re
import statistics
import sys
import threading
import time

import pytest
import ray
import torch
from simulated import simulated_cluster

from actors import GroupBusyError, ModelGroup, ShardWorker
from realloc import ModelSpec, Topology

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

SPEC = ModelSpec.preset("tiny")


class Trainer(ShardWorker):
    def slow_double(self, seconds: float):
        """A write that takes a while: the weights double at its end."""
        time.sleep(seconds)
        for t in self.context().tensors.values():
            t.mul_(2)


class Gen(ShardWorker):
    """A generator: digests of its weights, a long loop with safe points, the changes it saw."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.changes = []

    def on_shards_changed(self, ctx, change):
        self.changes.append((change.kind, change.version, ctx.version))

    def seen(self):
        return list(self.changes)

    def digest(self):
        ctx = self.context()
        return ctx.version, float(sum(t.double().abs().sum() for t in ctx.tensors.values()))

    def loop(self, steps: int, pause: float):
        ctx = self.context()
        out = []
        for step in range(steps):
            ctx.safe_point()
            out.append((step, ctx.version, float(sum(t.double().abs().sum() for t in ctx.tensors.values()))))
            time.sleep(pause)
        return out


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=4) as c:
        yield c


@pytest.fixture(scope="module")
def trainer(cluster):
    group = ModelGroup.create(SPEC, Topology(tp=2), name="st-trainer")
    yield group
    group.shutdown()


def _serve(group: ModelGroup, stop: threading.Event, log: list, errors: list) -> threading.Thread:
    def loop():
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                out = group.call("digest", writes=False)
            except Exception as err:  # noqa: BLE001 - the test asserts there were none
                errors.append(err)
                return
            log.append((t0, time.perf_counter() - t0, out))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_generator_serves_during_staging_and_switches_at_commit(trainer):
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen", worker_cls=Gen)
    try:
        trainer.init_synthetic(3)
        first = trainer.copy_to(gen)  # a generator that never wrote takes its source's version
        assert gen.version == first.version == trainer.version
        assert gen.verify_synthetic(3) == {}
        trainer.init_synthetic(4)
        old = gen.call("digest", writes=False)

        stop, log, errors = threading.Event(), [], []
        server = _serve(gen, stop, log, errors)
        time.sleep(0.5)
        idle = [lat for _, lat, _ in log]
        ray.get(trainer.actors[0].inject_fault.remote("stall", 1.5))  # a transfer that takes a while
        started = time.perf_counter()
        update = trainer.copy_to(gen, stage=True)
        assert update.state == "staging" and update.version == trainer.version
        stats = update.wait()
        staged_at = time.perf_counter()
        during = [(lat, out) for t0, lat, out in log if started <= t0 and t0 + lat <= staged_at]
        assert len(during) >= 3, "the generator served no calls while the update was staged"
        assert all(out == old for _, out in during), "a call during staging saw other weights than the committed ones"
        assert gen.call("digest", writes=False) == old  # staged, not committed: still the old weights
        update.commit()
        time.sleep(0.3)
        stop.set()
        server.join(30)
        assert errors == []
        assert update.state == "committed" and gen.version == update.version == trainer.version
        assert stats.version == update.version
        assert stats.shadow_bytes_per_actor == max(gen.layout.rank_bytes(r) for r in range(gen.num_workers))
        assert gen.verify_synthetic(4) == {}
        after = gen.call("digest", writes=False)
        assert all(v == update.version for v, _ in after) and after != old
        # the hook ran once per worker with the update's version
        assert all(seen[-1] == ("copy", update.version, update.version) for seen in gen.call("seen", writes=False))
        print(
            f"\ncall latency idle: median {statistics.median(idle) * 1e3:.2f} ms over {len(idle)} calls; "
            f"during staging: median {statistics.median(lat for lat, _ in during) * 1e3:.2f} ms, "
            f"max {max(lat for lat, _ in during) * 1e3:.2f} ms over {len(during)} calls; "
            f"pause at commit {update.pause_seconds * 1e3:.2f} ms; transfer {stats.seconds:.3f} s"
        )

        # double buffering: the next update reuses the buffers that served before (no new shadow set)
        trainer.init_synthetic(5)
        again = trainer.copy_to(gen, stage=True)
        again.commit()
        assert gen.verify_synthetic(5) == {} and gen.version == trainer.version
        files = _shm_files("st-gen")
        for seed in (6, 7):  # from now on every update writes the set that served before it
            trainer.init_synthetic(seed)
            trainer.copy_to(gen, stage=True).commit()
            assert gen.verify_synthetic(seed) == {}
            assert _shm_files("st-gen") == files, "a staged update allocated a new shadow set"
    finally:
        gen.shutdown()


def _shm_files(group: str) -> set[str]:
    """The shared-memory buffer files of ``group``'s workers (actors/wire/zero_copy.py names them)."""
    name = re.compile(rf"realloc-p\d+-{re.escape(group)}-[0-9a-f]{{12}}-")
    return {f for f in os.listdir("/dev/shm") if name.match(f)}


def test_safe_point_switch_is_one_step_per_replica(trainer):
    gen = ModelGroup.create(SPEC, Topology(dp=2, tp=2), name="st-gen-sp", worker_cls=Gen)
    try:
        trainer.init_synthetic(6)
        trainer.copy_to(gen)
        old_version = gen.version
        trainer.init_synthetic(7)
        update = trainer.copy_to(gen, stage=True)
        update.wait()
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("steps", gen.call("loop", 30, 0.05, writes=False)))
        thread.start()
        time.sleep(0.4)  # the loop is running: the switch happens inside it
        update.commit(at="safe_point")
        assert gen.version == update.version
        thread.join(120)
        per_rank = result["steps"]
        switch_step = {}
        for rank, steps in enumerate(per_rank):
            versions = [v for _, v, _ in steps]
            assert versions[0] == old_version and versions[-1] == update.version, versions
            first_new = versions.index(update.version)
            assert all(v == update.version for v in versions[first_new:]), "a rank went back to the old version"
            switch_step[rank] = first_new
        for dp in range(2):  # the ranks of one replica switch at the same decode step
            ranks = [r for r in range(4) if gen.topology.coords4(r)[0] == dp]
            assert len({switch_step[r] for r in ranks}) == 1, switch_step
        assert all(s > 0 for s in switch_step.values()), f"no mid-call switch: {switch_step}"
        assert gen.verify_synthetic(7) == {}
        # the next call and a change of the group both find every worker switched
        assert {v for v, _ in gen.call("digest", writes=False)} == {update.version}
        gen.reallocate(Topology(tp=4))
        assert gen.verify_synthetic(7) == {}
    finally:
        gen.shutdown()


def test_next_call_switches_in_an_update_committed_at_safe_points(trainer):
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen-nc", worker_cls=Gen)
    try:
        trainer.init_synthetic(8)
        trainer.copy_to(gen)
        trainer.init_synthetic(9)
        update = trainer.copy_to(gen, stage=True)
        update.commit(at="safe_point")  # no call is running: the next call switches first
        statuses = [ray.get(a.stage_status.remote()) for a in gen.actors]
        assert all(s["staged"]["armed"] and not s["staged"]["switched"] for s in statuses)
        assert {v for v, _ in gen.call("digest", writes=False)} == {update.version}
        assert gen.verify_synthetic(9) == {}
    finally:
        gen.shutdown()


def test_staged_refusals_change_nothing(trainer):
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen-bad", worker_cls=Gen)
    try:
        trainer.init_synthetic(10)
        trainer.copy_to(gen)
        before = gen.activity()
        for bad, match in (
            (lambda: trainer.copy_to(gen, stage="yes"), "stage must be True or False"),
            (lambda: trainer.copy_to(gen, eta=0.5, stage=True), "cannot blend"),
            (lambda: gen.reallocate(Topology(tp=2), stage=True), "nothing to stage"),
            (lambda: gen.reallocate(Topology(dp=2), stage=True, keep="host"), "keep='in_place'"),
        ):
            with pytest.raises(ValueError, match=match):
                bad()
        assert gen.activity() == before
        trainer.init_synthetic(11)
        update = trainer.copy_to(gen, stage=True)
        update.wait()
        for timeout in ("5", float("inf"), 0, True):  # issue 36: a string was accepted by both
            with pytest.raises(
                ValueError, match=rf"timeout_s must be a finite positive number of seconds, got {timeout!r}"
            ):
                update.wait(timeout_s=timeout)
            with pytest.raises(
                ValueError, match=rf"timeout_s must be a finite positive number of seconds, got {timeout!r}"
            ):
                update.trace(timeout_s=timeout)
        with pytest.raises(ValueError, match="allowed: 'now', 'safe_point'"):
            update.commit(at="later")
        for change in (
            lambda: gen.reallocate(Topology(dp=2)),
            lambda: gen.init_synthetic(1),
            lambda: gen.call("digest", writes=True),
            lambda: trainer.copy_to(gen, stage=True),
            lambda: trainer.copy_to(gen),
        ):
            with pytest.raises(GroupBusyError, match="staged update"):
                change()
        assert gen.verify_synthetic(10) == {}  # reads are served; the serving weights are the old ones
        update.abort()
        assert update.state == "aborted"
        with pytest.raises(ValueError, match="aborted"):
            update.commit()
        assert all(ray.get(a.stage_status.remote())["staged"] is None for a in gen.actors)
        assert gen.verify_synthetic(10) == {}
        trainer.copy_to(gen)  # the group takes changes again
        assert gen.verify_synthetic(11) == {}
    finally:
        gen.shutdown()


def test_a_commit_that_cannot_take_the_group_leaves_the_update_staged(trainer):
    """``commit(at="now")`` waits for the destination's lock up to its ``timeout_s``. Past that:
    ``GroupBusyError``, nothing switched, and the update is still staged, to be committed again (or
    aborted). It used to be marked failed while the group kept it as its pending update, so the
    group refused every change from then on and the update could be neither committed nor
    aborted (found in review, 2026-11-28)."""
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen-busy", worker_cls=Gen, timeout_s=2.0)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # another operation holding the group (a call running past its timeout)
        with gen.ledger.exclusive("the test's long call", staged_ok=True):
            held.set()
            release.wait(60)

    try:
        trainer.init_synthetic(12)
        trainer.copy_to(gen)
        trainer.init_synthetic(13)
        update = trainer.copy_to(gen, stage=True)
        update.wait()
        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert held.wait(30)
        try:
            with pytest.raises(GroupBusyError, match=r"is still staged \(every worker serves version \d+\): commit"):
                update.commit(at="now")
        finally:
            release.set()
            holder.join(30)
        assert update.state == "staged" and gen.verify_synthetic(12) == {}
        update.commit(at="now")
        assert update.state == "committed" and gen.verify_synthetic(13) == {}
        gen.reallocate(Topology(dp=2))  # the group takes changes again
        assert gen.verify_synthetic(13) == {}
    finally:
        gen.shutdown()


def test_staged_move_to_a_kept_layout(cluster):
    group = ModelGroup.create(SPEC, Topology(tp=2), name="st-colocated", worker_cls=Gen)
    try:
        group.init_synthetic(12)
        group.reallocate(Topology(dp=2), keep="in_place")
        group.reallocate(Topology(tp=2), keep="in_place")
        group.init_synthetic(13)  # the kept dp=2 layout is stale now
        update = group.reallocate(Topology(dp=2), stage=True, keep="in_place")
        update.wait()
        assert group.layout.topology == Topology(tp=2)  # serving in its layout while the other is staged
        with pytest.raises(GroupBusyError):
            group.call("digest", writes=True)  # its weights are the update's source
        assert len(group.call("digest", writes=False)) == 2
        update.commit()
        assert group.layout.topology == Topology(dp=2)
        assert group.verify_synthetic(13) == {}
        kept = {r.layout.topology: r for r in group.resident_layouts()}
        assert kept[Topology(tp=2)].fresh
        back = group.reallocate(Topology(tp=2))
        assert back.resident_use == "adopted" and group.verify_synthetic(13) == {}
    finally:
        group.shutdown()


def test_versions_in_stats_hooks_and_contexts(trainer):
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen-v", worker_cls=Gen)
    try:
        trainer.init_synthetic(14)
        trainer.run(lambda ctx: None)  # a write: the trainer's version moves on
        stats = trainer.copy_to(gen)
        assert stats.version == gen.version == trainer.version
        assert {v for v, _ in gen.call("digest", writes=False)} == {gen.version}
        gen.call("digest")  # writes=True by default: the generator's own version moves past its source's
        assert gen.version == trainer.version + 1
        stats = trainer.copy_to(gen)  # versions never go back
        assert stats.version == gen.version == trainer.version + 2
        assert all(seen[-1][:2] == ("copy", gen.version) for seen in gen.call("seen", writes=False))
    finally:
        gen.shutdown()


def test_the_hook_sees_one_version_per_change(trainer):
    """Issue 36: ``on_shards_changed(ctx, change)`` saw ``ctx.version`` 0 and ``change.version`` 1
    after ``init_synthetic``, 1 and 2 after a plain ``copy_to`` (the worker still had the version
    of its last call); after every kind of change both are the group's version now."""
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen-1v", worker_cls=Gen)
    try:
        gen.init_synthetic(20)
        trainer.init_synthetic(21)
        trainer.copy_to(gen)
        gen.reallocate(Topology(dp=2))
        trainer.run(lambda ctx: None)  # a write: the trainer's version moves on
        update = trainer.copy_to(gen, stage=True)
        update.wait()
        update.commit()
        gen.init_synthetic(22)
        for seen in gen.call("seen", writes=False):
            assert [kind for kind, _, _ in seen] == ["create", "fill", "copy", "reallocate", "copy", "fill"]
            assert [change for _, change, _ in seen] == [ctx for _, _, ctx in seen], seen
            assert seen[-1][1] == gen.version
    finally:
        gen.shutdown()


def test_reads_after_a_safe_point_commit_see_the_committed_version(trainer):
    """Reading the weights outside a call (verify, shard_boxes, state_dict) after
    ``commit(at="safe_point")`` and before any call must see the committed version, not the old
    buffers the workers still served (found by tests/test_fleet_ray.py: verify read old weights)."""
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen-rd", worker_cls=Gen)
    try:
        trainer.init_synthetic(15)
        trainer.copy_to(gen)
        trainer.init_synthetic(16)
        update = trainer.copy_to(gen, stage=True)
        update.commit(at="safe_point")
        assert gen.version == update.version
        assert gen.verify_synthetic(16) == {}
        expected = trainer.state_dict()
        assert all(torch.equal(expected[k], v) for k, v in gen.state_dict().items())
    finally:
        gen.shutdown()


def test_the_version_is_read_when_the_source_is_held(cluster):
    """A staged copy issued while the source runs a write must carry the version of what it sends:
    the source is held from the moment the version is read (before, the version was read when
    ``copy_to`` returned, the weights when the staging thread got the source: the generator held
    the written weights under the version from before the write)."""
    trainer = ModelGroup.create(SPEC, Topology(tp=2), name="st-trainer-w", worker_cls=Trainer)
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen-w", worker_cls=Gen)
    try:
        trainer.init_synthetic(17)
        trainer.copy_to(gen)
        trainer.run(lambda ctx: None)
        trainer.run(lambda ctx: None)  # the trainer two versions ahead of the generator
        writer = threading.Thread(target=lambda: trainer.call("slow_double", 1.5))
        writer.start()
        time.sleep(0.5)  # the write is running
        update = trainer.copy_to(gen, stage=True)
        update.commit()
        writer.join(60)
        assert update.version == gen.version == trainer.version
        expected = trainer.state_dict()
        assert all(torch.equal(expected[k], v) for k, v in gen.state_dict().items())
    finally:
        trainer.shutdown()
        gen.shutdown()


def test_trim_frees_the_shadow_set_and_a_recopy_keeps_the_version(trainer):
    """A copy of the weights the destination already holds (same source version, nothing written
    since) keeps its version (before: every copy moved it on, so a generator's version drifted
    away from its trainer's); ``trim_memory`` frees the spare shadow set (before: nothing could)."""
    gen = ModelGroup.create(SPEC, Topology(tp=2), name="st-gen-t", worker_cls=Gen)
    try:
        trainer.init_synthetic(18)
        trainer.copy_to(gen)
        assert gen.version == trainer.version
        assert trainer.copy_to(gen).version == gen.version == trainer.version
        update = trainer.copy_to(gen, stage=True)
        update.commit()
        assert update.version == gen.version == trainer.version
        files = _shm_files("st-gen-t")
        shadow = update.stats.shadow_bytes_per_actor
        assert gen.trim_memory() >= shadow * gen.num_workers
        assert len(_shm_files("st-gen-t")) < len(files)
        trainer.init_synthetic(19)
        trainer.copy_to(gen, stage=True).commit()  # a new shadow set is allocated again
        assert gen.verify_synthetic(19) == {} and gen.version == trainer.version
    finally:
        gen.shutdown()
