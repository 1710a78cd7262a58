"""The faults a test injects into a worker (``ShardWorker.inject_fault``) and where they fire.

One fault is armed at a time; the worker's code asks for it at the points below and it fires
once. ``exit_*`` faults end the process with ``os._exit(1)`` (no cleanup: as a crash would).
"""

from __future__ import annotations

import os

#: The faults, and where each fires: ``stall`` (seconds) sleeps at the start of the next execute
#: phase or staged transfer; ``exit_after_buckets`` (n) exits after n buckets of a transfer (moves
#: and staged ones); ``exit_in_commit`` exits when the next commit arrives, before anything is
#: adopted; ``exit_after_commit`` after the new buffers were adopted, before the answer;
#: ``exit_in_switch`` when a staged update's switch arrives; ``exit_in_convert`` when the worker
#: converts weight formats; ``exit_relaying`` (n) exits after n buckets of the next staged
#: transfer in which it relays a fleet update's staged set.
FAULTS = (
    "stall",
    "exit_after_buckets",
    "exit_in_commit",
    "exit_after_commit",
    "exit_in_switch",
    "exit_in_convert",
    "exit_relaying",
)


class Faults:
    """The fault armed on one worker (none at first)."""

    def __init__(self) -> None:
        self.armed: tuple[str, float] | None = None

    def arm(self, kind: str, value: float) -> None:
        """Arm ``kind`` with ``value``; ``ValueError`` naming the allowed kinds for another."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; allowed: {', '.join(FAULTS)}")
        self.armed = (kind, value)

    def take(self, kind: str) -> float | None:
        """The value of ``kind`` if it is the armed fault (disarming it), else None."""
        if self.armed and self.armed[0] == kind:
            value, self.armed = self.armed[1], None
            return value
        return None

    def after_bucket(self) -> None:
        """Count a bucket against ``exit_after_buckets``; the process exits at the last one."""
        if self.armed and self.armed[0] == "exit_after_buckets":
            remaining = self.armed[1] - 1
            self.armed = ("exit_after_buckets", remaining)
            if remaining <= 0:
                os._exit(1)
