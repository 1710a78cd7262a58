"""Errors of the Ray layer. Every one pickles (it may be raised on a worker and re-raised on the driver).

Bad arguments are plain ``ValueError``s, raised on the driver before any traffic. The errors here
are run-time failures; their message always says what state the group is in afterwards.
"""

from __future__ import annotations

from typing import Sequence


class ReallocationError(RuntimeError):
    """An operation on a model group failed at run time.

    ``dead``: workers (actor names) that died; ``unresponsive``: workers alive per Ray that did
    not answer a ping in time (stopped, hung, or stuck in native code); ``layout``: the layout
    every surviving worker holds afterwards (``str`` of it), or ``None`` when the operation did
    not change layouts. The message states the same facts in words.
    """

    def __init__(self, message: str, dead: Sequence[str] = (), unresponsive: Sequence[str] = (),
                 layout: str | None = None):
        super().__init__(message, list(dead), list(unresponsive), layout)
        self.message = message
        self.dead = list(dead)
        self.unresponsive = list(unresponsive)
        self.layout = layout

    def __str__(self) -> str:
        return self.message


class GroupBusyError(ReallocationError):
    """Another operation held the group for longer than the group's timeout; nothing was done."""


class HookError(ReallocationError):
    """A worker's ``on_shards_changed`` hook failed after a change was committed: the change
    stands (``layout`` says which layout every live worker holds); the user's state may not."""


class StaleOperationError(RuntimeError):
    """A worker got a command for an operation it is not running (a late or foreign driver call)."""
