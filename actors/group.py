"""The driver-side handle of a model group: Ray actors that own one model's shards.

Example (8 CPU workers; on a GPU cluster pass ``use_gpu=True``)::

    import ray
    from realloc import ModelSpec, Topology
    from actors import ModelGroup

    ray.init(num_cpus=8)
    policy = ModelGroup.create(ModelSpec.preset("tiny"), Topology(dp=2, tp=2, pp=2), name="policy")
    policy.init_synthetic(seed=0)
    stats = policy.reallocate(Topology(dp=4, tp=2))   # train layout -> generation layout
    outputs = policy.run(lambda ctx: ctx.tensors["lm_head.weight"].shape)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.world import World
from actors.zero_copy import sweep_stale_buffers
from actors.worker import PeerView, ShardWorker
from realloc.boxes import box_index
from realloc.layout import Layout
from realloc.placement import Placement
from realloc.plan import Plan
from realloc.planner import DEFAULT_BUCKET_BYTES, Bandwidths, plan_reallocation
from realloc.spec import ModelSpec
from realloc.topology import Topology

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ReallocationError(RuntimeError):
    """A reallocation failed; the source shards of every surviving worker are unchanged."""

    def __init__(self, message: str, dead: Sequence[str] = ()):
        super().__init__(message)
        self.dead = list(dead)


@dataclass
class ReallocStats:
    """What one ``reallocate``/``copy_to`` did, as measured on the workers."""

    transition: str
    bytes_intra_node: int
    bytes_inter_node: int
    bytes_local: int
    seconds: float
    plan_seconds: float
    peak_extra_bytes_per_actor: int
    planned: dict

    @property
    def gbps(self) -> float:
        moved = self.bytes_intra_node + self.bytes_inter_node + self.bytes_local
        return moved / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "transition": self.transition, "bytes_intra_node": self.bytes_intra_node,
            "bytes_inter_node": self.bytes_inter_node, "bytes_local": self.bytes_local,
            "seconds": self.seconds, "plan_seconds": self.plan_seconds, "gbps": self.gbps,
            "peak_extra_bytes_per_actor": self.peak_extra_bytes_per_actor,
        }


class ModelGroup:
    """One model's shards on ``topology.world_size`` Ray actors (one per GPU or CPU slot)."""

    def __init__(self, name: str, spec: ModelSpec, topology: Topology, actors: list, names: list[str],
                 placement: Placement, pg, options: dict):
        self.name, self.spec, self.topology = name, spec, topology
        self.actors, self.actor_names, self.placement, self._pg = actors, names, placement, pg
        self.options = options
        self.world: World | None = None
        self.vocab_pad_multiple = options["vocab_pad_multiple"]

    # -- creation ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        spec: ModelSpec,
        topology: Topology,
        *,
        name: str = "model",
        use_gpu: bool = False,
        strategy: str = "PACK",
        cpus_per_worker: float = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        zero_copy: bool = True,
        vocab_pad_multiple: int = 1,
        bandwidths: Bandwidths = Bandwidths(),
        runtime_env: dict | None = None,
    ) -> "ModelGroup":
        """Start ``topology.world_size`` actors in a placement group (one bundle per worker).

        ``strategy`` is the placement-group strategy (PACK by default: fill a node's GPUs first).
        ``timeout_s`` bounds every collective operation and every wait of the driver.
        ``zero_copy`` lets workers on one node copy from each other's buffers directly
        (shared memory on CPU, CUDA IPC on GPU) instead of going through the process group.

        Example:
            >>> group = ModelGroup.create(ModelSpec.preset("tiny"), Topology(dp=2, tp=2))  # doctest: +SKIP
        """
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a realloc.Topology, got {type(topology).__name__}")
        topology.check(spec)
        if strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {strategy!r} is not one of {STRATEGIES}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes must be an integer of at least 1024, got {bucket_bytes!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if not cpus_per_worker >= 0:
            raise ValueError(f"cpus_per_worker must be >= 0, got {cpus_per_worker!r}")
        if not name or "/" in name:
            raise ValueError(f"group name must be non-empty without '/', got {name!r}")
        n = topology.world_size
        bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=f"realloc-{name}")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise RuntimeError(f"placement group for {n} workers ({bundle} each) not ready after {timeout_s}s: "
                               f"the cluster lacks resources (available: {_summary(ray.available_resources())})")
        remote_cls = ray.remote(ShardWorker)
        actors, names = [], []
        for r in range(n):
            actor_name = f"realloc:{name}:rank{r}"
            actors.append(remote_cls.options(
                name=actor_name, num_cpus=cpus_per_worker, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
                runtime_env=runtime_env, max_restarts=0,
            ).remote(name, spec, zero_copy))
            names.append(actor_name)
        infos = _get(actors, [a.info.remote() for a in actors], names, timeout_s + 60, "start workers")
        placement = Placement(tuple(i["node_id"] for i in infos), tuple(i["device"] for i in infos))
        options = {"bucket_bytes": bucket_bytes, "timeout_s": timeout_s, "vocab_pad_multiple": vocab_pad_multiple,
                   "bandwidths": bandwidths, "infos": infos, "cpus_per_worker": cpus_per_worker,
                   "runtime_env": runtime_env, "zero_copy": zero_copy}
        group = cls(name, spec, topology, actors, names, placement, pg, options)
        _get(actors, [a.set_layout.remote(topology, r, vocab_pad_multiple) for r, a in enumerate(actors)],
             names, timeout_s, "allocate shards")
        return group

    @property
    def num_workers(self) -> int:
        return len(self.actors)

    @property
    def timeout_s(self) -> float:
        return self.options["timeout_s"]

    def layout(self) -> Layout:
        return Layout(self.spec, self.topology, self.vocab_pad_multiple)

    # -- weights -------------------------------------------------------------------------
    def init_synthetic(self, seed: int = 0) -> None:
        """Fill every shard with the deterministic synthetic weights of ``seed``."""
        self._call_all("init_synthetic", "initialise weights", seed)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors held on the driver; each worker slices only its boxes."""
        expected = {p.name: (p.shape, p.dtype) for p in self.spec.params}
        for name, (shape, _) in expected.items():
            tensor = state.get(name)
            if tensor is None and (alias := self.spec.tied_head_of(name)):
                tensor = state.get(alias)
            if tensor is None:
                raise ValueError(f"state dict lacks parameter {name!r}")
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"parameter {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        ref = ray.put({k: v.detach().cpu() for k, v in state.items()})
        self._call_all("load_full", "load weights", ref)

    def shard_boxes(self, ranks: Sequence[int] | None = None) -> dict[int, list[tuple[str, tuple, tuple, torch.Tensor]]]:
        """Per rank, ``(param, offsets, sizes, tensor)`` of every box it holds, fetched to the driver."""
        ranks = list(range(self.num_workers)) if ranks is None else list(ranks)
        boxes = _get([self.actors[r] for r in ranks], [self.actors[r].get_boxes.remote() for r in ranks],
                     [self.actor_names[r] for r in ranks], self.timeout_s, "read shards")
        return dict(zip(ranks, boxes))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors assembled on the driver from the shards of dp replica 0."""
        full = {p.name: torch.zeros(p.shape, dtype=getattr(torch, p.dtype)) for p in self.spec.params}
        replica0 = [r for r in range(self.num_workers) if self.topology.coords(r)[0] == 0]
        for rank_boxes in self.shard_boxes(replica0).values():
            for param, offsets, sizes, tensor in rank_boxes:
                full[param][box_index(offsets, sizes)] = tensor
        for alias, target in self.spec.aliases.items():
            full[alias] = full[target]
        return full

    def verify_synthetic(self, seed: int = 0) -> dict[int, list[str]]:
        """Per rank, the slots that differ from the synthetic weights of ``seed`` (empty: all good)."""
        bad = self._call_all("verify_synthetic", "verify weights", seed)
        return {r: b for r, b in enumerate(bad) if b}

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every worker against its local shards, in place."""
        return self._call_all("run", "run user function", fn, args, kwargs)

    # -- reallocation --------------------------------------------------------------------
    def plan_to(self, dst: Topology) -> Plan:
        """The plan :meth:`reallocate` would run (no traffic)."""
        if not isinstance(dst, Topology):
            raise ValueError(f"destination must be a realloc.Topology, got {type(dst).__name__}")
        if dst.world_size != self.num_workers:
            raise ValueError(f"destination {dst} needs {dst.world_size} workers but group {self.name!r} has "
                             f"{self.num_workers}; dp*tp*pp must stay {self.num_workers}")
        return plan_reallocation(self.spec, self.layout(), Layout(self.spec, dst, self.vocab_pad_multiple),
                                 self.placement, bucket_bytes=self.options["bucket_bytes"],
                                 bandwidths=self.options["bandwidths"])

    def reallocate(self, dst: Topology, src: Topology | None = None) -> ReallocStats:
        """Move the weights into layout ``dst`` (planned on the driver, executed on the actors).

        ``src`` (optional) must equal the current layout; it is accepted so RL loops can write
        ``group.reallocate(dst, src=train_topo)`` and get an error if they lost track.
        """
        if src is not None and src != self.topology:
            raise ValueError(f"group {self.name!r} is in layout {self.topology}, not {src}")
        started = time.perf_counter()
        plan = self.plan_to(dst)
        plan_seconds = time.perf_counter() - started
        world = self._ensure_world([self])
        peers_src = [(self.topology, r) for r in range(self.num_workers)]
        peers_dst = [(dst, r) for r in range(self.num_workers)]
        stats = _execute(world, plan, self.actors, self.actor_names, peers_src, peers_dst, self.placement,
                         self.vocab_pad_multiple, self.timeout_s, {"model": self.name}, blend=None)
        self.topology = dst
        return ReallocStats(f"{peers_src[0][0]} -> {dst}", plan_seconds=plan_seconds,
                            planned=plan.stats, **stats)

    def copy_to(self, other: "ModelGroup", eta: float | None = None) -> ReallocStats:
        """Copy this group's weights into ``other`` (e.g. policy -> reference), in ``other``'s layout.

        With ``eta``, ``other = eta * self + (1 - eta) * other`` (EMA-style blending).
        """
        if eta is not None and not 0.0 <= eta <= 1.0:
            raise ValueError(f"eta must be within [0, 1], got {eta!r}")
        if other is self:
            raise ValueError("copy_to needs another group; use reallocate to change this group's layout")
        self.spec.check_same_as(other.spec)
        started = time.perf_counter()
        n, m = self.num_workers, other.num_workers
        placement = Placement(self.placement.nodes + other.placement.nodes)
        plan = plan_reallocation(self.spec, self.layout(), other.layout(), placement,
                                 src_workers=list(range(n)), dst_workers=list(range(n, n + m)),
                                 bucket_bytes=self.options["bucket_bytes"], bandwidths=self.options["bandwidths"])
        plan_seconds = time.perf_counter() - started
        world = self._ensure_world([self, other])
        peers_src = [(self.topology, r) for r in range(n)] + [None] * m
        peers_dst = [None] * n + [(other.topology, r) for r in range(m)]
        stats = _execute(world, plan, self.actors + other.actors, self.actor_names + other.actor_names,
                         peers_src, peers_dst, placement, self.vocab_pad_multiple,
                         max(self.timeout_s, other.timeout_s), {"model": f"{self.name}->{other.name}"}, blend=eta)
        label = f"{self.name}[{self.topology}] -> {other.name}[{other.topology}]"
        return ReallocStats(label, plan_seconds=plan_seconds, planned=plan.stats, **stats)

    def checkpoint_manager(self, *, root: str | None = None, run_id: str | None = None, jump: int | None = None,
                           factor: int = 2, timeout_s: float | None = None):
        """Node-local checkpoints of this group with clique replication (docs/checkpoints.md).

        Example:
            >>> ckpt = group.checkpoint_manager(factor=2)  # doctest: +SKIP
            >>> ckpt.save(100).wait(); ckpt.load()         # doctest: +SKIP
        """
        from actors.checkpoint import CheckpointManager

        return CheckpointManager(self, root=root, run_id=run_id, jump=jump, factor=factor, timeout_s=timeout_s)

    def dead_workers(self) -> list[int]:
        """Ranks whose actors no longer answer."""
        names = set(_dead_actors(self.actors, self.actor_names))
        return [r for r, n in enumerate(self.actor_names) if n in names]

    def replace_dead_workers(self) -> list[int]:
        """Start fresh actors (empty, zeroed shards) for the dead ones; returns their ranks.

        Ray reschedules the placement-group bundles of a lost node onto nodes that have room,
        so replacements land wherever the cluster has capacity (a fresh node, typically). The
        placement is re-read from the new actors; restore the weights with a checkpoint load.
        """
        dead = self.dead_workers()
        if not dead:
            return []
        remote_cls = ray.remote(ShardWorker)
        infos = self.options["infos"]
        use_gpu = any(i["gpu_ids"] for i in infos)
        for r in dead:
            ray.kill(self.actors[r])
            self.actors[r] = remote_cls.options(
                name=f"{self.actor_names[r]}:gen{int(time.time() * 1000)}", num_cpus=self.options["cpus_per_worker"],
                num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r),
                runtime_env=self.options["runtime_env"], max_restarts=0,
            ).remote(self.name, self.spec, self.options["zero_copy"])
        fresh = _get([self.actors[r] for r in dead], [self.actors[r].info.remote() for r in dead],
                     [self.actor_names[r] for r in dead], self.timeout_s + 60, "start replacement workers")
        for r, info in zip(dead, fresh):
            infos[r] = info
        self.placement = Placement(tuple(i["node_id"] for i in infos), tuple(i["device"] for i in infos))
        _get([self.actors[r] for r in dead],
             [self.actors[r].set_layout.remote(self.topology, r, self.vocab_pad_multiple) for r in dead],
             [self.actor_names[r] for r in dead], self.timeout_s, "allocate shards")
        if self.world is not None:
            self.world.mark_broken()
        return dead

    def _ensure_world(self, groups: list["ModelGroup"]) -> World:
        actors = [a for g in groups for a in g.actors]
        current = groups[0].world
        if current is not None and current.alive and all(g.world is current for g in groups) and current.covers(actors):
            return current
        names = [n for g in groups for n in g.actor_names]
        world = World.form(actors, names, max(g.timeout_s for g in groups))
        for g in groups:
            g.world = world
        return world

    def _call_all(self, method: str, what: str, *args: Any) -> list[Any]:
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return _get(self.actors, refs, self.actor_names, self.timeout_s, what)

    def shutdown(self) -> None:
        """Stop the actors and release the placement group."""
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - best effort: dead actors cannot clean up
            pass
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self._pg)
        sweep_stale_buffers()  # files of workers that died before they could clean up (this node)
        self.world = None


def _summary(resources: dict) -> dict:
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory")}


def _execute(world: World, plan: Plan, actors: list, names: list[str], src: list, dst: list,
             placement: Placement, vocab_pad_multiple: int, timeout_s: float, tags: dict,
             blend: float | None) -> dict:
    """Run a plan on ``actors`` (plan worker ``i`` is ``actors[i]``): prepare, two phases, commit."""
    what = "reallocate"
    participants = sorted({w for _, w in plan.local_copies} | {w for _, a, b, _ in plan.routes() for w in (a, b)}
                          | {i for i, d in enumerate(dst) if d is not None})
    dst_handles = _get([actors[i] for i in participants],
                       [actors[i].prepare.remote(dst[i], vocab_pad_multiple) for i in participants],
                       [names[i] for i in participants], timeout_s, what)
    handles_by_worker = dict(zip(participants, dst_handles))
    src_handles = _get([actors[i] for i in participants], [actors[i].export_source.remote() for i in participants],
                       [names[i] for i in participants], timeout_s, what)
    src_by_worker = dict(zip(participants, src_handles))
    peers = [PeerView(world.rank_of(actors[i]), placement.nodes[i], src[i], dst[i],
                      src_by_worker.get(i) if src[i] is not None else None, handles_by_worker.get(i))
             for i in range(len(actors))]
    plan_ref = ray.put(plan)
    started = time.perf_counter()
    results = None
    try:
        for phase in (0, 1):
            refs = [actors[i].execute.remote(plan_ref, i, peers, phase, {**tags, "rank": str(i)}) for i in participants]
            results = _merge(results, _get([actors[i] for i in participants], refs,
                                           [names[i] for i in participants], timeout_s, what))
    except Exception:
        world.mark_broken()
        for i in participants:
            actors[i].abort.remote()
        raise
    seconds = time.perf_counter() - started
    _get([actors[i] for i in participants], [actors[i].commit.remote(blend if dst[i] is not None else None)
                                             for i in participants],
         [names[i] for i in participants], timeout_s, what)
    return {
        "bytes_intra_node": sum(r["bytes"]["intra"] for r in results),
        "bytes_inter_node": sum(r["bytes"]["inter"] for r in results),
        "bytes_local": sum(r["bytes"]["local"] for r in results),
        "seconds": seconds,
        "peak_extra_bytes_per_actor": max(r["staging_bytes"] + r["dst_bytes"] for r in results),
    }


def _merge(acc: list | None, new: list[dict]) -> list[dict]:
    if acc is None:
        return new
    for a, b in zip(acc, new):
        for k in a["bytes"]:
            a["bytes"][k] += b["bytes"][k]
        a["staging_bytes"] = max(a["staging_bytes"], b["staging_bytes"])
    return acc


def _get(actors: list, refs: list, names: list[str], timeout_s: float, what: str) -> list:
    """``ray.get`` that fails fast: the first failure raises, naming dead actors; no hang."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = [names[refs.index(r)] for r in pending]
            raise ReallocationError(f"{what}: timed out after {timeout_s:.0f}s waiting for {late}")
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for r in ready:
            try:
                ray.get(r)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as err:
                dead = _dead_actors(actors, names) or [names[refs.index(r)]]
                raise ReallocationError(f"{what}: worker(s) {dead} died ({type(err).__name__}); "
                                        "source shards of the surviving workers are unchanged", dead) from err
            except ray.exceptions.RayTaskError as err:
                dead = _dead_actors(actors, names)
                if dead:
                    raise ReallocationError(f"{what}: worker(s) {dead} died; source shards of the surviving "
                                            "workers are unchanged", dead) from err
                raise ReallocationError(f"{what} failed on {names[refs.index(r)]}: {err.cause!r}") from err
    return ray.get(refs)


def _dead_actors(actors: list, names: list[str]) -> list[str]:
    """Names of actors that no longer answer (a quick ping each)."""
    pings = [a.info.remote() for a in actors]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=5)
    dead = []
    for name, ping in zip(names, pings):
        if ping not in ready:
            continue
        try:
            ray.get(ping)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
            dead.append(name)
    return dead
