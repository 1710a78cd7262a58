"""The worker's side of staged updates: weights that arrive while the worker serves.

A staged update (``ModelGroup.copy_to(..., stage=True)``, ``reallocate(..., stage=True)``,
driver side in :mod:`actors.driver.staged`) writes a *shadow* set of this worker's buffers on the
worker's ``stage`` thread (a Ray concurrency group of its own) over a transport of its own,
while the default thread keeps running the user's calls on the serving buffers. Nothing the
worker serves changes until the update is switched in:

* ``open_rendezvous(STAGE, ...)``/``join(STAGE, ...)`` (``ShardWorker``, dispatched on the stage
  thread by ``World.form``): the staged updates' own world, the :data:`~actors.lanes.STAGE` lane.
* ``stage_run``: receive (or send) this worker's part of the plan into the shadow set (reused
  from the previous update: double buffering). The serving buffers are untouched.
* ``stage_arm``: the driver decided to commit; the worker switches at the next *safe point*
  its whole model replica agrees on (:meth:`StagingMixin.safe_point`, called by the user's
  generation loop between decode steps), or at the start of the next call the driver marks.
* ``stage_switch``: switch now, on the default thread (between two calls), keeping the old set
  as the rollback; ``stage_unswitch`` puts it back (a commit that failed elsewhere).
* ``stage_abort``: drop the shadow set (the serving buffers were never touched).

After a switch the buffers that served become the shadow set of the next update, so the memory
cost is one set of this worker's shards, stated in ``stage_run``'s report.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import ray
import torch

from actors.errors import StaleOperationError
from actors.lanes import CONTROL, STAGE
from actors.records import PLAIN_MOVE, KeepOrder, MoveOrder, ShardChange, WorkerReport
from actors.wire.executor import Phases
from actors.worker.context import ShardContext
from actors.worker.kept import Resident
from realloc.layout import RankLayout
from realloc.shards import ShardStore, buffers_nbytes, zero_padding

log = logging.getLogger(__name__)


@dataclass
class StagedSet:
    """This worker's part of one staged update."""

    id: str
    version: int  # the weight version the shadow set will hold
    dst: RankLayout | None  # what this worker will hold; None: it only sends
    buffers: dict[str, torch.Tensor] | None  # the shadow set
    ready: bool = False  # every byte of this worker's part arrived
    armed: bool = False  # the driver committed: switch at the next agreed safe point
    switched: bool = False
    rollback: tuple[RankLayout, dict[str, torch.Tensor], int] | None = None  # (held, buffers, version) before
    keep: KeepOrder | None = None  # reallocate: keep the layout left behind resident
    switched_at: int | None = None  # the safe point (count within the call) where it switched


