"""Lanes (actors/lanes.py) without Ray: the lane values, ``World.form`` calling the lane's methods
on fake actor handles, and a worker's per-lane state (``WorkerState.lanes``)."""

from __future__ import annotations

import pickle

import pytest
import torch

import actors.driver.world as world_module
from actors.driver.world import World
from actors.errors import StaleOperationError
from actors.lanes import CONCURRENCY_GROUPS, LANES, MOVE, STAGE, Lane
from actors.remote import Workers
from actors.wire.executor import Phases, Staging
from actors.worker import RESERVED_METHODS, ShardWorker, WorkerState
from actors.worker.state import LaneState


def test_the_lanes_differ_in_group_and_prefix_and_survive_pickling():
    assert LANES == (MOVE, STAGE)
    assert MOVE.concurrency_group is None  # the default thread: the protocol's steps
    assert STAGE.concurrency_group in CONCURRENCY_GROUPS  # a group every worker class declares
    assert MOVE.prefix != STAGE.prefix and MOVE.name != STAGE.name
    for lane in LANES:  # a lane crosses the Ray boundary: the same lane (and dict key) on the worker
        back = pickle.loads(pickle.dumps(lane))
        assert back == lane and hash(back) == hash(lane) and {lane: 1}[back] == 1
    with pytest.raises(AttributeError):  # a value, not a bag of settings
        MOVE.prefix = "x"  # type: ignore[misc]


class _Method:
    def __init__(self, actor: "_Actor", name: str, group: str | None = None):
        self.actor, self.name, self.group = actor, name, group

    def options(self, **options):
        assert set(options) == {"concurrency_group"}, options
        return _Method(self.actor, self.name, options["concurrency_group"])

    def remote(self, *args):
        self.actor.calls.append((self.name, self.group, args))
        return ("addr", 1234) if self.name == "open_rendezvous" else "gloo"


class _Actor:
    """A fake actor handle: records ``(method, concurrency group, args)`` of each call."""

    def __init__(self, actor_id: str):
        self._actor_id = actor_id
        self.calls: list = []

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)


@pytest.fixture
def fake_ray(monkeypatch):
    """``World.form`` over fake handles: ``gather`` hands back what the fake calls returned."""
    monkeypatch.setattr(world_module, "gather", lambda workers, refs, *args, **kwargs: list(refs))
    monkeypatch.setattr(world_module, "_LIVE", {lane: type(live)() for lane, live in world_module._LIVE.items()})


def _workers(*ids: str) -> Workers:
    return Workers(tuple(_Actor(i) for i in ids), tuple(f"w{i}" for i in ids))


@pytest.mark.parametrize("lane", LANES, ids=lambda lane: lane.name)
def test_world_form_calls_the_lanes_methods_on_its_group(fake_ray, lane: Lane):
    workers = _workers("a", "b", "c")
    world = World.form(workers, lane, timeout_s=5.0)
    assert world.lane == lane and world.backend == "gloo" and world.alive
    head = workers.actors[0]
    assert head.calls[0] == ("open_rendezvous", lane.concurrency_group, (lane, 3, 5.0, world.id))
    for rank, actor in enumerate(workers.actors):
        joins = [c for c in actor.calls if c[0] == "join"]
        assert joins == [("join", lane.concurrency_group, (lane, world.id, "addr", 1234, rank, 3, 5.0))]
        assert world.rank_of(actor) == rank
    assert {c[0] for a in workers.actors for c in a.calls} == {"open_rendezvous", "join"}  # no stage_* twins


def test_a_lane_breaks_only_its_own_worlds(fake_ray):
    workers = _workers("a", "b")
    move, staged = World.form(workers, MOVE, 5.0), World.form(workers, STAGE, 5.0)
    assert move.alive and staged.alive  # a staged world is a slot of its own: the move's world stays
    again = World.form(workers.subset([1]), STAGE, 5.0)  # shares actor b with the staged world
    assert not staged.alive and again.alive and move.alive


def test_stage_methods_run_on_the_stage_group_and_rendezvous_methods_are_one_per_lane():
    for name in ("stage_run", "stage_arm", "stage_abort"):
        assert getattr(ShardWorker, name).__ray_concurrency_group__ == STAGE.concurrency_group, name
    for name in ("open_rendezvous", "join"):  # dispatched on the lane's group at run time (World.form)
        assert not hasattr(getattr(ShardWorker, name), "__ray_concurrency_group__"), name
    assert {"open_rendezvous", "join"} <= RESERVED_METHODS
    assert not {"stage_open_rendezvous", "stage_join"} & RESERVED_METHODS


class _Transport:
    closed = False
    backend = "gloo"

    def close(self) -> None:
        self.closed = True


def _worker() -> ShardWorker:
    """A worker object with only the state the lane paths read (no Ray, no buffers)."""
    st = WorkerState.__new__(WorkerState)
    st.group = "g"
    st.lanes = {lane: LaneState(Staging(torch.device("cpu"))) for lane in LANES}
    worker = ShardWorker.__new__(ShardWorker)
    worker._realloc = st
    return worker


def test_a_worker_keeps_each_lanes_world_timeline_and_staging_apart():
    worker = _worker()
    st = worker._realloc
    assert st.lanes[MOVE].staging is not st.lanes[STAGE].staging  # a staged transfer never packs into a move's
    stage = st.lanes[STAGE]
    stage.transport, stage.world_id = _Transport(), "s1"
    assert worker._check_world("s1", STAGE) is stage
    with pytest.raises(StaleOperationError, match=r"is in world None of the move lane, not s1"):
        worker._check_world("s1")  # the move lane is in no world: the staged world is not its
    with pytest.raises(StaleOperationError, match=r"is in world s1 of the stage lane, not m1"):
        worker._check_world("m1", STAGE)
    st.lanes[MOVE].phases, stage.phases = Phases("move-op"), Phases("update")
    stage.phases.mark("convert")
    assert worker.last_trace()["op"] == "move-op"  # the default: the move lane
    staged = worker.last_trace(pickle.loads(pickle.dumps(STAGE)))
    assert staged["op"] == "update" and "clock" in staged
    assert "convert" not in worker.last_phases()  # the stage lane's marks stay on its own timeline
    transport = stage.transport
    stage.leave()
    assert transport.closed and stage.transport is None and stage.world_id is None


def test_an_unknown_lane_is_refused_by_name():
    worker = _worker()
    with pytest.raises(ValueError, match=r"unknown lane Lane\(side\); allowed: Lane\(move\), Lane\(stage\)"):
        worker.last_trace(Lane("side", None, "x"))
