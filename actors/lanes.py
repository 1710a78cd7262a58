"""The Ray concurrency groups of a worker (which calls run beside which), and the lanes bytes move on.

Concurrency groups:

* the default group (one thread): the protocol's steps and the user's calls, one at a time;
* :data:`CONTROL` (one thread): pings and status, answered even while the default thread is
  blocked in a transfer or a long user call;
* :data:`STAGE_GROUP` (one thread): a staged update's transfer into the shadow buffers
  (actors/worker/staging.py), beside the user's calls on the serving buffers;
* :data:`SAVE_GROUP` (one thread): waits for an async checkpoint save's background writes
  (``ckpt_save_result``), so the driver learns when they end (``SaveHandle.done``) while the
  default thread runs the user's training calls.

A :class:`Lane` is one path bytes take between workers: its own world (process group), formed
and joined on its own concurrency group, and on each worker its own transport, world id,
timeline and bucket staging (``WorkerState.lanes``). Moves, copies and checkpoint transfers run
on :data:`MOVE`; staged updates on :data:`STAGE`. The two lanes run the same code: the lane is
a value handed along (``World.form(workers, lane)``, ``ShardWorker.join(lane, ...)``,
``MoveRef.lane``), never a flag or a method name built from a string.

>>> MOVE.concurrency_group is None, STAGE.concurrency_group
(True, 'stage')
>>> STAGE.name, STAGE.prefix
('stage', 'realloc-staged')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONTROL = "control"
STAGE_GROUP = "stage"
SAVE_GROUP = "save"
#: ``concurrency_groups=`` of every worker actor class.
CONCURRENCY_GROUPS = {CONTROL: 1, STAGE_GROUP: 1, SAVE_GROUP: 1}


@dataclass(frozen=True)
class Lane:
    """One lane: what differs between the move lane and the staged lane, and nothing else.

    ``name``: how logs, errors and the worker's state name it. ``concurrency_group``: the
    worker's Ray concurrency group its world is formed and joined on (``None``: the default
    group, where the protocol's steps run; a staged world is joined on the stage thread, so a
    worker busy in a long user call joins it). ``prefix``: the transport's keys in the
    rendezvous store (``<prefix>/<world id>``). Compared by value: a lane pickled to a worker
    is the same lane there."""

    name: str
    concurrency_group: str | None
    prefix: str

    def method(self, actor: Any, name: str) -> Any:
        """``actor.<name>`` dispatched on this lane's concurrency group (Ray lets a call pick the
        group at run time: ``.options(concurrency_group=...)``), ready for ``.remote(...)``."""
        method = getattr(actor, name)
        return method if self.concurrency_group is None else method.options(concurrency_group=self.concurrency_group)

    def __repr__(self) -> str:
        return f"Lane({self.name})"


#: Moves, copies, adoptions and checkpoint transfers: the default thread, the world moves share.
MOVE = Lane("move", None, "realloc")
#: Staged updates: the stage thread, a world of their own beside the move lane's.
STAGE = Lane("stage", STAGE_GROUP, "realloc-staged")
LANES = (MOVE, STAGE)
