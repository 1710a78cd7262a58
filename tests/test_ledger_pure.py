"""actors.driver.ledger.GroupLedger without a Ray cluster: a group's version, origin, layout, kept
layouts, delta bookkeeping and pending staged update, as its transitions leave them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from actors import metrics
from actors.config import GroupConfig
from actors.driver.ledger import GroupLedger
from actors.errors import GroupBusyError
from actors.records import DeltaOrder, KeepOrder, ResidentLayout, ShardChange
from actors.remote import Deadline
from realloc import ModelSpec, Topology
from realloc.layout import Layout

SPEC = ModelSpec.preset("tiny")
TRAIN = Layout(SPEC, Topology(dp=1, tp=2, pp=2))
GEN = Layout(SPEC, Topology(dp=2, tp=2))


@pytest.fixture(autouse=True)
def versions(monkeypatch):
    """The versions the ledger reports to the metrics, in order (no Ray session needed)."""
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(metrics, "record_version", lambda model, version: seen.append((model, version)))
    return seen


def ledger(name: str = "g", layout: Layout = TRAIN, **config) -> GroupLedger:
    return GroupLedger(name, layout, GroupConfig(timeout_s=5.0, **config), lambda: [])


class FakeUpdate:
    """What the ledger reads of a ``StagedUpdate`` (its public attributes), and its switch."""

    def __init__(self, state: str = "staging", label: str = "u", **fields):
        self.state, self.label, self.id, self.known_version = state, label, f"id-{label}", "pending"
        self.switches = 0
        self.__dict__.update(fields)

    def finish_switch(self, deadline: Deadline) -> None:
        self.switches += 1


def test_a_new_ledger_holds_its_layout_at_version_0_copy_of_nobody():
    g = ledger()
    assert (g.layout, g.version, g.origin, g.sent, g.deltas, g.staged) == (TRAIN, 0, None, None, 0, None)
    assert g.resident_layouts() == [] and not g.closed


def test_changes_move_the_version_on_except_a_creation_and_a_move(versions):
    g = ledger()
    assert g.changed(ShardChange("create", TRAIN)).version == 0
    assert g.changed(ShardChange("fill", TRAIN, TRAIN)).version == 1
    g.copied(("policy", 7))
    assert g.changed(ShardChange("copy", TRAIN, TRAIN, version=7)).version == 7
    assert g.origin == ("policy", 7)  # a copy keeps the origin it landed with
    assert g.changed(ShardChange("reallocate", GEN, TRAIN)).version == 7
    assert g.origin == ("policy", 7)  # a move does not change the weights
    assert g.changed(ShardChange("load", GEN, GEN)).version == 8 and g.origin is None
    assert versions == [("g", 0), ("g", 1), ("g", 7), ("g", 7), ("g", 8)]


def test_copy_versions_never_go_back_and_a_copy_of_the_same_weights_keeps_its_version():
    source, dest = ledger("policy"), ledger("ref")
    for _ in range(3):
        source.changed(ShardChange("fill", TRAIN, TRAIN))
    assert dest.copy_version(source) == 3
    assert source.copied_version(dest) is None
    dest.copied((source.name, source.version))
    dest.changed(ShardChange("copy", TRAIN, TRAIN, version=dest.copy_version(source)))
    assert (dest.version, source.copied_version(dest)) == (3, 3)
    assert dest.copy_version(source) == 3  # the very weights it holds: same version
    with dest.writes("call", True):
        pass
    assert (dest.version, dest.origin, source.copied_version(dest)) == (4, None, None)
    assert dest.copy_version(source) == 5  # ahead of the source: the next one


def test_a_call_that_writes_moves_the_version_on_even_when_it_fails_and_one_that_does_not_keeps_it():
    g = ledger()
    g.copied(("policy", 0))
    with g.writes("call", False):
        pass
    assert (g.version, g.origin) == (0, ("policy", 0))
    with pytest.raises(RuntimeError):
        with g.writes("call", True):
            raise RuntimeError("the user's code failed")
    assert (g.version, g.origin) == (1, None)


@pytest.mark.parametrize("state", ["staging", "staged", "committing"])
def test_a_pending_staged_update_refuses_writes_and_changes_with_nothing_changed(state):
    g = ledger()
    update = FakeUpdate()
    g.begin_stage(update)
    update.state = state
    with pytest.raises(GroupBusyError, match="staged update pending"):
        with g.writes("call", True):
            pass
    with pytest.raises(GroupBusyError, match="staged update pending"):
        with g.exclusive("reallocate"):
            pass
    assert (g.version, g.staged, update.switches) == (0, update, 0)
    with g.exclusive("read", staged_ok=True):  # calls and reads still run
        pass
    with pytest.raises(GroupBusyError, match="busy with staged update u"):
        g.begin_stage(FakeUpdate(label="second"))
    g.end_stage(update)
    assert g.staged is None


def test_an_update_committed_at_safe_points_is_switched_in_before_a_change_and_ends_with_the_switching_call():
    g = ledger()
    update = FakeUpdate()
    g.begin_stage(update)
    update.state = "committed"
    assert g.switch_flag() == update.id
    with g.exclusive("reallocate"):  # a change switches it in everywhere first
        pass
    assert update.switches == 1
    g.settle_switch()
    assert update.switches == 2
    g.switched("another id")
    assert g.staged is update
    g.switched(update.id)
    assert g.staged is None and g.switch_flag() is None


def test_a_staged_update_cannot_start_while_a_change_or_a_write_runs():
    g = ledger()
    with g.exclusive("reallocate"):
        with pytest.raises(GroupBusyError, match="another operation or a call that writes"):
            g.begin_stage(FakeUpdate())
    with g.writes("call", True):
        with pytest.raises(GroupBusyError, match="another operation or a call that writes"):
            g.begin_stage(FakeUpdate())
    g.begin_stage(FakeUpdate())  # both over: the counters went back to 0


def test_a_shut_down_group_refuses_operations_and_staged_updates():
    g = ledger()
    with g.closing():
        pass
    assert g.closed
    with pytest.raises(ValueError, match="was shut down"):
        with g.exclusive("reallocate"):
            pass
    with pytest.raises(ValueError, match="was shut down"):
        g.begin_stage(FakeUpdate())


def test_a_move_keeps_the_layout_left_and_makes_a_kept_target_current(versions):
    g = ledger()
    g.moved(GEN, ResidentLayout(TRAIN, 0, "in_place", 100))
    assert g.layout == GEN and g.kept(TRAIN).version == 0
    assert [r.fresh for r in g.resident_layouts()] == [True]
    g.changed(ShardChange("fill", GEN, GEN))
    assert [r.fresh for r in g.resident_layouts()] == [False] and g.resident_known() == [(TRAIN, 0)]
    g.moved(TRAIN, None)  # back to the kept layout: it is the current one, no longer kept
    assert (g.layout, g.kept_layouts()) == (TRAIN, [])
    g.moved(GEN, ResidentLayout(TRAIN, 1, "host", 100))
    g.release([TRAIN])
    assert g.kept_layouts() == []
    g.moved(TRAIN, ResidentLayout(GEN, 1, "host", 100))
    g.copied(("policy", 1))
    assert (g.unready, g.user_groups_broken) == (frozenset(), False)
    g.workers_replaced([2, 5])
    assert (g.kept_layouts(), g.origin, g.sent) == ([], None, None)
    assert (g.unready, g.user_groups_broken) == ({2, 5}, True)  # set up, and the user groups re-formed, next
    g.replacements_ready()
    g.user_groups_formed()
    assert (g.unready, g.user_groups_broken) == (frozenset(), False)


def test_delta_bookkeeping_anchor_then_deltas_then_an_anchor_every_nth_and_after_a_failure():
    source, dest = ledger("policy", delta="host", delta_anchor_every=3), ledger("gen")
    assert source.delta_order(False, dest, None) is None
    first = source.delta_order(True, dest, None)
    assert first == DeltaOrder(None, 0, "host")  # no base yet: an anchor
    source.delta_done(TRAIN, dest, first, True)
    assert (source.sent, dest.deltas) == ((TRAIN, 0), 0)
    assert source.delta_order(True, dest, None).base is None  # dest is not known to hold version 0
    second = source.delta_order(True, dest, 0)
    assert second.base == 0
    source.delta_done(TRAIN, dest, second, True)
    assert dest.deltas == 1
    third = source.delta_order(True, dest, 0)
    assert third.base == 0
    source.delta_done(TRAIN, dest, third, True)
    assert dest.deltas == 2
    fourth = source.delta_order(True, dest, 0)
    assert fourth.base is None  # every 3rd move after an anchor is a full copy again
    source.delta_done(TRAIN, dest, fourth, True)
    assert dest.deltas == 0 and source.delta_order(True, dest, 0).base == 0
    source.delta_done(TRAIN, dest, source.delta_order(True, dest, 0), False)
    assert source.sent is None and dest.deltas == 0  # a failure: the bases are unknown
    assert source.delta_order(True, dest, 0).base is None
    source.delta_done(TRAIN, dest, None, False)  # a move without delta changes nothing
    assert source.sent is None


def commit_staged_copy(dest, sender: str, sender_ledger, origin, sent_layout, delta_order) -> FakeUpdate:
    """A staged copy into ``dest`` sent by ``sender`` (its ledger), bringing ``origin``'s weights, committed."""
    update = FakeUpdate(
        kind="copy",
        target=GEN,
        before=GEN,
        keep=None,
        version=dest.copy_version(SimpleNamespace(name=origin[0], version=origin[1])),
        source=SimpleNamespace(name=sender, ledger=sender_ledger),
        origin=origin,
        sent_layout=sent_layout,
        delta_order=delta_order,
    )
    dest.begin_stage(update)
    update.state = "staged"
    dest.commit_staged(update)
    return update


