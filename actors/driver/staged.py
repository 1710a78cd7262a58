"""Staged updates: new weights move while the destination keeps serving, then switch in at once.

``trainer.copy_to(generator, stage=True)`` (or ``group.reallocate(dst, stage=True)``) returns a
:class:`StagedUpdate` at once. A driver thread moves the bytes into a *shadow* set of the
destination's buffers, on the workers' stage thread and over a world of its own
(actors/worker/staging.py), while the destination serves ``call(..., writes=False)`` on the
weights it has committed. The protocol (docs/architecture.md, "Staged updates"):

0. The plan is made when the update is asked for, from the groups' layouts and workers as they
   are then (:class:`PlannedFrom`); the update checks that they still are once it holds each group:
   the destination when it registers the update (from then on it refuses every change), the source
   once its lock is taken. A change committed in between (another thread's ``reallocate``, a
   ``replace_dead_workers``) refuses the update with ``GroupBusyError``: nothing was staged (a plan
   of the old layout would read the boxes at the wrong offsets), ask again.
1. ``staging``: the transfer runs. The source is held (its lock: its weights cannot change
   under the transfer); the destination refuses every other change (``GroupBusyError``) but
   serves calls that do not write. A failure anywhere (a dead sender or receiver, the deadline)
   drops the shadow sets of every live worker: ``failed``, the serving weights never changed.
2. ``staged``: every byte arrived (``wait()`` returns the stats). ``abort()`` drops it.
3. ``commit(at="now")``: between two calls (it waits for a running call), every worker swaps the
   shadow set in, keeping the old one as its rollback; if any worker fails, every live worker
   swaps back (``failed``: the old version serves everywhere). Then ``on_shards_changed`` runs.
   The time calls wait for the switch (and the hook) is ``pause_seconds``.
   ``commit(at="safe_point")`` (same layout only): every worker is *armed*; each model replica
   switches at the next ``ctx.safe_point()`` its ranks agree on (or at the start of the next
   call), so a long generation call picks the new weights up between two decode steps. The
   decision is made when the driver arms: a worker that dies while being armed is named, the
   live ones still switch.

The destination's ``version`` becomes the update's (its source's weight version; never going
back: ``max(destination's + 1, source's)``), as do ``ReallocStats.version``, the hook's
``ShardChange.version`` and the ``realloc_weight_version`` metric.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from actors import metrics
from actors.driver.protocol import run_shares
from actors.errors import GroupBusyError, ReallocationError
from actors.lanes import STAGE
from actors.records import DeltaOrder, KeepOrder, MoveOrder, PhaseResult, ShardChange
from actors.remote import FAILURE_GRACE_S, Deadline, Workers, check_timeout, fire, gather, settle, undo
from actors.trace import MoveRef, MoveTrace, gather_trace, wall_spans
from realloc.layout import Layout, RankLayout
from realloc.plan import Placement, Plan

log = logging.getLogger(__name__)

#: Where ``StagedUpdate.commit`` switches the weights in.
COMMIT_AT = ("now", "safe_point")
#: States of a staged update, in order (``failed``/``aborted`` end it without a change).
STATES = ("staging", "staged", "committing", "committed", "failed", "aborted")


@dataclass(frozen=True)
class PlannedFrom:
    """What a staged update's plan was made from, of one group: its ``layout``, its ``workers``
    and its ``placement``, read before the update holds the group. ``replace_dead_workers``
    publishes new ``workers`` first and the placement read from them (with the workers' infos)
    later, after the replacements answer: a plan made in between has the new workers on the old
    placement, so both objects are compared (by identity: only a replacement sets them)."""

    group: Any
    layout: Layout
    workers: Workers
    placement: Any = None

    @classmethod
    def of(cls, group: Any, layout: Layout | None = None) -> "PlannedFrom":
        """``group`` now (``layout``: the one the plan takes for it, read from it earlier)."""
        return cls(group, group.layout if layout is None else layout, group.workers, group.placement)

    def changes(self) -> list[str]:
        """What the group changed since (empty: nothing the plan depends on)."""
        out = []
        if self.group.layout != self.layout:
            out.append(f"its layout is {self.group.layout} now, the plan's is {self.layout}")
        if self.group.workers is not self.workers:
            out.append("its workers were replaced (replace_dead_workers)")
        elif self.group.placement is not self.placement:
            out.append("its replaced workers were placed after the plan was made (replace_dead_workers)")
        return out


class StagedUpdate:
    """One staged update of ``dest`` (from ``source``; the same group for a staged move).

    ``version``: the weight version it brings; ``state``: one of :data:`STATES`; ``stats``: the
    transfer's :class:`~actors.driver.group.ReallocStats` once staged; ``pause_seconds``: how long the
    commit held the destination's calls (``at="now"``); ``error``: why it failed.
    """

    def __init__(
        self,
        source: Any,
        dest: Any,
        target: Layout,
        order: MoveOrder,
        *,
        version_of: Callable[[], int],
        workers: Workers,
        srcs: Sequence[RankLayout | None],
        dsts: Sequence[RankLayout | None],
        placement: Placement,
        shared: Sequence[bool],
        held: Sequence[RankLayout | None] | None = None,
        make_plan: Callable[[], Plan],
        groups: Sequence[Any],
        label: str,
        make_stats: Callable[..., Any],
        timeout_s: float | None = None,
        hold_source: bool = True,
        delta: bool = False,
        relay: "StagedUpdate | None" = None,
        planned: Sequence[PlannedFrom] | None = None,
    ):
        if order.blend is not None or order.delta is not None or order.relay is not None:
            raise ValueError(
                f"a staged update's order names what to keep and convert into; its delta order is decided "
                f"once the source is held (delta=True), it never blends, and it relays ``relay``, got {order!r}"
            )
        if relay is not None and (relay.dest is not source or delta or relay.target != source.layout):
            raise ValueError(
                f"a relay sends the staged set of an update into its source ({source.name!r} in layout "
                f"{source.layout}) as it is, never as a delta; got {relay!r} (delta={delta})"
            )
        self.id = uuid.uuid4().hex[:12]
        # relay: the staged update of ``source`` whose staged set (not its serving one) is sent: the
        # weights are that update's source's, of its version (a fleet update: actors/driver/fleet.py)
        self.relay = relay
        if relay is not None:
            order = replace(order, relay=relay.id)
        # keep: what the switch keeps; convert: the receivers convert into this layout
        # (realloc/plan/formats.py); delta: set once the source is held (actors/wire/delta.py)
        self.order = order
        self.delta = delta
        # planned: what the plan was made from (the source's, then a copy's destination's); checked
        # once the update holds each group (check_planned)
        self.planned = (
            list(planned) if planned is not None else [PlannedFrom.of(g) for g in dict.fromkeys((source, dest))]
        )
        if self.planned[0].group is not source or self.planned[-1].group is not dest:
            raise ValueError(f"planned names the source, then the destination (one for a staged move), got {planned}")
        self.sent_layout = self.planned[0].layout
        self.source, self.dest, self.target = source, dest, target
        self.version_of, self.hold_source = version_of, hold_source
        self._version: int | None = None
        self.source_version: int | None = None  # the source's version when it was held
        self._versioned = threading.Event()
        self.kind = "reallocate" if source is dest else "copy"
        self.before = self.planned[-1].layout
        self.workers, self.srcs, self.dsts = workers, list(srcs), list(dsts)
        self.placement, self.shared, self.make_plan, self.groups = placement, list(shared), make_plan, list(groups)
        self.held = held  # PeerView.held of each worker: a sender's buffers when it converts as it sends
        self.label, self.make_stats = label, make_stats
        self.deadline = Deadline(max(g.timeout_s for g in self.groups) if timeout_s is None else timeout_s)
        self.state = "staging"
        self.stats = None
        self.move: MoveRef | None = None  # set when the transfer ended: what trace() gathers
        self.error: ReallocationError | None = None
        self.pause_seconds: float | None = None
        self.at: str | None = None
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._stage, name=f"realloc-stage-{self.id}", daemon=True)

    @property
    def origin(self) -> tuple[str, int | None]:
        """Whose weights, of which version, the update brings: its source's when the source was
        held; a relay's, those of the update it relays (the fleet's trainer)."""
        if self.relay is not None:
            return self.relay.origin
        return self.source.name, self.source_version

    @property
    def keep(self) -> KeepOrder | None:
        """What the switch keeps of the layout it leaves (None: nothing)."""
        return self.order.keep

    @property
    def delta_order(self) -> DeltaOrder | None:
        """The delta order the transfer carries: None until the source is held, or without delta."""
        return self.order.delta

    def __repr__(self) -> str:
        return f"StagedUpdate({self.label}, version {self.known_version}, {self.state})"

    @property
    def version(self) -> int:
        """The weight version the update brings: its source's when the staging thread took hold of
        the source (``max(destination + 1, source)``). Waits for that moment (the source may be
        finishing a call); raises the update's error if it failed before."""
        if not self._versioned.wait(self.deadline.remaining() + FAILURE_GRACE_S + 5.0):
            raise TimeoutError(f"staged update {self.label}: the source was not free within its deadline")
        if self._version is None:
            raise self.error
        return self._version

    @property
    def known_version(self) -> "int | str":
        """The version if already known, else ``"pending"`` (for messages: never waits)."""
        return self._version if self._version is not None else "pending"

    def start(self) -> "StagedUpdate":
        self._thread.start()
        return self

    # -- the transfer (driver thread) ------------------------------------------------------
    def _stage(self) -> None:
        started = time.perf_counter()
        try:
            held = (
                self.source.ledger.exclusive(f"stage update {self.label}", deadline=self.deadline, staged_ok=True)
                if self.kind == "copy" and self.hold_source
                else nullcontext()
            )
            with held:  # the source's weights cannot change from here to the end of the transfer
                self.check_planned(self.source)  # ... nor its layout: is it still the plan's?
                self._version = self.version_of()
                self.source_version = self.source.version
                self.sent_layout = self.source.layout
                source = self.source.ledger
                self.order = replace(
                    self.order,
                    delta=source.delta_order(self.delta, self.dest.ledger, source.copied_version(self.dest.ledger)),
                )
                self._versioned.set()
                self.stats = self._transfer(started)
            self._set("staged")
        except ReallocationError as err:
            self.error = err
            self._set("failed")
        except BaseException as err:  # noqa: BLE001 - kept for wait(), which re-raises it
            self.error = ReallocationError(
                f"staged update {self.label} failed on the driver: {type(err).__name__}: {err}. {self._untouched()}",
                layout=str(self.dest.layout),
            )
            self.error.__cause__ = err
            self._set("failed")
            self._drop_everywhere()
        finally:
            if self.state == "failed":
                self._sources_unknown()
                self.dest.ledger.end_stage(self)
            self._versioned.set()
            self._finished.set()

    def _transfer(self, started: float):
        t0 = time.perf_counter()
        plan = self.make_plan()
        plan_seconds = time.perf_counter() - t0
        try:
            world = self.groups[0].world_for(STAGE, self.groups, self.deadline)
        except ReallocationError as err:
            self._abort(err)
        try:  # the move lane's code (actors/driver/protocol.py), on the stage lane's world and call
            results = run_shares(
                self.workers,
                world,
                plan,
                self.srcs,
                self.dsts,
                self.placement,
                self.shared,
                self.deadline,
                f"staged update {self.label}: transfer",
                lambda a, i, key, share: a.stage_run.remote(
                    self.id, world.id, key, share, i, {"model": self.label, "rank": str(i)}, self.version, self.order
                ),
                self.held,
            )
        except ReallocationError as err:
            self._abort(err)
        self.move = MoveRef(
            f"staged {self.label}",
            self.id,
            self.workers,
            tuple(self.placement.nodes),
            wall_spans(("staged transfer", started, time.perf_counter()), ("plan", t0, t0 + plan_seconds)),
            lane=STAGE,
        )
        result = PhaseResult.of(results, self.workers.names, delta=self.order.delta)
        stats = self.make_stats(plan, plan_seconds, result)
        stats.version = self.version
        stats.shadow_bytes_per_actor = result.shadow_bytes
        return stats

    def check_planned(self, group: Any) -> None:
        """``GroupBusyError`` when ``group`` (held by the caller, or refusing every change) is no
        longer what the plan was made from: another operation committed a change to it between the
        request and the hold. Nothing was staged then: the plan would send or receive the boxes of
        a layout the workers no longer hold."""
        for planned in self.planned:
            changes = planned.changes() if planned.group is group else []
            if changes:
                raise GroupBusyError(
                    f"stage update {self.label}: group {group.name!r} changed after the update was planned "
                    f"from it and before the update held it ({'; '.join(changes)}: another operation "
                    f"committed in between); nothing was staged. {self._untouched()}; stage the update again",
                    layout=str(self.dest.layout),
                )

    def _untouched(self) -> str:
        return (
            f"The serving weights are untouched: {self.dest.name!r} serves weight version {self.dest.version} "
            f"in layout {self.dest.layout}"
        )

    def _abort(self, cause: ReallocationError):
        """Drop the shadow sets of every live worker (within the failure grace), then raise what is true."""
        dead, silent = set(cause.dead), set(cause.unresponsive)
        found = undo(self.workers, cause, "stage_abort", self.id, seconds=self.deadline.grace())
        state = self._untouched()
        if found.unresponsive:
            state += (
                f"; {list(found.unresponsive)} are still in the transfer: their shadow set is dropped when it returns"
            )
        if silent:
            state += f"; {sorted(silent)} did not answer: their shadow set is dropped when they resume"
        all_dead = sorted(dead | set(found.dead))
        if all_dead:
            state += f"; dead: {all_dead}"
        log.warning("staged update %s (%s) failed: %s", self.id, self.label, cause.message)
        raise ReallocationError(
            f"{cause.message}. {state}.", all_dead, sorted(silent), str(self.dest.layout), sorted(found.unresponsive)
        ) from cause

    def _drop_everywhere(self) -> None:
        settle(
            self.workers, fire(self.workers, "stage_abort", self.id), min(FAILURE_GRACE_S, self.deadline.remaining())
        )

    def _set(self, state: str) -> None:
        with self._lock:
            self.state = state

    # -- the caller's side -----------------------------------------------------------------
    def done(self) -> bool:
        """Whether the transfer ended (staged or failed)."""
        return self._finished.is_set()

    def wait(self, timeout_s: float | None = None):
        """Wait for the transfer; returns its stats, or raises its :class:`ReallocationError`
        (the serving weights untouched). ``timeout_s``: give up waiting (``TimeoutError``; the
        transfer goes on, bounded by the update's own deadline; a finite positive number of
        seconds)."""
        if timeout_s is not None:
            check_timeout(timeout_s)
        limit = self.deadline.remaining() + FAILURE_GRACE_S + 5.0 if timeout_s is None else timeout_s
        if not self._finished.wait(limit):
            raise TimeoutError(f"staged update {self.label} still transferring after {limit:.1f}s")
        if self.error is not None:
            raise self.error
        return self.stats

    def trace(self, timeout_s: float | None = None) -> MoveTrace:
        """The timeline of this update's transfer (every worker's phases and steps on the
        driver's clock, as ``ModelGroup.last_trace`` gives a move's: actors/trace.py), gathered
        now. ``ValueError`` before the transfer ended or after it failed, or when a worker has
        run another staged update since. ``timeout_s``: a finite positive number of seconds
        (default: the update's)."""
        if timeout_s is not None:
            check_timeout(timeout_s)
        if self.move is None:
            raise ValueError(
                f"staged update {self.label} is {self.state}: its trace is there once the transfer has staged it"
            )
        return gather_trace(self.move, Deadline(self.deadline.seconds if timeout_s is None else timeout_s))

    def commit(self, at: str = "now") -> None:
        """Switch the destination to the staged weights: ``at="now"`` (between two calls, all
        workers or none) or ``at="safe_point"`` (each replica at its next agreed safe point).
        Waits for the transfer first (raising its error). ``GroupBusyError`` when a call held the
        destination past its ``timeout_s``: nothing switched, the update is still staged (commit
        it again, or abort it)."""
        if at not in COMMIT_AT:
            raise ValueError(f"at={at!r}; allowed: {', '.join(repr(a) for a in COMMIT_AT)}")
        if at == "safe_point" and self.target != self.before:
            raise ValueError(
                f"a staged move to another layout ({self.before} -> {self.target}) switches between calls: "
                "commit(at='now')"
            )
        self.wait()
        with self._lock:
            if self.state != "staged":
                raise ValueError(f"staged update {self.label} is {self.state}; only a staged one can be committed")
            self.state = "committing"
        self.at = at
        try:
            if at == "now":
                self._commit_now()
            else:
                self._arm()
        finally:
            if self.state == "committing":
                self._set("failed")

    def _commit_now(self) -> None:
        dest = self.dest
        deadline = Deadline(dest.timeout_s)
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(
                    dest.ledger.exclusive(f"commit staged update {self.label}", deadline=deadline, staged_ok=True)
                )
            except GroupBusyError as err:  # a call held the group past the deadline: nothing switched
                self._set("staged")
                raise GroupBusyError(
                    f"{err.message}; staged update {self.label} is still staged (every worker serves version "
                    f"{dest.version}): commit it again or abort() it",
                    layout=str(dest.layout),
                ) from err
            t0 = time.perf_counter()  # from here the destination's calls wait: the pause
            workers = dest.workers
            try:
                gather(
                    workers,
                    [a.stage_switch.remote(self.id) for a in workers.actors],
                    deadline,
                    f"commit staged update {self.label}: switch",
                )
            except ReallocationError as err:
                self._roll_back(err, deadline)
            self.dest.ledger.commit_staged(self)
            dest.ledger.end_stage(self)
            try:
                dest.announce(ShardChange(self.kind, self.target, self.before, version=self.version))
            finally:
                self.pause_seconds = time.perf_counter() - t0  # the switch and the hook
                metrics.record_pause(dest.name, "commit_staged", self.pause_seconds)
        fire(workers, "stage_finish", self.id)  # the old set becomes the next shadow set (after the calls' pause)

    def _roll_back(self, cause: ReallocationError, deadline: Deadline):
        dest = self.dest
        workers = dest.workers
        dead, silent = set(cause.dead), set(cause.unresponsive)
        found = undo(workers, cause, "stage_unswitch", self.id, seconds=deadline.grace())
        self._set("failed")
        self._sources_unknown()
        dest.ledger.end_stage(self)
        state = (
            f"Rolled back: every live worker whose rollback ran serves version {dest.version} in layout "
            f"{dest.layout} again"
        )
        if silent:
            state += f"; {sorted(silent)} did not answer: their rollback runs when they resume"
        if found.unresponsive or found.failed:
            state += f"; {list(found.unresponsive + found.failed)} did not confirm the rollback: state unknown"
        all_dead = sorted(dead | set(found.dead))
        if all_dead:
            state += f"; dead: {all_dead} (call replace_dead_workers(), then load their weights)"
        raise ReallocationError(
            f"{cause.message}. {state}.", all_dead, sorted(silent), str(dest.layout), list(found.unresponsive)
        ) from cause

    def _arm(self) -> None:
        dest = self.dest
        deadline = Deadline(dest.timeout_s)
        workers = dest.workers
        refs = [a.stage_arm.remote(self.id) for a in workers.actors]
        try:
            gather(workers, refs, deadline, f"commit staged update {self.label} at safe points: arm")
        except ReallocationError as err:
            self.dest.ledger.commit_staged(self)  # the decision stands: every armed live worker switches
            raise ReallocationError(
                f"{err.message}. Committed: every live, armed worker of {dest.name!r} switches to version "
                f"{self.version} at its next safe point (or next call); dead: {err.dead}, not answering pings: "
                f"{err.unresponsive} (their replica cannot agree on a safe point until they answer: resume a stopped "
                f"one, it then switches at its next call; a call that failed meanwhile leaves the process groups "
                f"of user code to be re-formed by the next call or replace_dead_workers()), arm not yet "
                f"confirmed: {err.waiting}",
                err.dead,
                err.unresponsive,
                str(dest.layout),
                err.waiting,
            ) from err
        self.dest.ledger.commit_staged(self)

    def _sources_unknown(self) -> None:
        """A failed or dropped update: the senders may have taken what they sent as their delta base."""
        if self.delta_order is not None:
            self.source.ledger.delta_done(self.sent_layout, self.dest.ledger, self.delta_order, False)

    def abort(self) -> None:
        """Drop the staged weights (waiting for the transfer to end first); the serving ones never
        changed. A no-op on a failed or aborted update; a committed one cannot be aborted."""
        try:
            self.wait()
        except ReallocationError:
            return
        with self._lock:
            if self.state in ("failed", "aborted"):
                return
            if self.state != "staged":
                raise ValueError(f"staged update {self.label} is {self.state}; it can no longer be aborted")
            self.state = "aborted"
        self._sources_unknown()
        found = settle(
            self.workers,
            [a.stage_abort.remote(self.id) for a in self.workers.actors],
            self.dest.timeout_s,
        )
        self.dest.ledger.end_stage(self)
        if found.dead or found.unresponsive or found.failed:
            raise ReallocationError(
                f"abort of staged update {self.label}: {found.describe() or f'failed on {list(found.failed)}'}. "
                f"{self._untouched()}; the others dropped their shadow sets",
                found.dead,
                found.unresponsive,
                str(self.dest.layout),
            )

    def finish_switch(self, deadline: Deadline) -> None:
        """After ``commit(at="safe_point")``: make every live worker that has not reached a safe
        point switch now (between calls), so the group is in one version again; the update ends
        here. A dead worker is left to ``replace_dead_workers``; a worker still in a call switches
        when the call returns (its switch is queued before any later call)."""
        workers = self.dest.workers
        found = settle(workers, [a.stage_switch.remote(self.id) for a in workers.actors], deadline.remaining())
        fire(workers, "stage_finish", self.id)
        self.dest.ledger.end_stage(self)
        if found.failed:
            raise ReallocationError(
                f"finish staged update {self.label}: the switch failed on {list(found.failed)}: their state is "
                f"unknown; the other live workers serve version {self.version}",
                found.dead,
                found.unresponsive,
                str(self.dest.layout),
            )
        if found.dead or found.unresponsive:
            log.warning(
                "staged update %s: switched in on every live worker; dead %s, still in a call %s (queued)",
                self.id,
                list(found.dead),
                list(found.unresponsive),
            )
