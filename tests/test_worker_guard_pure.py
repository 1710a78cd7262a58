"""A worker refuses, before any traffic, a share of a plan it cannot run as it holds
(actors/worker/guard.py), driven in-process: real ``ShardWorker`` methods (``op_run``,
``stage_run``, ``op_execute``) over a real :class:`~actors.worker.state.WorkerState` with real
buffers, without Ray (the runtime context and the metrics are stubbed) and with a transport that
raises :class:`Traffic` the moment anything touches it.

The case behind it: a staged copy planned from the trainer's tp=2 layout ran after the trainer
had moved to dp=2 (6bd7fea fixed the driver). The trainer's workers took the tp=2 source for a
"conversion" of what they held (same rank index, same model), and the generator beside them
mapped their dp=2 buffers at tp=2 offsets: wrong weights, committed without an error. Each test
of a refusal here failed on 6bd7fea: the worker went on to the transport (or, for a copy's
destination, had no ``MoveOrder.into`` to check). The legitimate shares, a plain copy and a copy
converting weight formats on its senders, still reach the transport.
"""

from __future__ import annotations

import re

import pytest
import ray
import torch

import actors.worker.actor as actor_module
from actors.lanes import MOVE, STAGE
from actors.records import PLAIN_MOVE, DeltaOrder, MoveOrder
from actors.wire.executor import checked_share
from actors.wire.shares import PeerView, worker_shares
from actors.worker import ShardWorker, WorkerState
from realloc.layout import Layout, RankLayout, Topology
from realloc.plan import Placement, plan_reallocation
from realloc.plan.formats import conversion
from realloc.spec import ModelSpec

TINY = ModelSpec.preset("tiny")  # bfloat16, 4 layers
TP2, DP2 = Layout(TINY, Topology(tp=2)), Layout(TINY, Topology(dp=2))
TP2_F32 = Layout(TINY, Topology(tp=2), weight_format="float32")
DP2_FP8 = Layout(TINY, Topology(dp=2), weight_format="fp8_block128")
NODE = "node-a"  # every worker on one node: the generator maps the trainer's buffers (zero-copy)
WORLD = "world-1"


class Traffic(AssertionError):
    """The worker touched its transport: it went past every check it makes before traffic."""


class NoTraffic:
    def __getattr__(self, name: str):
        raise Traffic(f"the worker used its transport ({name}): it did not refuse before traffic")


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """No Ray in this process: a node id without a runtime context, metrics that record
    nothing, and a worker's share handed over as it is (``received_share`` would ``ray.get``)."""

    class Context:
        def get_node_id(self) -> str:
            return NODE

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    monkeypatch.setattr(actor_module.metrics, "in_flight", lambda *args, **kwargs: None)
    monkeypatch.setattr(actor_module.metrics, "record_phase", lambda *args, **kwargs: None)
    monkeypatch.setattr(actor_module, "received_share", lambda box, me: checked_share(*box[0], me))


def worker(group: str, held: RankLayout, seed: int = 0) -> ShardWorker:
    """A worker of ``group`` holding ``held`` with seeded weights, in world ``WORLD`` on both lanes."""
    w = ShardWorker.__new__(ShardWorker)
    w._realloc = WorkerState(group, TINY, False, "cpu", "gloo")
    w.set_layout(held)
    gen = torch.Generator().manual_seed(seed)
    for t in w._realloc.buffers.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) if t.is_floating_point() else t)
    for lane in (MOVE, STAGE):
        state = w._realloc.lane(lane)
        state.transport, state.world_id = NoTraffic(), WORLD
    return w


