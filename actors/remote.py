"""Calling many workers from the driver: fail fast, never hang, name the worker that did not answer.

Every driver-side wait in the Ray layer goes through :func:`gather`. It waits for a set of
actor calls with one deadline; the first call that fails (or the deadline) ends the wait, and
before raising it *diagnoses* the workers: each one is pinged on its control thread (a Ray
concurrency group that answers even while the worker's main thread is busy in a transfer), so
the error can tell apart workers that died, workers that are alive but do not answer (a stopped
or hung process: the one the others are waiting for) and workers that are merely waiting.

Deadlines: a call's deadline (:class:`Deadline`, ``timeout_s`` of the group) bounds the wait for
the answers; its failure path (the diagnosis here, then the operation's aborts and clean-up in
:mod:`actors.driver.protocol` and :mod:`actors.driver.group`) shares one fixed window of
:data:`FAILURE_GRACE_S` opened by the first failure, and waits for nothing beyond it: a silent
worker's abort is sent and queued, not awaited. So a failed call raises within its deadline plus
``FAILURE_GRACE_S``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import ray

from actors.errors import ReallocationError
from realloc._checks import check_finite

log = logging.getLogger(__name__)

#: What the failure path of a call may add to its deadline, all steps together: the diagnosis
#: (pings), the rollback (aborts) and the clean-up after it (docs/architecture.md, failure table).
FAILURE_GRACE_S = 5.0
#: The longest a diagnosis waits for the pings (out of FAILURE_GRACE_S; the aborts get the rest).
#: A ping is answered on the control thread in milliseconds, even during a transfer.
PING_SECONDS = 3.0


def check_timeout(value: object, name: str = "timeout_s") -> float:
    """``value`` as seconds if it is a finite positive number (the one check of every timeout a
    caller gives: nothing waits forever, and a string is no number of seconds), else a
    ``ValueError`` naming ``name`` and what is allowed.

    Example:
        >>> check_timeout(float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: timeout_s must be a finite positive number of seconds, got inf
    """
    return float(check_finite(name, value, positive=True, allowed="a finite positive number of seconds"))


class Deadline:
    """One deadline for a whole call (lock wait, world formation, every step of the operation),
    and one window of :data:`FAILURE_GRACE_S` for its failure path, opened by the first failure
    and shared by everything that runs after it (diagnosis, aborts, clean-up). ``seconds``: a
    finite positive number (:func:`check_timeout`)."""

    def __init__(self, seconds: float):
        self.seconds = check_timeout(seconds)
        self.at = time.monotonic() + self.seconds
        self._grace_ends: float | None = None

    def remaining(self) -> float:
        """Seconds left before the deadline (0 once it passed)."""
        return max(0.0, self.at - time.monotonic())

    def grace(self) -> float:
        """Seconds left of the failure path's window (the first call opens it)."""
        now = time.monotonic()
        if self._grace_ends is None:
            self._grace_ends = now + FAILURE_GRACE_S
        return max(0.0, self._grace_ends - now)


def as_deadline(timeout: "float | Deadline") -> Deadline:
    """``timeout`` if it is a :class:`Deadline` (a step of a larger call), else a new one of that many seconds."""
    return timeout if isinstance(timeout, Deadline) else Deadline(timeout)


@dataclass(frozen=True)
class Workers:
    """Actors and their names, index-aligned (a group's workers, or a subset, or two groups)."""

    actors: tuple
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "actors", tuple(self.actors))
        object.__setattr__(self, "names", tuple(self.names))
        if len(self.actors) != len(self.names):
            raise ValueError(f"{len(self.actors)} actors but {len(self.names)} names")

    def __len__(self) -> int:
        return len(self.actors)

    def subset(self, indices: Sequence[int]) -> "Workers":
        return Workers(tuple(self.actors[i] for i in indices), tuple(self.names[i] for i in indices))

    def __add__(self, other: "Workers") -> "Workers":
        return Workers(self.actors + other.actors, self.names + other.names)


@dataclass(frozen=True)
class Diagnosis:
    """Which workers are dead, which are alive but silent, and (for a settled call) whose call
    raised while the worker lived on (names)."""

    dead: tuple[str, ...] = ()
    unresponsive: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    seconds: float = 0.0  # how long it waited for the answers

    def __bool__(self) -> bool:
        return bool(self.dead or self.unresponsive)

    def describe(self) -> str:
        parts = []
        if self.dead:
            parts.append(f"worker(s) {list(self.dead)} died")
        if self.unresponsive:
            parts.append(
                f"worker(s) {list(self.unresponsive)} are alive but did not answer a ping within "
                f"{self.seconds:.1f}s (stopped, hung, or stuck in native code)"
            )
        return "; ".join(parts)


#: What a call to a dead actor raises: the actor died, or Ray's memory monitor killed its process
#: (Ray then answers every later call to it with ``OutOfMemoryError``, not ``ActorDiedError``).
DEATHS = (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError, ray.exceptions.OutOfMemoryError)


def settle(workers: Workers, refs: Sequence, seconds: float) -> Diagnosis:
    """Wait up to ``seconds`` for one call per worker and classify the workers by its outcome:
    no answer (unresponsive), the actor died (dead), the call raised otherwise (failed)."""
    refs = list(refs)
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=seconds)[0]) if refs else set()
    dead, silent, failed = [], [], []
    for name, ref in zip(workers.names, refs):
        if ref not in ready:
            silent.append(name)
            continue
        try:
            ray.get(ref)
        except DEATHS:
            dead.append(name)
        except ray.exceptions.RayError:
            failed.append(name)
    return Diagnosis(tuple(dead), tuple(silent), tuple(failed), seconds)


