"""A worker's own state, as plain records: what ``ShardWorker`` holds under ``self._realloc``
(:class:`WorkerState`), each lane's part of it (:class:`LaneState`), the operation in progress
(:class:`PendingOp`) and a plan as this worker runs it (:class:`WorkerPlan`). No Ray calls, no
transfers: ``actors/worker/actor.py`` changes this state, in the driver's protocol."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
import torch

from actors.lanes import LANES, Lane
from actors.wire.communicator import Communicators
from actors.wire.delta import Base
from actors.wire.executor import Cuts, Phases, Staging
from actors.wire.shares import PeerTable, is_zero_copy
from actors.wire.transport import Transport, backend_for, wire_device
from actors.wire.zero_copy import BufferAllocator
from actors.worker.faults import Faults
from actors.worker.kept import Resident
from realloc.layout import Layout, RankLayout
from realloc.plan.slices import PlanSlice
from realloc.shards import ShardStore
from realloc.spec import ModelSpec


@dataclass
class WorkerPlan:
    """A plan as one worker runs it in ``op_run``, computed once per plan and world from its slice
    (realloc/plan/slices.py) and cached: its routes by step, its local copies, and whom it
    exchanges zero-copy handles and readiness with (decided from the peers' ``shared`` flags,
    identically at both ends). Everything here is O(this worker's routes)."""

    plan: PlanSlice
    peers: PeerTable
    routes: dict[int, list[tuple[int, int, int]]]
    local: list[int]
    #: peer -> which of its buffers this worker maps (forward flags: False its source, True its
    #: destination); it receives exactly these handles from that peer and opens each once
    read_from: dict[int, tuple[bool, ...]]
    #: peer -> which of this worker's buffers that peer maps (it is sent exactly these handles)
    read_by: dict[int, tuple[bool, ...]]
    wait_ready: dict[int, list[int]]  # fan-out step -> peers whose phase 0 must be done before it
    notify: list[int]  # peers that read this worker's destination buffers in fan-out steps
    cuts: Cuts = field(default_factory=Cuts)  # its buckets and messages, cut on the first run

    @staticmethod
    def make(plan: PlanSlice, peers: PeerTable, me: int) -> "WorkerPlan":
        routes = plan.routes_by_step()
        read_from: dict[int, set[bool]] = {}
        read_by: dict[int, set[bool]] = {}
        notify, wait_ready = set(), {}
        for s, step in routes.items():
            forward = plan.reads_destination(s)
            for a, b, _ in step:
                if not is_zero_copy(peers, a, b, forward):
                    continue
                if b == me:
                    read_from.setdefault(a, set()).add(forward)
                    if forward:
                        wait_ready.setdefault(s, []).append(a)
                if a == me:
                    read_by.setdefault(b, set()).add(forward)
                    if forward:
                        notify.add(b)
        return WorkerPlan(
            plan,
            peers,
            routes,
            list(plan.local),
            {p: tuple(sorted(f)) for p, f in sorted(read_from.items())},
            {p: tuple(sorted(f)) for p, f in sorted(read_by.items())},
            wait_ready,
            sorted(notify),
        )


@dataclass
class PendingOp:
    """This worker's part of one driver operation (named record of the pending state)."""

    id: str
    dst: RankLayout | None  # what this worker will hold; None: it only sends
    buffers: dict[str, torch.Tensor] | None  # destination buffers (written by the operation)
    committed: bool = False
    rollback: tuple[RankLayout, dict[str, torch.Tensor]] | None = None
    moved: dict[str, int] = field(default_factory=lambda: {"local": 0, "intra": 0, "inter": 0})
    seconds: float = 0.0
    tags: dict = field(default_factory=dict)  # metric tags of its execute phases
    kept: Layout | None = None  # the layout this operation's commit kept resident (keep=...)
    adopted: Resident | None = None  # the resident layout this operation adopted (op_adopt)
    refreshed: bool = False  # its destination buffers are a kept layout's (written in place)

    def store(self) -> ShardStore | None:
        return ShardStore(self.dst.shards(), self.buffers) if self.dst is not None else None


class Background(threading.Thread):
    """Runs ``fn`` in a thread; ``join()`` returns its result or raises its exception."""

    def __init__(self, fn: Callable[[], Any]):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in join
            self.error = err

    def join(self, timeout: float | None = None) -> Any:
        super().join(timeout)
        if self.error is not None:
            raise self.error
        return self.result


@dataclass
class LaneState:
    """One lane's state on a worker (actors/lanes.py): the transport of the lane's world and that
    world's id (``join(lane, ...)``), the timeline of the lane's last transfer (``last_trace(lane)``:
    ``op_run``/``op_execute`` on the move lane, ``stage_run`` on the stage lane) and its bucket
    staging. The lanes run on different threads (the default one, the stage one), so none of this
    is shared between them: a conversion marks its own lane's timeline, and a staged transfer
    packs into buffers no move uses."""

    staging: Staging
    transport: Transport | None = None
    world_id: str | None = None
    phases: Phases = field(default_factory=Phases)

    def leave(self) -> None:
        """Leave the lane's world (its process group is destroyed)."""
        if self.transport is not None:
            self.transport.close()
        self.transport, self.world_id = None, None


class WorkerState:
    """The library's own state of one worker, kept under ONE attribute of it (``self._realloc``).

    A subclass of :class:`ShardWorker` is the user's code: it may name its own state anything
    (``self.group``, ``self.device``, ``self.spec``, ``self.layout``, ``self.rank``,
    ``self.buffers``, ``self.transport``...) without touching what moves, verifies and fills rely on.
    """

    def __init__(
        self, group: str, spec: ModelSpec, zero_copy: bool, device: str | None = None, backend: str | None = None
    ):
        self.group, self.spec = group, spec
        self.specs_checked = [spec]  # the last spec objects found equal to it (the check is a deep compare)
        if device is None:
            device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.device = torch.device(device, 0) if device == "cuda" else torch.device(device)
        #: The process groups' backend (GroupConfig.backend) and the device their tensors live on:
        #: the buffers' device for NCCL, host memory for gloo (GPU buffers are staged through it).
        self.backend = backend if backend is not None else backend_for(self.device)
        if self.backend not in ("nccl", "gloo") or (self.backend == "nccl" and self.device.type != "cuda"):
            raise ValueError(
                f"backend {self.backend!r} cannot serve buffers on {self.device}; allowed: 'gloo', "
                "or 'nccl' for CUDA buffers"
            )
        self.wire = wire_device(self.backend, self.device)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.allocator = BufferAllocator(self.device, zero_copy, group)
        self.held: RankLayout | None = None
        self.buffers: dict[str, torch.Tensor] | None = None
        self.op: PendingOp | None = None
        #: each lane's transport, world, timeline and bucket staging (actors/lanes.py: moves', staged updates')
        self.lanes: dict[Lane, LaneState] = {lane: LaneState(Staging(self.device)) for lane in LANES}
        #: rendezvous stores this worker hosted lately, by world id (its join takes it from here;
        #: kept for an abort: a member resumed late reads the mark there), and the worlds whose
        #: formation the driver aborted
        self.hosted: OrderedDict[str, Any] = OrderedDict()
        self.aborted_worlds: OrderedDict[str, None] = OrderedDict()
        self.faults = Faults()  # what a test injected (actors/worker/faults.py)
        self.counters = {"prepare": 0, "execute": 0, "commit": 0, "abort": 0}
        self.communicators: Communicators | None = None
        self.group_rendezvous = None
        self.plans: OrderedDict[str, WorkerPlan] = OrderedDict()
        self.mapped: dict[tuple, tuple[int, Any]] = {}  # peer buffers kept mapped: key -> (last op, value)
        self.runs = 0
        self.copier: ThreadPoolExecutor | None = None
        self.kept: dict[Layout, Resident] = {}  # kept layouts (actors/worker/kept.py)
        self.ckpt_state = None  # actors/worker/checkpoint.py
        # staged updates (actors/worker/staging.py): the weight version served, the pending update,
        # the spare shadow set (double buffering) and the safe points of this call (their own
        # world is the STAGE lane's)
        self.version = 0
        self.staged = None
        self.stage_lock = threading.RLock()
        self.shadow_spare: tuple[RankLayout, dict[str, torch.Tensor]] | None = None
        self.safe_points = 0
        self.delta_base: Base | None = None  # what this worker last sent, for delta moves (actors/wire/delta.py)

    @property
    def layout(self) -> Layout | None:
        return self.held.layout if self.held is not None else None

    def lane(self, lane: Lane) -> "LaneState":
        """The state of ``lane`` (``ValueError`` naming the lanes for an unknown one)."""
        state = self.lanes.get(lane)
        if state is None:
            raise ValueError(f"worker of {self.group}: unknown lane {lane!r}; allowed: {', '.join(map(repr, LANES))}")
        return state

    @property
    def rank(self) -> int | None:
        return self.held.rank if self.held is not None else None
