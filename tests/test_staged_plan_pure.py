"""What a staged update's plan was made from (actors/driver/staged.py ``PlannedFrom``): the
changes of a group between the request and the update's hold that refuse it. Pure: stand-in
groups, no Ray."""

from __future__ import annotations

from types import SimpleNamespace

from actors.driver.staged import PlannedFrom


def group(layout="dp=2", workers=None, placement=None):
    return SimpleNamespace(layout=layout, workers=workers or object(), placement=placement or object())


def test_an_unchanged_group_is_what_the_plan_was_made_from():
    g = group()
    assert PlannedFrom.of(g).changes() == []
    assert PlannedFrom.of(g, "dp=2").changes() == []


def test_a_layout_or_workers_changed_since_the_plan_are_named():
    g = group()
    planned = PlannedFrom.of(g)
    g.layout = "tp=2"
    assert planned.changes() == ["its layout is tp=2 now, the plan's is dp=2"]
    g.layout, g.workers = "dp=2", object()
    assert planned.changes() == ["its workers were replaced (replace_dead_workers)"]


def test_a_plan_made_between_a_replacements_workers_and_its_placement_is_refused():
    """``replace_dead_workers`` publishes the new workers, then (after the replacements answer,
    up to ``start_timeout_s`` later) their infos and the placement read from them: a plan made in
    between has the new workers on the old placement (the dead worker's node, its zero-copy
    flags), and the workers alone compare equal at the hold (found in review, 2026-12-07)."""
    g = group()
    g.workers = object()  # the replacement published its workers ...
    planned = PlannedFrom.of(g)  # ... the staged copy is planned here ...
    g.placement = object()  # ... then the replacements answered and were placed
    assert planned.changes() == ["its replaced workers were placed after the plan was made (replace_dead_workers)"]