def copy_shares(src: Layout, dst: Layout, held: list | None = None, shared: bool = True) -> list:
    """Every worker's ``[share]`` of a copy from a 2-worker group in ``src`` (world ranks 0, 1) to
    one in ``dst`` (2, 3), all on one node, as the driver cuts them (``held``: ``PeerView.held``)."""
    plan = plan_reallocation(
        src.spec, src, dst, Placement((NODE,) * 4), src_workers=range(2), dst_workers=range(2, 4), bucket_bytes=4096
    )
    srcs, dsts = [src.at(0), src.at(1), None, None], [None, None, dst.at(0), dst.at(1)]
    held = held or [None] * 4
    views = [PeerView(i, NODE, srcs[i], dsts[i], shared=shared, held=held[i]) for i in range(4)]
    return [[share] for share in worker_shares(plan, views)]


def snapshot(w: ShardWorker) -> tuple:
    st = w._realloc
    return st.held, {d: (t, t.clone()) for d, t in st.buffers.items()}


def assert_untouched(w: ShardWorker, before: tuple) -> None:
    """Holds what it held, in the same buffers, bit for bit; nothing prepared or staged."""
    st = w._realloc
    held, buffers = before
    assert st.held == held and st.op is None and st.staged is None
    assert set(st.buffers) == set(buffers)
    for d, (t, copy) in buffers.items():
        assert st.buffers[d] is t and torch.equal(t, copy)


def key(share: list, me: int) -> str:
    """The plan key a driver would send with ``share`` (a worker caches its share by it)."""
    return f"{id(share[0])}-{me}"


def run(w: ShardWorker, share: list, me: int, order: MoveOrder = PLAIN_MOVE) -> None:
    w.op_run("op-1", WORLD, key(share, me), share, me, {}, order)


def stage(w: ShardWorker, share: list, me: int, order: MoveOrder = PLAIN_MOVE) -> None:
    w.stage_run("up-1", WORLD, key(share, me), share, me, {}, 7, order)


# -- the plan's source is what the sender holds ---------------------------------------------------


@pytest.mark.parametrize("call", [run, stage], ids=["op_run", "stage_run"])
def test_every_sender_refuses_a_plan_made_from_the_layout_its_group_left(call):
    """The trainer holds dp=2; the copy was planned from its tp=2 layout (same rank indices, same
    model and format). Every trainer worker refuses before any traffic, naming what it holds and
    what the plan says; its buffers are untouched and nothing is prepared or staged."""
    shares = copy_shares(TP2, TP2)
    for r in range(2):
        w = worker("train", DP2.at(r), seed=r)
        before = snapshot(w)
        with pytest.raises(ValueError) as err:
            call(w, shares[r], r)
        message = str(err.value)
        assert f"worker of train holds rank {r} of dp=2,tp=1,pp=1, but the plan sends rank {r} of dp=1,tp=2,pp=1" in (
            message
        ), message
        assert "refused before any traffic" in message, message
        assert_untouched(w, before)


def test_the_sender_of_a_driver_run_phase_refuses_another_layout_and_any_conversion(monkeypatch):
    """``op_execute`` (a blend's phases) never converts: a stale source is refused, and so is the
    source in another weight format (it would have sent the held bytes as that format)."""
    for plan_src, held in ((TP2, DP2), (conversion(TP2_F32, DP2).wire, TP2_F32)):
        shares = copy_shares(plan_src, DP2)
        w = worker("train", held.at(0))
        w.op_prepare("op-1", None, export=False)
        with pytest.raises(ValueError, match=r"worker of train holds rank 0 of .*, but the plan sends rank 0 of"):
            w.op_execute("op-1", WORLD, shares[0], 0, 0, {})


def test_a_receiver_of_a_driver_run_phase_refuses_a_plan_writing_another_layout_than_prepared():
    shares = copy_shares(TP2, TP2)
    w = worker("gen", DP2.at(0))
    w.op_prepare("op-1", DP2.at(0), export=False)
    with pytest.raises(ValueError, match=r"prepared rank 0 of dp=2,tp=1,pp=1, but the plan writes rank 0 of dp=1,tp=2"):
        w.op_execute("op-1", WORLD, shares[2], 2, 0, {})


