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

Every state change runs the protocol of :mod:`actors.driver.protocol` (prepare, execute, commit or
abort), one operation at a time per group: a second call from another thread waits for the
first (up to the group's timeout, then :class:`~actors.errors.GroupBusyError`). Bad arguments
raise ``ValueError`` before any worker is contacted.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import pickle
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import ray
import torch

from actors import metrics
from actors.config import GroupConfig
from actors.driver.checkpoint import CheckpointManager
from actors.driver.fleet import copy_to_groups
from actors.driver.launch import (
    check_arguments,
    check_worker_cls,
    discard,
    placement_of,
    remote_class,
    start_worker,
    start_workers,
    user_methods,
    worker_name,
)
from actors.driver.ledger import GroupLedger
from actors.driver.protocol import Operation
from actors.driver.staged import PlannedFrom, StagedUpdate
from actors.driver.world import World
from actors.errors import GroupBusyError, HookError, ReallocationError
from actors.lanes import LANES, MOVE, Lane
from actors.records import PLAIN_MOVE, KeepOrder, MoveOrder, PhaseResult, ResidentLayout, ShardChange, check_keep
from actors.remote import Deadline, Workers, call_all, check_timeout, diagnose, each_result, gather, settle
from actors.trace import MoveRef, MoveTrace, gather_trace, wall_spans
from actors.wire.zero_copy import sweep_stale_buffers
from actors.worker import ShardWorker
from realloc._checks import check_nonneg, is_int
from realloc.boxes import box_index
from realloc.layout import Layout, RankLayout, Topology
from realloc.plan import Bandwidths, Placement, Plan, plan_reallocation
from realloc.plan.formats import conversion
from realloc.progress import phase_summary, plan_summary
from realloc.shards import TORCH_DTYPES, check_eta
from realloc.spec import ModelSpec
from realloc.spec.formats import CASTS, unformatted

log = logging.getLogger(__name__)

__all__ = ["ModelGroup", "ReallocStats", "ReallocationError", "GroupBusyError", "StagedUpdate"]


@dataclass(kw_only=True)
class ReallocStats:
    """What one ``reallocate``/``copy_to`` did, as measured on the workers (built by keyword: 20 fields).

    ``seconds``: the transfers (both phases, the slowest worker's own clock); ``pause_seconds``:
    the whole call as the caller saw it (planning, the driver round trip, prepare, transfers, commit).
    ``resident_use``: ``"adopted"`` (the destination was a kept layout holding the current
    weights: nothing moved), ``"refreshed"`` (a kept layout's buffers were written in place) or
    None; ``resident_*_bytes_per_actor``: the largest worker's kept layouts afterwards, on its
    device and in host memory (actors/worker/kept.py). ``version``: the destination's weight
    version afterwards. For a staged update (actors/driver/staged.py) ``pause_seconds`` is 0 (nobody
    waited: the switch's pause is ``StagedUpdate.pause_seconds``) and ``shadow_bytes_per_actor``
    the largest worker's shadow set. ``delta``: for a move with ``delta=True``, what travelled
    (:func:`actors.records.delta_summary`: ``mode`` ``"delta"`` or ``"anchor"``, buckets, ``wire_bytes``
    against ``bytes``, the senders' base memory); None otherwise. ``conversion``: for a copy
    between weight formats, where they were converted (``"source"``: before sending, the wire
    carrying the destination's format; ``"destination"``: after receiving); None otherwise.
    ``slowest_worker``: the actor that took longest in the move (its own clock, from receiving
    the call to its commit: ``slowest_worker_seconds``) and ``slowest_phase`` its longest phase
    (``ShardWorker.last_phases``); None for a move where no worker ran a plan (an adopted layout).
    The whole timeline: ``ModelGroup.last_trace()``.
    """

    transition: str
    bytes_intra_node: int
    bytes_inter_node: int
    bytes_local: int
    seconds: float
    plan_seconds: float
    peak_extra_bytes_per_actor: int
    planned: dict
    pause_seconds: float = 0.0
    resident_use: str | None = None
    resident_in_place_bytes_per_actor: int = 0
    resident_host_bytes_per_actor: int = 0
    version: int | None = None
    shadow_bytes_per_actor: int = 0
    delta: dict | None = None
    conversion: str | None = None
    slowest_worker: str | None = None
    slowest_worker_seconds: float = 0.0
    slowest_phase: str | None = None
    slowest_phase_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        moved = self.bytes_intra_node + self.bytes_inter_node + self.bytes_local
        return moved / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "transition": self.transition,
            "bytes_intra_node": self.bytes_intra_node,
            "bytes_inter_node": self.bytes_inter_node,
            "bytes_local": self.bytes_local,
            "seconds": self.seconds,
            "plan_seconds": self.plan_seconds,
            "gbps": self.gbps,
            "peak_extra_bytes_per_actor": self.peak_extra_bytes_per_actor,
            "pause_seconds": self.pause_seconds,
            "resident_use": self.resident_use,
            "resident_in_place_bytes_per_actor": self.resident_in_place_bytes_per_actor,
            "resident_host_bytes_per_actor": self.resident_host_bytes_per_actor,
            "version": self.version,
            "shadow_bytes_per_actor": self.shadow_bytes_per_actor,
            "delta": self.delta,
            "conversion": self.conversion,
            "slowest_worker": self.slowest_worker,
            "slowest_worker_seconds": self.slowest_worker_seconds,
            "slowest_phase": self.slowest_phase,
            "slowest_phase_seconds": self.slowest_phase_seconds,
        }


@lru_cache(maxsize=64)
def _plan(
    src: Layout,
    dst: Layout,
    placement: Placement,
    src_workers: tuple | None,
    dst_workers: tuple | None,
    bucket_bytes: int,
    bandwidths: Bandwidths,
) -> Plan:
    """Plans are pure functions of their inputs: an RL loop alternating two layouts plans twice."""
    return plan_reallocation(
        src.spec,
        src,
        dst,
        placement,
        src_workers=src_workers,
        dst_workers=dst_workers,
        bucket_bytes=bucket_bytes,
        bandwidths=bandwidths,
    )


@runtime_checkable
class CopyTarget(Protocol):
    """A destination of :meth:`ModelGroup.copy_to` that is not a model group: an inference engine
    realloc updates through the engine's own API (actors/driver/vllm.py ``VLLMEngine``).
    ``receive_copy(source, stage, delta)`` moves ``source``'s weights in; with ``stage=True`` it
    returns the update (``wait``/``commit``/``abort``) at once, otherwise its stats once
    committed; ``delta``: only the changed elements travel where the target holds ``source``'s
    last weights (``copy_to(delta=True)``, checked by ``copy_to``)."""

    def receive_copy(self, source: "ModelGroup", stage: bool, delta: bool) -> Any: ...


