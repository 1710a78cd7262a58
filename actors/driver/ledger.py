"""A model group's state on the driver, and its one writer: :class:`GroupLedger`.

``ModelGroup`` (actors/driver/group.py) runs the operations; what they change of the group's own
record lives here and changes only through this class's transitions:

- ``layout``, ``version`` and ``origin`` (what every worker holds, the weights' version, and the
  group whose unchanged copy they are);
- the delta bookkeeping (actors/wire/delta.py): ``sent``, the (layout, version) every worker's base
  holds as far as the driver knows, and ``deltas``, the deltas received in a row since a full copy;
- the records of the kept (resident) layouts (actors/worker/kept.py);
- the pending staged update (actors/driver/staged.py), the counters of the operations changing
  the group and of the calls that write, and whether the group was shut down;
- the two locks: ``exclusive`` (one operation at a time) and the state lock the staged updates
  and the calls share.

Readers (``ModelGroup``, ``StagedUpdate``, ``Fleet``, ``CheckpointManager``) read the attributes;
only the methods below write them. The ledger sends nothing to a worker itself: the one remote
question it asks (the workers' staged state, in :meth:`begin_stage`) is the ``stage_states``
callable its group hands it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from actors import metrics
from actors.config import GroupConfig
from actors.errors import GroupBusyError
from actors.records import DeltaOrder, ResidentLayout, ShardChange
from actors.remote import Deadline
from realloc.layout import Layout

if TYPE_CHECKING:
    from actors.driver.staged import StagedUpdate

__all__ = ["GroupLedger"]


class GroupLedger:
    """The state of group ``name`` (created in ``layout``, version 0), and its transitions.

    ``stage_states()``: every worker's ``stage_status`` (the group asks them; only
    :meth:`begin_stage` needs it, to see whether a previous update committed at safe points is
    switched in everywhere)."""

    def __init__(
        self,
        name: str,
        layout: Layout,
        config: GroupConfig,
        stage_states: Callable[[], list[dict]] | None = None,
    ):
        self.name, self.config = name, config
        self._stage_states = stage_states
        self._layout = layout
        self._version = 0
        #: (source group, its version) when the weights are an unchanged copy of that source's
        self._origin: tuple[str, int] | None = None
        self._resident: dict[Layout, ResidentLayout] = {}
        self._lock = threading.RLock()
        self._closed = False
        # staged updates (actors/driver/staged.py): the pending one, and the operations changing the group
        self._staged: StagedUpdate | None = None
        self._state_lock = threading.Lock()
        self._changing = 0
        self._writing = 0  # calls that write, running
        # delta moves (actors/wire/delta.py): the (layout, version) every worker's base holds, as far
        # as the driver knows, and the deltas this group received in a row since a full copy
        self._sent: tuple[Layout, int] | None = None
        #: replaced ranks not yet holding their shards, and whether the user code's process groups
        #: (ctx.groups) may be broken (a failed call or run, a replacement): re-formed before the next call
        self._unready: set[int] = set()
        self._user_groups_broken = False
        self._deltas = 0

    # -- reads ---------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        """What every worker holds."""
        return self._layout

    @property
    def version(self) -> int:
        """The weights' version (never going back)."""
        return self._version

    @property
    def origin(self) -> tuple[str, int] | None:
        """(source group, its version) when the weights are an unchanged copy of that source's."""
        return self._origin

    @property
    def sent(self) -> tuple[Layout, int] | None:
        """The (layout, version) every worker's delta base holds, as far as the driver knows."""
        return self._sent

    @property
    def deltas(self) -> int:
        """The deltas this group received in a row since a full copy."""
        return self._deltas

    @property
    def staged(self) -> StagedUpdate | None:
        """The pending staged update (one committed at safe points stays until switched everywhere)."""
        return self._staged

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s

    def kept(self, layout: Layout) -> ResidentLayout | None:
        """The record of kept layout ``layout``, if the group keeps it."""
        return self._resident.get(layout)

    def kept_layouts(self) -> list[Layout]:
        return list(self._resident)

    def resident_layouts(self) -> list[ResidentLayout]:
        """The kept layouts' records, ``fresh`` when they hold the current version."""
        return [replace(r, fresh=r.version == self._version) for r in self._resident.values()]

    def resident_known(self) -> list[tuple[Layout, int]]:
        return [(layout, r.version) for layout, r in self._resident.items()]

    # -- one operation at a time ---------------------------------------------------------
    @contextlib.contextmanager
    def exclusive(
        self, what: str, *others: "GroupLedger", deadline: Deadline | None = None, staged_ok: bool = False
    ) -> Iterator[None]:
        """Hold the groups' locks; wait for each up to its timeout, or up to ``deadline`` (the
        call's, which the operation run under the locks then shares).

        A group with a staged update pending (actors/driver/staged.py) refuses operations that change
        it (``GroupBusyError``) unless ``staged_ok`` (calls, reads, the update's own steps); one
        committed at safe points is first switched in on every worker."""
        ledgers = sorted({id(g): g for g in (self, *others)}.values(), key=id)  # one global order: no deadlock
        taken, changing = [], []
        try:
            for g in ledgers:
                if g._closed:
                    raise ValueError(f"{what}: group {g.name!r} was shut down")
                waited = time.monotonic()
                if not g._lock.acquire(timeout=g.timeout_s if deadline is None else deadline.remaining()):
                    raise GroupBusyError(
                        f"{what}: group {g.name!r} stayed busy with another operation for "
                        f"{time.monotonic() - waited:.0f}s; nothing was done",
                        layout=str(g.layout),
                    )
                taken.append(g)
                if g._closed:
                    raise ValueError(f"{what}: group {g.name!r} was shut down")
                if not staged_ok:
                    g.enter_change(what, deadline or Deadline(g.timeout_s))
                    changing.append(g)
            yield
        finally:
            for g in reversed(changing):
                with g._state_lock:
                    g._changing -= 1
            for g in reversed(taken):
                g._lock.release()

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """Mark the group shut down, holding its lock (waiting up to its timeout for a running
        operation; past that it is marked all the same)."""
        acquired = self._lock.acquire(timeout=self.timeout_s)
        try:
            self._closed = True
            yield
        finally:
            if acquired:
                self._lock.release()

    def enter_change(self, what: str, deadline: Deadline) -> None:
        """Mark an operation that changes this group (under its lock), or refuse it while a staged
        update is pending; one committed at safe points is switched in everywhere first."""
        with self._state_lock:
            staged = self._staged
            if staged is None:
                self._changing += 1
                return
            if staged.state != "committed":
                raise GroupBusyError(
                    f"{what}: group {self.name!r} has a staged update pending ({staged.label}, version "
                    f"{staged.known_version}, {staged.state}); nothing was done: commit or abort it first",
                    layout=str(self.layout),
                )
        staged.finish_switch(deadline)
        with self._state_lock:
            self._changing += 1

    # -- versions ------------------------------------------------------------------------
    def copy_version(self, source: "GroupLedger", blend: bool = False) -> int:
        """The version a copy of ``source``'s weights gives this group: the source's, unless this
        group's own count is ahead (then the next one: versions never go back, so a kept layout
        tagged with a version is fresh only while nothing changed). A copy of the very weights this
        group already holds (the same source version, nothing written since) keeps its version;
        a ``blend`` never does (``eta*w + (1-eta)*w`` is not ``w`` in every bit)."""
        if not blend and self._origin == (source.name, source.version) and self._version == source.version:
            return self._version
        return max(self._version + 1, source.version)

    def copied_version(self, other: "GroupLedger") -> int | None:
        """The version of this group's weights ``other`` holds unchanged, if it does."""
        return other.origin[1] if other.origin is not None and other.origin[0] == self.name else None

    def changed(self, change: ShardChange) -> ShardChange:
        """After ``change`` was committed: every change but a creation and a move is a change of the
        weights (the version moves on; a copy brings its source's, never going back), and only a
        copy or a move leaves the weights a copy of the origin. Returns ``change`` with the version."""
        if change.version is not None:  # a copy brings its source's version (never going back)
            self._version = change.version
        elif change.kind not in ("create", "reallocate"):
            self._version += 1
        if change.kind not in ("copy", "reallocate"):
            self._origin = None
        if change.version is None:
            change = replace(change, version=self._version)
        metrics.record_version(self.name, self._version)
        return change

    def copied(self, origin: tuple[str, int] | None) -> None:
        """A copy landed: the weights are an unchanged copy of ``origin`` (source name, its version),
        or nobody's (None: a blend)."""
        self._origin = origin

    @contextlib.contextmanager
    def writes(self, what: str, writes: bool) -> Iterator[None]:
        """Around a call or run: one that writes moves the version on (even if it fails: the
        weights may have changed) and is refused while a staged update is pending, whose version
        would not include the write; a staged update cannot start while it runs."""
        if not writes:
            yield
            return
        with self._state_lock:
            staged = self._staged
            if staged is not None and staged.state in ("staging", "staged", "committing"):
                raise GroupBusyError(
                    f"{what} with writes=True: group {self.name!r} has a staged update pending ({staged.label}, "
                    f"{staged.state}) whose version would not include the write; nothing was done: pass "
                    "writes=False, or commit or abort the update first",
                    layout=str(self.layout),
                )
            self._writing += 1
            self._version += 1
            self._origin = None
        try:
            yield
        finally:
            with self._state_lock:
                self._writing -= 1
            metrics.record_version(self.name, self._version)

    # -- moves and kept layouts ----------------------------------------------------------
    def moved(self, target: Layout, keep: ResidentLayout | None) -> None:
        """A move into ``target`` committed: a kept copy of ``target`` (adopted, or refreshed in
        place) is the current layout now, and the layout left is kept as ``keep`` (if given)."""
        self._resident.pop(target, None)
        if keep is not None:
            self._resident[keep.layout] = keep
        self._layout = target

    def forget_kept(self, layout: Layout) -> None:
        """``layout`` is no longer kept (a failed move's aborts freed or restored it, or a staged
        move makes it the shadow set)."""
        self._resident.pop(layout, None)

    def release(self, layouts: list[Layout]) -> None:
        """Free the records of kept ``layouts`` (every one of them kept: the caller checked)."""
        for layout in layouts:
            del self._resident[layout]

    def workers_replaced(self, ranks: Sequence[int]) -> None:
        """Fresh workers joined as ``ranks``: the weights changed (they hold zeros), so the version
        moves on now, before anything can fail; and they keep nothing (no kept layout is whole any
        more), nor a copy's weights, nor a base for deltas. They are not ready (:attr:`unready`)
        until :meth:`replacements_ready`; the user code's process groups are broken meanwhile."""
        self._resident.clear()
        self._origin, self._sent = None, None
        self._version += 1
        self._unready |= set(ranks)
        self._user_groups_broken = True
        metrics.record_version(self.name, self._version)

    @property
    def unready(self) -> frozenset[int]:
        """Replaced ranks not yet holding their shards (a ``replace_dead_workers`` that failed
        after they started: the next one sets them up)."""
        return frozenset(self._unready)

    def replacements_ready(self) -> None:
        """Every replaced rank holds its shards of the layout."""
        self._unready.clear()

    # -- the process groups of user code (ctx.groups) -----------------------------------------
    @property
    def user_groups_broken(self) -> bool:
        """A failed call, run or replacement may have broken the process groups of user code:
        they are re-formed on every worker before the next call (``ModelGroup._repair_user_groups``)."""
        return self._user_groups_broken

    def user_groups_failed(self) -> None:
        """A call or run failed, or workers are being replaced: the user code's groups may be broken."""
        self._user_groups_broken = True

    def user_groups_formed(self) -> None:
        """The user code's process groups were formed again on every worker."""
        self._user_groups_broken = False

    # -- delta moves (actors/wire/delta.py) ------------------------------------------------
    def delta_order(self, delta: bool, dest: "GroupLedger", holds: int | None) -> DeltaOrder | None:
        """The :class:`~actors.records.DeltaOrder` of a move from this group with ``delta`` into
        ``dest`` (this group itself for a refresh of a kept layout), which holds this group's
        weights of version ``holds`` (None: not known to hold any): a delta when every worker's
        base is of this layout and that version and ``dest`` is not due a full copy, else an anchor."""
        if not delta:
            return None
        sent = self._sent
        base = None
        if sent is not None and sent == (self.layout, holds) and dest.deltas + 1 < self.config.delta_anchor_every:
            base = holds
        return DeltaOrder(base, self._version, self.config.delta)

    def delta_done(self, sent: Layout, dest: "GroupLedger", order: DeltaOrder | None, ok: bool) -> None:
        """After a move that carried ``order`` from this group's layout ``sent``: the workers' bases
        hold what they sent (``ok``), or, after a failure, something the driver cannot name."""
        if order is None:
            return
        self._sent = (sent, order.version) if ok else None
        if ok:
            dest.received_delta(order)

    def received_delta(self, order: DeltaOrder) -> None:
        """A move carrying ``order`` into this group committed: one more delta in a row, or an anchor."""
        self._deltas = self._deltas + 1 if order.base is not None else 0

    # -- staged updates (actors/driver/staged.py) ------------------------------------------
    def settle_switch(self, deadline: Deadline | None = None) -> None:
        """Before reading the weights outside a call (under the lock): an update committed at safe
        points is switched in on every worker that has not reached one, so what is read is the
        version the driver reports."""
        staged = self._staged
        if staged is not None and staged.state == "committed":
            staged.finish_switch(deadline or Deadline(self.timeout_s))

    def begin_stage(self, update: "StagedUpdate") -> None:
        """Register ``update`` as this group's pending staged update (``GroupBusyError`` when another
        operation changes the group, a call that writes runs, or another staged update is pending).

        The previous update, if committed at safe points, must be in on every worker first: the
        workers that reached no safe point nor call since switch now, between calls (an idle
        replica at once, a busy one when its running call returns; within the group's timeout)."""
        while True:
            with self._state_lock:
                if self._closed:
                    raise ValueError(f"stage update: group {self.name!r} was shut down")
                pending = self._staged
                if self._changing or self._writing or (pending is not None and pending.state != "committed"):
                    doing = (
                        f"staged update {pending.label} ({pending.state})"
                        if pending is not None and pending.state != "committed"
                        else "another operation or a call that writes"
                    )
                    raise GroupBusyError(
                        f"stage update {update.label}: group {self.name!r} is busy with {doing}; nothing was done",
                        layout=str(self.layout),
                    )
                if pending is None:
                    self._staged = update
                    return
            states = self._stage_states()
            if all(st["staged"] is None or st["staged"]["switched"] for st in states):
                self.end_stage(pending)  # every worker switched at a safe point
            else:
                pending.finish_switch(Deadline(self.timeout_s))

    def end_stage(self, update: Any) -> None:
        """``update`` is over (committed and switched everywhere, failed or aborted)."""
        with self._state_lock:
            if self._staged is update:
                self._staged = None

    def switch_flag(self) -> "str | None":
        """The staged update committed at safe points that the next call switches in first."""
        staged = self._staged
        return staged.id if staged is not None and staged.state == "committed" else None

    def switched(self, switch: "str | None") -> None:
        """After a call that switched a staged update in on every worker: the update is over."""
        if switch is not None:
            with self._state_lock:
                if self._staged is not None and self._staged.id == switch:
                    self._staged = None

    def commit_staged(self, update: "StagedUpdate") -> None:
        """Staged ``update`` of this group is committed: under the state lock (so no reader sees one
        without the other) its state turns ``"committed"`` and this group takes its layout and
        version (and, for a copy, its source as origin; for a move, the layout left is kept if it
        said so). Then its source's delta bookkeeping records what the workers sent."""
        with self._state_lock:
            update.state = "committed"
            if update.kind == "reallocate":
                keep = None
                if update.keep is not None:
                    keep = ResidentLayout(
                        update.before,
                        update.keep.version,
                        update.keep.where,
                        max(update.before.rank_bytes(r) for r in range(update.before.topology.world_size)),
                    )
                self.moved(update.target, keep)
            self._layout = update.target
            self._version = update.version
            if update.kind == "copy":
                self._origin = update.origin
        update.source.ledger.delta_done(update.sent_layout, self, update.delta_order, True)
        metrics.record_version(self.name, self._version)