# -- same-node zero-copy reads: the mapped buffers are of the layout the plan reads them as --------


def test_a_converting_sender_refuses_a_view_that_maps_its_buffers_as_another_layout():
    """A copy converting on its senders (fp32 tp=2 -> bf16: the plan sends tp=2 in bf16, and the
    generator beside the trainer maps the trainer's fp32 buffers as ``PeerView.held``). A view
    that says the buffers hold a stale layout, or says nothing (a reader would map them as the
    plan's bf16), is refused by the sender itself, before it sends its handles."""
    wire = conversion(TP2_F32, TP2).wire
    for held_view in (DP2.at(0), None):
        shares = copy_shares(wire, TP2, held=[held_view, TP2_F32.at(1), None, None])
        w = worker("train", TP2_F32.at(0))
        before = snapshot(w)
        mapped = re.escape(str(held_view or wire.at(0)))
        with pytest.raises(ValueError, match=f"the plan has its same-node readers map its buffers as {mapped}:"):
            run(w, shares[0], 0)
        assert_untouched(w, before)


def test_a_reader_refuses_to_map_a_same_node_sender_as_a_layout_it_cannot_read_the_plan_from():
    """The generator would map trainer worker 0's buffers as dp=2 to read a tp=2 source from
    them: refused before it maps anything or sends a byte."""
    shares = copy_shares(TP2, TP2, held=[DP2.at(0), None, None, None])
    w = worker("gen", TP2.at(0))
    before = snapshot(w)
    with pytest.raises(
        ValueError,
        match=r"the plan maps the buffers of same-node worker 0 as rank 0 of dp=2,tp=1,pp=1 to read rank 0 of dp=1,tp=2",
    ):
        run(w, shares[2], 2)
    assert_untouched(w, before)


# -- the plan's destination is what the receiver holds (its rank; a copy's: its layout) ------------


@pytest.mark.parametrize("call", [run, stage], ids=["op_run", "stage_run"])
def test_a_copys_receiver_refuses_a_plan_made_from_the_layout_it_left(call):
    """The generator moved to dp=2; a copy into it planned for its old tp=2 layout is refused
    (``MoveOrder.into``: what a copy's receivers hold and keep); before, it was staged and
    committed, undoing the generator's move behind the driver's back."""
    shares = copy_shares(TP2, TP2)
    w = worker("gen", DP2.at(1))
    before = snapshot(w)
    with pytest.raises(
        ValueError,
        match=r"worker of gen holds rank 1 of dp=2,tp=1,pp=1, but the copy into dp=1,tp=2,pp=1 writes rank 1 of dp=1,tp=2",
    ):
        call(w, shares[3], 3, MoveOrder(into=TP2))
    assert_untouched(w, before)


def test_a_blends_receiver_refuses_at_prepare_a_destination_it_does_not_hold():
    """``copy_to(eta=)`` runs prepare, the driver-run phases and a blending commit, which mixes
    what a receiver got with what it holds. A blend planned for the generator's old tp=2 layout
    after it moved to dp=2 is refused at prepare (``op_prepare(into=)``), before any buffer is
    allocated or any byte moves. Before, a blend's receivers took any destination at prepare
    (only ``op_run``'s copies checked ``MoveOrder.into``): the worker's own defence against a
    driver bug, as for the copies above."""
    w = worker("gen", DP2.at(1))
    before = snapshot(w)
    with pytest.raises(
        ValueError,
        match=r"worker of gen holds rank 1 of dp=2,tp=1,pp=1, but the copy into dp=1,tp=2,pp=1 writes rank 1 of dp=1,tp=2",
    ):
        w.op_prepare("op-1", TP2.at(1), True, TP2)
    assert_untouched(w, before)
    w.op_prepare("op-2", DP2.at(1), True, DP2)  # what it holds: prepared
    assert w._realloc.op.id == "op-2" and w._realloc.op.dst == DP2.at(1)


