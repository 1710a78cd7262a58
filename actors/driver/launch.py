"""Starting a group's workers (runs in the driver): the placement group and one actor per rank
(the start half of :meth:`ModelGroup.create <actors.driver.group.ModelGroup.create>`, and the
replacements of :meth:`~actors.driver.group.ModelGroup.replace_dead_workers`), and the checks of
the user's worker class and of the arguments of ``run``/``call``, all before anything starts."""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config import GroupConfig
from actors.errors import ReallocationError
from actors.lanes import CONCURRENCY_GROUPS
from actors.remote import Workers, call_all
from actors.worker import RESERVED_METHODS, ShardWorker
from realloc.plan import Placement
from realloc.spec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launched:
    """A group's started workers: the actors, their own reports (``info``), the planner's
    placement read from them, and the placement group they run in."""

    workers: Workers
    infos: list[dict]
    placement: Placement
    pg: object


def worker_name(group: str, rank: int) -> str:
    """The Ray actor name of worker ``rank`` of group ``group`` (a replacement started by
    ``replace_dead_workers`` adds a ``:gen<ms>`` suffix to it)."""
    return f"realloc:{group}:rank{rank}"


def start_workers(name: str, spec: ModelSpec, n: int, config: GroupConfig, worker_cls: type) -> Launched:
    """Start ``n`` workers of group ``name`` in a new placement group (one bundle each) and wait
    for their reports. The cluster's capacity and the name are checked first (``ValueError``,
    nothing started); a failure after the placement group exists removes it and the actors."""
    check_capacity(n, config)
    check_name_free(name)
    pg = placement_group([config.bundle() for _ in range(n)], strategy=config.strategy, name=f"realloc-{name}")
    names = [worker_name(name, r) for r in range(n)]
    actors: list = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=config.start_timeout_s)
        if not ready:
            raise ReallocationError(
                f"placement group for {n} workers ({config.bundle()} each) not ready after {config.start_timeout_s:.0f}s "
                f"(available now: {_summary(ray.available_resources())}); nothing was started"
            )
        remote_cls = remote_class(config, worker_cls)
        for r in range(n):
            actors.append(start_worker(remote_cls, names[r], pg, r, name, spec, config))
        workers = Workers(tuple(actors), tuple(names))
        infos = call_all(workers, "info", timeout_s=config.start_timeout_s, what=f"start workers of {name!r}")
        return Launched(workers, infos, placement_of(infos), pg)
    except BaseException:
        discard(actors, pg, names[: len(actors)])
        raise


def discard(actors, pg, names=()) -> None:
    """Kill ``actors`` and remove their placement group (a start that failed, or a shutdown);
    ``names``: theirs, waited on until free (:func:`release_names`)."""
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)
    release_names(names)


def release_names(names, timeout_s: float = 30.0) -> list[str]:
    """Wait until no live actor holds any of ``names`` (killed just before): ``ray.kill`` returns
    before the cluster has marked the actor dead, and until it has, its name is taken, so a group
    started again under the same name right after a shutdown would be refused as still running.
    Returns (and logs) the names still held at the deadline."""
    deadline = time.monotonic() + timeout_s
    held = list(names)
    while held:
        held = [n for n in held if _held(n)]
        if not held or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if held:
        log.warning("names still held %.0fs after their actors were killed: %s", timeout_s, held)
    return held


