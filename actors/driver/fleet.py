"""An elastic rollout fleet: several generator groups (replicas) updated as one.

Asynchronous RL serves generation from several replicas of one model, each its own
:class:`~actors.driver.group.ModelGroup` (its own layout, e.g. tp=2), that keep generating while the
trainer's next weights arrive (staged updates, :mod:`actors.driver.staged`). A :class:`Fleet`:

* ``fleet.stage(trainer)`` stages the trainer's weights into every replica, each byte leaving
  the trainer once: the trainer is held while it stages one replica, and then every staged
  replica relays its staged set (not the weights it serves) to the next ones, the relays
  doubling each round (the replicas serve meanwhile, and the trainer is free); it returns a
  :class:`FleetUpdate`; ``update.commit(at="safe_point")`` switches every staged replica in (each
  at its own safe point). A replica whose staging or commit fails (it died, it stalled past its
  ``timeout_s``) is *dropped* from the fleet with its error; the others commit. The whole update
  is bounded by the fleet's ``timeout_s``.
* ``fleet.join(group)`` seeds a new replica with the fleet's current weights from a replica that
  serves them (no byte from the trainer), while the other replicas keep serving.

Dead replicas: ``stage`` and ``join`` first ping every replica's workers; a replica with a dead
worker is *dropped* from ``fleet.replicas`` then and there (into ``fleet.dropped``, with an error
naming the dead workers), so it is never staged into nor picked as a joining replica's seed (nor
is a seed that dies during the copy: the next replica serving the version seeds instead).
Repair a dropped replica (``replace_dead_workers()``) and ``join`` it again. A relay that dies
while it relays is dropped too (its live workers drop their staged sets), and the replica it was
sending to is staged from another staged replica (from the trainer again only when none is
left): a relay takes with it only what it had not yet delivered. A replica whose
workers are alive but do not answer (a stopped process) is not dropped for that: an update
stages it last, over a world of its own (the healthy replicas share one), and drops it only if
its staging fails; a join does not seed from it.

``source.copy_to([a, b, ...])`` (:func:`copy_to_groups`) copies into several groups the same way,
each byte leaving the source once, but as one copy: every group is staged (the relays doubling),
then every one switches; if any group could not be staged, none switches.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, runtime_checkable

from actors.driver.staged import COMMIT_AT, StagedUpdate
from actors.errors import GroupBusyError, ReallocationError
from actors.lanes import STAGE
from actors.remote import FAILURE_GRACE_S, Deadline, check_timeout, diagnose
from realloc.spec.formats import unformatted

if TYPE_CHECKING:
    from actors.driver.group import ModelGroup, ReallocStats

log = logging.getLogger(__name__)


@runtime_checkable
class _Group(Protocol):
    """What a fleet takes as a replica or a source: a :class:`~actors.driver.group.ModelGroup`,
    recognised by the methods a fleet calls (this module does not import group.py, which hands
    ``copy_to([...])`` to :func:`copy_to_groups`)."""

    def start_stage(self, *args, **kwargs): ...

    def copy_version(self, source): ...

    def world_for(self, *args, **kwargs): ...


class Fleet:
    """Replica groups of one model served as one rollout fleet.

    ``replicas``: the serving groups (same model, any layouts); ``timeout_s``: the deadline of one
    fleet update, staging of every replica included (default: the sum of the replicas' timeouts).
    ``dropped``: ``(group, error)`` of every replica dropped so far (shut it down or replace it).
    """

    def __init__(self, replicas: Sequence[ModelGroup], *, timeout_s: float | None = None):
        if not isinstance(replicas, _Group) and (
            isinstance(replicas, (str, bytes)) or not hasattr(replicas, "__iter__")
        ):
            raise ValueError(f"replicas must be a ModelGroup or a sequence of ModelGroups, got {replicas!r}"[:200])
        if timeout_s is not None:
            check_timeout(timeout_s)
        replicas = list(replicas) if not isinstance(replicas, _Group) else [replicas]
        if not replicas or not all(isinstance(r, _Group) for r in replicas):
            raise ValueError(f"a fleet needs one or more ModelGroups, got {replicas!r}"[:200])
        if len({id(r) for r in replicas}) != len(replicas):
            raise ValueError("a fleet lists each replica group once")
        for r in replicas[1:]:
            replicas[0].spec.check_same_as(r.spec)  # one weight format: a joining replica is seeded from another
        self.replicas: list[ModelGroup] = replicas
        self.timeout_s = timeout_s
        self.dropped: list[tuple[ModelGroup, ReallocationError]] = []
        self._lock = threading.RLock()
        self._update: FleetUpdate | None = None

    @property
    def version(self) -> int | None:
        """The weight version the fleet serves (the lowest of its replicas'; None without replicas)."""
        return min((r.version for r in self.replicas), default=None)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.replicas]

    def deadline_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else sum(r.timeout_s for r in self.replicas)

    def stage(self, source: ModelGroup) -> "FleetUpdate":
        """Stage ``source``'s weights into every replica (returns at once); see :class:`FleetUpdate`."""
        if not isinstance(source, _Group):
            raise ValueError(f"stage needs the source ModelGroup (the trainer), got {type(source).__name__}")
        if any(source is r for r in self.replicas):
            raise ValueError(f"the source {source.name!r} is a replica of this fleet; stage from the trainer")
        with self._lock:
            if not self.replicas:
                raise ValueError(
                    f"the fleet has no replicas left (dropped: {[g.name for g, _ in self.dropped]}); join one"
                )
            unformatted(self.replicas[0].spec).check_same_as(unformatted(source.spec))  # the copies convert formats
            if self._update is not None and not self._update.ended:
                raise ValueError("a fleet update is in progress: commit or abort it first")
            self._update = FleetUpdate(self, source, Deadline(self.deadline_s()))
            return self._update.start()

    def join(self, group: ModelGroup) -> ReallocStats:
        """Seed ``group`` with the fleet's weights from a serving replica, then serve it as a replica.

        The source replica is held for the copy (its calls wait); the others keep serving. Nothing
        comes from the trainer. Not during a fleet update."""
        if not isinstance(group, _Group):
            raise ValueError(f"join needs a ModelGroup, got {type(group).__name__}")
        if any(group is r for r in self.replicas):
            raise ValueError(f"group {group.name!r} is already a replica of this fleet")
        with self._lock:
            if not self.replicas:
                raise ValueError("the fleet has no replica left to seed from; copy the weights into the group instead")
            self.replicas[0].spec.check_same_as(group.spec)
            if self._update is not None and not self._update.ended:
                raise ValueError("a fleet update is in progress: join after its commit")
            dead, silent = _ping(self.replicas)
            for replica, err in dead:
                self.drop(replica, err)
            if not self.replicas:
                raise ValueError(
                    f"the fleet has no live replica left to seed from (dropped: {[g.name for g, _ in self.dropped]}); "
                    "copy the weights into the group instead"
                )
            version = self.version
            serving = [r for r in self.replicas if r.version == version]
            sources = sorted((r for r in serving if r not in silent), key=lambda r: r.num_workers)  # cheapest first
            if not sources:
                stuck = [n for r in serving for n in r.workers.names if n in silent[r]]
                raise ReallocationError(
                    f"join {group.name!r}: no replica serving version {version} can seed it: workers {stuck} are "
                    "alive but do not answer pings (stopped or hung); nothing was done",
                    unresponsive=stuck,
                    layout=str(group.layout),
                )
            for source in sources:
                try:
                    stats = source.copy_to(group)
                    break
                except ReallocationError as err:  # the seed died during the copy: drop it, try the next
                    died = [n for n in err.dead if n in source.workers.names]
                    if not died:
                        raise
                    self.drop(source, err)
                    if source is sources[-1]:
                        raise
                    log.warning(
                        "fleet: seed %s died while seeding %s; seeding from the next replica", source.name, group.name
                    )
            self.replicas.append(group)
        log.info("fleet: %s joined, seeded from %s with version %d", group.name, source.name, group.version)
        return stats

    def drop(self, group: ModelGroup, error: ReallocationError) -> None:
        """Stop serving ``group`` as a replica (kept in ``dropped`` with ``error``)."""
        with self._lock:
            if any(group is r for r in self.replicas):
                self.replicas = [r for r in self.replicas if r is not group]
                self.dropped.append((group, error))
                log.warning("fleet: replica %s dropped: %s", group.name, error)


def _ping(
    replicas: Sequence[ModelGroup],
) -> tuple[list[tuple[ModelGroup, ReallocationError]], dict[ModelGroup, set[str]]]:
    """Ping every worker of ``replicas`` at once: the replicas with a dead worker (each with
    the error it is dropped with) and those with workers that did not answer (by name)."""
    if not replicas:
        return [], {}
    workers = replicas[0].workers
    for r in replicas[1:]:
        workers = workers + r.workers
    found = diagnose(workers)
    dead, silent = [], {}
    for r in replicas:
        died = [n for n in r.workers.names if n in found.dead]
        stuck = {n for n in r.workers.names if n in found.unresponsive}
        if died:
            dead.append(
                (
                    r,
                    ReallocationError(
                        f"fleet: replica {r.name!r} has dead worker(s) {died}: dropped from the fleet (its live "
                        f"workers still hold version {r.version}); replace_dead_workers(), then join it again",
                        died,
                        sorted(stuck),
                        str(r.layout),
                    ),
                )
            )
        elif stuck:
            silent[r] = stuck
    return dead, silent


class FleetUpdate:
    """One update of a fleet: staged into every replica, then committed on the staged ones.

    The source is held until one replica is staged from it; the staged replicas then relay their
    staged sets to the others, doubling each round (:meth:`_relay_all`), while the source is free
    (its next training step may run). So each byte leaves the source once, and every replica gets
    the same weights, of ``version`` (the source's when it was held). ``updates``: replica name -> its
    :class:`~actors.driver.staged.StagedUpdate`; ``relayed_from``: replica name -> the group it
    was staged from (the source, or a replica); ``source_sends``: the source's transfers (1, more
    only when every staged replica was lost as a relay); ``errors``: replica name -> why it got
    no update; ``skipped``: replicas that were busy (another operation, a call that writes) and
    keep serving what they served; the others with an error were dropped from the fleet.
    """

    def __init__(self, fleet: Fleet, source: ModelGroup, deadline: Deadline):
        self.fleet, self.source, self.deadline = fleet, source, deadline
        self.replicas = list(fleet.replicas)
        self.updates: dict[str, StagedUpdate] = {}
        self.errors: dict[str, ReallocationError] = {}
        self.skipped: list[str] = []
        self.relayed_from: dict[str, str] = {}  # replica name -> the group its weights came from
        self.source_sends = 0  # transfers out of the source (1 unless every relay was lost)
        self.ended = False
        self._version: int | None = None
        self._failure: BaseException | None = None  # what ended the staging thread unexpectedly
        self._staged = threading.Event()
        self._thread = threading.Thread(target=self._stage_all, name="realloc-fleet-stage", daemon=True)

    @property
    def version(self) -> int | None:
        """The source's version when the update took hold of it (waits for that moment); None if
        the source could not be held (see ``errors``)."""
        if self._version is None:
            self._staged.wait(self.deadline.remaining() + FAILURE_GRACE_S + 5.0)
        return self._version

    def start(self) -> "FleetUpdate":
        self._thread.start()
        return self

    def _stage_all(self) -> None:
        source = self.source
        try:
            with source.ledger.exclusive(f"fleet update from {source.name}", deadline=self.deadline, staged_ok=True):
                self._version = source.version
                dead, silent = _ping(self.replicas)
                for replica, err in dead:  # never staged: dropped now
                    self._drop(replica, err)
                gone = {id(r) for r, _ in dead}
                healthy = [r for r in self.replicas if id(r) not in gone and r not in silent]
                try:  # one staged world over the source and every healthy replica, reused by each transfer
                    if healthy:
                        source.world_for(STAGE, [source, *healthy], self.deadline)
                except ReallocationError as err:  # e.g. one died since: each transfer forms its own world
                    log.info("fleet update: no world over every replica (%s); one per replica", err.message)
                pending, quiet = list(healthy), [r for r in self.replicas if r in silent]
                relays = self._from_source(pending, quiet)
            # the source is free again (its next training step may run): the relays carry its weights
            self._relay_all(relays, pending, quiet)
        except GroupBusyError as err:  # the source stayed busy past the deadline: nobody was touched
            for replica in self.replicas:
                self.errors.setdefault(replica.name, err)
                self.skipped.append(replica.name)
        except BaseException as err:  # a defect, not a fault of a replica: wait() raises it, never {}
            self._failure = err
            for update in list(self.updates.values()):  # nothing switches in: every staged set is dropped
                try:
                    update.abort()
                except (ReallocationError, ValueError) as why:
                    log.warning("fleet update: dropping %s after a defect: %s", update.label, why)
            self.updates.clear()
        finally:
            self._staged.set()

    def _from_source(self, pending: list[ModelGroup], silent: list[ModelGroup]) -> list[StagedUpdate]:
        """The source (held by the caller) stages the first of ``pending``, then ``silent``, that
        takes it (taken off the lists); the staged update, as the first relay (none if none took it)."""
        while pending or silent:
            replica = pending.pop(0) if pending else silent.pop(0)
            update = self._stage_one(replica, None)
            if update is not None:
                return [update]
        return []

    def _from_source_again(self, pending: list[ModelGroup], silent: list[ModelGroup]) -> list[StagedUpdate]:
        """Every staged replica was lost as a relay: hold the source again and stage from it, if it
        still holds the update's version; else the replicas left keep serving what they served."""
        source = self.source
        try:
            with source.ledger.exclusive(
                f"fleet update from {source.name} (again: no relay left)", deadline=self.deadline, staged_ok=True
            ):
                if source.version == self._version:
                    return self._from_source(pending, silent)
                err = ReallocationError(
                    f"fleet update from {source.name!r}: every staged replica was lost as a relay, and "
                    f"{source.name!r} holds version {source.version} now, not the update's {self._version}; "
                    f"{[r.name for r in pending + silent]} keep serving what they served"
                )
        except (GroupBusyError, ValueError) as why:  # busy past the deadline, or shut down
            err = ReallocationError(
                f"fleet update from {source.name!r}: every staged replica was lost as a relay, and the source "
                f"could not be held again ({why}); {[r.name for r in pending + silent]} keep serving what "
                "they served"
            )
        for replica in pending + silent:
            self.errors[replica.name] = err
            self.skipped.append(replica.name)
        pending.clear()
        silent.clear()
        return []

    def _relay_all(self, relays: list[StagedUpdate], pending: list[ModelGroup], silent: list[ModelGroup]) -> None:
        """Stage ``pending``, then ``silent`` (their workers did not answer the ping), from
        ``relays`` (the replicas the source staged): every staged replica relays its staged set to
        one pending replica per round, the rounds' transfers side by side (1, 2, 4, ... replicas
        staged: ceil(log2(R)) rounds after the source's transfer for R replicas). A silent replica
        is staged alone, after the others. A transfer that fails because its relay died or did not
        answer is retried from another staged replica (the relay stops relaying; a dead one is
        dropped); the source sends again only when no staged replica is left to relay
        (``source_sends`` counts its transfers), and only if it still holds the update's version."""
        while pending or silent:
            if not relays:
                relays = self._from_source_again(pending, silent)
                continue
            if pending:
                pairs = list(zip(relays, pending))
                del pending[: len(pairs)]
            else:  # a silent replica: alone, so that no other transfer waits for it
                pairs = [(relays[0], silent.pop(0))]
            results: dict[str, StagedUpdate | ModelGroup | None] = {}
            defects: list[BaseException] = []

            def relay_one(relay: StagedUpdate, replica: ModelGroup) -> None:
                try:
                    results[replica.name] = self._stage_one(replica, relay)
                except BaseException as err:  # a defect: the staging thread ends with it (wait() raises it)
                    defects.append(err)

            threads = [
                threading.Thread(target=relay_one, args=pair, name=f"realloc-fleet-relay-{pair[1].name}", daemon=True)
                for pair in pairs
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if defects:
                raise defects[0]
            for relay, replica in pairs:
                got = results.get(replica.name)
                if isinstance(got, StagedUpdate):
                    relays.append(got)
                elif got is relay.dest:  # the relay failed the transfer: it relays no more; the replica waits
                    relays = [u for u in relays if u is not relay]
                    pending.insert(0, replica)

    def _stage_one(self, replica: ModelGroup, relay: StagedUpdate | None) -> "StagedUpdate | ModelGroup | None":
        """Stage ``replica`` from the source (``relay`` None) or from ``relay``'s staged set.
        Returns its staged update; the relay's group when the relay's workers died or did not
        answer (the replica was not dropped: it is staged from another); None when the replica
        got nothing (skipped as busy, or dropped with its error)."""
        left = self.deadline.remaining()
        if left <= 0:
            self._drop(
                replica,
                ReallocationError(
                    f"fleet update: no time left of the fleet's {self.deadline.seconds:.0f}s to stage "
                    f"{replica.name!r}; it keeps serving version {replica.version}",
                    layout=str(replica.layout),
                ),
            )
            return None
        sender = self.source if relay is None else relay.dest
        try:
            update = sender.start_stage(
                replica,
                replica.layout,
                lambda: replica.copy_version(self.source),
                None,
                min(replica.timeout_s, left),
                hold_source=False,  # the source is held by the fleet update; a relay is staging
                relay=relay,
            )
            self.updates[replica.name] = update
            self.relayed_from[replica.name] = sender.name
            update.wait()
            if relay is None:
                self.source_sends += 1
            return update
        except GroupBusyError as err:  # busy, not broken: it keeps serving what it served
            self.updates.pop(replica.name, None)  # its update staged nothing (from wait(): it was registered)
            self.relayed_from.pop(replica.name, None)
            self.errors[replica.name] = err
            self.skipped.append(replica.name)
        except ReallocationError as err:
            self.updates.pop(replica.name, None)
            self.relayed_from.pop(replica.name, None)
            if relay is not None:  # whose fault: the relay's (the replica is staged from another) or the replica's
                broken = [n for n in (*err.dead, *err.unresponsive) if n in relay.dest.workers.names]
                if broken and not any(n in replica.workers.names for n in err.dead):
                    log.warning(
                        "fleet update: relay %s failed staging %s (%s); it relays no more",
                        relay.dest.name,
                        replica.name,
                        err.message,
                    )
                    if any(n in relay.dest.workers.names for n in err.dead):
                        self._drop(relay.dest, err)
                        try:  # its live workers drop their staged sets: it serves what it served
                            relay.abort()
                        except ReallocationError:
                            pass  # its dead workers cannot answer; the live ones dropped theirs
                    return relay.dest
            self._drop(replica, err)
        return None

    def _drop(self, replica: ModelGroup, err: ReallocationError) -> None:
        self.errors[replica.name] = err
        self.updates.pop(replica.name, None)
        self.relayed_from.pop(replica.name, None)
        self.fleet.drop(replica, err)

    def wait(self) -> dict[str, ReallocStats]:
        """Wait until every replica is staged, skipped or dropped; the staged ones' stats by name.
        An update that staged no replica is no success: it raises :class:`ReallocationError`
        saying why each replica got nothing (every replica keeps serving what it served)."""
        if not self._staged.wait(self.deadline.remaining() + FAILURE_GRACE_S + 5.0):
            raise TimeoutError("fleet update: staging did not end within the fleet's deadline")
        if self._failure is not None or not self.updates:
            self.ended = True  # nothing is staged: nothing to commit or abort, the fleet takes the next update
        if self._failure is not None:
            raise ReallocationError(
                f"fleet update from {self.source.name!r} failed on the driver "
                f"({type(self._failure).__name__}: {self._failure}); no replica switched (the staged sets were "
                "dropped): each keeps serving what it served"
            ) from self._failure
        if not self.updates:
            why = _reasons(self.errors) or "the fleet has no replica"
            raise ReallocationError(
                f"fleet update from {self.source.name!r} staged no replica; each keeps serving what it "
                f"served (skipped as busy: {self.skipped}; dropped from the fleet: "
                f"{[n for n in self.errors if n not in self.skipped]}): {why}"
            )
        return {r.name: self.updates[r.name].stats for r in self.replicas if r.name in self.updates}

    def commit(self, at: str = "safe_point") -> list[str]:
        """Commit every staged replica (``at``: as :meth:`StagedUpdate.commit`); a replica whose
        commit fails is dropped, one that a call held past its ``timeout_s`` is skipped (its staged
        set dropped: it serves what it served, in the fleet). Returns the names of the replicas
        that serve the new version (those switching at safe points included)."""
        if at not in COMMIT_AT:
            raise ValueError(f"at={at!r}; allowed: {', '.join(repr(a) for a in COMMIT_AT)}")
        self.wait()
        committed = []
        try:
            for name, update in [(r.name, self.updates[r.name]) for r in self.replicas if r.name in self.updates]:
                try:
                    update.commit(at=at)
                    committed.append(name)
                except GroupBusyError as err:  # a call held it past its timeout: nothing switched, still staged
                    self.errors[name] = GroupBusyError(
                        f"commit of {name!r}: a call held it past its timeout_s, so its staged set is dropped and "
                        f"it keeps serving version {update.dest.version} ({err.message})",
                        layout=str(update.dest.layout),
                    )
                    self.skipped.append(name)
                    try:  # it keeps serving what it served, in the fleet; the next update brings it along
                        update.abort()
                    except ReallocationError as abort_err:  # a worker died meanwhile: it cannot serve
                        self._drop(update.dest, abort_err)
                except ReallocationError as err:  # rolled back, or committed with a dead worker: it cannot serve
                    self._drop(update.dest, err)
        finally:
            self.ended = True
        return committed

    def abort(self) -> None:
        """Drop the staged weights of every replica; every replica keeps serving what it served.
        Every replica's staged set is dropped even when one's abort fails (a dead worker): then
        :class:`ReallocationError` names those, after all of them were asked."""
        try:
            self.wait()
        except ReallocationError:
            return  # nothing was staged (wait() says why): nothing to drop
        failed: dict[str, ReallocationError] = {}
        try:
            for name, update in self.updates.items():
                try:
                    update.abort()
                except ReallocationError as err:
                    own = set(update.dest.workers.names)  # a dead relay (sender) is not this replica's failure
                    if not (err.dead or err.unresponsive) or own & {*err.dead, *err.unresponsive}:
                        failed[name] = err
        finally:
            self.ended = True
        if failed:
            raise _failed(
                f"fleet update from {self.source.name!r} aborted: every replica keeps serving what it served; "
                f"{sorted(failed)} could not confirm that they dropped their staged sets",
                failed,
            )


def copy_to_groups(source: ModelGroup, groups: Sequence[ModelGroup]) -> dict[str, ReallocStats]:
    """``source.copy_to([a, b, ...])``: copy ``source``'s weights into every group of ``groups``
    (any layouts, one weight format), each byte leaving ``source`` once.

    The source stages the first group (a shadow set: the groups keep serving ``writes=False``
    calls), the staged groups relay their staged sets to the others, doubling each round (as
    :meth:`Fleet.stage`; the source is held only for its one transfer), and once every group is
    staged every one switches (``commit(at="now")``, group by group, in the order given).
    Returns each group's :class:`~actors.driver.group.ReallocStats` by name, in that order:
    ``transition`` names who sent it (the source or a relay), ``pause_seconds`` the group's
    switch, ``version`` its version afterwards (``max(own + 1, source's)``, as ``copy_to``).

    All or none: a group that could not be staged (a dead worker, busy past the deadline, a
    relay's failure with none left to relay) drops every staged set, and
    :class:`~actors.errors.ReallocationError` says that every group keeps its previous weights. A
    switch that fails after others switched (a worker died in between) leaves the ones before it
    and after it on the new weights and that one on its old (or dead): the error names which.
    """
    if not groups:
        raise ValueError("copy_to([...]) needs one or more ModelGroups to copy into, got none")
    if not all(isinstance(g, _Group) for g in groups):
        kinds = sorted({type(g).__name__ for g in groups if not isinstance(g, _Group)})
        raise ValueError(
            f"copy_to([...]) copies into ModelGroups, got {', '.join(kinds)}: copy into an inference engine "
            "with its own copy_to(engine)"
        )
    if any(g is source for g in groups):
        raise ValueError(f"copy_to([...]) lists the source {source.name!r}; use reallocate to change its layout")
    fleet = Fleet(groups)  # one weight format among the groups (their relays copy it as it is); each listed once
    update = fleet.stage(source)
    what = f"copy {source.name!r} -> {[g.name for g in groups]}"
    try:
        update.wait()
    except ReallocationError as err:  # nothing staged: nothing switched
        raise ReallocationError(f"{what}: {err.message}", err.dead, err.unresponsive) from err
    if update.errors:
        errors = dict(update.errors)
        try:
            update.abort()
        except ReallocationError as err:  # every staged group was asked; it names those that did not confirm
            errors["dropping the staged sets"] = err
        raise _failed(
            f"{what}: {sorted(update.errors)} could not be staged, so no group switched: every group keeps its "
            f"previous weights and {source.name!r} is untouched",
            errors,
        )
    switched = update.commit(at="now")  # in the order given; a group whose switch fails is dropped
    stats: dict[str, ReallocStats] = {}
    for name in switched:
        staged = update.updates[name]
        stats[name] = dataclasses.replace(staged.stats, pause_seconds=staged.pause_seconds)
    if len(switched) < len(groups):
        raise _failed(
            f"{what}: every group was staged, but {sorted(update.errors)} failed to switch; {switched} switched to "
            f"version {update.version} of {source.name!r}",
            update.errors,
        )
    return stats


def _failed(message: str, errors: Mapping[str, ReallocationError]) -> ReallocationError:
    """One error for the groups' ``errors`` (by name): ``message``, each group's error after it,
    and the dead and unresponsive workers of them all."""
    return ReallocationError(
        f"{message} ({_reasons(errors)})",
        dead=[n for err in errors.values() for n in err.dead],
        unresponsive=[n for err in errors.values() for n in err.unresponsive],
    )


def _reasons(errors: Mapping[str, ReallocationError]) -> str:
    """``errors`` (by group name) as one clause: each name with its error."""
    return "; ".join(f"{name}: {err}" for name, err in errors.items())