def test_a_receiver_refuses_another_rank_and_a_conversion_into_another_placement():
    shares = copy_shares(TP2, TP2)
    w = worker("gen", TP2.at(0))
    before = snapshot(w)
    with pytest.raises(ValueError, match=r"holds rank 0 of dp=1,tp=2,pp=1, but the plan writes rank 1 of"):
        run(w, shares[3], 3)  # worker 3's share: rank 1
    with pytest.raises(ValueError, match=r"to be converted into dp=2,tp=1,pp=1 format float32, which is not"):
        run(w, shares[2], 2, MoveOrder(convert=Layout(TINY, Topology(dp=2), weight_format="float32")))
    assert_untouched(w, before)


# -- the legitimate shares go through ------------------------------------------------------------


@pytest.mark.parametrize("call", [run, stage], ids=["op_run", "stage_run"])
def test_plain_and_converting_copies_pass_every_check_and_reach_the_transport(call):
    """A plain copy, and a copy converting on its senders (fp32 -> bf16, the trainer's view says
    its buffers hold fp32) and one converting on its receivers (bf16 dp=2 -> fp32 tp=2): every
    worker goes past its checks (the first thing it touches after them is the transport)."""
    to_f32 = conversion(TP2, TP2_F32)
    assert to_f32.where == "destination"
    cases = [
        (copy_shares(TP2, TP2), [TP2.at(0), TP2.at(1), TP2.at(0), TP2.at(1)], MoveOrder(into=TP2)),
        (
            copy_shares(conversion(TP2_F32, TP2).wire, TP2, held=[TP2_F32.at(0), TP2_F32.at(1), None, None]),
            [TP2_F32.at(0), TP2_F32.at(1), TP2.at(0), TP2.at(1)],
            MoveOrder(into=TP2),
        ),
        (
            copy_shares(TP2, to_f32.wire, shared=False),
            [TP2.at(0), TP2.at(1), TP2_F32.at(0), TP2_F32.at(1)],
            MoveOrder(convert=TP2_F32, into=TP2_F32),
        ),
    ]
    for shares, held, order in cases:
        for i in range(4):
            w = worker("train" if i < 2 else "gen", held[i])
            with pytest.raises(Traffic):
                call(w, shares[i], i, order)


def test_a_relay_sends_its_staged_set_as_it_is_and_nothing_else():
    """A fleet relay (``MoveOrder.relay``) sends the staged set it holds: its layout, never
    converted, whatever it serves."""
    shares = copy_shares(TP2, TP2)
    w = worker("r1", DP2.at(0))  # serves dp=2, staged tp=2 (a fleet replica mid-update)
    st = w._realloc
    st.staged = type("Ready", (), {"id": "up-0", "ready": True, "switched": False, "dst": TP2.at(0)})()
    st.staged.buffers = st.allocator.allocate(TP2.at(0).buffer_numels())
    with pytest.raises(Traffic):
        stage(w, shares[0], 0, MoveOrder(relay="up-0"))
    st.staged.dst = DP2.at(0)  # a staged set of another layout than the plan's
    with pytest.raises(ValueError, match=r"relays a staged set of rank 0 of dp=2,tp=1,pp=1"):
        stage(w, shares[0], 0, MoveOrder(relay="up-0"))


# -- no delta move with a weight-format conversion (task: DeltaRoute sends bytes as they are) -----


