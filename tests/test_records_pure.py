"""The records that cross the Ray boundary (actors/records.py) without Ray: a move's order
(:class:`MoveOrder`) is a frozen value that pickles, and what refuses an order it cannot carry."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from actors.driver.protocol import Operation
from actors.records import PLAIN_MOVE, DeltaOrder, KeepOrder, MoveOrder
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
