"""Progress bars and start/end logs for long operations (HF import and export, checkpoint save
and load, the bench).

Every long operation runs under one :class:`Progress`: it logs an INFO record when it starts, an
INFO record when it ends (bytes, seconds, GB/s), a WARNING when it fails (naming what failed and
after how long; the exception goes on to the caller), and shows a `tqdm <https://tqdm.github.io>`_
bar on stderr while it runs, one bar per step (``"write"``, ``"replicate"``, ...). The bar is
advanced as the work is done: by the driver as each worker's call finishes, or per file.

Bars are off when stderr is not a terminal (logs, CI, pytest); ``REALLOC_PROGRESS=1`` forces them
on, ``REALLOC_PROGRESS=0`` off. Bars never change results. The library configures no logging
handler: an application sees the records once it configures :mod:`logging` (``realloc
--log-level INFO`` or ``-v`` does it for the command line).

Example:
    >>> import logging
    >>> with Progress(logging.getLogger("demo"), "copy 2 files", total=20, enabled=False) as op:
    ...     op.advance(12)
    ...     op.advance(8)
    ...     op.nbytes = op.count
    >>> op.count, op.seconds > 0
    (20, True)
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import IO, Any, Mapping, Sequence

from tqdm import tqdm

#: Environment variable that forces the bars on (``1``) or off (``0``); unset: on when stderr is a terminal.
PROGRESS_ENV = "REALLOC_PROGRESS"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def bars_enabled(stream: "IO[str] | None" = None) -> bool:
    """Whether bars are shown on ``stream`` (default stderr): :data:`PROGRESS_ENV` if set, else
    whether ``stream`` is a terminal. A value of :data:`PROGRESS_ENV` other than 1/0 is a ``ValueError``."""
    setting = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if setting in _ON:
        return True
    if setting in _OFF:
        return False
    if setting:
        raise ValueError(
            f"{PROGRESS_ENV}={os.environ[PROGRESS_ENV]!r}: expected 1 (bars on) or 0 (bars off), "
            "or leave it unset (bars when stderr is a terminal)"
        )
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def write(message: str, stream: "IO[str] | None" = None) -> None:
    """Print ``message`` on ``stream`` (default stderr) without breaking a bar that is shown there."""
    tqdm.write(message, file=sys.stderr if stream is None else stream)
    (sys.stderr if stream is None else stream).flush()


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes per second in GB/s (0 for an instant operation)."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


class Progress:
    """One long operation: start and end records on ``log``, and a progress bar.

    ``what`` names it in the records and on the bar ("checkpoint save of iteration 3 (run x)");
    ``total``: what it will count, in ``unit`` (``"B"``: bytes, shown scaled), or ``None``: no bar
    until the first :meth:`step`. :meth:`step` starts a step with its own bar of its own total (an
    estimate may be exceeded: the bar then ends at what was counted); :meth:`advance` counts work
    done. Before the end, the caller sets :attr:`nbytes` (the bytes the end record reports) and
    may set :attr:`detail` (more text for it). Use it as a context manager: leaving the block
    normally logs the end, an exception logs the failure (WARNING) and propagates. :meth:`end`
    and :meth:`fail` do the same for an operation that spans calls (an async save); only the
    first of them logs.

    ``enabled``: show the bar (default :func:`bars_enabled` of ``stream``, stderr by default).
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        total: int | None = None,
        unit: str = "B",
        *,
        stream: "IO[str] | None" = None,
        enabled: bool | None = None,
    ):
        self.log, self.what, self.unit = log, what, unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bars_enabled(self.stream) if enabled is None else bool(enabled)
        self.count = 0  #: work counted over all steps, in ``unit``
        self.steps: list[tuple[str, int]] = []  #: each finished step's name and what it counted
        self.nbytes: int | None = None  #: the bytes the end record reports
        self.detail = ""  #: appended to the end record
        self.seconds = 0.0  #: wall time, set at the end
        self.ended = False
        self._bar: tqdm | None = None
        self._step: str | None = None
        self._step_count = 0
        self._started = time.perf_counter()
        log.info("%s: started", what, stacklevel=2)
        if total is not None:
            self._new_bar(None, total)

    # -- the bar ---------------------------------------------------------------------------
    def _new_bar(self, step: str | None, total: int | None) -> None:
        self._close_bar()
        self._step, self._step_count = step, 0
        self._bar = tqdm(
            total=total,
            desc=self.what if step is None else f"{self.what}: {step}",
            unit=self.unit,
            unit_scale=self.unit == "B",
            unit_divisor=1024 if self.unit == "B" else 1000,
            file=self.stream,
            disable=not self.enabled,
            dynamic_ncols=True,
            leave=True,  # each step stays on screen as it ended
        )

    def _close_bar(self) -> None:
        if self._bar is not None:
            self.steps.append((self._step or self.what, self._step_count))
            if self._bar.total is not None and self._bar.n > self._bar.total:
                self._bar.total = self._bar.n  # a total that was an estimate (file headers): show 100%
                self._bar.refresh()
            self._bar.close()
            self._bar = None

    @property
    def bar(self) -> "tqdm | None":
        """The current step's bar (``bar.n``: counted in this step); ``None`` once ended."""
        return self._bar

    def step(self, name: str, total: int | None = None) -> None:
        """Start step ``name`` (a fresh bar of ``total``); logs it at DEBUG."""
        self.log.debug("%s: %s (%s)", self.what, name, "?" if total is None else f"{total} {self.unit}", stacklevel=2)
        self._new_bar(name, total)

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more units of work done."""
        n = int(n)
        if n < 0:
            raise ValueError(f"{self.what}: progress goes forward, got advance({n})")
        self.count += n
        if self._bar is not None:
            self._step_count += n
            self._bar.update(n)

    # -- the end ---------------------------------------------------------------------------
    def end(self) -> None:
        """Log the end record (once) and close the bar."""
        self._finish(None)

    def fail(self, exc: BaseException) -> None:
        """Log the failure (once, WARNING: what failed, after how long, the exception) and close the bar."""
        self._finish(exc)

    def _finish(self, exc: BaseException | None) -> None:
        if self.ended:
            return
        self.ended = True
        self._close_bar()
        self.seconds = time.perf_counter() - self._started
        where = {"stacklevel": 3}  # the record names the code that ended the operation (or its with block)
        if exc is not None:
            self.log.warning(
                "%s: failed after %.3f s (%d %s done): %s: %s",
                self.what,
                self.seconds,
                self.count,
                self.unit,
                type(exc).__name__,
                exc,
                **where,
            )
            return
        detail = f"; {self.detail}" if self.detail else ""
        if self.nbytes is not None:
            self.log.info(
                "%s: done, %d bytes in %.3f s (%.3f GB/s)%s",
                self.what,
                self.nbytes,
                self.seconds,
                gbps(self.nbytes, self.seconds),
                detail,
                **where,
            )
        else:
            units = self.unit if self.count == 1 else f"{self.unit}s"  # "4 round trips"
            self.log.info("%s: done, %d %s in %.3f s%s", self.what, self.count, units, self.seconds, detail, **where)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        self._finish(exc)
        return False


# -- DEBUG summaries ----------------------------------------------------------------------------


def plan_summary(stats: Mapping[str, Any]) -> str:
    """One line of a plan's statistics (``Plan.stats``) for a DEBUG record.

    Example:
        >>> plan_summary({"bytes_intra_node": 10, "bytes_inter_node": 20, "bytes_local_copy": 5,
        ...               "num_steps": 2, "num_routes": 3, "estimated_seconds": 0.5})
        '3 routes in 2 steps: 20 bytes inter-node, 10 intra-node, 5 local; estimated 0.500 s'
    """
    return (
        f"{stats.get('num_routes', 0)} routes in {stats.get('num_steps', 0)} steps: "
        f"{stats.get('bytes_inter_node', 0)} bytes inter-node, {stats.get('bytes_intra_node', 0)} intra-node, "
        f"{stats.get('bytes_local_copy', 0)} local; estimated {stats.get('estimated_seconds', 0.0):.3f} s"
    )


def phase_summary(phases: Sequence["Mapping[str, float] | None"]) -> str:
    """Per phase, the slowest worker's seconds and its index, from each worker's ``{phase: seconds}``
    (``None`` for a worker that reported none; entries that are not numbers are skipped); empty
    when none did.

    Example:
        >>> phase_summary([{"prepare": 0.1, "transfer": 0.5}, {"prepare": 0.2, "transfer": 0.4}, None])
        'prepare 0.200 s (worker 1), transfer 0.500 s (worker 0)'
    """
    slowest: dict[str, tuple[float, int]] = {}
    for worker, own in enumerate(phases):
        for phase, seconds in (own if isinstance(own, Mapping) else {}).items():
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
                continue  # not a duration: left out of a summary that must never fail the move it describes
            if phase not in slowest or seconds > slowest[phase][0]:
                slowest[phase] = (float(seconds), worker)
    return ", ".join(f"{p} {s:.3f} s (worker {w})" for p, (s, w) in slowest.items())
