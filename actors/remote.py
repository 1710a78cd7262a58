"""Calling many workers from the driver: fail fast, never hang, name the worker that did not answer.

Every driver-side wait in the Ray layer goes through :func:`gather`. It waits for a set of
actor calls with one deadline; the first call that fails (or the deadline) ends the wait, and
before raising it *diagnoses* the workers: each one is pinged on its control thread (a Ray
concurrency group that answers even while the worker's main thread is busy in a transfer), so
the error can tell apart workers that died, workers that are alive but do not answer (a stopped
or hung process: the one the others are waiting for) and workers that are merely waiting.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import ray

from actors.errors import ReallocationError

log = logging.getLogger(__name__)

#: How long a diagnosis waits for the pings of all workers.
PING_SECONDS = 5.0


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

    def __bool__(self) -> bool:
        return bool(self.dead or self.unresponsive)

    def describe(self) -> str:
        parts = []
        if self.dead:
            parts.append(f"worker(s) {list(self.dead)} died")
        if self.unresponsive:
            parts.append(f"worker(s) {list(self.unresponsive)} are alive but did not answer within "
                         f"{PING_SECONDS:.0f}s (stopped, hung, or stuck in native code)")
        return "; ".join(parts)


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
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
            dead.append(name)
        except ray.exceptions.RayError:
            failed.append(name)
    return Diagnosis(tuple(dead), tuple(silent), tuple(failed))


def diagnose(workers: Workers, seconds: float = PING_SECONDS) -> Diagnosis:
    """Ping every worker's control thread; classify the ones that did not answer."""
    return settle(workers, [a.ping.remote() for a in workers.actors], seconds)


def gather(workers: Workers, refs: Sequence, timeout_s: float, what: str, state: str = "") -> list[Any]:
    """``ray.get`` of ``refs`` (one per worker of ``workers``) with one deadline, failing fast.

    On the first failed call or at the deadline, raises :class:`ReallocationError` naming the
    dead and the unresponsive workers (and, if none, the worker whose call failed, with its
    exception), followed by ``state``: what is true of the group afterwards.
    """
    refs = list(refs)
    if len(refs) != len(workers):
        raise ValueError(f"{what}: {len(refs)} calls for {len(workers)} workers")
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    index = {r: i for i, r in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = [workers.names[index[r]] for r in pending]
            found = diagnose(workers)
            cause = found.describe() if found else f"workers {late} are alive and answer pings but their call is " \
                                                   "still running (a peer may be stuck)"
            _fail(f"{what}: timed out after {timeout_s:.0f}s waiting for {late}; {cause}", found, state)
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for r in ready:
            try:
                results[index[r]] = ray.get(r)
            except ray.exceptions.RayError as err:
                found = diagnose(workers)
                name = workers.names[index[r]]
                if found:
                    _fail(f"{what}: {found.describe()}", found, state, err)
                cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
                _fail(f"{what} failed on {name}: {type(cause).__name__}: {cause}", found, state, err)
    return results


def _fail(message: str, found: Diagnosis, state: str, cause: BaseException | None = None):
    text = f"{message}. {state}" if state else message
    log.warning("%s", text)
    err = ReallocationError(text, found.dead, found.unresponsive)
    if cause is not None:
        raise err from cause
    raise err


def call_all(workers: Workers, method: str, *args: Any, timeout_s: float, what: str, state: str = "") -> list[Any]:
    """Call ``method(*args)`` on every worker and :func:`gather` the results."""
    return gather(workers, [getattr(a, method).remote(*args) for a in workers.actors], timeout_s, what, state)


def fire(workers: Workers, method: str, *args: Any) -> list:
    """Send ``method(*args)`` to every worker without waiting (clean-up after a failure)."""
    refs = []
    for a in workers.actors:
        try:
            refs.append(getattr(a, method).remote(*args))
        except Exception:  # noqa: BLE001 - a dead actor may refuse the call; clean-up is best effort
            log.debug("could not send %s", method, exc_info=True)
    return refs