def _held(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def start_worker(remote_cls, actor_name: str, pg, bundle: int, group: str, spec: ModelSpec, config: GroupConfig):
    """One worker actor, named, in bundle ``bundle`` of the group's placement group."""
    args, kwargs = _worker_args(group, spec, config.zero_copy, config.backend)
    return remote_cls.options(
        name=actor_name,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
    ).remote(*args, **kwargs)


def _worker_args(group: str, spec: ModelSpec | None, zero_copy: bool, backend: str | None) -> tuple[tuple, dict]:
    """What every worker class is started with: ``worker_cls(group, spec, zero_copy, backend=...)``."""
    return (group, spec, zero_copy), {"backend": backend}


def placement_of(infos: list[dict]) -> Placement:
    """The planner's placement from the workers' own reports (real Ray node ids)."""
    return Placement(tuple(i["node_id"] for i in infos), tuple(i["device"] for i in infos))


def remote_class(config: GroupConfig, worker_cls: type = ShardWorker):
    """The actor class with the group's resources; per-actor options (name, bundle) come on top.

    The control concurrency group answers pings while the default group is busy in a transfer;
    the stage group runs staged transfers beside the user's calls (actors/lanes.py).
    """
    return ray.remote(
        num_cpus=config.cpus_per_worker,
        num_gpus=config.num_gpus,
        runtime_env=config.runtime_env,
        max_restarts=0,
        concurrency_groups=CONCURRENCY_GROUPS,
    )(worker_cls)


def check_worker_cls(worker_cls: object) -> None:
    if not isinstance(worker_cls, type) or not issubclass(worker_cls, ShardWorker):
        raise ValueError(f"worker_cls must be a subclass of actors.ShardWorker, got {worker_cls!r}"[:200])
    own = [c for c in worker_cls.__mro__ if c is not object and not issubclass(ShardWorker, c)]  # the user's classes
    clashes = sorted(
        {n for c in own for n in vars(c) if (n in _RESERVED and n != "on_shards_changed") or n == "_realloc"}
    )
    if clashes:
        raise ValueError(
            f"worker_cls {worker_cls.__name__} redefines methods the protocol relies on: {clashes}; "
            "rename them (only on_shards_changed is meant to be overridden; _realloc holds the "
            "library's state; the reserved names are actors.worker.RESERVED_METHODS)"
        )
    if worker_cls.__init__ is ShardWorker.__init__:
        return
    signature = _signature(worker_cls.__init__)
    if signature is None:
        return  # no signature to check (not Python code): starting the workers tells
    args, kwargs = _worker_args("group", None, True, None)
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as err:
        raise ValueError(
            f"worker_cls {worker_cls.__name__}.__init__{signature} cannot take what every worker is "
            f"started with, {worker_cls.__name__}(group, spec, zero_copy, backend=...): {err}; allowed: "
            "no __init__ of your own, or def __init__(self, *args, **kwargs) that calls "
            "super().__init__(*args, **kwargs) (parameters of your own need defaults)"
        ) from None


#: Names of ShardWorker's methods (the driver and the worker call them): a subclass must not
#: redefine them, and ``call`` refuses them. Attributes are free: the library's state is ``_realloc``.
_RESERVED = RESERVED_METHODS


def user_methods(worker_cls: type) -> list[str]:
    """Public methods the user's subclass adds (what ``ModelGroup.call`` may call)."""
    return sorted(
        n for n in dir(worker_cls) if not n.startswith("_") and n not in _RESERVED and callable(getattr(worker_cls, n))
    )


def check_arguments(fn: Callable, leading: int, args: tuple, kwargs: dict, what: str) -> None:
    """``ValueError`` when ``fn`` cannot take ``leading`` arguments (self, ctx) then ``args`` and
    ``kwargs``: on the driver, before any traffic (not a ``TypeError`` from every worker)."""
    signature = _signature(fn)
    if signature is None:
        return  # no signature to check (not Python code): the call itself tells
    try:
        signature.bind(*[None] * leading, *args, **kwargs)
    except TypeError as err:
        raise ValueError(f"{what}{signature} cannot take these arguments: {err}") from None


def _signature(fn: Callable) -> inspect.Signature | None:
    """``fn``'s signature as its author wrote it (without the ``_ray_trace_ctx`` parameter Ray adds
    to the methods of an actor class), or ``None`` when it has none."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "_ray_trace_ctx"])


def check_capacity(n: int, config: GroupConfig) -> None:
    """``ValueError`` when the cluster as it is cannot ever hold ``n`` bundles (instead of waiting)."""
    if not ray.is_initialized():
        raise ValueError("Ray is not initialised: call ray.init() (or ray.init(address=...)) first")
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    for resource, amount in config.bundle().items():
        if amount <= 0:
            continue
        per_node = [math.floor(r.get(resource, 0) / amount + 1e-9) for r in nodes]
        fits = sum(per_node)
        if config.strategy == "STRICT_PACK":
            fits = max(per_node, default=0)
        elif config.strategy == "STRICT_SPREAD":
            fits = sum(1 for k in per_node if k > 0)
        if fits < n:
            total = sum(r.get(resource, 0) for r in nodes)
            raise ValueError(
                f"the cluster cannot hold {n} workers of {amount:g} {resource} each with strategy "
                f"{config.strategy}: its {len(nodes)} live nodes have {total:g} {resource} in all and fit {fits} "
                "(add nodes, or lower cpus_per_worker)"
            )


def check_name_free(name: str) -> None:
    try:
        ray.get_actor(worker_name(name, 0))
    except ValueError:
        return
    raise ValueError(
        f"a group named {name!r} is already running (its actors hold the names {worker_name(name, 0)[:-1]}*); "
        "shut it down or choose another name"
    )


def _summary(resources: dict) -> dict:
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory")}
