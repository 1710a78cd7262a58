"""An elastic rollout fleet: several generator groups (replicas) updated as one.

Asynchronous RL serves generation from several replicas of one model, each its own
:class:`~actors.group.ModelGroup` (its own layout, e.g. tp=2), that keep generating while the
trainer's next weights arrive (staged updates, :mod:`actors.staged`). A :class:`Fleet`:

* ``fleet.stage(trainer)`` stages the trainer's weights into every replica, one replica after
  the other (the trainer sends each its bytes; the replicas serve meanwhile) and returns a
  :class:`FleetUpdate`; ``update.commit(at="safe_point")`` switches every staged replica in (each
  at its own safe point). A replica whose staging or commit fails (it died, it stalled past its
  ``timeout_s``) is *dropped* from the fleet with its error; the others commit. The whole update
  is bounded by the fleet's ``timeout_s``.
* ``fleet.join(group)`` seeds a new replica with the fleet's current weights from a replica that
  serves them (no byte from the trainer), while the other replicas keep serving.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from actors.errors import ReallocationError
from actors.group import ModelGroup, ReallocStats
from actors.remote import FAILURE_GRACE_S, Deadline
from actors.staged import COMMIT_AT, StagedUpdate

log = logging.getLogger(__name__)


class Fleet:
    """Replica groups of one model served as one rollout fleet.

    ``replicas``: the serving groups (same model, any layouts); ``timeout_s``: the deadline of one
    fleet update, staging of every replica included (default: the sum of the replicas' timeouts).
    ``dropped``: ``(group, error)`` of every replica dropped so far (shut it down or replace it).
    """

    def __init__(self, replicas: Sequence[ModelGroup], *, timeout_s: float | None = None):
        replicas = list(replicas) if not isinstance(replicas, ModelGroup) else [replicas]
        if not replicas or not all(isinstance(r, ModelGroup) for r in replicas):
            raise ValueError(f"a fleet needs one or more ModelGroups, got {replicas!r}"[:200])
        if len({id(r) for r in replicas}) != len(replicas):
            raise ValueError("a fleet lists each replica group once")
        for r in replicas[1:]:
            replicas[0].spec.check_same_as(r.spec)
        if timeout_s is not None and (isinstance(timeout_s, bool) or not timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.replicas: list[ModelGroup] = replicas
        self.timeout_s = timeout_s
        self.dropped: list[tuple[ModelGroup, ReallocationError]] = []
        self._lock = threading.RLock()
        self._update: FleetUpdate | None = None

    @property
    def version(self) -> int:
        """The weight version the fleet serves (the lowest of its replicas')."""
        return min(r.version for r in self.replicas)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.replicas]

    def deadline_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else sum(r.timeout_s for r in self.replicas)

    def stage(self, source: ModelGroup) -> "FleetUpdate":
        """Stage ``source``'s weights into every replica (returns at once); see :class:`FleetUpdate`."""
        if not isinstance(source, ModelGroup):
            raise ValueError(f"stage needs the source ModelGroup (the trainer), got {type(source).__name__}")
        if any(source is r for r in self.replicas):
            raise ValueError(f"the source {source.name!r} is a replica of this fleet; stage from the trainer")
        self.replicas[0].spec.check_same_as(source.spec)
        with self._lock:
            if self._update is not None and not self._update.ended:
                raise ValueError("a fleet update is in progress: commit or abort it first")
            self._update = FleetUpdate(self, source, Deadline(self.deadline_s()))
            return self._update.start()

    def join(self, group: ModelGroup) -> ReallocStats:
        """Seed ``group`` with the fleet's weights from a serving replica, then serve it as a replica.

        The source replica is held for the copy (its calls wait); the others keep serving. Nothing
        comes from the trainer. Not during a fleet update."""
        if not isinstance(group, ModelGroup):
            raise ValueError(f"join needs a ModelGroup, got {type(group).__name__}")
        if any(group is r for r in self.replicas):
            raise ValueError(f"group {group.name!r} is already a replica of this fleet")
        self.replicas[0].spec.check_same_as(group.spec)
        with self._lock:
            if self._update is not None and not self._update.ended:
                raise ValueError("a fleet update is in progress: join after its commit")
            version = self.version
            sources = [r for r in self.replicas if r.version == version]
            source = min(sources, key=lambda r: r.num_workers)  # the cheapest to hold
            stats = source.copy_to(group)
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


class FleetUpdate:
    """One update of a fleet: staged into every replica, then committed on the staged ones.

    ``version``: the source's weight version; ``updates``: replica name -> its
    :class:`~actors.staged.StagedUpdate`; ``errors``: replica name -> why it was dropped.
    """

    def __init__(self, fleet: Fleet, source: ModelGroup, deadline: Deadline):
        self.fleet, self.source, self.deadline = fleet, source, deadline
        self.version = source.version
        self.replicas = list(fleet.replicas)
        self.updates: dict[str, StagedUpdate] = {}
        self.errors: dict[str, ReallocationError] = {}
        self.ended = False
        self._staged = threading.Event()
        self._thread = threading.Thread(target=self._stage_all, name="realloc-fleet-stage", daemon=True)

    def start(self) -> "FleetUpdate":
        self._thread.start()
        return self

    def _stage_all(self) -> None:
        try:
            for replica in self.replicas:
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
                    continue
                try:
                    update = self.source._stage(
                        replica,
                        replica.layout,
                        max(replica.version + 1, self.source.version),
                        None,
                        min(replica.timeout_s, left),
                    )
                    self.updates[replica.name] = update
                    update.wait()
                except ReallocationError as err:
                    self._drop(replica, err)
        finally:
            self._staged.set()

    def _drop(self, replica: ModelGroup, err: ReallocationError) -> None:
        self.errors[replica.name] = err
        self.updates.pop(replica.name, None)
        self.fleet.drop(replica, err)

    def wait(self) -> dict[str, ReallocStats]:
        """Wait until every replica is staged or dropped; the staged ones' stats by replica name."""
        if not self._staged.wait(self.deadline.remaining() + FAILURE_GRACE_S + 5.0):
            raise TimeoutError("fleet update: staging did not end within the fleet's deadline")
        return {name: u.stats for name, u in self.updates.items()}

    def commit(self, at: str = "safe_point") -> list[str]:
        """Commit every staged replica (``at``: as :meth:`StagedUpdate.commit`); a replica whose
        commit fails is dropped. Returns the names of the replicas that serve the new version
        (those switching at safe points included)."""
        if at not in COMMIT_AT:
            raise ValueError(f"at={at!r}; allowed: {', '.join(repr(a) for a in COMMIT_AT)}")
        self.wait()
        committed = []
        for name, update in list(self.updates.items()):
            try:
                update.commit(at=at)
                committed.append(name)
            except ReallocationError as err:  # rolled back, or committed with a dead worker: it cannot serve
                self._drop(update.dest, err)
        self.ended = True
        return committed

    def abort(self) -> None:
        """Drop the staged weights of every replica; every replica keeps serving what it served."""
        self.wait()
        for update in self.updates.values():
            update.abort()
        self.ended = True
