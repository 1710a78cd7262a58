"""actors.metrics without a Ray cluster: gauges stay set, checkpoint stats map to their bytes."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")

from actors import metrics


class FakeInstrument:
    def __init__(self):
        self.calls = []

    def set(self, value, tags):
        self.calls.append((value, dict(tags)))

    observe = inc = set


def test_seconds_feed_the_histogram_and_the_exact_total():
    seconds = metrics._Seconds.__new__(metrics._Seconds)
    seconds.histogram, seconds.total = FakeInstrument(), FakeInstrument()
    seconds.observe(0.25, {"model": "m"})
    seconds.observe(0.0, {"model": "m"})  # a counter takes no 0 increment (Ray raises ValueError)
    assert seconds.histogram.calls == [(0.25, {"model": "m"}), (0.0, {"model": "m"})]
    assert seconds.total.calls == [(0.25, {"model": "m"})]


def test_a_gauge_is_set_again_until_its_next_value(monkeypatch):
    """Ray exports a gauge only while it is being set (values set once left the export within
    seconds): the last value of each gauge is set again periodically, the newest one only."""
    monkeypatch.setattr(metrics, "_refresh_period_s", lambda: 0.05)
    monkeypatch.setattr(metrics, "_gauges", {})
    monkeypatch.setattr(metrics, "_refresher", None)
    gauge = FakeInstrument()
    metrics._set_gauge("g", gauge, 3.0, {"model": "m"})
    metrics._set_gauge("g", gauge, 4.0, {"model": "m"})
    metrics._set_gauge("g", gauge, 1.0, {"model": "other"})
    deadline = time.monotonic() + 10
    while len(gauge.calls) < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    later = gauge.calls[3:]
    assert len(later) >= 6, gauge.calls  # set again, more than once
    assert {(v, t["model"]) for v, t in later} == {(4.0, "m"), (1.0, "other")}, later


def test_the_refresh_follows_the_report_interval_and_survives_a_failing_gauge(monkeypatch):
    """The refresh thread outlives the Ray session it started in: it reads the period every round
    (in the full suite it started under Ray's default 10 s interval, kept a 5 s period, and a later
    session reporting every second evicted the weight version between refreshes), and a gauge that
    cannot be set (between sessions) stops neither the thread nor the other gauges."""
    period = [2.0]  # started under a slow report interval
    monkeypatch.setattr(metrics, "_refresh_period_s", lambda: period[0])
    monkeypatch.setattr(metrics, "_gauges", {})
    monkeypatch.setattr(metrics, "_refresher", None)

    class Broken(FakeInstrument):
        def set(self, value, tags):
            if self.calls:
                raise RuntimeError("no Ray session")
            super().set(value, tags)

    gauge = FakeInstrument()
    metrics._set_gauge("a", Broken(), 1.0, {"model": "gone"})
    metrics._set_gauge("b", gauge, 2.0, {"model": "m"})
    period[0] = 0.02  # the next session reports faster
    deadline = time.monotonic() + 6  # the old period would set it again twice in this time
    while len(gauge.calls) < 15 and time.monotonic() < deadline:
        time.sleep(0.05)
    monkeypatch.setattr(metrics, "_refresher", None)  # the thread ends at its next round
    assert len(gauge.calls) >= 15, gauge.calls


def test_checkpoint_stats_become_seconds_and_bytes_by_kind(monkeypatch):
    from actors.driver.checkpoint import LoadStats, SaveStats

    inst = {k: FakeInstrument() for k in ("ckpt_seconds", "ckpt_bytes")}
    monkeypatch.setattr(metrics, "_driver_instruments", lambda: inst)
    save = SaveStats(3, 0.5, 0.25, 1.0, 1000, 300, 200, 2, [])
    metrics.record_checkpoint("m", "save", save)
    load = LoadStats(3, "reshard", 0, 0, 0, 0, 2.0, 900, 10, 20, 30)
    metrics.record_checkpoint("m", load.method, load)
    metrics.record_checkpoint("m", "import_hf", {"bytes_read": 70, "seconds": 0.5})
    assert inst["ckpt_seconds"].calls == [
        (1.0, {"model": "m", "op": "save"}),
        (2.0, {"model": "m", "op": "reshard"}),
        (0.5, {"model": "m", "op": "import_hf"}),
    ]
    got = {(t["op"], t["kind"]): v for v, t in inst["ckpt_bytes"].calls}
    assert got == {
        ("save", "disk"): 1000,
        ("save", "inter"): 300,
        ("save", "intra"): 200,
        ("reshard", "disk"): 900,
        ("reshard", "local"): 10,
        ("reshard", "intra"): 20,
        ("reshard", "inter"): 30,
        ("import_hf", "disk"): 70,
    }