def test_commit_staged_copy_takes_version_layout_and_origin_and_records_the_senders_base(versions):
    source, dest = ledger("policy", delta="host"), ledger("gen", GEN)
    for _ in range(4):
        source.changed(ShardChange("fill", TRAIN, TRAIN))
    order = source.delta_order(True, dest, None)
    update = commit_staged_copy(dest, "policy", source, ("policy", source.version), TRAIN, order)
    assert update.state == "committed"
    assert (dest.layout, dest.version, dest.origin) == (GEN, 4, ("policy", 4))
    assert (source.sent, dest.deltas) == ((TRAIN, 4), 0)
    assert source.copied_version(dest) == 4
    assert versions[-1] == ("gen", 4)


def test_a_relayed_staged_copy_takes_the_trainers_weights_as_its_origin():
    """A fleet's relay (actors/driver/fleet.py) is sent by a replica, but the weights are the
    trainer's: the destination's origin is the trainer's name and version, so a later delta from
    the trainer knows what it holds (before, the ledger recorded the sending replica)."""
    policy, relay, dest = ledger("policy", delta="host"), ledger("gen-0", GEN), ledger("gen-1", GEN)
    for _ in range(3):
        policy.changed(ShardChange("fill", TRAIN, TRAIN))
    commit_staged_copy(dest, "gen-0", relay, ("policy", policy.version), GEN, None)
    assert (dest.version, dest.origin) == (3, ("policy", 3))
    assert policy.copied_version(dest) == 3 and relay.copied_version(dest) is None


def test_commit_staged_move_switches_the_layout_and_keeps_the_one_left():
    g = ledger()
    g.moved(TRAIN, None)
    g.changed(ShardChange("fill", TRAIN, TRAIN))
    g.moved(GEN, ResidentLayout(TRAIN, 1, "in_place", 1))
    g.moved(TRAIN, ResidentLayout(GEN, 1, "in_place", 1))  # GEN kept: the staged move's shadow set
    g.forget_kept(GEN)
    update = FakeUpdate(
        kind="reallocate",
        target=GEN,
        before=TRAIN,
        keep=KeepOrder("in_place", 1),
        version=g.version,
        source=SimpleNamespace(name="g", ledger=g),
        source_version=1,
        sent_layout=TRAIN,
        delta_order=None,
    )
    g.begin_stage(update)
    g.commit_staged(update)
    assert (g.layout, g.version, g.origin) == (GEN, 1, None)
    (kept,) = g.resident_layouts()
    assert (kept.layout, kept.version, kept.where, kept.fresh) == (TRAIN, 1, "in_place", True)
    assert kept.bytes_per_worker == max(TRAIN.rank_bytes(r) for r in range(4))