@pytest.mark.parametrize("call", [run, stage], ids=["op_run", "stage_run"])
@pytest.mark.parametrize("delta", [DeltaOrder(3, 4), DeltaOrder(None, 4)], ids=["delta", "anchor"])
def test_a_delta_move_converting_on_its_senders_is_refused_before_traffic(call, delta):
    """bf16 dp=2 -> block FP8: the senders convert as they pack. As a delta, their routes would
    send the bf16 bytes of their base into FP8 pieces (DeltaRoute ignores the conversion), and
    an anchor would keep a bf16 base tagged as the FP8 wire layout: every sender refuses, and so
    does a same-node receiver that knows its senders convert."""
    c = conversion(DP2, DP2_FP8)
    assert c.where == "source"
    shares = copy_shares(c.wire, DP2_FP8, held=[DP2.at(0), DP2.at(1), None, None])
    for i, held in enumerate([DP2.at(0), DP2.at(1), DP2_FP8.at(0), DP2_FP8.at(1)]):
        w = worker("train" if i < 2 else "gen", held)
        before = snapshot(w)
        with pytest.raises(ValueError, match=r"a delta move \(delta=True\) with a weight-format conversion"):
            call(w, shares[i], i, MoveOrder(delta=delta))
        assert_untouched(w, before)


@pytest.mark.parametrize("call", [run, stage], ids=["op_run", "stage_run"])
def test_a_delta_move_converting_on_its_receivers_is_refused_before_traffic(call):
    """bf16 tp=2 -> fp32 tp=2: the receivers convert what they receive. As a delta, they would
    apply bf16 deltas to their fp32 weights: every worker refuses, the senders included."""
    c = conversion(TP2, TP2_F32)
    shares = copy_shares(TP2, c.wire, shared=False)
    for i, held in enumerate([TP2.at(0), TP2.at(1), TP2_F32.at(0), TP2_F32.at(1)]):
        w = worker("train" if i < 2 else "gen", held)
        with pytest.raises(ValueError, match=r"the receivers convert into dp=1,tp=2,pp=1 format float32"):
            call(w, shares[i], i, MoveOrder(delta=DeltaOrder(3, 4), convert=TP2_F32))


def test_the_run_itself_refuses_a_delta_with_a_conversion(monkeypatch):
    """``_run``, where the routes become delta routes, refuses the combination on its own (a
    caller that skipped the up-front check: still no traffic)."""
    monkeypatch.setattr(ShardWorker, "_check_share", lambda self, *args: False)
    c = conversion(DP2, DP2_FP8)
    shares = copy_shares(c.wire, DP2_FP8, held=[DP2.at(0), DP2.at(1), None, None])
    w = worker("train", DP2.at(0))
    with pytest.raises(ValueError, match=r"a delta move \(delta=True\) with a weight-format conversion"):
        run(w, shares[0], 0, MoveOrder(delta=DeltaOrder(3, 4)))
    with pytest.raises(ValueError, match=r"holds rank 0 of dp=2,tp=1,pp=1, but the plan sends rank 0 of dp=1,tp=2"):
        run(w, copy_shares(TP2, TP2)[0], 0)  # the sender's own source check, in _source_store


# -- the pieces ----------------------------------------------------------------------------------


def test_same_placement_is_one_layout_in_any_weight_format():
    from actors.worker.guard import reformatted  # imported here: every test above runs on 6bd7fea (and fails)
    from realloc.plan.formats import same_placement

    assert same_placement(TP2, TP2_F32) and same_placement(TP2, conversion(TP2_F32, TP2).wire)
    assert not same_placement(TP2, DP2) and not same_placement(TP2, Layout(TINY, Topology(tp=2), 64))
    assert not same_placement(TP2, Layout(ModelSpec.preset("bench-1gb"), Topology(tp=2)))
    assert reformatted(TP2_F32.at(1), TP2.at(1)) and not reformatted(TP2.at(1), TP2.at(1))  # equal: no conversion
    assert not reformatted(TP2_F32.at(0), TP2.at(1)) and not reformatted(DP2.at(0), TP2.at(0))


def test_check_delta_lets_plain_deltas_and_plain_conversions_through():
    from actors.worker.guard import check_delta

    check_delta("g", DeltaOrder(1, 2), False, None)
    check_delta("g", None, True, TP2)
    with pytest.raises(ValueError, match=r"worker of g: a delta move"):
        check_delta("g", DeltaOrder(None, 2), True, None)
