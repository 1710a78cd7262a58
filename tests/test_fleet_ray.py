"""An elastic rollout fleet with real Ray actors (actors/driver/fleet.py): replicas updated as one while
they serve, and a replica that joins mid-run seeded from the serving replicas, not the trainer.
A replica dying during an update: tests/test_staged_faults_ray.py."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import ray
from simulated import simulated_cluster, wait_for_dead_workers

from actors import Fleet, GroupBusyError, ModelGroup, ReallocationError, ShardWorker
from actors.driver.fleet import FleetUpdate
from actors.driver.staged import StagedUpdate
from actors.lanes import STAGE
from realloc import ModelSpec, Topology

pytestmark = pytest.mark.slow
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

SPEC = ModelSpec.preset("tiny")


class Replica(ShardWorker):
    def digest(self):
        ctx = self.context()
        return ctx.version, float(sum(t.double().abs().sum() for t in ctx.tensors.values()))

    def generate(self, steps: int):
        ctx = self.context()
        versions = []
        for _ in range(steps):
            ctx.safe_point()
            versions.append(ctx.version)
            time.sleep(0.02)
        return versions


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(nodes=2, cpus_per_node=4) as c:
        yield c


def _serving(replicas, stop: threading.Event, calls: dict, errors: list, method=("digest",)) -> list[threading.Thread]:
    def loop(group):
        while not stop.is_set():
            try:
                calls.setdefault(group.name, []).append(group.call(*method, writes=False))
            except Exception as err:  # noqa: BLE001 - the test asserts there were none
                errors.append((group.name, err))
                return

    threads = [threading.Thread(target=loop, args=(g,), daemon=True) for g in replicas]
    for t in threads:
        t.start()
    return threads


def test_fleet_updates_while_serving_and_a_joining_replica_is_seeded_from_the_fleet(cluster):
    trainer = ModelGroup.create(SPEC, Topology(dp=2), name="fl-trainer")
    replicas = [ModelGroup.create(SPEC, Topology(tp=2), name=f"fl-r{i}", worker_cls=Replica) for i in range(2)]
    late = None
    try:
        with pytest.raises(ValueError, match="one or more ModelGroups"):
            Fleet([])
        with pytest.raises(ValueError, match="each replica group once"):
            Fleet([replicas[0], replicas[0]])
        fleet = Fleet(replicas)
        with pytest.raises(ValueError, match="is a replica of this fleet"):
            fleet.stage(replicas[0])

        trainer.init_synthetic(21)
        first = fleet.stage(trainer)
        assert set(first.wait()) == {"fl-r0", "fl-r1"}
        assert first.commit(at="now") == ["fl-r0", "fl-r1"]
        assert fleet.version == trainer.version and all(r.verify_synthetic(21) == {} for r in replicas)

        # the replicas generate continuously; the next version switches in at their safe points
        stop, calls, errors = threading.Event(), {}, []
        threads = _serving(replicas, stop, calls, errors, ("generate", 20))
        trainer.init_synthetic(22)
        update = fleet.stage(trainer)
        update.wait()
        assert update.commit(at="safe_point") == ["fl-r0", "fl-r1"]
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(60)
        assert errors == []
        assert fleet.version == trainer.version == update.version
        assert all(r.verify_synthetic(22) == {} for r in replicas)
        for name, batches in calls.items():  # every rank of a replica: the same version at every step
            for per_rank in batches:
                assert all(steps == per_rank[0] for steps in per_rank), (name, per_rank)
        assert any(update.version in per_rank[0] for batches in calls.values() for per_rank in batches)

        # a replica joins while the two serve: seeded from them, the trainer sends nothing
        late = ModelGroup.create(SPEC, Topology(tp=2), name="fl-r2", worker_cls=Replica)
        trainer_activity = trainer.activity()
        stop, calls, errors = threading.Event(), {}, []
        threads = _serving(replicas, stop, calls, errors)
        time.sleep(0.3)
        stats = fleet.join(late)
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(60)
        assert errors == [], errors
        assert all(len(calls[r.name]) > 0 for r in replicas)
        assert trainer.activity() == trainer_activity  # no byte from the trainer
        source = stats.transition.split("[")[0]
        assert source in ("fl-r0", "fl-r1") and stats.version == fleet.version
        assert fleet.names == ["fl-r0", "fl-r1", "fl-r2"] and late.version == fleet.version
        reference = replicas[0].state_dict()
        joined = late.state_dict()
        assert all(bool((reference[k] == joined[k]).all()) for k in reference)  # bit-exact
        assert late.verify_synthetic(22) == {}

        # the next update reaches all three
        trainer.init_synthetic(23)
        update = fleet.stage(trainer)
        assert update.commit() == ["fl-r0", "fl-r1", "fl-r2"]
        assert all(r.verify_synthetic(23) == {} for r in fleet.replicas)
        with pytest.raises(ValueError, match="already a replica"):
            fleet.join(late)
    finally:
        for g in [trainer, *replicas, *([late] if late is not None else [])]:
            g.shutdown()


def test_idle_replicas_take_the_next_update_over_one_world(cluster):
    """Two updates committed at safe points in a row, with no call between them: the replicas are
    idle, not broken; the second update switches the first in and goes on (before, the fleet
    dropped both). Every update runs over one staged world of the trainer and all replicas."""
    trainer = ModelGroup.create(SPEC, Topology(dp=2), name="fl-idle-trainer")
    replicas = [ModelGroup.create(SPEC, Topology(tp=2), name=f"fl-idle-r{i}", worker_cls=Replica) for i in range(2)]
    try:
        fleet = Fleet(replicas)
        worlds = []
        for seed in (31, 32, 33):
            trainer.init_synthetic(seed)
            update = fleet.stage(trainer)
            assert update.commit(at="safe_point") == ["fl-idle-r0", "fl-idle-r1"], update.errors
            assert update.version == trainer.version == fleet.version
            worlds.append(trainer.worlds[STAGE].id)
            assert all(r.worlds[STAGE] is trainer.worlds[STAGE] for r in replicas)
        assert fleet.dropped == []
        assert len(set(worlds)) == 1, "each update formed a new staged world"
        assert all(r.verify_synthetic(33) == {} for r in replicas)
    finally:
        for g in [trainer, *replicas]:
            g.shutdown()


def test_a_fleet_update_that_staged_no_replica_is_an_error_not_a_success(cluster, monkeypatch):
    """Issue 36, defect 5: an update that updated no replica returned from ``wait()`` as if it had
    succeeded (``{}``). Now it raises, saying why each replica got nothing: here the only replica
    died (dropped), and then a defect inside the staging thread (a failing ping) that used to end
    the thread silently. Nothing of the replicas changes either way."""
    trainer = ModelGroup.create(SPEC, Topology(dp=2), name="fl-none-trainer")
    alive = ModelGroup.create(SPEC, Topology(tp=2), name="fl-none-alive")
    lost = ModelGroup.create(SPEC, Topology(tp=2), name="fl-none-lost")
    spare = ModelGroup.create(SPEC, Topology(tp=2), name="fl-none-spare")
    try:
        trainer.init_synthetic(41)
        alive.init_synthetic(40)
        lost.init_synthetic(40)
        fleet = Fleet([lost])
        ray.kill(lost.actors[1])
        wait_for_dead_workers(lost)
        update = fleet.stage(trainer)
        with pytest.raises(ReallocationError, match=r"staged no replica.*dropped from the fleet: \['fl-none-lost'\]"):
            update.wait()
        assert fleet.replicas == [] and update.updates == {}

        fleet = Fleet([alive])
        before = alive.version

        def broken_ping(replicas):
            raise RuntimeError("ping failed")

        monkeypatch.setattr("actors.driver.fleet._ping", broken_ping)
        failed = fleet.stage(trainer)
        with pytest.raises(ReallocationError, match=r"failed on the driver \(RuntimeError: ping failed\)"):
            failed.wait()
        assert fleet.replicas == [alive] and alive.version == before
        assert alive.verify_synthetic(40) == {}
        # the failed update has ended: nothing to commit, nothing to abort, and the same fleet takes
        # the next update (it used to refuse every later stage and join: found in review, 2026-11-28)
        monkeypatch.undo()
        assert failed.ended
        failed.abort()  # nothing was staged: nothing to drop
        assert fleet.stage(trainer).commit(at="now") == ["fl-none-alive"]
        assert alive.verify_synthetic(41) == {}
        alive.init_synthetic(40)
        before = alive.version

        # a defect in a relay round, after the trainer staged the first replica: that staged set is
        # dropped too, and nothing switches in (before relays, the message said none was staged)
        monkeypatch.undo()
        spare.init_synthetic(40)
        real = FleetUpdate._stage_one

        def broken_relay(self, replica, relay):
            if relay is not None:
                raise RuntimeError("relay defect")
            return real(self, replica, relay)

        monkeypatch.setattr(FleetUpdate, "_stage_one", broken_relay)
        fleet = Fleet([alive, spare])
        with pytest.raises(ReallocationError, match=r"\(RuntimeError: relay defect\); no replica switched"):
            fleet.stage(trainer).commit()
        assert fleet.replicas == [alive, spare] and alive.version == before
        assert all(ray.get(a.stage_status.remote(), timeout=60)["staged"] is None for a in alive.actors)
        assert alive.verify_synthetic(40) == {} and spare.verify_synthetic(40) == {}
    finally:
        for g in (trainer, alive, lost, spare):
            g.shutdown()


def test_a_fleet_update_sends_each_byte_out_of_the_trainer_once(cluster, monkeypatch):
    """Issue 39 item 2: the trainer stages one replica; the staged replicas relay their staged sets
    (not what they serve) to the others, doubling each round, across layouts and nodes, while the
    trainer is free again. Before, the trainer sent the model once per replica (4x its bytes for 4
    replicas), held the whole time; now once, held for its one transfer."""
    trainer = ModelGroup.create(SPEC, Topology(dp=2), name="fl-once-trainer")
    layouts = [Topology(tp=2), Topology(), Topology(tp=2), Topology()]
    replicas = [ModelGroup.create(SPEC, t, name=f"fl-once-r{i}", worker_cls=Replica) for i, t in enumerate(layouts)]
    try:
        for r in replicas:
            r.init_synthetic(50)
        fleet = Fleet(replicas)
        trainer.init_synthetic(51)
        served = {r.name: r.call("digest", writes=False) for r in replicas}
        real, held = FleetUpdate._stage_one, []

        def stage_one(self, replica, relay):
            if relay is not None:  # a relay: is the trainer free (its training step could run now)?
                free = self.source.ledger._lock.acquire(timeout=0)
                if free:
                    self.source.ledger._lock.release()
                held.append(not free)
            return real(self, replica, relay)

        monkeypatch.setattr(FleetUpdate, "_stage_one", stage_one)
        update = fleet.stage(trainer)
        stats = update.wait()
        assert held == [False, False, False]  # three relays, the trainer free during each
        # staged, not switched: every replica still serves the weights it served
        assert {r.name: r.call("digest", writes=False) for r in replicas} == served
        names = [r.name for r in replicas]
        assert update.source_sends == 1
        assert update.relayed_from[names[0]] == "fl-once-trainer"
        assert update.relayed_from[names[1]] == names[0]  # round 1: one relay
        assert {update.relayed_from[names[2]], update.relayed_from[names[3]]} == {names[0], names[1]}  # round 2
        sent = {n: s.bytes_intra_node + s.bytes_inter_node + s.bytes_local for n, s in stats.items()}
        # each replica receives the model once (tp=2 with its vocabulary padding)...
        assert sent[names[1]] == sent[names[3]] == SPEC.total_bytes() and sent[names[0]] == sent[names[2]], sent
        from_trainer = [n for n in names if update.relayed_from[n] == "fl-once-trainer"]
        assert sum(sent[n] for n in from_trainer) == sent[names[0]]  # ...and the trainer sends it once
        assert update.commit(at="now") == names
        assert all(r.verify_synthetic(51) == {} for r in replicas)
        # the weights of the trainer's version, and one version number everywhere (max(own + 1, the trainer's))
        assert update.version == trainer.version and {r.version for r in replicas} == {trainer.version + 1}

        # Every relay lost (made to fail here) after the trainer moved on: the trainer is not asked
        # again for weights of another version; the replicas left keep serving what they served.
        def relay_lost(self, replica, relay):
            if relay is None:
                return real(self, replica, relay)
            trainer.init_synthetic(53)  # the trainer is free: its next step runs
            return relay.dest

        monkeypatch.setattr(FleetUpdate, "_stage_one", relay_lost)
        trainer.init_synthetic(52)
        update = fleet.stage(trainer)
        assert list(update.wait()) == [names[0]] and update.source_sends == 1
        assert sorted(update.skipped) == sorted(names[1:]) and set(update.errors) == set(names[1:])
        assert "holds version" in str(update.errors[names[1]]) and fleet.replicas == replicas
        assert update.commit(at="now") == [names[0]]
        assert replicas[0].verify_synthetic(52) == {} and all(r.verify_synthetic(51) == {} for r in replicas[1:])

        # A replica whose staged update ends busy (GroupBusyError from its wait: nothing staged) is
        # skipped and left out of the update: not reported staged, not committed. Before, its
        # failed update stayed among the staged ones (wait() gave it no stats and commit() tried it).
        monkeypatch.setattr(FleetUpdate, "_stage_one", real)
        real_wait = StagedUpdate.wait

        def busy_wait(self, timeout_s=None):
            if self.dest.name == names[3]:
                raise GroupBusyError(f"{names[3]!r} changed after the update was planned from it", layout="")
            return real_wait(self, timeout_s)

        monkeypatch.setattr(StagedUpdate, "wait", busy_wait)
        trainer.init_synthetic(54)
        update = fleet.stage(trainer)
        assert sorted(update.wait()) == sorted(names[:3]) and update.skipped == [names[3]]
        assert names[3] not in update.updates and names[3] not in update.relayed_from
        assert update.commit(at="now") == names[:3]
        assert all(r.verify_synthetic(54) == {} for r in replicas[:3]) and replicas[3].verify_synthetic(51) == {}
    finally:
        for g in [trainer, *replicas]:
            g.shutdown()


def test_copy_to_several_groups_sends_each_byte_out_of_the_source_once_and_switches_all_or_none(cluster, monkeypatch):
    """Issue 39 item 2: ``copy_to([a, b, c])`` is one copy: the source sends the model once, the
    staged groups relay to the others, and every group switches, or (one could not be staged)
    none does. Before, ``copy_to`` took one group: a copy into three sent the model three times."""
    import pickle

    trainer = ModelGroup.create(SPEC, Topology(), name="cp-trainer")
    layouts = [Topology(tp=2), Topology(), Topology()]
    groups = [ModelGroup.create(SPEC, t, name=f"cp-g{i}", worker_cls=Replica) for i, t in enumerate(layouts)]
    names = [g.name for g in groups]
    try:
        for g in groups:
            g.init_synthetic(60)
        trainer.init_synthetic(61)
        for bad, match in (
            ([], "one or more ModelGroups"),
            ([groups[0], groups[0]], "each replica group once"),
            ([groups[0], trainer], "lists the source"),
            ([groups[0], "cp-g1"], "copies into ModelGroups, got str"),
        ):
            with pytest.raises(ValueError, match=match):
                trainer.copy_to(bad)
        for kwargs in ({"eta": 0.5}, {"stage": True}, {"delta": True}):
            with pytest.raises(ValueError, match=f"takes no {next(iter(kwargs))}"):
                trainer.copy_to(groups, **kwargs)
        assert all(g.verify_synthetic(60) == {} for g in groups)  # refused before any traffic

        stats = trainer.copy_to(groups)
        assert list(stats) == names
        assert all(g.verify_synthetic(61) == {} for g in groups)
        assert {g.version for g in groups} == {trainer.version + 1} == {s.version for s in stats.values()}
        sender = {n: s.transition.split("[")[0] for n, s in stats.items()}
        assert sender[names[0]] == "cp-trainer" and sender[names[1]] == names[0]
        assert sender[names[2]] in names[:2]  # round 2: from a relay, not the trainer
        moved = {n: s.bytes_intra_node + s.bytes_inter_node + s.bytes_local for n, s in stats.items()}
        assert sum(b for n, b in moved.items() if sender[n] == "cp-trainer") == moved[names[0]]  # sent once

        # One group dead: the others were staged, but none switches; the trainer is untouched.
        ray.kill(groups[2].workers.actors[0])
        wait_for_dead_workers(groups[2])
        trainer.init_synthetic(62)
        with pytest.raises(ReallocationError, match="no group switched: every group keeps its previous") as err:
            trainer.copy_to(groups)
        assert groups[2].workers.names[0] in err.value.dead
        again = pickle.loads(pickle.dumps(err.value))
        assert again.message == err.value.message and again.dead == err.value.dead
        assert all(g.verify_synthetic(61) == {} for g in groups[:2]) and trainer.verify_synthetic(62) == {}
        assert {g.version for g in groups[:2]} == {stats[names[0]].version}
        assert trainer.copy_to(groups[:2])[names[1]].version > stats[names[0]].version  # usable after the refusal
        assert all(g.verify_synthetic(62) == {} for g in groups[:2])

        # A switch that fails after another group switched (rolled back, as a commit that fails
        # before its workers adopt): the error says which group holds which weights.
        commit = StagedUpdate.commit

        def failing(update, at="now"):
            if update.dest is groups[1]:
                update.abort()
                raise ReallocationError(f"{update.dest.name}: its switch failed (injected)")
            return commit(update, at=at)

        monkeypatch.setattr(StagedUpdate, "commit", failing)
        trainer.init_synthetic(63)
        with pytest.raises(ReallocationError, match=r"but \['cp-g1'\] failed to switch; \['cp-g0'\] switched") as err:
            trainer.copy_to(groups[:2])
        assert "(injected)" in err.value.message
        assert groups[0].verify_synthetic(63) == {} and groups[1].verify_synthetic(62) == {}
    finally:
        for g in [trainer, *groups]:
            g.shutdown()