class StagingMixin:
    """Staged updates on a :class:`~actors.worker.ShardWorker` (state in ``self._realloc``)."""

    # -- the staged transfer (stage thread) -------------------------------------------------
    @ray.method(concurrency_group=STAGE.concurrency_group)
    def stage_run(
        self,
        update_id: str,
        world_id: str,
        key: str,
        plan_box: list,
        me: int,
        tags: dict,
        version: int,
        order: MoveOrder = PLAIN_MOVE,
    ) -> WorkerReport:
        """This worker's part of a staged update: prepare its shadow set (if it receives), run the
        plan over the staged world into it, and report. The serving buffers are only read.
        ``order`` (:class:`~actors.records.MoveOrder`; never a blend): ``keep``, what the switch
        keeps of the layout it leaves; ``delta``, a staged copy with ``delta=True``; ``convert``,
        the layout the shadow set ends in when the plan brings it in the sender's weight format
        (converted here, before it is ready); ``relay``, the staged update whose ready staged set
        this worker sends from (a fleet update's relay: it only sends, and its serving set is not
        read)."""
        keep, convert = order.keep, order.convert
        st = self._realloc
        lane = self._check_world(world_id, STAGE)
        wp = self._worker_plan(key, plan_box, me)
        dst = wp.peers[me].dst
        sending = None
        with st.stage_lock:
            if dst is None and order.relay is not None:  # it sends the staged set of that update
                relayed = st.staged
                if relayed is None or relayed.id != order.relay or not relayed.ready or relayed.switched:
                    state = "none" if relayed is None else f"{relayed.id} (ready: {relayed.ready})"
                    raise StaleOperationError(
                        f"worker of {st.group} cannot relay staged update {order.relay}: its staged set is {state}"
                    )
                sending = (relayed.dst, relayed.buffers)
            if dst is not None and st.staged is not None and st.staged.armed and not st.staged.switched:
                raise StaleOperationError(
                    f"worker of {st.group}: staged update {st.staged.id} is committed but not switched in yet"
                )
            # the share is what this worker holds (or relays), before anything of it changes
            # (actors/worker/guard.py: ValueError naming what it holds and what the plan says)
            self._check_share(wp, me, order, sending[0] if sending is not None else None)
            if dst is None:  # it only sends: nothing of it changes
                buffers, staged = None, StagedSet(update_id, version, None, None)
                if sending is not None:
                    buckets = st.faults.take("exit_relaying")
                    if buckets is not None:
                        st.faults.arm("exit_after_buckets", buckets)
            else:
                self._stage_drop(log_unfinished=True)
                buffers = self._shadow_for(dst)
                staged = st.staged = StagedSet(update_id, version, dst, buffers, keep=keep)
        started = time.perf_counter()
        lane.phases = Phases(update_id)
        result = self._run(_StagedOp(staged), wp, me, lane, order, sending)
        if convert is not None and dst is not None:
            converted = _StagedOp(staged)
            self._convert_destination(converted, convert, lane.phases)
            with st.stage_lock:
                staged.dst, staged.buffers = converted.dst, converted.buffers
            buffers = converted.buffers
        result.seconds = time.perf_counter() - started
        with st.stage_lock:
            if st.staged is staged:
                staged.ready = True
        result.shadow_bytes = buffers_nbytes(buffers.values()) if buffers else 0
        result.phases = dict(lane.phases.seconds)
        return result

    def _shadow_for(self, dst: RankLayout) -> dict[str, torch.Tensor]:
        """The shadow set for ``dst``: the spare left by the last switch if it fits, a kept
        (resident, in place) layout of ``dst``, or new buffers. Padding zeroed."""
        st = self._realloc
        spare, st.shadow_spare = st.shadow_spare, None
        if spare is not None and spare[0] == dst:
            buffers = spare[1]
        else:
            if spare is not None:
                st.allocator.release(spare[1], keep=False)
            kept = st.kept.get(dst.layout)
            if kept is not None and kept.where == "in_place" and kept.held == dst:
                buffers = st.kept.pop(dst.layout).buffers  # the kept layout is refreshed as the shadow set
            else:
                buffers = st.allocator.allocate(dst.buffer_numels(), zero=False)
        zero_padding(ShardStore(dst.shards(), buffers))
        return buffers

    @ray.method(concurrency_group=STAGE.concurrency_group)
    def stage_arm(self, update_id: str) -> str:
        """Commit decided: switch at the next safe point the replica agrees on (or the next call
        the driver marks). Returns the layout this worker serves now."""
        st = self._realloc
        with st.stage_lock:
            staged = self._staged(update_id)
            if not staged.ready:
                raise StaleOperationError(f"staged update {update_id} is not complete on this worker")
            staged.armed = True
        return str(st.held)

    @ray.method(concurrency_group=STAGE.concurrency_group)
    def stage_abort(self, update_id: str) -> str | None:
        """Drop the shadow set of ``update_id`` (idempotent); the serving buffers were never touched.
        A switched update is undone by ``stage_unswitch`` (default thread), not here."""
        st = self._realloc
        with st.stage_lock:
            staged = st.staged
            if staged is not None and staged.id == update_id and not staged.switched:
                self._stage_drop()
        return str(st.held) if st.held else None

    @ray.method(concurrency_group=CONTROL)
    def stage_status(self) -> dict:
        """What this worker serves and whether a staged update is pending (answers during calls)."""
        st = self._realloc
        staged = st.staged
        return {
            "version": st.version,
            "staged": None
            if staged is None
            else {
                "id": staged.id,
                "version": staged.version,
                "ready": staged.ready,
                "armed": staged.armed,
                "switched": staged.switched,
                "switched_at": staged.switched_at,
            },
        }

    # -- switching (default thread: between or inside the user's calls) -------------------
    def stage_switch(self, update_id: str) -> dict:
        """Switch to the shadow set of ``update_id`` now (the serving set becomes the rollback).
        Idempotent: an update already switched at a safe point reports so."""
        st = self._realloc
        if self._realloc.faults.take("exit_in_switch") is not None:
            os._exit(1)
        with st.stage_lock:
            staged = self._staged(update_id)
            if not staged.ready:
                raise StaleOperationError(f"staged update {update_id} is not complete on this worker")
            staged.armed = True
            if not staged.switched:
                self._switch(staged)
        return {"version": st.version, "layout": str(st.held)}

    def stage_unswitch(self, update_id: str) -> str | None:
        """Undo the switch of ``update_id`` (its commit failed on another worker); then drop it."""
        st = self._realloc
        with st.stage_lock:
            staged = st.staged
            if staged is None or staged.id != update_id:
                return str(st.held) if st.held else None
            if staged.switched and staged.rollback is not None:
                held, buffers, version = staged.rollback
                if staged.keep is not None and held.layout in st.kept:
                    st.kept.pop(held.layout)
                new = st.buffers
                st.held, st.buffers, st.version = held, buffers, version
                staged.buffers, staged.switched, staged.rollback = new, False, None
            self._stage_drop()
        return str(st.held) if st.held else None

    def stage_finish(self, update_id: str) -> None:
        """The update is committed everywhere: the buffers that served become the next shadow set
        (or a kept layout, for a staged move with ``keep``)."""
        st = self._realloc
        with st.stage_lock:
            staged = st.staged
            if staged is not None and staged.id == update_id:
                if not staged.switched and staged.dst is not None:
                    raise StaleOperationError(f"staged update {update_id} was not switched on this worker")
                self._stage_drop()

    def stage_release(self) -> int:
        """Free the spare shadow set (a switched update's old set included; a pending update's
        shadow set stays); returns its bytes."""
        st = self._realloc
        with st.stage_lock:
            if st.staged is not None and st.staged.switched:
                self._stage_drop()  # its rollback becomes the spare
            spare, st.shadow_spare = st.shadow_spare, None
            if spare is None:
                return 0
            st.allocator.release(spare[1], keep=False)
            return buffers_nbytes(spare[1].values())

    def safe_point(self, ctx: ShardContext) -> bool:
        """A point between two decode steps of the user's loop where an armed update may switch in.

        The ranks of this worker's model replica (same dp coordinate) agree with one all-reduce
        (MIN over their own group) on whether every one of them is armed; if so they all switch
        here, at the same step, and run ``on_shards_changed`` here (replica members together).
        ``ctx`` (the caller's context) is updated in place. Returns whether it switched."""
        st = self._realloc
        st.safe_points += 1
        staged = st.staged
        armed = staged.version if staged is not None and staged.armed and not staged.switched else -1
        members = ctx.groups.ranks.replica if ctx.groups is not None else (st.rank,)
        if len(members) > 1:
            flag = torch.tensor([armed], dtype=torch.int64, device=st.wire)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=ctx.groups.replica)
            armed = int(flag.item())
        if armed < 0:
            return False
        with st.stage_lock:
            if st.staged is not staged or staged.version != armed:  # cannot happen: armed updates stay until switched
                raise RuntimeError(f"worker of {st.group}: replica agreed on version {armed}, this worker has none")
            self._switch(staged)
            staged.switched_at = st.safe_points
        self._refresh(ctx)
        self.after_change(ShardChange("copy", st.held.layout, staged.rollback[0].layout, version=st.version))
        return True

    def _refresh(self, ctx: ShardContext) -> None:
        fresh = self.context()
        for name in ("tensors", "shards", "layout", "groups", "rank_layout", "buffers", "version"):
            setattr(ctx, name, getattr(fresh, name))

    def _begin_call(self, version: int | None, switch: str | None) -> None:
        """Before a user call: switch first when the driver marked the call (``switch``: an
        update armed on every worker), then take the driver's version (unless an armed update
        has yet to switch in here: then the driver's version is already the new one)."""
        st = self._realloc
        st.safe_points = 0
        if switch is not None:
            staged = st.staged
            if staged is not None and staged.id == switch and not staged.switched:
                self.stage_switch(switch)
                self.after_change(ShardChange("copy", st.held.layout, staged.rollback[0].layout, version=st.version))
        staged = st.staged
        if version is not None and (staged is None or staged.switched or not staged.armed):
            st.version = version  # the driver's version is the served one unless a switch is due

    # -- helpers --------------------------------------------------------------------------
    def _switch(self, staged: StagedSet) -> None:
        """Swap the serving set for the shadow set (under the stage lock, on the default thread)."""
        st = self._realloc
        if staged.dst is None:
            staged.switched = True
            return
        staged.rollback = (st.held, st.buffers, st.version)
        if staged.keep is not None and st.held.layout != staged.dst.layout:
            st.kept[st.held.layout] = Resident(st.held, st.buffers, staged.keep.version, "in_place")
        st.held, st.buffers, st.version = staged.dst, staged.buffers, staged.version
        staged.switched = True

    def _staged(self, update_id: str) -> StagedSet:
        staged = self._realloc.staged
        if staged is None or staged.id != update_id:
            running = staged.id if staged is not None else None
            raise StaleOperationError(f"worker of {self._realloc.group} stages update {running}, not {update_id}")
        return staged

    def _stage_drop(self, log_unfinished: bool = False) -> None:
        """Forget the current staged set; its shadow buffers become the spare (never the serving ones)."""
        st = self._realloc
        staged, st.staged = st.staged, None
        if staged is None:
            return
        if staged.switched:  # committed: the set that served before is the spare (unless kept)
            if staged.rollback is not None and staged.keep is None:
                self._keep_spare(staged.rollback[0], staged.rollback[1])
            return
        if log_unfinished:
            log.warning(
                "worker of %s: staged update %s was never committed or aborted; dropping it", st.group, staged.id
            )
        if staged.buffers is not None:
            self._keep_spare(staged.dst, staged.buffers)

    def _keep_spare(self, held: RankLayout, buffers: dict[str, torch.Tensor]) -> None:
        """Make ``buffers`` the spare shadow set (one at most: an older spare is freed)."""
        st = self._realloc
        if st.shadow_spare is not None:
            st.allocator.release(st.shadow_spare[1], keep=False)
        st.shadow_spare = (held, buffers)


class _StagedOp:
    """The slice of a :class:`~actors.worker.state.PendingOp` that ``ShardWorker._run`` uses, over a shadow set."""

    def __init__(self, staged: StagedSet):
        self.id, self.dst, self.buffers = staged.id, staged.dst, staged.buffers
        self.refreshed = False  # a delta's receiving side reads the serving buffers, never the shadow set

    def store(self) -> ShardStore | None:
        return ShardStore(self.dst.shards(), self.buffers) if self.dst is not None else None
