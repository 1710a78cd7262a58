"""The Ray actor that owns one worker's shards and runs its part of every operation.

State changes follow the driver's protocol (``actors/driver/protocol.py``, docs/architecture.md):

* ``op_prepare(op, dst)``: allocate destination buffers for ``dst`` (this worker's rank of the
  new layout, or ``None`` for a worker that only sends). The current buffers are untouched.
* ``op_execute`` / ``op_fill`` / ``ckpt_exchange``: write the destination buffers (transfers
  from peers, synthetic weights, a state dict, checkpoint files).
* ``op_commit(op)``: adopt the destination buffers; the old ones are kept as the *rollback*.
* ``op_abort(op)``: undo whatever ``op`` did here: drop its destination buffers, or, after
  a commit, put the rollback back. The driver aborts every live worker when any step of an
  operation fails anywhere, so every live worker ends in the old layout.

The rollback is dropped when the next operation is prepared (it becomes the spare buffer set,
which the allocator keeps anyway), so it costs no memory beyond what buffer reuse holds.
Commands carry the operation id; a command for an operation this worker is not running raises
:class:`~actors.errors.StaleOperationError` instead of touching buffers.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import ray
import torch

from actors import metrics
from actors.errors import StaleOperationError
from actors.lanes import CONTROL, MOVE, Lane
from actors.records import PLAIN_MOVE, DeltaOrder, KeepOrder, MoveOrder, ShardChange, WorkerReport
from actors.trace import clock_reading
from actors.wire.communicator import Communicators
from actors.wire.delta import DeltaSides, sender_base, snapshot, updated_in_place
from actors.wire.executor import Phases, StepRunner, collector_paused, received_share
from actors.wire.shares import PeerTable, PeerView
from actors.wire.transport import (
    Transport,
    abort_formation,
    built_together,
    check_in,
    connect_rendezvous,
    host_rendezvous,
)
from actors.wire.zero_copy import open_handles
from actors.worker import guard, handles
from actors.worker.checkpoint import CheckpointMixin
from actors.worker.context import ShardContext
from actors.worker.kept import Resident, copy_into, to_host
from actors.worker.parallel import ParallelGroups
from actors.worker.staging import StagingMixin
from actors.worker.state import Background, LaneState, PendingOp, WorkerPlan, WorkerState
from realloc.boxes import box_index
from realloc.layout import Layout, RankLayout
from realloc.plan.slices import PlanSlice
from realloc.shards import (
    ShardStore,
    blend_into,
    buffers_nbytes,
    copy_local,
    flat_views,
    fused_views,
    local_copies,
    zero_padding,
)
from realloc.shards.convert import Converted, block_box, convert_rank, in_format, write_box
from realloc.shards.synthetic import synthetic_box
from realloc.spec import ModelSpec
from realloc.spec.formats import FP8, scale_name, unformatted

log = logging.getLogger(__name__)

#: Plans (with their peers and this worker's routes) kept per worker.
PLANS_KEPT = 8


class _Unset:
    """``ShardWorker._realloc`` before ``ShardWorker.__init__`` ran: a clear error instead of a bare
    ``AttributeError`` deep inside the library."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        raise _not_initialised(obj)


def _not_initialised(worker: Any) -> ValueError:
    return ValueError(
        f"worker class {type(worker).__name__}: ShardWorker.__init__ did not run; an __init__ of your "
        "own must call super().__init__(*args, **kwargs) and pass it every argument it got"
    )


