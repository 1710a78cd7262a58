"""A collective world: one process group over a set of actors (one or several model groups).

Formed once and reused by every plan among its actors. A copy between two groups forms one
world over both (and keeps it for later copies and reallocations); a failure marks it broken
and the next operation forms a fresh one, so the number of communicators stays bounded.

An actor belongs to one world at a time: joining a new world destroys its membership of the old
one. So forming a world marks every other live world that shares an actor as broken (group A
copies to B, then to C: the A+B world is gone, and B must not reuse it). Each world has an id
that its workers remember; every plan carries it, and a worker refuses a plan for a world it is
not in, so a stale world can never silently pair the wrong ranks.

A formation that fails (a member died or did not join within the deadline) is aborted on every
member (``abort_world``): the live members leave the rendezvous at once instead of waiting for
the missing one until their own timeout (which kept a staged world's members, e.g. a fleet's
trainer, busy for the next formation: a healthy replica timed out behind a dead one), and a
member that joins late (a stopped worker, resumed) is refused without touching its worlds.
"""

from __future__ import annotations

import logging
import uuid
import weakref

from actors.errors import ReallocationError
from actors.lanes import LANES, Lane
from actors.remote import Deadline, Workers, fire, gather

log = logging.getLogger(__name__)

#: the live worlds of each lane (an actor is in one world per lane: each lane is a slot of its own)
_LIVE: "dict[Lane, weakref.WeakSet[World]]" = {lane: weakref.WeakSet() for lane in LANES}


class World:
    def __init__(self, workers: Workers, backend: str, world_id: str, lane: Lane):
        self._rank = {a._actor_id: i for i, a in enumerate(workers.actors)}
        self.workers, self.backend, self.id, self.lane = workers, backend, world_id, lane
        self.alive = True

    @staticmethod
    def form(workers: Workers, lane: Lane, timeout_s: float, deadline: Deadline | None = None) -> "World":
        """A world of ``lane`` (actors/lanes.py) over ``workers``; its collectives time out after
        ``timeout_s``. The driver waits up to ``deadline`` (that of the operation forming it), or
        ``timeout_s`` for the store and ``timeout_s + 30`` for the joins (the workers' own
        rendezvous timeout comes first).

        The workers host the rendezvous and join on the lane's concurrency group, into the
        lane's slot: forming a staged world (joined on the stage thread, so a worker busy in a
        user call joins it) never breaks the world moves use, only other staged worlds sharing
        an actor, and the other way round."""
        n = len(workers)
        world_id = uuid.uuid4().hex[:12]
        ids = {a._actor_id for a in workers.actors}
        live = _LIVE[lane]
        for other in list(live):
            if other.alive and ids & set(other._rank):
                other.mark_broken()  # its actors are about to leave it
        head = workers.subset([0])
        host = lane.method(head.actors[0], "open_rendezvous").remote(lane, n, timeout_s, world_id)
        addr, port = gather(head, [host], deadline or timeout_s, "form world")[0]
        refs = [
            lane.method(a, "join").remote(lane, world_id, addr, port, r, n, timeout_s)
            for r, a in enumerate(workers.actors)
        ]
        try:
            backends = gather(workers, refs, deadline or timeout_s + 30, "form world")
        except ReallocationError:
            # The members that are alive wait at the rendezvous for the missing one (a dead or
            # stopped worker) until timeout_s: release them now, so the next formation over any
            # of them (another replica's, a retry) finds them free; a late join is refused.
            fire(workers, "abort_world", world_id)
            raise
        if len(set(backends)) != 1:
            raise ValueError(
                f"workers disagree on the backend ({sorted(set(backends))}): mixing GPU and CPU "
                "workers in one world is not supported"
            )
        world = World(workers, backends[0], world_id, lane)
        live.add(world)
        log.debug("formed %s world %s over %d workers (%s)", lane.name, world_id, n, backends[0])
        return world

    def rank_of(self, actor) -> int:
        return self._rank[actor._actor_id]

    def covers(self, actors) -> bool:
        return all(a._actor_id in self._rank for a in actors)

    def mark_broken(self) -> None:
        self.alive = False
