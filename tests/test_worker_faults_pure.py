"""The faults a test injects into a worker (actors/worker/faults.py), without Ray: one armed at a
time, each fires once, and ``exit_after_buckets`` exits at its last bucket."""

from __future__ import annotations

import pytest

from actors.worker import faults as faults_module
from actors.worker.faults import FAULTS, Faults


def test_an_unknown_fault_is_refused_naming_the_allowed_ones():
    f = Faults()
    with pytest.raises(ValueError, match=r"unknown fault 'crash'; allowed: stall, exit_after_buckets"):
        f.arm("crash", 1)
    assert f.armed is None


def test_a_fault_fires_once_and_only_for_its_kind():
    f = Faults()
    f.arm("stall", 1.5)
    assert f.take("exit_in_commit") is None and f.armed == ("stall", 1.5)
    assert f.take("stall") == 1.5
    assert f.take("stall") is None  # disarmed
    f.arm("exit_in_commit", 0)
    f.arm("exit_after_commit", 0)  # one armed at a time: the last one
    assert f.take("exit_in_commit") is None and f.take("exit_after_commit") == 0


def test_exit_after_buckets_exits_at_the_last_bucket(monkeypatch):
    exits = []
    monkeypatch.setattr(faults_module.os, "_exit", exits.append)
    f = Faults()
    f.after_bucket()  # nothing armed: nothing happens
    f.arm("exit_after_buckets", 3)
    f.after_bucket()
    f.after_bucket()
    assert exits == [] and f.armed == ("exit_after_buckets", 1)
    f.after_bucket()
    assert exits == [1]
    assert set(FAULTS) >= {"stall", "exit_after_buckets", "exit_in_switch", "exit_in_convert"}
