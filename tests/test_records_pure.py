"""The records that cross the Ray boundary (actors/records.py) without Ray: a move's order
(:class:`MoveOrder`) is a frozen value that pickles, what refuses an order it cannot carry, and
:meth:`PhaseResult.of`, the one summation of the workers' reports (:class:`WorkerReport`), on
hand-made reports with the numbers worked out by hand."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from actors.driver.protocol import Operation
from actors.records import PLAIN_MOVE, DeltaOrder, KeepOrder, MoveOrder, PhaseResult, WorkerReport
from actors.remote import Workers
from realloc.layout import Layout, Topology
from realloc.spec import ModelSpec


def test_a_move_order_pickles_to_an_equal_frozen_value():
    layout = Layout(ModelSpec.preset("tiny"), Topology(dp=1, tp=2))
    order = MoveOrder(keep=KeepOrder("host", 3), delta=DeltaOrder(2, 3, "device"), convert=layout, blend=0.25)
    back = pickle.loads(pickle.dumps(order))
    assert back == order and back is not order
    assert (back.keep, back.delta, back.convert, back.blend) == (
        KeepOrder("host", 3),
        DeltaOrder(2, 3, "device"),
        layout,
        0.25,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        order.keep = None  # type: ignore[misc]
    assert PLAIN_MOVE == MoveOrder() and (PLAIN_MOVE.keep, PLAIN_MOVE.delta, PLAIN_MOVE.convert, PLAIN_MOVE.blend) == (
        None,
        None,
        None,
        None,
    )


def test_run_plan_refuses_a_blend_before_any_traffic():
    class NoActor:  # any remote call would raise AttributeError, not ValueError
        pass

    op = Operation(Workers((NoActor(),), ("w0",)), [None], 5.0, "test move", "nothing changes", "dp=1")
    with pytest.raises(ValueError, match="no blend"):
        op.run_plan(None, None, [None], None, [False], {}, MoveOrder(blend=0.5))


def _reports() -> list[WorkerReport]:
    return [
        WorkerReport(
            {"local": 10, "intra": 100, "inter": 0},
            staging_bytes=64,
            dst_bytes=500,
            seconds=0.5,
            phases={"prepare": 0.1, "transfers": 0.3},
            resident={"in_place": 700, "host": 0},
            delta={"buckets": 3, "delta": 2, "whole": 1, "repaired": 0, "wire_bytes": 40, "bytes": 120},
            delta_base_bytes=900,
            shadow_bytes=11,
        ),
        WorkerReport(
            {"local": 0, "intra": 20, "inter": 1000},
            staging_bytes=128,
            dst_bytes=300,
            seconds=1.25,
            phases={"prepare": 0.2, "transfers": 0.9, "commit": 0.05},
            refreshed=True,
            resident={"in_place": 0, "host": 800},
            delta={"buckets": 5, "delta": 1, "whole": 3, "repaired": 1, "wire_bytes": 600, "bytes": 1000},
            shadow_bytes=33,
        ),
        WorkerReport({"local": 7, "intra": 0, "inter": 0}, seconds=0.75),  # only sends: no phases, no delta
    ]


def test_phase_result_of_sums_adds_bytes_and_takes_the_largest_worker():
    got = PhaseResult.of(_reports(), ("w0", "w1", "w2"))
    assert (got.bytes_local, got.bytes_intra_node, got.bytes_inter_node) == (17, 120, 1000)
    assert got.peak_extra_bytes_per_actor == 564  # w0: 64 + 500 (w1: 128 + 300)
    assert got.seconds == 1.25 and got.refreshed
    assert (got.resident_in_place_bytes, got.resident_host_bytes, got.shadow_bytes) == (700, 800, 33)
    assert got.delta is None  # no order: no summary
    assert got.slowest == {"worker": "w1", "seconds": 0.2 + 0.9 + 0.05, "phase": "transfers", "phase_seconds": 0.9}
    assert got.phases == (_reports()[0].phases, _reports()[1].phases, None)
    untimed = PhaseResult.of(_reports(), timed=False)  # the caller times it; no names: no slowest
    assert untimed.seconds == 0.0 and untimed.slowest is None


def test_phase_result_of_summarises_a_delta_move_and_an_anchor():
    delta = PhaseResult.of(_reports(), delta=DeltaOrder(4, 5)).delta
    assert delta == {
        "mode": "delta",
        "base_version": 4,
        "buckets": 8,
        "delta": 3,
        "whole": 4,
        "repaired": 1,
        "wire_bytes": 640,
        "bytes": 1120,
        "base_bytes_per_actor": 900,
    }
    anchor = PhaseResult.of(_reports(), delta=DeltaOrder(None, 5)).delta
    # an anchor is a full move: every byte moved between workers (intra + inter) travelled
    assert anchor["mode"] == "anchor" and anchor["base_version"] is None
    assert anchor["bytes"] == anchor["wire_bytes"] == 120 + 1000


def test_a_report_merges_the_next_execute_phase():
    first, later = _reports()[0], _reports()[1]
    first.merge(later)
    assert first.bytes == {"local": 10, "intra": 120, "inter": 1000}
    assert first.staging_bytes == 128 and first.dst_bytes == 500  # the destination: the first phase's
    assert first.phases == later.phases  # the phases so far, the later one's included
    assert pickle.loads(pickle.dumps(first)) == first


def test_an_exchange_report_pickles_and_sums_as_a_moves_bytes():
    """A worker's part of a checkpoint plan (``ckpt_exchange``) is a record, not a bare dict: it
    crosses the Ray boundary by pickle, and its bytes sum as a move's do."""
    import pickle

    from actors.records import ExchangeReport, PhaseResult, WorkerReport

    reports = [
        ExchangeReport({"local": 4, "intra": 8, "inter": 0}, seconds=0.5, finish_seconds=0.1, replicas=2),
        ExchangeReport(
            {"local": 0, "intra": 0, "inter": 16},
            seconds=0.25,
            finish_seconds=0.2,
            files=[{"name": "model-00001-of-00001.safetensors", "bytes": 16}],
        ),
    ]
    assert pickle.loads(pickle.dumps(reports)) == reports
    summed = PhaseResult.of([WorkerReport(r.bytes) for r in reports], timed=False)
    assert (summed.bytes_local, summed.bytes_intra_node, summed.bytes_inter_node) == (4, 8, 16)
    assert reports[0].files == [] and reports[1].replicas == 0