class _ReadOnly:
    """``self.<name>`` of a worker reads ``self._realloc.<name>`` (conveniences for user code)
    until the subclass assigns the name: from then on the name is the subclass's own (the
    library never reads it)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj._realloc, self.name)


class ShardWorker(CheckpointMixin, StagingMixin):
    """One worker of a model group: its flat buffers, its process-group membership, its operations.

    Subclass it to run your own code in the workers (``ModelGroup.create(..., worker_cls=Mine)``):
    the driver calls your public methods with ``group.call("method", ...)``; your state (a model,
    an optimizer) lives across reallocations; ``self.context()`` is the current
    :class:`~actors.worker.context.ShardContext` (shards, views, ``bind``, dp/tp/pp groups); and
    :meth:`on_shards_changed` runs after every committed change of the shards (rebind there).

    Attributes are yours: the library keeps its state under ``self._realloc`` alone
    (:class:`WorkerState`), so ``self.group``, ``self.device``, ``self.spec``, ``self.layout``,
    ``self.rank``, ``self.buffers``, ``self.transport``, ``self.node_id``... may hold your own
    values. ``self.rank``, ``self.layout``, ``self.device``, ``self.spec`` and
    ``self.communicators`` read the worker's current ones until your class assigns them.

    Reserved: ``_realloc``, and the names of the methods defined here and in
    :class:`~actors.worker.checkpoint.CheckpointMixin` (:data:`RESERVED_METHODS`: ``abort_world``,
    ``activity``, ``after_change``, ``clock``, ``context``, ``get_boxes``, ``info``, ``inject_fault``,
    ``join``, ``join_groups``, ``last_phases``, ``last_trace``, ``open_group_rendezvous``,
    ``open_rendezvous``, ``ping``, ``run``, ``safe_point``, ``set_layout``, ``shutdown``,
    ``source_digest``, ``trim_memory``, ``user_call``, ``verify_synthetic``, the ``op_*``,
    ``ckpt_*``, ``resident_*`` and ``stage_*`` ones, and private helpers
    such as ``_run``, ``_keep``, ``_worker_plan``, ``_ckpt``): the driver and the worker call them.
    ``ModelGroup.create`` refuses a class that redefines one (only :meth:`on_shards_changed` is
    meant to be overridden), and a worker whose code assigns one as an attribute gets a
    ``ValueError`` naming it (the attribute is removed). ``__init__`` must accept the arguments
    every worker is started with: define none, or ``def __init__(self, *args, **kwargs)`` that
    calls ``super().__init__(*args, **kwargs)`` (extra parameters of your own need defaults);
    ``create`` checks the signature before anything starts.
    """

    _realloc = _Unset()
    rank, layout, device, spec, communicators = _ReadOnly(), _ReadOnly(), _ReadOnly(), _ReadOnly(), _ReadOnly()

    def __init__(
        self, group: str, spec: ModelSpec, zero_copy: bool, device: str | None = None, backend: str | None = None
    ):
        torch.set_num_threads(max(1, int(os.environ.get("REALLOC_TORCH_THREADS", "1"))))
        self._realloc = WorkerState(group, spec, zero_copy, device, backend)

    # -- user code ----------------------------------------------------------------------------
    def on_shards_changed(self, ctx: ShardContext, change: ShardChange) -> None:
        """Hook: runs on every worker of the group after a change of its shards is committed
        everywhere (a new layout, new weights, creation, replacement). Every shard tensor is a
        new object then: rebind or rebuild your modules here. All workers run it together, so
        it may use ``ctx.groups``. Override it; the default does nothing."""

    def context(self) -> ShardContext:
        """The current layout's :class:`~actors.worker.context.ShardContext` of this worker."""
        store = self._store_now()
        st = self._realloc
        layout = st.held.layout
        dp_rank, fsdp_rank, tp_rank, pp_rank = layout.topology.coords4(st.rank)
        groups = ParallelGroups(layout, st.rank, st.communicators)
        # ZeRO-3: a slot's tensor is its flat partition (DeepSpeed's ds_tensor), not one of its shards;
        # Megatron's model under FSDP2 (qkv_order="megatron", fsdp > 1): its fused linear_qkv /
        # linear_fc1 chunks in place of q/k/v/gate/up (pieces of those chunks)
        if layout.topology.fsdp_split == "zero3":
            tensors = flat_views(st.held, st.buffers)
        elif layout.fused_sharded:
            tensors = fused_views(st.held, st.buffers, padding=True, convention="megatron")
        else:
            tensors = store.shard_tensors()
        return ShardContext(
            st.rank,
            layout.topology,
            dp_rank,
            tp_rank,
            pp_rank,
            st.device,
            tensors,
            st.held.shards(),
            layout,
            groups,
            st.held,
            st.buffers,
            fsdp_rank,
            st.version,
            self.safe_point,
        )

    def after_change(self, change: ShardChange) -> None:
        """Driver entry point of the hook (after the commit of ``change``). The version the
        change brings (``change.version``, the group's after it) is the one this worker serves
        from now on: the hook's context carries the same (a fill or a copy moved the group's
        version on the driver while the worker still had the one of its last call)."""
        if change.version is not None:
            self._realloc.version = change.version
        try:
            self.on_shards_changed(self.context(), change)
        finally:
            _check_names(self, f"{type(self).__name__}.on_shards_changed")

    def user_call(
        self, method: str, args: tuple, kwargs: dict, version: int | None = None, switch: str | None = None
    ) -> Any:
        """Driver entry point of ``group.call``: run a method of the user's subclass (after
        switching to the staged update ``switch``, armed everywhere; ``version``: the group's)."""
        self._begin_call(version, switch)
        try:
            return detach_result(getattr(self, method)(*args, **kwargs))
        finally:
            _check_names(self, f"{type(self).__name__}.{method}")

    def open_group_rendezvous(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        """Host the rendezvous store of the process groups for user code (rank 0 of the group)."""
        addr = ray.util.get_node_ip_address()
        self._realloc.group_rendezvous = host_rendezvous(addr, world_size, timeout_s)
        return addr, self._realloc.group_rendezvous.port

    def join_groups(self, addr: str, port: int, rank: int, world_size: int, generation: str, timeout_s: float) -> None:
        """Start a fresh cache of user process groups (at creation and after a replacement)."""
        if self._realloc.communicators is not None:
            self._realloc.communicators.close()
        store = self._realloc.group_rendezvous
        if store is None:
            store = connect_rendezvous(addr, port, world_size, timeout_s)
        self._realloc.communicators = Communicators(store, rank, world_size, self._realloc.wire, timeout_s, generation)

    # -- identity, liveness and collective set-up --------------------------------------------
    def info(self) -> dict:
        """Where this worker runs (the driver's first call to a new worker)."""
        _check_names(self, f"{type(self).__name__}.__init__")
        return {
            "node_id": self._realloc.node_id,
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "device": str(self._realloc.device),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "zero_copy": self._realloc.allocator.shared,
        }

    @ray.method(concurrency_group=CONTROL)
    def ping(self) -> dict:
        """Answered on the control thread, even while a transfer blocks the main one."""
        return {
            "pid": os.getpid(),
            "op": self._realloc.op.id if self._realloc.op else None,
            "layout": str(self._realloc.held) if self._realloc.held else None,
        }

    def activity(self) -> dict:
        """Operation counters (tests: invalid input must cause no traffic and no state change)."""
        return dict(self._realloc.counters)

    def open_rendezvous(self, lane: Lane, world_size: int, timeout_s: float, world_id: str) -> tuple[str, int]:
        """Host the rendezvous store of ``world_id``, a world of ``lane`` (rank 0 of a world being
        formed). The driver calls it on the lane's concurrency group (``World.form``: a staged
        world's on the stage thread, beside a running user call)."""
        st = self._realloc
        st.lane(lane)
        store = host_rendezvous(ray.util.get_node_ip_address(), world_size, timeout_s)
        st.hosted[world_id] = store
        while len(st.hosted) > 4:  # the last few (moves' and staged updates' worlds)
            st.hosted.popitem(last=False)
        return store.host, store.port

    def _rendezvous(self, world_id: str, addr: str, port: int, world_size: int, timeout_s: float):
        """The store of ``world_id``'s rendezvous (this worker's own if it hosts it) once every
        member checked in (transport.check_in). ``StaleOperationError`` for a formation the
        driver aborted (a late call: the worker was stopped, or busy): nothing changes here."""
        st = self._realloc
        if world_id in st.aborted_worlds:
            raise StaleOperationError(f"worker of {st.group}: the formation of world {world_id} was aborted")
        hosted = st.hosted.get(world_id)
        store = hosted if hosted is not None else connect_rendezvous(addr, port, world_size, timeout_s)
        check_in(store, world_id, world_size, timeout_s, lambda: world_id in st.aborted_worlds)
        return store

    @ray.method(concurrency_group=CONTROL)
    def abort_world(self, world_id: str) -> None:
        """The driver gave up forming ``world_id`` (a member died or did not answer): members
        waiting at its rendezvous leave it now, and a late join of it is refused (on the control
        thread: answered while the joins wait)."""
        st = self._realloc
        st.aborted_worlds[world_id] = None
        while len(st.aborted_worlds) > 64:
            st.aborted_worlds.popitem(last=False)
        store = st.hosted.get(world_id)
        if store is not None:  # a member not told yet (stopped, resumed late) reads the mark
            try:
                abort_formation(store, world_id)
            except Exception:  # noqa: BLE001 - best effort: the members also time out on their own
                log.debug("could not mark world %s aborted", world_id, exc_info=True)

    def join(
        self, lane: Lane, world_id: str, addr: str, port: int, world_rank: int, world_size: int, timeout_s: float
    ) -> str:
        """Join ``world_id``, the new world of ``lane``, leaving the lane's previous one (the other
        lane's world stays: a staged world is a process group beside the one moves use). The
        driver calls it on the lane's concurrency group (``World.form``). A formation the driver
        aborted is refused, and leaves the lane's current world as it is."""
        st = self._realloc
        state = st.lane(lane)
        started = time.monotonic()
        store = self._rendezvous(world_id, addr, port, world_size, timeout_s)
        state.leave()
        state.transport = built_together(
            store,
            world_id,
            world_rank,
            world_size,
            max(timeout_s - (time.monotonic() - started), 0.1),
            lambda: Transport(
                addr,
                port,
                world_rank,
                world_size,
                st.device,
                timeout_s,
                store=store,
                prefix=f"{lane.prefix}/{world_id}",
                backend=st.backend,
            ),
        )
        state.world_id = world_id
        return state.transport.backend

    def _check_world(self, world_id: str, lane: Lane = MOVE) -> "LaneState":
        """``lane``'s state, if this worker is in ``world_id`` on it (``StaleOperationError`` if not)."""
        state = self._realloc.lane(lane)
        if state.transport is None or state.world_id != world_id:
            raise StaleOperationError(
                f"worker of {self._realloc.group} is in world {state.world_id} of the {lane.name} lane, "
                f"not {world_id}: it joined another world since (re-form the world)"
            )
        return state

    # -- weights -------------------------------------------------------------------------
    def set_layout(self, target: RankLayout) -> int:
        """Adopt an (empty, zeroed) layout outside any operation (a new or replaced worker)."""
        self._drop_op()
        old = self._realloc.buffers
        self._realloc.buffers = self._realloc.allocator.allocate(target.buffer_numels())
        self._realloc.held = target
        self._realloc.allocator.release(old)
        return self._realloc.held.layout.rank_bytes(target.rank)

    def _store_now(self) -> ShardStore:
        if self._realloc.held is None or self._realloc.buffers is None:
            raise RuntimeError(f"worker of {self._realloc.group} has no layout yet")
        return ShardStore(self._realloc.held.shards(), self._realloc.buffers)

    def get_boxes(self) -> list[tuple[str, tuple, tuple, torch.Tensor]]:
        """``(param, offsets, sizes, tensor)`` of every held box, on CPU (padding excluded); float8
        boxes as their bytes (uint8: torch cannot pickle float8 tensors; ``shard_boxes`` views
        them back)."""
        store = self._store_now()
        out = []
        for s in self._realloc.held.shards():
            if s.numel:
                t = store.view(s.param, s.offsets, s.sizes).cpu().clone()
                out.append((s.param, s.offsets, s.sizes, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t))
        return out

    def verify_synthetic(self, seed: int) -> list[str]:
        """Names of slots whose values differ from the synthetic weights (padding must be zero)."""
        bad = []
        store = self._store_now()
        model = unformatted(self._realloc.held.layout.spec).by_name
        for s, local in ((s, t) for entries in store.by_param.values() for s, t in entries):
            if s.param not in model:
                continue  # block scales: checked with their weight
            expected = torch.zeros(s.local_shape, dtype=local.dtype, device=local.device)
            if s.numel:
                p = model[s.param]
                value = synthetic_box(s.param, p.shape, s.offsets, s.sizes, p.dtype, seed, local.device)
                value, scale = in_format(value, s.dtype)  # the weight format the layout holds
                expected[tuple(slice(0, n) for n in s.sizes)] = value
                if scale is not None and not torch.equal(
                    store.view(scale_name(s.param), *block_box(s.offsets, s.sizes)), scale
                ):
                    bad.append(scale_name(s.slot))
            if s.dtype == FP8:  # no value comparisons of float8 tensors: their bits
                local, expected = local.view(torch.uint8), expected.view(torch.uint8)
            if not torch.equal(local, expected):
                bad.append(s.slot)
        return bad

    def run(
        self, fn: Callable, args: tuple, kwargs: dict, version: int | None = None, switch: str | None = None
    ) -> Any:
        self._begin_call(version, switch)
        return detach_result(fn(self.context(), *args, **kwargs))

    def source_digest(self) -> dict[str, float]:
        """A cheap fingerprint of the current buffers (tests: sources untouched after a failure)."""
        return {
            d: float(t.double().sum()) + float((t.double() ** 2).sum())
            for d, t in (self._realloc.buffers or {}).items()
        }

    def inject_fault(self, kind: str, value: float) -> None:
        """Fault injection for tests of the failure paths: ``("stall", seconds)`` sleeps at the start
        of the next execute phase; ``("exit_after_buckets", n)`` kills this process after ``n``
        buckets; ``("exit_in_commit", 0)`` kills it when the next commit arrives (after every
        transfer, before it adopts anything); ``("exit_after_commit", 0)`` kills it after it
        adopted the new buffers, before it answers; ``("exit_in_switch", 0)`` kills it when a staged
        update's switch arrives (``stage_switch``), before it switches; ``("exit_in_convert", 0)``
        kills it when it converts weight formats (realloc/plan/formats.py). ``stall`` and
        ``exit_after_buckets`` apply to staged transfers too."""
        self._realloc.faults.arm(kind, value)

    # -- the protocol --------------------------------------------------------------------
    def op_prepare(
        self, op_id: str, dst: RankLayout | None, export: bool = True, into: Layout | None = None
    ) -> dict | None:
        """Start operation ``op_id``: allocate destination buffers for ``dst`` (if any).

        Returns the zero-copy handles of the destination and the current (source) buffers
        (``export=False``: nothing, ``op_run`` sends them to the peers that need them).
        ``into``: the operation is a copy into ``into`` that this worker must already hold (a
        blend, ``copy_to(eta=)``, mixes what it receives with what it holds): ``ValueError``
        before anything changes when ``dst`` is not what it holds (actors/worker/guard.py).
        """
        if into is not None:
            guard.check_destination(self._realloc.group, self._realloc.held, dst, None, into)
        self._realloc.counters["prepare"] += 1
        self._drop_op()
        buffers, refreshed = None, False
        if dst is not None:
            if not any(dst.layout.spec is s for s in self._realloc.specs_checked):
                if unformatted(dst.layout.spec) != unformatted(self._realloc.spec):  # a format is no other model
                    raise ValueError(
                        f"worker of {self._realloc.group} holds model {self._realloc.spec.name!r}, "
                        f"not {dst.layout.spec.name!r}"
                    )
                self._realloc.specs_checked = [dst.layout.spec, *self._realloc.specs_checked[:PLANS_KEPT]]
            kept = self._realloc.kept.pop(dst.layout, None)  # stale (a fresh one is adopted instead): refresh it
            if kept is not None and kept.where == "in_place" and kept.held == dst:
                buffers, refreshed = kept.buffers, True  # same memory: modules bound to it stay valid
            else:
                # Every real element is written by the operation: only padding needs zeros in a reused buffer.
                buffers = self._realloc.allocator.allocate(dst.buffer_numels(), zero=False)
            zero_padding(ShardStore(dst.shards(), buffers))
        self._realloc.op = PendingOp(op_id, dst, buffers, refreshed=refreshed)
        if self._realloc.device.type == "cuda":
            torch.cuda.synchronize(self._realloc.device)  # peers read these bytes from other processes
            # CUDA IPC handles are made per reader and opened once each (handles.swap_handles): never
            # broadcast through the driver. Without them the driver-run phases (op_execute)
            # carry every route over the transport.
            return {"dst": None, "src": None} if export else None
        if not export:
            return None
        current, allocator = self._realloc.buffers, self._realloc.allocator
        return {
            "dst": allocator.export(buffers) if buffers is not None else None,
            "src": allocator.export(current) if current is not None else None,
        }

    def _current_op(self, op_id: str) -> PendingOp:
        if self._realloc.op is None or self._realloc.op.id != op_id:
            running = self._realloc.op.id if self._realloc.op else None
            raise StaleOperationError(f"worker of {self._realloc.group} runs operation {running}, not {op_id}")
        if self._realloc.op.committed:
            raise StaleOperationError(f"operation {op_id} is already committed on this worker")
        return self._realloc.op

    def _drop_op(self) -> None:
        """End the previous operation for good: its rollback becomes the spare set."""
        op, self._realloc.op = self._realloc.op, None
        if op is None:
            return
        if op.committed:
            if op.rollback is not None and op.kept is None:  # a kept rollback belongs to the kept layouts
                self._realloc.allocator.release(op.rollback[1])
        elif op.buffers is not None:
            log.warning(
                "worker of %s: operation %s was never committed or aborted; dropping it", self._realloc.group, op.id
            )
            self._realloc.allocator.release(op.buffers)

    def op_execute(self, op_id: str, world_id: str, share: list, me: int, phase: int, tags: dict) -> WorkerReport:
        """Run phase ``phase`` of this worker's slice of a plan (0: local copies and routes from
        holders, 1: fan-out). ``share``: ``[ObjectRef of (PlanSlice, PeerTable)]``, this
        worker's alone (``Operation.execute_plan``)."""
        self._realloc.counters["execute"] += 1
        move = self._check_world(world_id)
        op = self._current_op(op_id)
        plan, peers = received_share(share, me)
        # the driver-run phases never convert: the plan sends exactly what this worker holds,
        # writes exactly what it prepared, and maps its same-node peers as what they send
        group, mine = self._realloc.group, peers[me]
        guard.source_converts(group, self._realloc.held, mine, convert=False)
        if mine.dst is not None and mine.dst != op.dst:
            raise ValueError(f"worker of {group} prepared {op.dst}, but the plan writes {mine.dst}: {guard.REFUSED}")
        guard.check_reads(group, peers, [p for p in peers.views if p != me], convert=False)
        if move.phases.op != op_id:
            move.phases = Phases(op_id)
        else:
            move.phases.mark("driver barrier")  # since the previous phase: the driver's wait for all
        result = self._timed(op, tags, phase, lambda: self._execute(op, plan, me, peers, phase, move))
        move.phases.mark(f"phase {phase}")
        result.phases = dict(move.phases.seconds)
        return result

    def _timed(self, op: PendingOp, tags: dict, phase: "int | str", run: Callable[[], WorkerReport]) -> WorkerReport:
        """``run()`` (an execute phase of ``op``), timed and counted into ``op`` and the metrics."""
        started = time.perf_counter()
        metrics.in_flight(tags, +1)
        try:
            with collector_paused():
                result = run()
        finally:
            metrics.in_flight(tags, -1)
        seconds = time.perf_counter() - started
        for kind, n in result.bytes.items():
            op.moved[kind] += n
        op.seconds += seconds
        op.tags = tags
        metrics.record_phase(tags, phase, result.bytes, seconds)
        log.debug("%s op %s phase %s: %s in %.3fs", self._realloc.group, op.id, phase, result.bytes, seconds)
        result.seconds = seconds
        return result

    def _execute(
        self, op: PendingOp, plan: PlanSlice, me: int, peers: PeerTable, phase: int, lane: LaneState
    ) -> WorkerReport:
        src = self._store_now() if peers[me].src is not None else None
        dst = op.store()
        moved = {"local": 0, "intra": 0, "inter": 0}
        local_copies = None
        if phase == 0:
            # Local copies write boxes no route writes, and torch copies release the GIL: run
            # them beside the transfers instead of before them.
            def copy_all() -> int:
                started = time.perf_counter()
                nbytes = sum(copy_local(src, dst, plan.segment_list(j)) for j in plan.local)
                lane.phases.local(started, time.perf_counter(), nbytes)
                return nbytes

            local_copies = Background(copy_all)
        stall = self._realloc.faults.take("stall")
        if stall:
            time.sleep(stall)
        runner = StepRunner(
            lane.transport,
            self._realloc.device,
            plan,
            me,
            peers,
            src,
            dst,
            self._peer_store,
            on_bucket=self._realloc.faults.after_bucket,
            staging=lane.staging,
            timeline=lane.phases,
        )
        try:
            for s, routes in plan.routes_by_step().items():
                if (s < plan.forward_from) == (phase == 0):
                    for kind, nbytes in runner.run_step(s, routes):
                        moved[kind] += nbytes
        finally:  # never leave a thread writing into buffers an abort is about to recycle
            if local_copies is not None:
                moved["local"] += local_copies.join()
        return self._finished(op, moved, lane)

    def _finished(self, op: PendingOp, moved: dict[str, int], lane: LaneState) -> WorkerReport:
        """An execute phase's report, once its writes are complete (on a GPU: synchronised)."""
        if self._realloc.device.type == "cuda":
            torch.cuda.synchronize(self._realloc.device)
        dst_bytes = buffers_nbytes(op.buffers.values()) if op.buffers else 0
        return WorkerReport(moved, staging_bytes=lane.staging.nbytes, dst_bytes=dst_bytes)

    def _peer_store(self, peer: PeerView, forward: bool) -> ShardStore:
        held = peer.dst if forward else peer.src
        exported = peer.dst_handles if forward else peer.src_handles
        return ShardStore(held.shards(), open_handles(exported))

    def op_run(
        self,
        op_id: str,
        world_id: str,
        key: str,
        plan_box: list,
        me: int,
        tags: dict,
        order: MoveOrder = PLAIN_MOVE,
    ) -> WorkerReport:
        """A whole plan in one call: prepare, both execute phases, commit (``Operation.run_plan``).

        ``plan_box`` is ``[ObjectRef of (PlanSlice, PeerTable)]``, this worker's share of the plan
        alone (realloc/plan/slices.py), fetched only the first time this worker sees ``key`` (its
        WorkerPlan is cached). Zero-copy handles travel between the workers that need
        them (point to point, on the world's process group) instead of through the driver, and a
        fan-out read of a peer's destination buffers waits for that peer's "phase 0 done" message
        instead of a driver barrier. The commit at the end is the protocol's: if any worker fails,
        the driver aborts every live worker, which rolls a committed one back (``op_abort``).
        ``order`` (:class:`~actors.records.MoveOrder`; its ``blend`` is never set here): ``keep``,
        keep the layout left behind resident (actors/worker/kept.py); if the destination
        layout is a kept one, the plan writes into its buffers (``refreshed`` in the result).
        ``delta``: a move with ``delta=True`` (actors/wire/delta.py). ``convert``: the layout this worker
        ends in when the plan's destination is that layout in another weight format (the
        receivers convert, realloc/plan/formats.py): converted before the commit. A plan whose
        source is another format than the one held is converted from it before sending.
        ``into``: a copy's destination, which this worker must hold. A share this worker cannot
        run as it holds (a plan of another layout, a delta with a conversion: actors/worker/guard.py)
        is refused with ``ValueError`` before anything is allocated or sent.
        """
        move = self._check_world(world_id)
        move.phases = Phases(op_id)
        worker_plan = self._worker_plan(key, plan_box, me)
        self._check_share(worker_plan, me, order)
        self.op_prepare(op_id, worker_plan.peers[me].dst, export=False)
        self._realloc.counters["execute"] += 1
        op = self._realloc.op
        self._realloc.runs += 1
        handles.evict_mappings(self._realloc)
        move.phases.mark("prepare")
        result = self._timed(op, tags, "all", lambda: self._run(op, worker_plan, me, move, order))
        if order.convert is not None and op.dst is not None:
            self._convert_destination(op, order.convert, move.phases)
        self.op_commit(op_id)  # never a blend: it would rewrite bytes peers may still be reading
        if order.keep is not None:
            self._keep(op, order.keep)
        handles.unmap_device_sources(self._realloc)
        result.refreshed = op.refreshed
        result.resident = self.resident_bytes()
        move.phases.mark("commit")
        result.phases = dict(move.phases.seconds)
        return result

    def last_phases(self) -> dict[str, float]:
        """Seconds by phase of the last ``op_run`` on this worker (prepare, handles, transfers,
        fan-out, local copies, device sync, commit): where a move's time went."""
        return dict(self._realloc.lanes[MOVE].phases.seconds)

    def last_trace(self, lane: Lane = MOVE) -> dict:
        """The timeline of this worker's last transfer on ``lane`` (the move lane's: ``op_run``, or
        the phases of ``op_execute``; the stage lane's: the last staged update's ``stage_run``):
        :meth:`Phases.record` with this host's clock domain (``ModelGroup.last_trace``,
        ``StagedUpdate.trace``)."""
        return {**self._realloc.lane(lane).phases.record(), "clock": clock_reading()}

    @ray.method(concurrency_group=CONTROL)
    def clock(self) -> dict:
        """This host's wall clock now and its domain (``ModelGroup.last_trace`` aligns the
        workers' timelines to the driver's clock with it); answered on the control thread."""
        return clock_reading()

    # -- resident layouts (actors/worker/kept.py) ----------------------------------------------
    def _keep(self, op: PendingOp, order: KeepOrder) -> None:
        """Keep the layout ``op`` committed away from (its rollback) resident, as ``order`` says."""
        if op.rollback is None:
            return
        held, buffers = op.rollback
        if order.where == "host":
            host = to_host(buffers)
            self._realloc.allocator.release(buffers, keep=False)  # the device memory goes back (generation needs it)
            buffers = host
            op.rollback = (held, host)
        self._realloc.kept[held.layout] = Resident(held, buffers, order.version, order.where)
        op.kept = held.layout

    def op_adopt(self, op_id: str, layout: Layout, version: int, keep: KeepOrder | None = None) -> WorkerReport:
        """Prepare and commit a move to the kept ``layout`` in one call: its buffers become the
        current ones (from host memory: copied back to the device first). No byte travels.

        The kept layout must hold weight ``version`` (the driver's current one); otherwise
        :class:`~actors.errors.StaleOperationError` and nothing changes. ``op_abort`` undoes it
        (the adopted buffers become resident again)."""
        self._realloc.counters["prepare"] += 1
        started = time.perf_counter()
        self._drop_op()
        kept = self._realloc.kept.get(layout)
        if kept is None or kept.version != version:
            have = f"version {kept.version}" if kept is not None else "nothing"
            raise StaleOperationError(
                f"worker of {self._realloc.group} keeps {have} of layout {layout}, not weight "
                f"version {version}: nothing was adopted"
            )
        buffers = self._on_device(kept)
        del self._realloc.kept[layout]
        op = self._realloc.op = PendingOp(op_id, kept.held, buffers, adopted=kept)
        op.moved["local"] = buffers_nbytes(buffers.values()) if kept.where == "host" else 0
        self.op_commit(op_id)
        if keep is not None:
            self._keep(op, keep)
        seconds = time.perf_counter() - started
        return WorkerReport(dict(op.moved), seconds=seconds, resident=self.resident_bytes())

    def _on_device(self, kept: Resident) -> dict[str, torch.Tensor]:
        """A kept layout's buffers on the device: themselves, or a copy of the host copy."""
        if kept.where != "host":
            return kept.buffers
        buffers = self._realloc.allocator.allocate(kept.held.buffer_numels(), zero=False)
        copy_into(buffers, kept.buffers)
        return buffers

    def trim_memory(self) -> int:
        """Free what a finished operation left: its rollback, the spare buffer set (kept to reuse
        touched pages) and the spare shadow set of staged updates (the next one allocates it
        again). Kept layouts and a pending staged update stay. Returns the bytes freed. Outside
        any operation."""
        self._drop_op()
        return self._realloc.allocator.drop_spares() + self.stage_release()

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of the kept layouts, by where they are (``in_place``, ``host``)."""
        out = {"in_place": 0, "host": 0}
        for r in self._realloc.kept.values():
            out[r.where] += r.nbytes
        return out

    def resident_sync(self, known: list[tuple[Layout, int]]) -> dict[str, int]:
        """Free every kept layout the driver does not list as ``(layout, version)`` (after a
        failure, a replacement, or ``release_resident``). Outside any operation."""
        self._drop_op()
        wanted = set(known)
        for layout in [k for k, r in self._realloc.kept.items() if (k, r.version) not in wanted]:
            r = self._realloc.kept.pop(layout)
            if r.where == "in_place":
                self._realloc.allocator.release(r.buffers, keep=False)
        return self.resident_bytes()

    def _worker_plan(self, key: str, plan_box: list, me: int) -> WorkerPlan:
        worker_plan = self._realloc.plans.get(key)
        if worker_plan is None:
            plan, peers = received_share(plan_box, me)
            worker_plan = self._realloc.plans[key] = WorkerPlan.make(plan, peers, me)
            while len(self._realloc.plans) > PLANS_KEPT:
                self._realloc.plans.popitem(last=False)
        self._realloc.plans.move_to_end(key)
        return worker_plan

    def _check_share(self, wp: WorkerPlan, me: int, order: MoveOrder, sending: "RankLayout | None" = None) -> bool:
        """``ValueError`` unless this worker can run its share of ``wp`` under ``order`` as it holds
        (actors/worker/guard.py: the plan's source and destination are what it holds, its
        same-node senders are mapped as what they hold, no delta with a conversion): before
        anything is allocated or sent. Returns whether it converts what it sends."""
        return guard.checked_order(self._realloc.group, self._realloc.held, wp.peers, me, order, sending)

    def _run(
        self,
        op: PendingOp,
        wp: WorkerPlan,
        me: int,
        lane: LaneState,
        order: MoveOrder = PLAIN_MOVE,
        sending: "tuple[RankLayout, dict[str, torch.Tensor]] | None" = None,
    ) -> WorkerReport:
        """``op``'s part of ``wp`` on ``lane``: over its transport, through its bucket staging, marked
        on its timeline (a move's, ``op_run``; a staged update's, actors/worker/staging.py).
        ``order.delta``: run the routes as deltas when it names a base version, and keep what was
        sent as the new base (actors/wire/delta.py); never with a conversion (``order.convert``, or
        senders converting as they send: refused before any traffic). ``sending``: the (rank,
        buffers) this worker sends from when it is not its serving set (a staged set a fleet
        update relays)."""
        timeline, transport = lane.phases, lane.transport
        delta = order.delta
        # a sender converting into the plan's format converts as it packs (a same-node reader of
        # its buffers as it reads), and collects the blocks it cannot quantize (inf/NaN): it fails
        # after the transfers (runner.conversion_failures()), not before (its peers would wait for
        # its routes until their collective timed out); the move then aborts like any failed one
        src, convert = self._source_store(wp.peers[me], sending)
        if convert is not None and wp.local:
            raise ValueError(f"worker of {self._realloc.group}: a plan converting on its senders has no local copies")
        # delta routes move the bytes as they are: never into, out of or beside a conversion
        converts = convert is not None or guard.peers_convert(wp.peers, me)
        guard.check_delta(self._realloc.group, delta, converts, order.convert)
        dst = op.store()
        sides = self._delta_sides(op, wp.peers[me], delta) if delta is not None and delta.base is not None else None
        if sides is not None and sides.src_base is not None:
            # the base is brought up to date box by box as it is sent (DeltaRoute.encoded): until
            # the move is done it is of no version (a failed move leaves it so: its buckets go whole)
            self._realloc.delta_base.version = -1
        moved = {"local": 0, "intra": 0, "inter": 0}
        if self._realloc.copier is None:
            self._realloc.copier = ThreadPoolExecutor(1, thread_name_prefix="realloc-local")

        # Local copies write boxes no route writes, and torch copies release the GIL: beside the
        # handle exchange (which waits for the peers to arrive) and the transfers.
        def copy_local() -> int:
            started = time.perf_counter()
            nbytes = sum(
                wp.cuts.programs.run(
                    ("local", j),
                    lambda j=j: local_copies(src, dst, wp.plan.segment_list(j)),
                    dst.buffers,
                    src.buffers,
                )
                for j in wp.local
            )
            timeline.local(started, time.perf_counter(), nbytes)
            return nbytes

        local = self._realloc.copier.submit(copy_local) if wp.local else None
        ready: dict[int, Any] = {}
        sent: list = []
        ok = False
        try:
            opened = (
                handles.swap_handles(self._realloc, wp, op, transport, src.buffers if src is not None else None)
                if (wp.read_from or wp.read_by)
                else {}
            )
            timeline.mark("handles")
            runner = StepRunner(
                transport,
                self._realloc.device,
                wp.plan,
                me,
                wp.peers,
                src,
                dst,
                lambda view, forward: opened[view.world_rank, forward],
                on_bucket=self._realloc.faults.after_bucket,
                staging=lane.staging,
                cuts=wp.cuts,
                delta=sides,
                timeline=timeline,
                convert=convert,
            )
            stall = self._realloc.faults.take("stall")
            if stall:
                time.sleep(stall)
            steps = sorted(wp.routes)
            forward_from = wp.plan.forward_from
            for s in (s for s in steps if s < forward_from):
                for kind, nbytes in runner.run_step(s, wp.routes[s]):
                    moved[kind] += nbytes
            timeline.mark("transfers")
            # Phase 0 is done here: tell the peers that read my destination buffers (fan-out reads
            # forward only cells received over routes, never local copies: planner, step 2).
            sent, ready = handles.post_ready(self._realloc, wp, wp.peers, transport)
            timeline.mark("ready")
            for s in (s for s in steps if s >= forward_from):
                for peer in wp.wait_ready.get(s, ()):
                    work = ready.pop(peer, None)
                    if work is not None:
                        work.wait()
                for kind, nbytes in runner.run_step(s, wp.routes[s]):
                    moved[kind] += nbytes
            for work in sent + list(ready.values()):
                work.wait()
            timeline.mark("fan-out")
            if delta is not None and src is not None:  # what was sent: the next delta's base
                st = self._realloc
                if updated_in_place(sides, src):  # as it was sent, box by box
                    st.delta_base.version = delta.version
                else:
                    st.delta_base = snapshot(st.delta_base, wp.peers[me].src, src.buffers, delta)
                timeline.mark("delta base")
            ok = True
        finally:  # never leave a thread writing into buffers an abort is about to recycle
            if local is not None:
                if ok:
                    moved["local"] += local.result()
                else:
                    local.exception()
        timeline.mark("local copies")
        failed = runner.conversion_failures()
        if failed:
            raise failed[0]
        result = self._finished(op, moved, lane)
        timeline.mark("device sync")
        if sides is not None:
            result.delta = sides.stats
        if delta is not None:
            result.delta_base_bytes = self._realloc.delta_base.nbytes if self._realloc.delta_base else 0
        return result

    def _source_store(
        self, me: PeerView, sending: "tuple[RankLayout, dict[str, torch.Tensor]] | None" = None
    ) -> tuple[ShardStore | None, Converted | None]:
        """What this worker sends from (``me``: its view in the plan; ``(None, None)`` when it
        sends nothing): its buffers, and, for a plan in another weight format than the one held
        (realloc/plan/formats.py), those buffers seen in the plan's format (each message
        converted as it is packed: :class:`~realloc.shards.convert.Converted`). ``sending``: a
        relayed staged set's (rank, buffers), sent as they are (never converted). A plan of any
        other layout than the one it holds is refused (:func:`actors.worker.guard.source_converts`)."""
        st = self._realloc
        converts = guard.source_converts(st.group, st.held, me, sending[0] if sending is not None else None)
        src, held = me.src, st.held
        if src is None:
            return None, None
        if sending is not None:
            return ShardStore(src.shards(), sending[1]), None
        if not converts:
            return self._store_now(), None
        if self._realloc.faults.take("exit_in_convert") is not None:
            os._exit(1)
        store = self._store_now()
        return store, Converted(store, held.layout.spec.by_name, src.layout.spec.by_name)

    def _convert_destination(self, op: PendingOp, final: Layout, timeline: Phases) -> None:
        """Convert what ``op`` received (the destination in the sender's weight format) into
        ``final``'s format: ``op`` then commits ``final``'s rank and its buffers. ``timeline``:
        the running operation's (a move's, or a staged update's), where ``convert`` is marked."""
        target = RankLayout(final, op.dst.rank)
        store = self._converted(op.dst, op.store(), target, timeline)
        self._realloc.allocator.release(op.buffers)
        op.dst, op.buffers = target, store.buffers

    def _converted(self, have: RankLayout, store: ShardStore, want: RankLayout, timeline: Phases) -> ShardStore:
        """``store`` (rank ``have``) converted into fresh buffers of ``want``: the same rank in
        another weight format (realloc/shards/convert.py); the buffers go back on failure (a
        block of inf/NaN to quantize raises :class:`~realloc.shards.convert.NonFiniteBlock`).
        The time is marked ``convert`` on ``timeline``: the operation running it (never
        another's)."""
        if self._realloc.faults.take("exit_in_convert") is not None:
            os._exit(1)
        buffers = self._realloc.allocator.allocate(want.buffer_numels(), zero=False)
        out = ShardStore(want.shards(), buffers)
        zero_padding(out)
        try:
            convert_rank(have.layout, want.layout, want.rank, store, out)
        except BaseException:
            self._realloc.allocator.release(buffers)
            raise
        timeline.mark("convert")
        return out

    def _delta_sides(self, op: PendingOp, me: PeerView, order: DeltaOrder) -> DeltaSides:
        """The bases of a delta move on this worker: its own base, if it sends and the base is of
        the order's version; as a receiver, what its destination held (a kept layout refreshed in
        place, or the serving buffers when they are in the destination's layout)."""
        st = self._realloc
        dst_base = None
        if me.dst is not None:
            if op.refreshed:
                dst_base = op.store()
            elif st.held == me.dst and st.buffers is not None:
                dst_base = ShardStore(st.held.shards(), st.buffers)
        return DeltaSides(sender_base(st.delta_base, me.src, order), dst_base)

    def op_fill(self, op_id: str, how: str, *args: Any) -> int:
        """Write the destination buffers of ``op_id`` from local data: ``("synthetic", seed)``,
        ``("full", state_dict)`` (full tensors, this worker slices its boxes) or
        ``("hf", path, tensors, mapping)`` (a HF safetensors directory). Returns bytes written."""
        op = self._current_op(op_id)
        store, shards = op.store(), op.dst.shards()
        if how == "hf":
            from realloc.ckpt.hf import load_shards

            return load_shards(args[0], args[1], args[2], shards, store)
        model = unformatted(op.dst.layout.spec).by_name  # a layout of another weight format holds these converted
        if how == "synthetic":

            def box(s):
                p = model[s.param]
                return synthetic_box(s.param, p.shape, s.offsets, s.sizes, p.dtype, args[0], self._realloc.device)
        elif how == "full":  # the driver keys the state dict by storage parameter (aliases resolved)

            def box(s):
                return args[0][s.param][box_index(s.offsets, s.sizes)].to(self._realloc.device)
        else:
            raise ValueError(f"unknown fill {how!r}; allowed: synthetic, full, hf")
        for s in shards:
            if s.numel and s.param in model:  # not in it: block scales, written with their weight
                write_box(store, s.param, s.offsets, s.sizes, box(s), s.dtype)
        return sum(s.nbytes for s in shards)

    def op_commit(self, op_id: str, blend: float | None = None) -> str:
        """Adopt the destination buffers of ``op_id`` (blended with the current ones when ``blend``
        is given: ``eta * new + (1 - eta) * old``); the old buffers become the rollback."""
        self._realloc.counters["commit"] += 1
        op = self._current_op(op_id)
        if self._realloc.faults.take("exit_in_commit") is not None:
            os._exit(1)
        if op.dst is not None:
            if blend is not None:
                blend_into(op.buffers, self._realloc.buffers, blend)
            self._realloc.allocator.drop_spares()  # memory: the rollback takes the spares' place
            op.rollback = (self._realloc.held, self._realloc.buffers)
            self._realloc.held, self._realloc.buffers = op.dst, op.buffers
        op.committed = True
        total = sum(op.moved.values())
        if total:
            metrics.record_operation(op.tags, total, op.seconds)
        if self._realloc.faults.take("exit_after_commit") is not None:
            os._exit(1)
        return str(self._realloc.held)

    def op_abort(self, op_id: str) -> str | None:
        """Undo ``op_id`` on this worker (drop its buffers, or roll a commit back); idempotent.

        Returns the layout this worker holds afterwards."""
        self._realloc.counters["abort"] += 1
        op = self._realloc.op
        if op is None or op.id != op_id:
            return str(self._realloc.held) if self._realloc.held else None  # nothing of that operation is here
        self._realloc.op = None
        if op.committed and op.rollback is not None:
            new = self._realloc.buffers
            held, old = op.rollback
            if op.kept is not None:  # the old buffers were kept resident: take them back
                old = self._on_device(self._realloc.kept.pop(op.kept))
            self._realloc.held, self._realloc.buffers = held, old
            if op.adopted is not None:  # the adopted layout is kept again, as it was
                self._realloc.kept[op.adopted.held.layout] = op.adopted
                if op.adopted.where == "host":
                    self._realloc.allocator.release(new, keep=False)
            else:
                self._realloc.allocator.release(new)
        elif not op.committed and op.buffers is not None:
            self._realloc.allocator.release(op.buffers)  # a refreshed kept layout is half written: freed too
        self._ckpt_forget_sources()
        return str(self._realloc.held) if self._realloc.held else None

    def shutdown(self) -> None:
        self._drop_op()
        self._realloc.staged = None
        self._realloc.shadow_spare = None
        self._realloc.kept.clear()
        self._realloc.mapped.clear()
        self._realloc.plans.clear()
        if self._realloc.copier is not None:
            self._realloc.copier.shutdown(wait=True)
            self._realloc.copier = None
        self._realloc.allocator.release_all()
        for lane in self._realloc.lanes.values():
            lane.leave()
        if self._realloc.communicators is not None:
            self._realloc.communicators.close()
            self._realloc.communicators = None


#: Names of the methods the driver and the worker itself call on a worker: a subclass must not
#: redefine them (``ModelGroup.create`` refuses it) nor assign them as attributes.
RESERVED_METHODS = frozenset(
    n for n in dir(ShardWorker) if not n.startswith("__") and inspect.isfunction(inspect.getattr_static(ShardWorker, n))
)


def _check_names(worker: ShardWorker, where: str) -> None:
    """``ValueError`` if user code (``where``) replaced the library's state or assigned a reserved
    method name as an attribute of ``worker`` (such attributes are removed: the worker stays usable)."""
    if not isinstance(vars(worker).get("_realloc"), WorkerState):
        if "_realloc" not in vars(worker):
            raise _not_initialised(worker)
        raise ValueError(
            f"{where} assigned self._realloc, the worker's library state (the one reserved attribute "
            "name of a worker class); this worker cannot go on: rename the attribute"
        )
    shadowing = sorted(RESERVED_METHODS.intersection(vars(worker)))
    if shadowing:
        for name in shadowing:
            del worker.__dict__[name]
        raise ValueError(
            f"{where} assigned attribute(s) {shadowing} of the worker: those names are methods the "
            "library calls (ShardWorker's reserved names); the attributes were removed, rename them"
        )


def detach_result(value: Any) -> Any:
    """``value`` with every tensor that is a view of a larger storage copied out.

    Ray pickles a tensor with its whole storage: a user function returning a view of a worker's
    flat buffer would ship the buffer (and pin shared memory). Lists, tuples, sets and dicts are
    walked; other objects are returned as they are.
    """
    if isinstance(value, torch.Tensor):
        own = value.numel() * value.element_size()
        if value.untyped_storage().nbytes() != own or not value.is_contiguous():
            return value.detach().clone(memory_format=torch.contiguous_format)
        return value
    if isinstance(value, list):
        return [detach_result(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(detach_result(v) for v in value)
    if isinstance(value, tuple):  # a named tuple
        return type(value)(*(detach_result(v) for v in value))
    if isinstance(value, dict):
        return {k: detach_result(v) for k, v in value.items()}
    return value