class ModelGroup:
    """One model's shards on ``layout.topology.world_size`` Ray actors (one per GPU or CPU slot).

    ``layout`` is the group's state: the one value saying what every worker holds. ``version``
    counts the changes of the weights the driver knows of (fills, loads, copies into the group,
    replacements, and ``run``/``call`` unless told ``writes=False``); kept layouts
    (``reallocate(..., keep=)``) are tagged with it.
    """

    def __init__(
        self,
        name: str,
        layout: Layout,
        config: GroupConfig,
        workers: Workers,
        placement: Placement,
        pg,
        infos: list[dict],
        worker_cls: type = ShardWorker,
    ):
        self.name, self.config, self.worker_cls = name, config, worker_cls
        self.workers, self.placement, self._pg, self.infos = workers, placement, pg, infos
        #: the world of each lane (actors/lanes.py) this group's workers are in, reused while alive
        self.worlds: dict[Lane, World | None] = dict.fromkeys(LANES)
        #: the group's state (layout, version, origin, kept layouts, delta bases, the pending staged
        #: update, the locks): its one writer (actors/driver/ledger.py)
        self.ledger = GroupLedger(name, layout, config, self._stage_states)
        self._last_move: MoveRef | None = None  # what last_trace() gathers

    # -- creation ------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        spec: ModelSpec,
        topology: "Topology | str | Layout",
        *,
        name: str = "model",
        vocab_pad_multiple: int = 1,
        vocab_pad_rule: str = "megatron",
        qkv_order: str = "hf",
        weight_format: str | None = None,
        config: GroupConfig | None = None,
        worker_cls: type = ShardWorker,
        **settings: Any,
    ) -> "ModelGroup":
        """Start one actor per rank of ``topology`` in a placement group (one bundle per worker).

        ``worker_cls``: your subclass of :class:`~actors.worker.ShardWorker` (your model code in
        the workers: call its methods with :meth:`call`; its ``on_shards_changed`` hook runs after
        every committed change, the first time when the group has started).

        ``topology`` is a :class:`Topology`, its string (``"dp=2,tp=4"``) or a full
        :class:`Layout`; ``vocab_pad_multiple``, ``vocab_pad_rule`` and ``qkv_order`` (engine
        conventions, :mod:`realloc.layout.conventions`) and ``weight_format`` (what the group holds
        the weights as, e.g. ``"fp8_block128"`` for a generator serving block FP8 or
        ``"bfloat16"`` beside fp32 masters: :mod:`realloc.spec.formats`; :meth:`copy_to` converts)
        build the layout from a topology (a Layout carries its own: give one or the other). ``settings`` are :class:`GroupConfig` fields (``use_gpu``, ``gpus_per_worker``,
        ``transport``, ``strategy``, ``cpus_per_worker``, ``bucket_bytes``, ``timeout_s``, ``start_timeout_s``, ``zero_copy``, ``bandwidths``,
        ``runtime_env``), or pass ``config=``. Every argument is checked, and the cluster's
        capacity too, before anything starts; a failure after the placement group exists
        removes it and the actors again.

        Example:
            >>> group = ModelGroup.create(ModelSpec.preset("tiny"), Topology(dp=2, tp=2))  # doctest: +SKIP
        """
        if not isinstance(spec, ModelSpec):
            raise ValueError(
                f"spec must be a realloc.ModelSpec (e.g. ModelSpec.preset('tiny')), got {type(spec).__name__} {spec!r}"[
                    :200
                ]
            )
        options = {"vocab_pad_multiple": vocab_pad_multiple, "vocab_pad_rule": vocab_pad_rule, "qkv_order": qkv_order}
        if isinstance(topology, Layout):
            for option, default in (("vocab_pad_multiple", 1), ("vocab_pad_rule", "megatron"), ("qkv_order", "hf")):
                given, own = options[option], topology.options[option]
                if given != default and given != own:
                    what = "padding" if option == "vocab_pad_multiple" else option
                    raise ValueError(
                        f"{option}={given!r} contradicts the layout's own {what} ({own}); "
                        f"a Layout carries its {what}, give one or the other"
                    )
        if weight_format is not None:
            if isinstance(topology, Layout):
                raise ValueError(
                    "weight_format= with a Layout: a Layout carries its weight format, give one or the other"
                )
            options["weight_format"] = weight_format
        layout = _as_layout(spec, topology, options)
        check_worker_cls(worker_cls)
        if config is not None and settings:
            raise ValueError(f"give either config= or settings, not both (got {sorted(settings)})")
        if config is None:
            unknown = sorted(set(settings) - set(GroupConfig.__dataclass_fields__))
            if unknown:
                raise ValueError(
                    f"unknown group settings {unknown}; allowed: {sorted(GroupConfig.__dataclass_fields__)}"
                )
            config = GroupConfig(**settings)
        elif not isinstance(config, GroupConfig):
            raise ValueError(f"config must be an actors.config.GroupConfig, got {type(config).__name__}")
        if not isinstance(name, str) or not name or any(c in name for c in "/:") or name != name.strip():
            raise ValueError(
                f"group name must be a non-empty string without '/', ':' or surrounding spaces, got {name!r}"
            )
        launched = start_workers(name, spec, layout.topology.world_size, config, worker_cls)
        try:
            group = cls(
                name, layout, config, launched.workers, launched.placement, launched.pg, launched.infos, worker_cls
            )
            gather(
                launched.workers,
                [a.set_layout.remote(layout.at(r)) for r, a in enumerate(launched.workers.actors)],
                config.timeout_s,
                "allocate shards",
            )
            group._form_user_groups()
            group.announce(ShardChange("create", layout))
        except BaseException:
            discard(launched.workers.actors, launched.pg, launched.workers.names)
            raise
        log.info(
            "group %s: %d workers on %d nodes in layout %s",
            name,
            layout.topology.world_size,
            launched.placement.num_nodes,
            layout,
        )
        return group

    # -- views ---------------------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        return self.layout.spec

    @property
    def topology(self) -> Topology:
        return self.layout.topology

    @property
    def vocab_pad_multiple(self) -> int:
        return self.layout.vocab_pad_multiple

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def actors(self) -> list:
        return list(self.workers.actors)

    @property
    def actor_names(self) -> list[str]:
        return list(self.workers.names)

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s

    # -- the group's state (actors/driver/ledger.py) --------------------------------------
    @property
    def layout(self) -> Layout:
        """What every worker holds: the one value saying what the group is."""
        return self.ledger.layout

    @property
    def version(self) -> int:
        """The weights' version (never going back)."""
        return self.ledger.version

    @property
    def origin(self) -> tuple[str, int] | None:
        """(source group, its version) when the weights are an unchanged copy of that source's."""
        return self.ledger.origin

    def copy_version(self, source: "ModelGroup") -> int:
        """The version a copy of ``source``'s weights gives this group: the source's, unless this
        group's own count is ahead (then the next one: versions never go back, so a kept layout
        tagged with a version is fresh only while nothing changed). A copy of the very weights this
        group already holds (the same source version, nothing written since) keeps its version."""
        return self.ledger.copy_version(source.ledger)

    def _stage_states(self) -> list[dict]:
        """Every worker's staged state (``ShardWorker.stage_status``)."""
        return call_all(self.workers, "stage_status", timeout_s=self.timeout_s, what=f"staged state ({self.name})")

    def _check_delta(self, delta: object, what: str) -> bool:
        if not isinstance(delta, bool):
            raise ValueError(f"delta must be True or False, got {delta!r}")
        if delta and self.config.delta is None:
            raise ValueError(
                f"{what}(delta=True): group {self.name!r} keeps no base to compute deltas against; "
                "create it with GroupConfig(delta='host') or GroupConfig(delta='device')"
            )
        return delta

    def _call(self, method: str, what: str, *args: Any) -> list[Any]:
        return call_all(
            self.workers, method, *args, timeout_s=self.timeout_s, what=f"{what} ({self.name})", layout=str(self.layout)
        )

    def _operation(self, dst: Layout, what: str, keeps: str, timeout_s: "float | Deadline | None" = None) -> Operation:
        """An operation of this group's workers into ``dst``; on failure they keep ``self.layout``."""
        return Operation(
            self.workers,
            [dst.at(r) for r in range(self.num_workers)],
            self.timeout_s if timeout_s is None else timeout_s,
            what,
            keeps,
            str(self.layout),
        )

    def weights_operation(self, what: str, timeout_s: "float | Deadline | None" = None) -> Operation:
        """An operation that replaces this group's weights and keeps its layout (a checkpoint load:
        actors/driver/checkpoint.py)."""
        return self._operation(
            self.layout,
            f"{what} ({self.name})",
            f"group {self.name!r} keeps its previous weights in layout {self.layout}",
            timeout_s,
        )

    # -- weights -------------------------------------------------------------------------
    def init_synthetic(self, seed: int = 0) -> None:
        """Fill every shard with the deterministic synthetic weights of ``seed`` (atomically)."""
        _check_seed(seed)
        self.fill("initialise weights", "synthetic", seed)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load full tensors held on the driver; each worker slices only its boxes (atomically).

        Keys are parameter names (a tied head may be given by its alias instead); every parameter
        is required, unknown keys are refused, values must be real (not meta) floating-point
        ``torch.Tensor``s of the parameter's shape (a float dtype other than the parameter's is cast).
        """
        ref = ray.put(self._checked_state(state))
        self.fill("load weights", "full", ref)

    def _checked_state(self, state: object) -> dict[str, torch.Tensor]:
        if not isinstance(state, Mapping):
            raise ValueError(f"a state dict maps parameter names to tensors, got {type(state).__name__}")
        spec = self.spec
        known = {p.name for p in spec.params} | set(spec.aliases)
        unknown = sorted(str(k) for k in state if k not in known)
        if unknown:
            raise ValueError(f"state dict has keys that are not parameters of {spec.name!r}: {unknown[:5]}")
        out = {}
        for p in spec.params:
            alias = spec.tied_head_of(p.name)
            keys = [k for k in (p.name, alias) if k is not None and k in state]  # both checked when both given
            if not keys:
                raise ValueError(f"state dict lacks parameter {p.name!r}")
            for key in keys:
                tensor = state[key]
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"parameter {key!r} must be a torch.Tensor, got {type(tensor).__name__}")
                if tensor.device.type == "meta":
                    raise ValueError(f"parameter {key!r} is a meta tensor (no data); materialise it first")
                if not tensor.is_floating_point():
                    raise ValueError(
                        f"parameter {key!r} has dtype {tensor.dtype}; expected a floating-point tensor "
                        f"(the model holds {p.dtype})"
                    )
                if tuple(tensor.shape) != tuple(p.shape):
                    raise ValueError(f"parameter {key!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            if len(keys) == 2 and not torch.equal(state[alias].cpu(), state[p.name].cpu()):
                raise ValueError(f"tied parameters {p.name!r} and {alias!r} are both given and differ")
            out[p.name] = state[keys[0]].detach().to("cpu", TORCH_DTYPES[p.dtype]).contiguous()
        return out

    def fill(
        self,
        what: str,
        how: str,
        *args: Any,
        timeout_s: float | None = None,
        on_result: Callable[[int, int], None] | None = None,
    ) -> list[int]:
        """New weights from each worker's local data (``ShardWorker.op_fill``), as one operation
        under one deadline (``timeout_s``, default the group's; the lock wait included); returns
        the bytes each worker wrote. ``on_result(rank, bytes)``: as each worker's write finishes
        (a progress bar). :meth:`init_synthetic`, :meth:`load_state_dict` and a checkpoint load
        (actors/driver/checkpoint.py) run it."""
        deadline = Deadline(self.timeout_s if timeout_s is None else timeout_s)
        with self.ledger.exclusive(what, deadline=deadline):
            op = self.weights_operation(what, deadline)
            op.prepare()
            with each_result(on_result) if on_result is not None else contextlib.nullcontext():
                written = op.call([a.op_fill.remote(op.id, how, *args) for a in self.workers.actors], "write shards")
            op.commit()
            self.announce(ShardChange("fill", self.layout, self.layout))
        return written

    def shard_boxes(
        self, ranks: Sequence[int] | None = None
    ) -> dict[int, list[tuple[str, tuple, tuple, torch.Tensor]]]:
        """Per rank, ``(param, offsets, sizes, tensor)`` of every box it holds, fetched to the driver."""
        ranks = self._check_ranks(ranks)
        with self.ledger.exclusive("read shards", staged_ok=True):
            self.ledger.settle_switch()
            boxes = call_all(
                self.workers.subset(ranks), "get_boxes", timeout_s=self.timeout_s, what=f"read shards ({self.name})"
            )
        dtypes = {p.name: TORCH_DTYPES[p.dtype] for p in self.spec.params}
        return {  # float8 boxes travel as their bytes (ShardWorker.get_boxes)
            rank: [(p, o, z, t.view(dtypes[p]) if t.dtype != dtypes[p] else t) for p, o, z, t in rank_boxes]
            for rank, rank_boxes in zip(ranks, boxes)
        }

    def _check_ranks(self, ranks: object) -> list[int]:
        if ranks is None:
            return list(range(self.num_workers))
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise ValueError(f"ranks must be a sequence of integers, got {type(ranks).__name__}")
        bad = [r for r in ranks if not is_int(r) or not 0 <= r < self.num_workers]
        if bad:
            raise ValueError(f"ranks {bad[:5]} are not ranks of group {self.name!r} (0..{self.num_workers - 1})")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks {list(ranks)} name a rank twice")
        return list(ranks)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors assembled on the driver from the shards of dp replica 0."""
        full = {p.name: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in self.spec.params}
        replica0 = [r for r in range(self.num_workers) if self.topology.coords(r)[0] == 0]
        for rank_boxes in self.shard_boxes(replica0).values():
            for param, offsets, sizes, tensor in rank_boxes:
                full[param][box_index(offsets, sizes)] = tensor
        for alias, target in self.spec.aliases.items():
            full[alias] = full[target]
        return full

    def verify_synthetic(self, seed: int = 0) -> dict[int, list[str]]:
        """Per rank, the slots that differ from the synthetic weights of ``seed`` (empty: all good)."""
        _check_seed(seed)
        with self.ledger.exclusive("verify weights", staged_ok=True):
            self.ledger.settle_switch()
            bad = self._call("verify_synthetic", "verify weights", seed)
        return {r: b for r, b in enumerate(bad) if b}

    def run(self, fn: Callable, *args: Any, writes: bool = True, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every worker against its local shards, in place.

        ``ctx`` is a :class:`~actors.worker.context.ShardContext`. Writes into ``ctx.tensors`` change the
        weights directly (user code, not an atomic operation). Returned tensors that are views of
        the worker's buffers are copied first, so only their own bytes travel. ``writes=False``
        promises that ``fn`` does not change the weights: kept layouts stay current
        (:meth:`reallocate` with ``keep``); by default every run counts as a change.
        """
        if not callable(fn):
            raise ValueError(f"run needs a callable fn(ctx, ...), got {type(fn).__name__}")
        check_arguments(fn, 1, args, kwargs, f"run: {getattr(fn, '__name__', type(fn).__name__)}")
        _check_writes(writes)
        shipped = _shipped("run", fn, args, kwargs)
        with self.ledger.exclusive("run user function", staged_ok=True):
            self._repair_user_groups()
            with self.ledger.writes("run", writes), self._user_code("run user function"):
                switch = self.ledger.switch_flag()
                out = self._call("run", "run user function", *shipped, self.version, switch)
                self.ledger.switched(switch)
                return out

    def call(
        self, method: str, *args: Any, ranks: Sequence[int] | None = None, writes: bool = True, **kwargs: Any
    ) -> list[Any]:
        """Call ``method(*args, **kwargs)`` of your worker class on every worker (or on ``ranks``),
        all at once, and return the results in rank order.

        ``method`` is the name of a public method your ``worker_cls`` defines. Like :meth:`run`,
        it is user code (no atomic operation) and returned views of shard buffers are copied;
        pass ``writes=False`` for methods that do not change the weights (generation), so kept
        layouts stay current.
        Example:
            >>> losses = group.call("train_step", batch)  # doctest: +SKIP
        """
        allowed = user_methods(self.worker_cls)
        if not isinstance(method, str) or method not in allowed:
            raise ValueError(
                f"{method!r} is not a method of worker class {self.worker_cls.__name__}; "
                f"callable: {allowed or 'none (pass worker_cls= to ModelGroup.create)'}"
            )
        own = inspect.isfunction(inspect.getattr_static(self.worker_cls, method))  # takes self first
        check_arguments(
            getattr(self.worker_cls, method), int(own), args, kwargs, f"{self.worker_cls.__name__}.{method}"
        )
        ranks = self._check_ranks(ranks)
        _check_writes(writes)
        if not ranks:
            return []  # no worker runs it: nothing is sent, the weights stay as they are
        args, kwargs = _shipped(f"call({method!r})", args, kwargs)
        with self.ledger.exclusive(f"call {method}", staged_ok=True):
            if len(ranks) == self.num_workers:  # a subset cannot re-form groups over every worker
                self._repair_user_groups()
            with self.ledger.writes(f"call({method!r})", writes), self._user_code(f"call {method}"):
                switch = self.ledger.switch_flag() if len(ranks) == self.num_workers else None
                workers = self.workers.subset(ranks)
                out = gather(
                    workers,
                    [a.user_call.remote(method, args, kwargs, self.version, switch) for a in workers.actors],
                    self.timeout_s,
                    f"{self.worker_cls.__name__}.{method} ({self.name})",
                )
                self.ledger.switched(switch)
                return out

    @contextlib.contextmanager
    def _user_code(self, what: str) -> Iterator[None]:
        """Around a call or run: a failure (a worker died, stopped, or raised) may leave a
        collective of the user's code half done, and its process groups (``ctx.groups``, the
        all-reduce of ``ctx.safe_point()``) broken on the ranks that took part: they are marked
        for re-formation before the next call, and the error says so."""
        try:
            yield
        except ReallocationError as err:
            self.ledger.user_groups_failed()
            raise ReallocationError(
                f"{err.message}. The process groups of user code (ctx.groups) of {self.name!r} may be broken by "
                "this failure: they are re-formed on every worker before the next call or run on all of them "
                "(or by replace_dead_workers(), which also replaces dead workers)",
                err.dead,
                err.unresponsive,
                err.layout,
                err.waiting,
            ) from err

    def _repair_user_groups(self) -> None:
        """Re-form the process groups of user code if a failed call may have broken them (under
        the lock; needs every worker: a dead one must be replaced, a stopped one resumed)."""
        if not self.ledger.user_groups_broken:
            return
        try:
            self._form_user_groups()
        except ReallocationError as err:
            raise ReallocationError(
                f"{err.message}. The process groups of user code of {self.name!r}, which an earlier failed call may "
                "have broken, could not be re-formed, so nothing was called: replace_dead_workers() if a worker "
                "died, resume a stopped one, then call again",
                err.dead,
                err.unresponsive,
                str(self.layout),
                err.waiting,
            ) from err
        self.ledger.user_groups_formed()
        log.info("group %s: process groups of user code re-formed after a failed call", self.name)

    def announce(self, change: ShardChange, ranks: Sequence[int] | None = None) -> None:
        """Record ``change``, just committed, in the ledger (the version moves on:
        :meth:`GroupLedger.changed <actors.driver.ledger.GroupLedger.changed>`), then run the
        workers' ``on_shards_changed`` hook (all of them, or ``ranks``). A failing hook does not
        undo the change: the error (:class:`~actors.errors.HookError`) says so."""
        change = self.ledger.changed(change)
        if self.worker_cls.on_shards_changed is ShardWorker.on_shards_changed:
            return  # nothing to run: save the round trip
        workers = self.workers if ranks is None else self.workers.subset(ranks)
        try:
            gather(
                workers,
                [a.after_change.remote(change) for a in workers.actors],
                self.timeout_s,
                f"{self.worker_cls.__name__}.on_shards_changed after {change.kind} ({self.name})",
            )
        except ReallocationError as err:
            raise HookError(
                f"{err.message}. The {change.kind} itself is committed: every live worker of "
                f"{self.name!r} holds layout {self.layout} with the new weights",
                err.dead,
                err.unresponsive,
                str(self.layout),
            ) from err

    def _form_user_groups(self) -> None:
        """A fresh rendezvous store (on rank 0) and process-group cache on every worker."""
        n, timeout = self.num_workers, self.timeout_s
        addr, port = call_all(
            self.workers.subset([0]),
            "open_group_rendezvous",
            n,
            timeout,
            timeout_s=timeout,
            what=f"host the process-group store ({self.name})",
        )[0]
        generation = uuid.uuid4().hex[:8]
        gather(
            self.workers,
            [a.join_groups.remote(addr, port, r, n, generation, timeout) for r, a in enumerate(self.workers.actors)],
            timeout + 30,
            f"join the process-group store ({self.name})",
        )

    def trim_memory(self) -> int:
        """Free, on every worker, the buffers the last operation left behind (its rollback, which
        becomes the spare set the next move reuses to avoid page faults) and the spare shadow set of
        staged updates; e.g. before generation allocates its cache. Kept layouts and a pending staged
        update stay (:meth:`release_resident`). Returns the bytes freed."""
        with self.ledger.exclusive("trim memory", staged_ok=True):
            return sum(self._call("trim_memory", "trim memory"))

    def activity(self) -> list[dict]:
        """Per worker, how many operation steps it ran (prepare/execute/commit/abort counters)."""
        return self._call("activity", "read activity")

    # -- reallocation --------------------------------------------------------------------
    def target(self, dst: "Topology | str | Layout") -> Layout:
        """The layout ``dst`` names for this group (a topology keeps the group's padding and conventions)."""
        layout = _as_layout(self.spec, dst, self.layout.options, self.layout)
        if layout.spec != self.spec:
            raise ValueError(
                f"destination {layout} holds weight format {layout.spec.weight_format or 'model dtypes'}, group "
                f"{self.name!r} {self.spec.weight_format or 'model dtypes'}: reallocate keeps the format "
                "(copy_to converts between groups of different formats)"
            )
        if layout.topology.world_size != self.num_workers:
            raise ValueError(
                f"destination {layout} needs {layout.topology.world_size} workers but group "
                f"{self.name!r} has {self.num_workers}; dp*tp*pp must stay {self.num_workers}"
            )
        return layout

    def plan_to(self, dst: "Topology | str | Layout") -> Plan:
        """The plan :meth:`reallocate` would run (no traffic)."""
        return self._plan_to(self.target(dst))

    def _plan_to(self, target: Layout) -> Plan:
        return _plan(self.layout, target, self.placement, None, None, self.config.bucket_bytes, self.config.bandwidths)

    def reallocate(
        self,
        dst: "Topology | str | Layout",
        src: "Topology | str | Layout | None" = None,
        *,
        keep: str | None = None,
        stage: bool = False,
        delta: bool = False,
    ):
        """Move the weights into layout ``dst`` (planned on the driver, executed on the actors).

        ``src`` (optional) must name the current layout; RL loops write
        ``group.reallocate(dst, src=train_topo)`` to get an error if they lost track. On any
        failure every live worker keeps the old layout and weights, ``group.layout`` is unchanged
        and :class:`ReallocationError` says so, naming dead, unresponsive and waiting workers
        (``.layout == str(group.layout)``).

        Deadline: the whole call (the wait for the group's lock, forming the world, the move) has
        the group's ``timeout_s``; a failure raises within ``timeout_s + FAILURE_GRACE_S`` (5 s,
        :mod:`actors.remote`) of the call, rollback included: the diagnosis' pings and the aborts
        share that grace, and a worker that does not answer (stopped, hung) gets its abort queued,
        not awaited. An ``on_shards_changed`` hook after a successful move has its own ``timeout_s``.

        ``keep="in_place"`` or ``"host"`` keeps the layout left behind resident (on the device,
        or copied to host memory), tagged with the weight version (actors/worker/kept.py). Moving
        to a kept layout that still holds the current weights adopts it (no traffic); to one
        that is stale, writes into its buffers (same memory). :meth:`release_resident` frees them.

        ``stage=True`` returns a :class:`~actors.driver.staged.StagedUpdate` at once: the new layout is
        written into a shadow set (a layout kept in place is refreshed as that set) while the group
        serves ``call(..., writes=False)`` in its current layout; ``update.commit()`` switches every
        worker to it between two calls (``keep`` then applies to the layout left; ``"in_place"``
        only), ``update.abort()`` drops it.

        ``delta=True`` (a group created with ``GroupConfig(delta=...)``): moving back to a stale
        kept layout sends only the elements that changed since it was kept (actors/wire/delta.py);
        every other move is a full one (an anchor) that sets the workers' bases for the next.
        ``stats.delta`` says which. Not with ``stage=True``.
        """
        started = time.perf_counter()
        keep = check_keep(keep)
        target = self.target(dst)
        if not isinstance(stage, bool):
            raise ValueError(f"stage must be True or False, got {stage!r}")
        delta = self._check_delta(delta, "reallocate")
        if stage and delta:
            raise ValueError(
                "reallocate(stage=True, delta=True): a staged move is always a full one; delta=True is for copy_to or an unstaged move"
            )
        if stage:
            current = self.layout  # what the arguments are checked against, and the plan made from
            if src is not None and self.target(src) != current:
                raise ValueError(f"group {self.name!r} holds layout {current}, but src says {self.target(src)}")
            if target == current:
                raise ValueError(f"group {self.name!r} already holds layout {target}: nothing to stage")
            if keep == "host":
                raise ValueError("a staged move keeps the layout it leaves in place: keep=None or keep='in_place'")
            order = KeepOrder(keep, self.version) if keep is not None else None
            return self.start_stage(self, target, lambda: self.version, order, source_layout=current)
        deadline = Deadline(self.timeout_s)
        with self.ledger.exclusive("reallocate", deadline=deadline):
            if src is not None:
                claimed = self.target(src)
                if claimed != self.layout:
                    raise ValueError(f"group {self.name!r} holds layout {self.layout}, but src says {claimed}")
            before = self.layout
            order = KeepOrder(keep, self.version) if keep is not None and target != before else None
            op = self._operation(
                target,
                f"reallocate {self.name} {before} -> {target}",
                f"group {self.name!r} stays in layout {before}",
                deadline,
            )
            record = self.ledger.kept(target)
            delta_order = None
            try:
                if record is not None and record.version == self.version:
                    stats = self._adopt(op, target, order, f"{before} -> {target}", started)
                else:
                    delta_order = self.ledger.delta_order(
                        delta,
                        self.ledger,
                        record.version if record is not None and record.where == "in_place" else None,
                    )
                    stats = _move(
                        [self],
                        op,
                        lambda: self._plan_to(target),
                        [before.at(r) for r in range(self.num_workers)],
                        self.placement,
                        self.name,
                        f"{before} -> {target}",
                        started,
                        order=MoveOrder(keep=order, delta=delta_order),
                    )
            except ReallocationError as err:
                self.ledger.delta_done(before, self.ledger, delta_order, False)
                self.ledger.forget_kept(target)  # no longer kept (the workers' aborts freed or restored it)
                self._sync_resident(deadline.grace(), err.dead + err.unresponsive + err.waiting)  # ... and everywhere
                raise
            self.ledger.delta_done(before, self.ledger, delta_order, True)
            kept = None
            if order is not None:
                kept = ResidentLayout(
                    before, order.version, keep, max(before.rank_bytes(r) for r in range(self.num_workers))
                )
            self.ledger.moved(target, kept)  # a kept copy of target (adopted, or refreshed in place) is current now
            self.announce(
                ShardChange(
                    "reallocate",
                    target,
                    before,
                    same_storage=stats.resident_use == "refreshed"
                    or (stats.resident_use == "adopted" and record.where == "in_place"),
                )
            )
        stats.version = self.version
        metrics.record_pause(self.name, "reallocate", stats.pause_seconds)
        return stats

    def _adopt(
        self, op: Operation, target: Layout, order: KeepOrder | None, label: str, started: float
    ) -> ReallocStats:
        result = op.adopt(target, self.version, order)
        self._last_move = None  # nothing moved: no timeline
        return ReallocStats(
            transition=label,
            bytes_intra_node=0,
            bytes_inter_node=0,
            bytes_local=result.bytes_local,
            seconds=result.seconds,
            plan_seconds=0.0,
            peak_extra_bytes_per_actor=0,
            planned={"adopted": True},
            pause_seconds=time.perf_counter() - started,
            resident_use="adopted",
            resident_in_place_bytes_per_actor=result.resident_in_place_bytes,
            resident_host_bytes_per_actor=result.resident_host_bytes,
        )

    def last_trace(self, timeout_s: float | None = None) -> MoveTrace:
        """The timeline of this group's last move (its last ``reallocate``, or a ``copy_to`` it
        took part in on either side; not an adopted kept layout, where nothing moved, nor a staged
        update's background transfers): every worker's phases, steps (peer, bytes, link, start,
        end) and local copies, gathered from the workers now and put on the driver's clock
        (actors/trace.py). ``.write(path)`` saves it as Chrome trace JSON for Perfetto or
        ``chrome://tracing``; ``.steps()`` lists the steps. ``ValueError`` when there is no such
        move, or when one of its workers has run another move since (its timeline is gone); a
        dead or silent worker raises the group's usual error, naming it, within ``timeout_s``
        (default: the group's; a finite positive number of seconds)."""
        if timeout_s is not None:
            check_timeout(timeout_s)
        with self.ledger.exclusive("gather the last move's trace", staged_ok=True):
            move = self._last_move
            if move is None:
                raise ValueError(
                    f"group {self.name!r} has no traced move: last_trace() follows a reallocate() or "
                    "copy_to() that ran a plan (not one that adopted a kept layout)"
                )
            return gather_trace(move, Deadline(self.timeout_s if timeout_s is None else timeout_s))

    def resident_layouts(self) -> list[ResidentLayout]:
        """The layouts kept by ``reallocate(..., keep=)``, with their versions (``fresh``: moving
        there adopts them, nothing moves)."""
        with self.ledger.exclusive("list kept layouts", staged_ok=True):
            return self.ledger.resident_layouts()

    def release_resident(
        self, layouts: "Sequence[Topology | str | Layout] | Topology | str | Layout | None" = None
    ) -> None:
        """Free kept layouts on every worker: all of them (``None``), one (a :class:`Topology`, a
        topology string or a :class:`Layout`) or a sequence of them. Every layout is checked
        before anything is sent: one the group does not keep is a ``ValueError``."""
        if isinstance(layouts, (str, Topology, Layout)):
            layouts = [layouts]
        elif layouts is not None and (
            isinstance(layouts, (bytes, Mapping)) or not isinstance(layouts, (Sequence, set, frozenset))
        ):
            raise ValueError(
                f"layouts must be None (every kept layout), one layout (a realloc.Topology, a topology "
                f"string like 'dp=2,tp=4' or a realloc.Layout) or a sequence of them, "
                f"got {type(layouts).__name__} {layouts!r}"[:300]
            )
        with self.ledger.exclusive("release kept layouts"):
            drop = (
                self.ledger.kept_layouts() if layouts is None else list(dict.fromkeys(self.target(x) for x in layouts))
            )
            unknown = [str(x) for x in drop if self.ledger.kept(x) is None]
            if unknown:
                raise ValueError(
                    f"group {self.name!r} keeps no layout {unknown}; kept: {[str(x) for x in self.ledger.kept_layouts()] or 'none'}"
                )
            if not drop:
                return
            self.ledger.release(drop)
            self._call("resident_sync", "release kept layouts", self.ledger.resident_known())

    def _sync_resident(self, seconds: float = 30.0, busy: Sequence[str] = ()) -> None:
        """After a failure: every live worker frees the kept layouts the driver does not list (best
        effort). Waits up to ``seconds``, not for the workers named in ``busy`` (dead, silent, or
        still in a failed call): theirs is queued behind what they run."""
        known = self.ledger.resident_known()
        refs = [a.resident_sync.remote(known) for a in self.workers.actors]
        idle = [i for i, n in enumerate(self.workers.names) if n not in busy]
        found = settle(self.workers.subset(idle), [refs[i] for i in idle], seconds)
        if found.dead or found.unresponsive or found.failed:
            log.warning(
                "group %s: kept layouts not synchronised on %s",
                self.name,
                list(found.dead + found.unresponsive + found.failed),
            )

    def copy_to(
        self,
        other: "ModelGroup | CopyTarget | Sequence[ModelGroup]",
        eta: float | None = None,
        *,
        stage: bool = False,
        delta: bool = False,
    ):
        """Copy this group's weights into ``other`` (e.g. policy -> reference), in ``other``'s layout.

        ``other`` a list of groups (e.g. ``[generator, reference]``): one copy into all of them,
        each byte leaving this group once (the groups staged relay to the others), every group
        switched or none (:func:`actors.driver.fleet.copy_to_groups`; no ``eta``, ``stage`` or
        ``delta``); returns each group's stats by name.

        With ``eta``, ``other = eta * self + (1 - eta) * other`` (EMA-style blending). On failure
        ``other`` keeps its old weights and this group is untouched (the error's ``layout`` is
        ``other``'s). One deadline, the larger ``timeout_s`` of the two, bounds the call as in
        :meth:`reallocate` (a failure raises within it plus ``FAILURE_GRACE_S``). ``other`` takes
        this group's weight version (``max(other.version + 1, self.version)``: never going back).

        ``stage=True`` returns a :class:`~actors.driver.staged.StagedUpdate` at once: the bytes move into
        a shadow set of ``other``'s buffers while ``other`` keeps serving ``call(...,
        writes=False)``; ``update.commit()`` (or ``commit(at="safe_point")``) switches them in,
        ``update.abort()`` drops them (actors/driver/staged.py). This group is held until the bytes left it.

        ``delta=True`` (this group created with ``GroupConfig(delta=...)``): when ``other`` holds
        the weights this group last sent it (nothing wrote them since), only the elements that
        changed travel, checksummed per bucket (a miss sends that bucket whole); otherwise, and
        every ``delta_anchor_every``-th time, a full copy (an anchor). ``other`` ends bit-identical
        to this group either way; ``stats.delta`` says what travelled (actors/wire/delta.py).
        """
        if isinstance(other, (list, tuple)):
            return self._copy_to_groups(list(other), eta, stage, delta)
        if isinstance(other, CopyTarget):  # an inference engine (actors/driver/vllm.py VLLMEngine)
            if not isinstance(stage, bool):
                raise ValueError(f"stage must be True or False, got {stage!r}")
            delta = self._check_delta(delta, "copy_to")
            if eta is not None:
                raise ValueError(f"copy_to({other!r}, eta=...): an engine takes the weights as they are, no blend")
            return other.receive_copy(self, stage, delta)
        if not isinstance(other, ModelGroup):
            raise ValueError(f"copy_to needs another ModelGroup or a CopyTarget, got {type(other).__name__}")
        if other is self:
            raise ValueError("copy_to needs another group; use reallocate to change this group's layout")
        if not isinstance(stage, bool):
            raise ValueError(f"stage must be True or False, got {stage!r}")
        delta = self._check_delta(delta, "copy_to")
        if eta is not None:
            if stage:
                raise ValueError("a staged copy cannot blend (eta): stage=True copies the weights as they are")
            if delta:
                raise ValueError("copy_to(eta=..., delta=True): a blend writes every element; delta=True copies")
            eta = check_eta(eta)
        unformatted(self.spec).check_same_as(unformatted(other.spec))
        converting = self.layout.spec != other.layout.spec  # weight formats differ (realloc/plan/formats.py)
        held = self.layout.spec.weight_format or ""
        if eta is not None and not converting and held.startswith("fp8_block128"):
            raise ValueError(
                f"copy_to(eta=...) between groups holding {held}: a blend of block-FP8 weights would mix "
                "quantized values and their scales; blend groups holding the model's dtypes or a cast "
                f"({', '.join(CASTS)}), then copy into the FP8 group (it converts)"
            )
        if converting and (delta or eta is not None):
            what = "delta=True" if delta else "eta"
            raise ValueError(
                f"copy_to({what}) between weight formats ({self.layout.spec.weight_format or 'model dtypes'} -> "
                f"{other.layout.spec.weight_format or 'model dtypes'}): a delta or a blend needs one format on "
                "both sides; a plain or staged copy converts"
            )
        if stage:
            return self.start_stage(other, other.layout, lambda: other.copy_version(self), None, delta=delta)
        started = time.perf_counter()
        deadline = Deadline(max(self.timeout_s, other.timeout_s))
        with self.ledger.exclusive("copy_to", other.ledger, deadline=deadline):
            conv = conversion(self.layout, other.layout)
            plan_src, plan_dst = conv.plan_sides(self.layout, other.layout)
            placement, make_plan = self._copy_plan(other, plan_src, plan_dst)
            n, m = self.num_workers, other.num_workers
            label = f"{self.name}[{self.layout}] -> {other.name}[{other.layout}]"
            op = Operation(
                self.workers + other.workers,
                [None] * n + [plan_dst.at(r) for r in range(m)],
                deadline,
                f"copy {label}",
                f"{other.name!r} keeps its previous weights and {self.name!r} is untouched",
                str(other.layout),
            )
            delta_order = self.ledger.delta_order(delta, other.ledger, self.ledger.copied_version(other.ledger))
            try:
                stats = _move(
                    [self, other],
                    op,
                    make_plan,
                    [plan_src.at(r) for r in range(n)] + [None] * m,
                    placement,
                    f"{self.name}->{other.name}",
                    label,
                    started,
                    order=MoveOrder(
                        delta=delta_order,
                        convert=other.layout if conv.where == "destination" else None,
                        blend=eta,
                        into=other.layout,  # each receiver checks that it holds it (actors/worker/guard.py)
                    ),
                    converting=conv.where,
                )
                stats.conversion = conv.where
            except ReallocationError:
                self.ledger.delta_done(self.layout, other.ledger, delta_order, False)
                raise
            self.ledger.delta_done(self.layout, other.ledger, delta_order, True)
            # a blend is no copy: its result is nobody's weights, and new ones even where the
            # destination held the source's
            version = other.ledger.copy_version(self.ledger, blend=eta is not None)
            stats.version = version
            other.ledger.copied((self.name, self.version) if eta is None else None)
            other.announce(ShardChange("copy", other.layout, other.layout, version=version))
        metrics.record_pause(f"{self.name}->{other.name}", "copy_to", stats.pause_seconds)
        return stats

    def _copy_to_groups(self, groups: list, eta, stage, delta) -> "dict[str, ReallocStats]":
        """``copy_to([...])``: the options it refuses, then :func:`actors.driver.fleet.copy_to_groups`."""
        given = [
            name
            for name, value in (("eta", eta is not None), ("stage", stage is not False), ("delta", delta is not False))
            if value
        ]
        if given:
            raise ValueError(
                f"copy_to([...]) into several groups takes no {', '.join(given)}: it copies the weights as they "
                "are, every group switched at once; for staged updates of serving replicas use "
                "Fleet(groups).stage(source), for a blend or a delta copy into each group on its own"
            )
        return copy_to_groups(self, groups)

    def _copy_plan(
        self, other: "ModelGroup", src: Layout | None = None, dst: Layout | None = None
    ) -> tuple[Placement, Callable[[], Plan]]:
        """The placement over both groups and the plan maker of a copy into ``other`` (from ``src``
        to ``dst``: the groups' layouts, or one of them in the other's weight format)."""
        n, m = self.num_workers, other.num_workers
        placement = Placement(self.placement.nodes + other.placement.nodes)
        src, dst = src or self.layout, dst or other.layout
        return placement, lambda: _plan(
            src,
            dst,
            placement,
            tuple(range(n)),
            tuple(range(n, n + m)),
            self.config.bucket_bytes,
            self.config.bandwidths,
        )

    def start_stage(
        self,
        dest: "ModelGroup",
        target: Layout,
        version_of: Callable[[], int],
        keep: KeepOrder | None,
        timeout_s: float | None = None,
        hold_source: bool = True,
        delta: bool = False,
        relay: StagedUpdate | None = None,
        source_layout: Layout | None = None,
    ) -> StagedUpdate:
        """Start a staged update of ``dest`` from this group (actors/driver/staged.py). ``version_of()``:
        the version it brings, read once the source is held (``hold_source=False``: the caller
        holds it, as a fleet update does for all its replicas); ``timeout_s`` bounds the transfer
        (default: the larger timeout of the groups); ``delta``: a staged copy with ``delta=True``;
        ``relay``: a staged update of this group whose staged set is sent instead of the serving
        one (a fleet update's relay; the caller keeps it staged until this one ends).
        ``reallocate``/``copy_to`` with ``stage=True`` and a fleet update (actors/driver/fleet.py) run it.

        The plan is made from the groups as found here, outside their locks (this group's layout is
        ``source_layout`` when given: the one the caller checked its arguments against; a copy's
        destination's, ``target``): the update checks that they still are once it holds each group
        (:meth:`StagedUpdate.check_planned`), and stages nothing otherwise (``GroupBusyError``)."""
        if self.ledger.closed:
            raise ValueError(f"stage from group {self.name!r}: it was shut down")
        copy = dest is not self
        planned = [PlannedFrom.of(self, source_layout)] + ([PlannedFrom.of(dest, target)] if copy else [])
        before, n = planned[0].layout, len(planned[0].workers)
        conv = conversion(before, target)  # copies between weight formats (realloc/plan/formats.py)
        if copy:
            plan_src, plan_dst = conv.plan_sides(before, target)
            placement, make_plan = self._copy_plan(dest, plan_src, plan_dst)
            workers, groups = planned[0].workers + planned[1].workers, [self, dest]
            m = len(planned[1].workers)
            srcs = [plan_src.at(r) for r in range(n)] + [None] * m
            dsts = [None] * n + [plan_dst.at(r) for r in range(m)]
            label = f"{self.name}[{before}] -> {dest.name}[{target}]"
        else:
            placement, workers, groups = self.placement, planned[0].workers, [self]
            srcs, dsts = [before.at(r) for r in range(n)], [target.at(r) for r in range(n)]
            label = f"{self.name} {before} -> {target}"

            def make_plan() -> Plan:
                return _plan(before, target, placement, None, None, self.config.bucket_bytes, self.config.bandwidths)

        shared, held = _zero_copy(groups, conv.where), _held(groups, conv.where, before)

        def make_stats(plan: Plan, plan_seconds: float, result: PhaseResult) -> ReallocStats:
            return ReallocStats(
                transition=label,
                bytes_intra_node=result.bytes_intra_node,
                bytes_inter_node=result.bytes_inter_node,
                bytes_local=result.bytes_local,
                seconds=result.seconds,
                plan_seconds=plan_seconds,
                peak_extra_bytes_per_actor=result.peak_extra_bytes_per_actor,
                planned=plan.stats,
                pause_seconds=0.0,
                delta=result.delta,
                conversion=conv.where,
                **_slowest_fields(result.slowest),
            )

        update = StagedUpdate(
            self,
            dest,
            target,
            MoveOrder(
                keep=keep,
                convert=target if conv.where == "destination" else None,
                into=target if copy else None,  # a copy's receivers check that they hold it (actors/worker/guard.py)
            ),
            version_of=version_of,
            workers=workers,
            srcs=srcs,
            dsts=dsts,
            placement=placement,
            shared=shared,
            held=held,
            make_plan=make_plan,
            groups=groups,
            label=label,
            make_stats=make_stats,
            timeout_s=timeout_s,
            hold_source=hold_source,
            delta=delta,
            relay=relay,
            planned=planned,
        )
        dest.ledger.begin_stage(update)
        try:  # the destination refuses every change from here: is it still what the plan was made from?
            update.check_planned(dest)
        except GroupBusyError:
            dest.ledger.end_stage(update)
            raise
        if not copy:
            self.ledger.forget_kept(target)  # a kept copy of the target becomes the shadow set
        return update.start()

    def checkpoint_manager(
        self,
        *,
        root: str | None = None,
        run_id: str | None = None,
        jump: int | None = None,
        factor: int = 2,
        timeout_s: float | None = None,
    ):
        """Node-local checkpoints of this group with clique replication (docs/checkpoints.md).

        Example:
            >>> ckpt = group.checkpoint_manager(factor=2)  # doctest: +SKIP
            >>> ckpt.save(100).wait(); ckpt.load()         # doctest: +SKIP
        """
        return CheckpointManager(self, root=root, run_id=run_id, jump=jump, factor=factor, timeout_s=timeout_s)

    # -- failures ------------------------------------------------------------------------
    def dead_workers(self) -> list[int]:
        """Ranks whose actors are dead (Ray says so; a stopped process is not dead)."""
        dead = set(diagnose(self.workers).dead)
        return [r for r, n in enumerate(self.workers.names) if n in dead]

    def replace_dead_workers(self) -> list[int]:
        """Start fresh actors (zeroed shards of the current layout) for the dead ones; returns their ranks.

        Ray reschedules the placement-group bundles of a lost node onto nodes that have room,
        so replacements land wherever the cluster has capacity (a fresh node, typically). The
        placement is re-read from the new actors; restore the weights with a checkpoint load.
        Nobody dead, it still re-forms the process groups of user code (``ctx.groups``) if a
        failed call may have broken them (a worker stopped in a collective, then resumed); the
        next call on every worker does that too. The version moves on as the replacements start
        (their shards are zeros); if it fails after that (a replacement not up within
        ``start_timeout_s``), call it again: it sets up the replacements it started.
        """
        with self.ledger.exclusive("replace dead workers"):
            died = self.dead_workers()
            # replacements of an earlier call that failed before they held their shards (not up
            # within start_timeout_s, say: Ray counts a pending actor as alive) are set up again
            dead = sorted(set(died) | self.ledger.unready)
            if not dead:
                self._repair_user_groups()  # nobody died, but a failed call may have broken them
                return []
            if died:
                remote_cls = remote_class(self.config, self.worker_cls)
                actors, names = list(self.workers.actors), list(self.workers.names)
                for r in died:
                    ray.kill(actors[r])
                    actors[r] = start_worker(
                        remote_cls,
                        f"{worker_name(self.name, r)}:gen{int(time.time() * 1000)}",
                        self._pg,
                        r,
                        self.name,
                        self.spec,
                        self.config,
                    )
                self.workers = Workers(tuple(actors), tuple(names))
                # the weights changed (the new ranks hold zeros): the version moves on now, and no
                # kept layout is whole any more, nor a copy nor a delta base
                self.ledger.workers_replaced(died)  # and the user code's groups broken until re-formed below
                self._sync_resident()
            self.ledger.user_groups_failed()  # until re-formed below (a retry, or the next call, does it)
            fresh_workers = self.workers.subset(dead)
            fresh = call_all(
                fresh_workers, "info", timeout_s=self.config.start_timeout_s, what="start replacement workers"
            )
            for r, info in zip(dead, fresh):
                self.infos[r] = info
            self.placement = placement_of(self.infos)
            gather(
                fresh_workers,
                [self.workers.actors[r].set_layout.remote(self.layout.at(r)) for r in dead],
                self.timeout_s,
                "allocate shards of replacement workers",
            )
            self.ledger.replacements_ready()
            for world in self.worlds.values():
                if world is not None:
                    world.mark_broken()
            self._form_user_groups()  # the old store may have died with rank 0; every cache restarts
            self.ledger.user_groups_formed()
            self.announce(ShardChange("replace", self.layout, self.layout, version=self.version), dead)
            return dead

    def world_for(
        self, lane: Lane, groups: Sequence["ModelGroup"] | None = None, deadline: Deadline | None = None
    ) -> World:
        """The world of ``lane`` over ``groups``' workers (default: this group's alone; this group
        comes first), reused while it is alive and every group is in it, else formed (within
        ``deadline``) and recorded in each group's ``worlds[lane]``."""
        groups = [self] if groups is None else list(groups)
        if not groups or groups[0] is not self:
            raise ValueError(f"world_for: the groups must start with {self.name!r}, got {[g.name for g in groups]}")
        actors = [a for g in groups for a in g.workers.actors]
        current = self.worlds[lane]
        if (
            current is not None
            and current.alive
            and all(g.worlds[lane] is current for g in groups)
            and current.covers(actors)
        ):
            return current
        workers = Workers(tuple(actors), tuple(n for g in groups for n in g.workers.names))
        world = World.form(workers, lane, max(g.timeout_s for g in groups), deadline)
        for g in groups:
            g.worlds[lane] = world
        return world

    def shutdown(self) -> None:
        """Stop the actors and release the placement group (waits for a running operation first).
        On return the group's name is free: a group of the same name can be created at once."""
        if self.ledger.closed:
            return
        with self.ledger.closing():
            try:
                ray.get([a.shutdown.remote() for a in self.workers.actors], timeout=30)
            except Exception:  # noqa: BLE001 - best effort: dead actors cannot clean up
                log.debug("group %s: some workers could not shut down cleanly", self.name, exc_info=True)
            discard(self.workers.actors, self._pg, self.workers.names)  # its name is free on return
            sweep_stale_buffers()  # files of workers that died before they could clean up (this node)
            self.worlds = dict.fromkeys(LANES)


# -- helpers -------------------------------------------------------------------------------


def _zero_copy(groups: list[ModelGroup], converting: str | None) -> list[bool]:
    """Per worker of ``groups`` (the sending group first): whether its same-node peers read its
    buffers in place. A move converting on the senders (realloc/plan/formats.py) reads them all:
    the sending group's hold another format than the plan's, and a reader converts what it reads
    from them (:func:`_held` says what they hold), as a sender converts each message it packs;
    the receivers' hold the plan's format (fan-out reads as usual). One converting on the
    receivers reads none (each replaces the buffers its peers would read with their conversion)."""
    reads = converting is None or (converting == "source" and len(groups) > 1)
    return [info["zero_copy"] and reads for g in groups for info in g.infos]


def _held(
    groups: list[ModelGroup], converting: str | None, layout: Layout | None = None
) -> list[RankLayout | None] | None:
    """``PeerView.held`` per worker of a copy's ``groups`` (the sending group first): the sending
    group's own layout (``layout``: the one the plan was made from; default its current one) when
    it converts as it sends (the plan sends that layout in the destination's format); None when
    nothing is converted on the senders."""
    if converting != "source" or len(groups) < 2:
        return None
    sender = groups[0]
    layout = sender.layout if layout is None else layout
    return [layout.at(r) for r in range(sender.num_workers)] + [None for g in groups[1:] for _ in range(g.num_workers)]


def _move(
    groups: list[ModelGroup],
    op: Operation,
    make_plan: Callable[[], Plan],
    srcs: list,
    placement: Placement,
    model: str,
    label: str,
    started: float,
    *,
    order: MoveOrder = PLAIN_MOVE,
    converting: str | None = None,
) -> ReallocStats:
    """Plan, then run ``op`` over the plan (prepare, both phases and commit: one call per worker;
    with ``order.blend``: prepare, both phases, then the driver's commit, which blends).

    ``converting``: where the move converts weight formats (realloc/plan/formats.py; zero-copy
    reads as :func:`_zero_copy` says); ``order``: what the workers keep,
    the delta, the layout the destination workers convert into before committing, the blend.

    The caller holds the groups' locks and changes its state only after this returns. Every wait,
    forming the world included, shares ``op.deadline``; any failure aborts ``op``.
    """
    plan_started = time.perf_counter()
    plan = make_plan()
    plan_seconds = time.perf_counter() - plan_started
    log.debug("%s: planned in %.3f s: %s", op.what, plan_seconds, plan_summary(plan.stats))
    try:
        world = groups[0].world_for(MOVE, groups, op.deadline)
    except ReallocationError as err:  # e.g. a worker stopped before it joined: nothing changed, same report
        op.abort(err)
    if order.blend is None:
        shared = _zero_copy(groups, converting)
        result = op.run_plan(world, plan, srcs, placement, shared, {"model": model}, order, _held(groups, converting))
        if any(result.phases):
            log.debug("%s: slowest worker per phase: %s", op.what, phase_summary(result.phases))
        seconds = result.seconds
    else:  # blending rewrites destination buffers that fan-out readers may still be reading:
        op.prepare(order.into)  # commit only after every worker finished (the driver's barrier)
        t0 = time.perf_counter()
        result = op.execute_plan(world, plan, srcs, placement, {"model": model})
        seconds = time.perf_counter() - t0
        op.commit(blend=order.blend)
    ended = time.perf_counter()
    pause = ended - started
    log.debug("%s: %s in %.3fs", op.what, label, pause)
    move = MoveRef(
        label,
        op.id,
        op.workers,
        tuple(placement.nodes),
        wall_spans(("move", started, ended), ("plan", plan_started, plan_started + plan_seconds)),
    )
    for g in groups:
        g._last_move = move
    return ReallocStats(
        transition=label,
        bytes_intra_node=result.bytes_intra_node,
        bytes_inter_node=result.bytes_inter_node,
        bytes_local=result.bytes_local,
        seconds=seconds,
        plan_seconds=plan_seconds,
        peak_extra_bytes_per_actor=result.peak_extra_bytes_per_actor,
        planned=plan.stats,
        pause_seconds=pause,
        resident_use="refreshed" if result.refreshed else None,
        resident_in_place_bytes_per_actor=result.resident_in_place_bytes,
        resident_host_bytes_per_actor=result.resident_host_bytes,
        delta=result.delta,
        **_slowest_fields(result.slowest),
    )


def _slowest_fields(worst: dict | None) -> dict:
    """``ReallocStats``'s slowest-worker fields from :func:`actors.trace.slowest`'s answer."""
    worst = worst or {}
    return {
        "slowest_worker": worst.get("worker"),
        "slowest_worker_seconds": worst.get("seconds", 0.0),
        "slowest_phase": worst.get("phase"),
        "slowest_phase_seconds": worst.get("phase_seconds", 0.0),
    }


#: Arguments of ``call``/``run`` up to this size (pickled) travel inside the call itself (Ray
#: inlines them); larger ones are put into the object store once for all workers. Putting even
#: empty arguments there cost a generator call on bench-1gb 13.6 ms instead of ~4 ms: the workers
#: of another node fetched them (docs/benchmarks.md, "Staged updates").
INLINE_ARGUMENT_BYTES = 64 << 10


def _shipped(what: str, *values: Any) -> list:
    """``values`` as the calls will carry them (small ones inline, large ones put into Ray's
    object store, serialised once for all workers), or ``ValueError`` when one does not pickle:
    before any traffic and before the group's state changes."""
    try:
        return [v if len(ray.cloudpickle.dumps(v)) <= INLINE_ARGUMENT_BYTES else ray.put(v) for v in values]
    except (TypeError, AttributeError, pickle.PicklingError) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(
            f"the arguments of {what} cannot be sent to the workers, they must pickle: {type(err).__name__}: {first}"[
                :400
            ]
        ) from err


def _as_layout(spec: ModelSpec, value: object, options: dict, current: Layout | None = None) -> Layout:
    """A layout from a Layout, a Topology or a topology string (``ValueError`` for anything else)."""
    if isinstance(value, Layout):
        if unformatted(value.spec) != unformatted(spec):
            raise ValueError(f"layout {value!r} is of model {value.spec.name!r}, not {spec.name!r}")
        return value
    if isinstance(value, str):
        value = Topology.parse(value)
    if not isinstance(value, Topology):
        raise ValueError(
            f"a layout is a realloc.Topology, a topology string like 'dp=2,tp=4' or a realloc.Layout, "
            f"got {type(value).__name__}"
        )
    return current.with_topology(value) if current is not None else Layout(spec, value, **options)


def _check_writes(writes: object) -> None:
    if not isinstance(writes, bool):
        raise ValueError(f"writes must be True or False (does the code change the weights?), got {writes!r}")


def _check_seed(seed: object) -> None:
    check_nonneg("seed", seed)
