"""The driver-side exchange protocol: prepare, execute, then commit or abort.

Every state change of a model group goes through one :class:`Operation` (``reallocate``,
``copy_to``, ``init_synthetic``, ``load_state_dict``, checkpoint restore, resharding load and
HF import), in the spirit of torch.distributed.checkpoint's storage-writer call sequence:

1. ``prepare``: every participating worker allocates destination buffers for its rank of the
   new layout (or none: a worker that only sends) and returns zero-copy handles. Nothing a
   worker holds changes.
2. ``execute``: the plan's phases (or a local fill) write the destination buffers only.
3. ``commit``: every destination worker adopts its destination buffers and keeps the old ones
   as its rollback. Only when *every* participant acknowledged does the driver change the
   group's state (its layout).
4. ``abort`` (after a failure at any step, on every live participant): a worker drops the
   operation's buffers, or, if it had committed, puts its rollback back. So after any failure
   every live worker holds the old layout and the old weights (or will, once the call it is
   still stuck in returns: its abort is queued behind it), and the error says so, naming the
   dead, the unresponsive and the waiting workers.

One :class:`~actors.remote.Deadline` bounds the whole operation: every step waits only for what
is left of it, and the failure path (diagnosis, aborts) shares the deadline's fixed grace
(``FAILURE_GRACE_S``), so a failed operation raises within ``timeout_s + FAILURE_GRACE_S``.

The failure table in docs/architecture.md lists each step, what can fail there, and the state
that follows. Worker-side counterparts: ``op_prepare``, ``op_execute``/``op_fill``/
``ckpt_exchange``, ``op_commit``, ``op_abort`` in :mod:`actors.worker`.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from typing import Any, Callable, NoReturn, Sequence

import ray

from actors.errors import ReallocationError
from actors.records import PLAIN_MOVE, KeepOrder, MoveOrder, PhaseResult, WorkerReport
from actors.remote import Deadline, Workers, as_deadline, gather, undo
from actors.wire.shares import PeerView, worker_shares
from realloc.layout import Layout, RankLayout
from realloc.plan import Placement, Plan

log = logging.getLogger(__name__)


class Operation:
    """One state change over ``workers``; ``dsts[i]`` is what worker ``i`` will hold (or None).

    ``timeout_s``: seconds, or the :class:`~actors.remote.Deadline` of the call (started before
    it waited for the group's lock); every step waits only for what is left of it. ``what`` names
    the operation in errors; ``keeps`` says what stays true when it fails (e.g. "group 'policy'
    stays in layout dp=2,tp=2,pp=1"); ``layout`` is the error's ``layout``: ``str`` of the layout
    the surviving workers of the changed group hold afterwards (its current one).
    """

    def __init__(
        self,
        workers: Workers,
        dsts: Sequence[RankLayout | None],
        timeout_s: "float | Deadline",
        what: str,
        keeps: str,
        layout: str,
    ):
        if len(dsts) != len(workers):
            raise ValueError(f"{len(dsts)} destinations for {len(workers)} workers")
        self.id = uuid.uuid4().hex[:12]
        self.workers, self.dsts = workers, list(dsts)
        self.deadline, self.what, self.keeps, self.layout = as_deadline(timeout_s), what, keeps, layout
        self.handles: list[dict] | None = None
        log.debug("operation %s: %s", self.id, what)

    # -- steps -----------------------------------------------------------------------------
    def prepare(self, into: Layout | None = None) -> list[dict]:
        """Step 1 on every worker; returns each worker's ``{"dst": handles, "src": handles}``.
        ``into``: a copy into ``into``, which each receiving worker checks it holds."""
        refs = [a.op_prepare.remote(self.id, d, True, into) for a, d in zip(self.workers.actors, self.dsts)]
        self.handles = self.call(refs, "prepare")
        return self.handles

    def call(self, refs: Sequence, step: str) -> list[Any]:
        """Wait for one step's calls (one per worker); abort all on failure."""
        try:
            return gather(self.workers, refs, self.deadline, f"{self.what}: {step}")
        except ReallocationError as err:
            self.abort(err)

    def execute_plan(
        self, world, plan: Plan, srcs: Sequence[RankLayout | None], placement: Placement, tags: dict
    ) -> PhaseResult:
        """Step 2 for a plan: both phases on every worker (plan worker ``i`` = ``workers[i]``)."""
        if self.handles is None:
            raise RuntimeError("execute before prepare")
        plan.validate(len(self.workers))
        peers = [
            PeerView(
                world.rank_of(a),
                placement.nodes[i],
                srcs[i],
                self.dsts[i],
                self.handles[i]["src"] if srcs[i] is not None else None,
                self.handles[i]["dst"],
            )
            for i, a in enumerate(self.workers.actors)
        ]
        shares = [ray.put(share) for share in worker_shares(plan, peers)]
        results: list[dict] | None = None
        try:
            for phase in (0, 1):
                refs = [
                    a.op_execute.remote(self.id, world.id, [shares[i]], i, phase, {**tags, "rank": str(i)})
                    for i, a in enumerate(self.workers.actors)
                ]
                results = _merged(results, gather(self.workers, refs, self.deadline, f"{self.what}: transfer"))
        except ReallocationError as err:
            world.mark_broken()  # peers may be stuck mid-collective: the next operation forms a fresh world
            self.abort(err)
        return PhaseResult.of(results, self.workers.names, timed=False)

    def run_plan(
        self,
        world,
        plan: Plan,
        srcs: Sequence[RankLayout | None],
        placement: Placement,
        shared: Sequence[bool],
        tags: dict,
        order: MoveOrder = PLAIN_MOVE,
        held: Sequence[RankLayout | None] | None = None,
    ) -> PhaseResult:
        """Steps 1-3 for a plan in one call per worker (``ShardWorker.op_run``): prepare, both phases
        and commit on every worker, one driver round trip. ``shared[i]``: worker ``i`` exports
        zero-copy handles (its ``info()["zero_copy"]``); ``held[i]``: what worker ``i``'s buffers
        hold when it sends ``srcs[i]`` converted (``PeerView.held``; None: what it sends).

        The workers exchange zero-copy handles and fan-out readiness among themselves, and each
        commits when its own part is done. Any failure anywhere aborts every live worker, which
        rolls a committed one back: afterwards every live worker holds the old layout, as after a
        failed commit of :meth:`commit`. Not for blending commits (``copy_to(eta=)``): a blend
        rewrites destination buffers that other workers may still be reading (an ``order`` with a
        ``blend`` is a ``ValueError``). ``order``: the :class:`~actors.records.MoveOrder` every
        worker gets: ``keep``, every worker keeps the layout it leaves resident
        (actors/worker/kept.py); ``delta``, a move with ``delta=True`` (actors/wire/delta.py);
        ``convert``, the layout the destination workers convert into before committing
        (realloc/plan/formats.py; the plan's destination is that layout in the source's weight format).
        """
        if self.handles is not None:
            raise RuntimeError("run_plan replaces prepare/execute/commit; this operation is already prepared")
        if order.blend is not None:
            raise ValueError(
                f"run_plan commits on each worker when its part is done: no blend (got blend={order.blend!r}); "
                "a blend goes through prepare, execute_plan and commit(blend=)"
            )
        try:
            results = run_shares(
                self.workers,
                world,
                plan,
                srcs,
                self.dsts,
                placement,
                shared,
                self.deadline,
                f"{self.what}: prepare, transfer and commit",
                lambda a, i, key, share: a.op_run.remote(
                    self.id, world.id, key, share, i, {**tags, "rank": str(i)}, order
                ),
                held,
            )
        except ReallocationError as err:
            self.abort(err)
        return PhaseResult.of(results, self.workers.names, delta=order.delta)

    def adopt(self, layout: Layout, version: int, keep: KeepOrder | None = None) -> PhaseResult:
        """Steps 1-3 of a move to a kept ``layout`` that holds weight ``version`` (``op_adopt``:
        one call per worker, buffers swapped, no traffic). Any failure aborts every live worker,
        which puts its current buffers back and keeps the adopted ones resident again."""
        refs = [a.op_adopt.remote(self.id, layout, version, keep) for a in self.workers.actors]
        results = self.call(refs, "adopt the kept layout")
        return PhaseResult.of(results)

    def commit(self, blend: float | None = None) -> None:
        """Step 3: every worker adopts; any failure rolls every live worker back."""
        refs = [
            a.op_commit.remote(self.id, blend if d is not None else None)
            for a, d in zip(self.workers.actors, self.dsts)
        ]
        self.call(refs, "commit")

    # -- failure -----------------------------------------------------------------------------
    def abort(self, cause: ReallocationError) -> NoReturn:
        """Step 4: undo the operation on every live worker, then raise what is true.

        Waits only within the deadline's grace, and only for the workers that answered the
        diagnosis' pings (``cause``: every worker but the dead and the unresponsive); a silent
        worker's abort is sent and queued (it runs when the worker resumes; it never adopted
        anything without a commit). A worker that answers pings but is still in the failed call
        (blocked on a peer until its collective times out) and whose abort has not run by then is
        ``waiting``: its abort is queued behind that call. Nobody is pinged again.
        """
        dead, silent = set(cause.dead), set(cause.unresponsive)
        found = undo(self.workers, cause, "op_abort", self.id, seconds=self.deadline.grace())
        all_dead = sorted(dead | set(found.dead))
        unresponsive, waiting = sorted(silent), sorted(found.unresponsive)  # ``waiting``: they answered pings
        state = f"Rolled back: {self.keeps}; every live worker whose abort ran holds its old shards and weights"
        if waiting:
            state += (
                f"; {waiting} answer pings but are still in the failed call (e.g. blocked on a peer until "
                "their collective times out): their abort is queued and runs when that call returns"
            )
        if unresponsive:
            state += (
                f"; {unresponsive} did not answer: their abort is queued and runs when they resume "
                "(they never adopted anything without a commit)"
            )
        if found.failed:
            state += f"; the abort raised on {list(found.failed)}: their state is unknown"
        if all_dead:
            state += f"; dead: {all_dead} (call replace_dead_workers(), then restore their weights from a checkpoint)"
        log.warning("operation %s (%s) aborted: %s", self.id, self.what, cause.message)
        raise ReallocationError(f"{cause.message}. {state}.", all_dead, unresponsive, self.layout, waiting) from cause


#: (plan, world, peers) -> (key, ObjectRefs of every worker's (PlanSlice, PeerTable), plan): a loop
#: alternating layouts cuts and ships each plan once; the workers cache it by key
#: (``ShardWorker._worker_plan``).
_WORKER_PLANS: "OrderedDict[tuple, tuple[str, list, Plan]]" = OrderedDict()
_WORKER_PLANS_KEPT = 16


def worker_plan_refs(
    plan: Plan,
    world,
    actors: Sequence,
    srcs,
    dsts,
    placement: Placement,
    shared: Sequence[bool],
    held: Sequence[RankLayout | None] | None = None,
) -> tuple[str, list]:
    """``(key, [ObjectRef of worker i's (PlanSlice, PeerTable)])`` of ``plan`` over ``world``:
    each worker is shipped its own share only (cached: see above). ``held``: ``PeerView.held`` of
    each worker (None: every worker's buffers hold what it sends)."""
    ranks = tuple(world.rank_of(a) for a in actors)
    held = tuple(held) if held is not None else (None,) * len(ranks)
    key = (id(plan), world.id, ranks, tuple(srcs), tuple(dsts), tuple(placement.nodes), tuple(shared), held)
    hit = _WORKER_PLANS.get(key)
    if hit is not None and hit[2] is plan:
        _WORKER_PLANS.move_to_end(key)
        return hit[0], hit[1]
    plan.validate(len(actors))
    peers = [
        PeerView(r, placement.nodes[i], srcs[i], dsts[i], shared=bool(shared[i]), held=held[i])
        for i, r in enumerate(ranks)
    ]
    refs = [ray.put(share) for share in worker_shares(plan, peers)]
    entry = _WORKER_PLANS[key] = (uuid.uuid4().hex, refs, plan)
    while len(_WORKER_PLANS) > _WORKER_PLANS_KEPT:
        _WORKER_PLANS.popitem(last=False)
    return entry[0], entry[1]


def run_shares(
    workers: Workers,
    world,
    plan: Plan,
    srcs: Sequence[RankLayout | None],
    dsts: Sequence[RankLayout | None],
    placement: Placement,
    shared: Sequence[bool],
    deadline: Deadline,
    what: str,
    send: Callable[[Any, int, str, list], Any],
    held: Sequence[RankLayout | None] | None = None,
) -> list[WorkerReport]:
    """Every worker's share of ``plan`` run in one call per worker, on either lane: ``send(actor,
    i, key, [share])`` is the remote call that runs worker ``i``'s share (``op_run`` for a move,
    ``stage_run`` for a staged update); their reports, gathered within ``deadline``. A failure
    marks ``world`` broken (peers may be stuck mid-collective: the next operation forms a fresh
    world) and raises the :class:`ReallocationError` for the caller's undo. ``held``: as
    :func:`worker_plan_refs` says."""
    key, shares = worker_plan_refs(plan, world, workers.actors, srcs, dsts, placement, shared, held)
    try:
        refs = [send(a, i, key, [shares[i]]) for i, a in enumerate(workers.actors)]
        return gather(workers, refs, deadline, what)
    except ReallocationError:
        world.mark_broken()
        raise


def _merged(acc: list[WorkerReport] | None, new: list[WorkerReport]) -> list[WorkerReport]:
    """Each worker's report of the phases so far, with its report of the next phase added."""
    if acc is None:
        return new
    for a, b in zip(acc, new):
        a.merge(b)
    return acc