#: The callback of :func:`each_result` in force in this thread, if any.
_ON_RESULT: contextvars.ContextVar["Callable[[int, Any], None] | None"] = contextvars.ContextVar(
    "realloc_on_result", default=None
)


@contextlib.contextmanager
def each_result(callback: Callable[[int, Any], None]) -> Iterator[None]:
    """Within the block, every :func:`gather` of this thread calls ``callback(index, result)`` as
    each worker's call finishes (``index`` into its workers), in the waiting thread, before the
    next wait: progress bars and DEBUG records of waits made deep in other layers (an operation's
    steps). The deadline and failure semantics of :func:`gather` are unchanged; a failed call
    never reaches ``callback``, and an exception of ``callback`` is logged (WARNING), not raised."""
    token = _ON_RESULT.set(callback)
    try:
        yield
    finally:
        _ON_RESULT.reset(token)


def diagnose(workers: Workers, seconds: float = PING_SECONDS) -> Diagnosis:
    """Ping every worker's control thread; classify the ones that did not answer."""
    return settle(workers, [a.ping.remote() for a in workers.actors], seconds)


def gather(
    workers: Workers,
    refs: Sequence,
    timeout_s: "float | Deadline",
    what: str,
    state: str = "",
    layout: str | None = None,
) -> list[Any]:
    """``ray.get`` of ``refs`` (one per worker of ``workers``) with one deadline, failing fast.

    ``timeout_s``: seconds, or the :class:`Deadline` of the call this wait is a step of. On the
    first failed call or at the deadline, pings the workers (within the deadline's grace, at most
    :data:`PING_SECONDS`) and raises :class:`ReallocationError` naming the dead, the unresponsive
    and the waiting workers (and, if none died or went silent, the worker whose call failed, with
    its exception), followed by ``state``: what is true of the group afterwards; ``layout``: the
    error's ``layout``. Inside :func:`each_result`, each result is handed to its callback as it arrives.
    """
    refs = list(refs)
    if len(refs) != len(workers):
        raise ValueError(f"{what}: {len(refs)} calls for {len(workers)} workers")
    deadline = as_deadline(timeout_s)
    pending = list(refs)
    index = {r: i for i, r in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    on_result = _ON_RESULT.get()
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=deadline.remaining())
        if not ready:
            late = [workers.names[index[r]] for r in pending]
            found = diagnose(workers, min(PING_SECONDS, deadline.grace()))
            cause = (
                found.describe()
                if found
                else f"workers {late} are alive and answer pings but their call is still running (a peer may be stuck)"
            )
            _fail(
                f"{what}: timed out after {deadline.seconds:.0f}s waiting for {late}; {cause}",
                found,
                late,
                state,
                layout,
            )
        for r in ready:
            try:
                results[index[r]] = ray.get(r)
            except ray.exceptions.RayError as err:
                found = diagnose(workers, min(PING_SECONDS, deadline.grace()))
                name = workers.names[index[r]]
                late = [workers.names[index[p]] for p in pending]
                cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
                raised = f"{what} failed on {name}: {type(cause).__name__}: {cause}"
                if found.dead:  # a death explains the failed calls of its peers
                    _fail(f"{what}: {found.describe()}", found, late, state, layout, err)
                # the call itself raised: its error leads, and the silent peers follow (a peer
                # still starting, or stopped, must not hide why the call failed)
                _fail(f"{raised}; {found.describe()}" if found else raised, found, late, state, layout, err)
            if on_result is not None:
                try:
                    on_result(index[r], results[index[r]])
                except Exception:  # noqa: BLE001 - a progress report never changes the call's outcome
                    log.warning("%s: the result callback failed on %s", what, workers.names[index[r]], exc_info=True)
    return results


def _fail(
    message: str,
    found: Diagnosis,
    late: Sequence[str],
    state: str,
    layout: str | None,
    cause: BaseException | None = None,
):
    """Raise the error of a failed :func:`gather`: ``late`` workers that answered pings are waiting."""
    text = f"{message}. {state}" if state else message
    log.warning("%s", text)
    waiting = [n for n in late if n not in found.dead and n not in found.unresponsive]
    err = ReallocationError(text, found.dead, found.unresponsive, layout, waiting)
    if cause is not None:
        raise err from cause
    raise err


def call_all(
    workers: Workers,
    method: str,
    *args: Any,
    timeout_s: "float | Deadline",
    what: str,
    state: str = "",
    layout: str | None = None,
) -> list[Any]:
    """Call ``method(*args)`` on every worker and :func:`gather` the results."""
    return gather(workers, [getattr(a, method).remote(*args) for a in workers.actors], timeout_s, what, state, layout)


def fire(workers: Workers, method: str, *args: Any) -> list:
    """Send ``method(*args)`` to every worker without waiting (clean-up after a failure)."""
    refs = []
    for a in workers.actors:
        try:
            refs.append(getattr(a, method).remote(*args))
        except Exception:  # noqa: BLE001 - a dead actor may refuse the call; clean-up is best effort
            log.debug("could not send %s", method, exc_info=True)
    return refs


def undo(workers: Workers, cause: ReallocationError, method: str, *args: Any, seconds: float) -> Diagnosis:
    """After a failed step: call ``method(*args)`` (an abort) on every worker the failure ``cause``
    did not find dead, waiting up to ``seconds`` only for those that answered its pings (a silent
    worker's call is sent and queued). Returns the settled workers' diagnosis (its ``unresponsive``:
    they answer pings but are still in the failed call; their undo is queued behind it)."""
    dead, silent = set(cause.dead), set(cause.unresponsive)
    fire(workers.subset([i for i, n in enumerate(workers.names) if n in silent]), method, *args)
    answering = workers.subset([i for i, n in enumerate(workers.names) if n not in dead | silent])
    return settle(answering, [getattr(a, method).remote(*args) for a in answering.actors], seconds)
