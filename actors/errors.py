"""Errors of the Ray layer. Every one pickles (it may be raised on a worker and re-raised on the driver).

Bad arguments are plain ``ValueError``s, raised on the driver before any traffic. The errors here
are run-time failures; their message always says what state the group is in afterwards.
"""

from __future__ import annotations

from typing import Sequence


class ReallocationError(RuntimeError):
    """An operation on a model group failed at run time.

    ``dead``: workers (actor names) that died. ``unresponsive``: workers alive per Ray that did
    not answer a ping (on their control thread, which answers even while a transfer blocks the
    main one) within the diagnosis' wait: stopped, hung, or stuck in native code holding the GIL.
    ``waiting``: workers that answer pings but were still inside the failed call when the error
    was raised (typically blocked in a collective on a dead or stopped peer, until that
    collective's timeout): their abort is queued behind the call and runs when it returns.
    ``layout``: ``str`` of the layout every surviving worker of the group the call concerns holds
    afterwards (``str(group.layout)``; for ``copy_to`` the destination's, the source keeps its
    own), or ``None`` where no group exists yet (a failed ``create``) or the raiser does not know
    the group. The message states the same facts in words.
    """

    def __init__(
        self,
        message: str,
        dead: Sequence[str] = (),
        unresponsive: Sequence[str] = (),
        layout: str | None = None,
        waiting: Sequence[str] = (),
    ):
        super().__init__(message, list(dead), list(unresponsive), layout, list(waiting))
        self.message = message
        self.dead = list(dead)
        self.unresponsive = list(unresponsive)
        self.layout = layout
        self.waiting = list(waiting)

    def __str__(self) -> str:
        return self.message


class GroupBusyError(ReallocationError):
    """Another operation held the group until this call's deadline passed, or (a staged update)
    changed it between the request and the update's hold on it; nothing was done (``layout``: the
    group's layout, unchanged)."""


class HookError(ReallocationError):
    """A worker's ``on_shards_changed`` hook failed after a change was committed: the change
    stands (``layout`` says which layout every live worker holds); the user's state may not."""


class StaleOperationError(RuntimeError):
    """A worker got a command for an operation it is not running (a late or foreign driver call)."""
