"""Records that cross the Ray boundary between the driver and the workers, and their checks.

The orders a driver sends with a move (:class:`MoveOrder` of a :class:`KeepOrder`, a
:class:`DeltaOrder`, a conversion and a blend), the change a
worker's hook is told of (:class:`ShardChange`), the checkpoint fault a test injects
(:class:`CheckpointFault`), the schema of a worker's delta counters (:data:`DELTA_COUNTERS`),
what a worker reports of its part of a move (:class:`WorkerReport`) or of a checkpoint plan
(:class:`ExchangeReport`) and what the driver sums the reports into (:meth:`PhaseResult.of`, the one summation), and records of a kept
layout (:class:`ResidentLayout`). Both sides import them; this module imports nothing of
``actors`` (it sits at the bottom of the package's import order, below ``wire/``, ``worker/``
and ``driver/``) and no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

from realloc._checks import check_nonneg
from realloc.layout import Layout

# -- kept (resident) layouts: actors/worker/kept.py, ModelGroup.reallocate(keep=...) ------------

#: Where ``keep`` puts the buffers of the layout a group leaves.
KEEP_MODES = ("in_place", "host")


def check_keep(keep: object) -> str | None:
    """``keep`` itself, or ``ValueError`` naming the allowed values."""
    if keep is None or keep in KEEP_MODES:
        return keep
    raise ValueError(
        f"keep={keep!r} is not a resident mode; allowed: None (free the old layout), "
        f"{', '.join(repr(m) for m in KEEP_MODES)}"
    )


@dataclass(frozen=True)
class KeepOrder:
    """What a worker keeps when it commits a move: where, tagged with the weights' ``version``."""

    where: str
    version: int


@dataclass(frozen=True)
class ResidentLayout:
    """The driver's record of one kept layout (``ModelGroup.resident_layouts()``).

    ``version``: the weight version its buffers hold; ``fresh``: equal to the group's current
    version (moving there adopts, no traffic); ``where``: ``"in_place"`` or ``"host"``;
    ``bytes_per_worker``: the largest worker's kept bytes."""

    layout: Layout
    version: int
    where: str
    bytes_per_worker: int
    fresh: bool = False


# -- delta moves: actors/wire/delta.py -----------------------------------------------------------

#: Where a group's workers keep their base: ``"host"`` (host memory; the same as ``"device"`` for
#: CPU workers) or ``"device"`` (beside the buffers).
DELTA_PLACES = ("host", "device")


@dataclass(frozen=True)
class DeltaOrder:
    """What a move with ``delta=True`` tells its workers.

    ``base``: the weight version the destination holds and the senders' bases must hold for the
    routes to travel as deltas; None: an anchor (a full move). ``version``: the source's weight
    version now; the senders' bases take it once their part is sent. ``where``: where the bases
    are kept (:data:`DELTA_PLACES`)."""

    base: int | None
    version: int
    where: str = "host"


@dataclass(frozen=True)
class MoveOrder:
    """What a move tells its workers besides the plan (``Operation.run_plan`` ->
    ``ShardWorker.op_run``, ``StagedUpdate`` -> ``stage_run``), in one record.

    ``keep``: keep the layout left behind resident (:class:`KeepOrder`); ``delta``: a move with
    ``delta=True`` (:class:`DeltaOrder`); ``convert``: the layout the destination workers convert
    into before committing (realloc/plan/formats.py); ``blend``: a blending commit's weight
    (``copy_to(eta=)``; the driver commits it, after every worker finished: it never travels in
    ``op_run``); ``relay``: the staged update whose staged set the senders send from instead of
    their serving set (a fleet update relaying the trainer's weights from one replica to the
    next: actors/driver/fleet.py; staged updates only); ``into``: a copy's, the layout its
    receiving workers hold and keep (the destination group's): each refuses, before any traffic,
    a plan whose destination (converted into ``convert``) is not the rank it holds
    (actors/worker/guard.py). All None: a plain move."""

    keep: KeepOrder | None = None
    delta: DeltaOrder | None = None
    convert: Layout | None = None
    blend: float | None = None
    relay: str | None = None
    into: Layout | None = None


#: The order of a plain move: nothing kept, no delta, no conversion, no blend.
PLAIN_MOVE = MoveOrder()


#: What :class:`DeltaSides` counts of the buckets it receives: all of them, those whose delta
#: landed, those that travelled whole, those sent again whole after a missed checksum, the bytes
#: that travelled, the bytes the buckets hold.
DELTA_COUNTERS = ("buckets", "delta", "whole", "repaired", "wire_bytes", "bytes")


# -- shard changes: the worker's on_shards_changed hook (actors/worker/context.py) ---------------

#: Kinds of :class:`ShardChange`.
CHANGES = ("create", "reallocate", "copy", "fill", "load", "replace")


@dataclass(frozen=True)
class ShardChange:
    """One committed change of a worker's shard tensors (the hook's second argument).

    ``kind``: ``create`` (the group started), ``reallocate`` (new layout), ``copy`` (this
    group received another group's weights: ``copy_to``), ``fill`` (new weights in the same
    layout: ``init_synthetic``, ``load_state_dict``, HF import), ``load`` (checkpoint restore or
    resharding load) or ``replace`` (this worker replaced a dead one: its weights are zeros until
    the next load). ``old`` is the layout before (``None`` at creation). After every change the
    shard tensors are new objects: views taken before are stale (the old buffers become the
    rollback and are recycled later), so modules must be rebound. Except when ``same_storage``:
    the move went to a layout kept in place (``reallocate(..., keep="in_place")``), and the
    shard tensors view the very memory this layout had when it was last held, so modules bound
    to it then (and CUDA graphs captured over them) are still valid.
    """

    kind: str
    new: Layout
    old: Layout | None = None
    same_storage: bool = False
    version: int | None = None  # the weight version the worker holds after the change

    def __post_init__(self) -> None:
        if self.kind not in CHANGES:
            raise ValueError(f"unknown shard change {self.kind!r}; allowed: {', '.join(CHANGES)}")

    @property
    def layout_changed(self) -> bool:
        return self.old is None or self.old != self.new

    def __str__(self) -> str:
        return f"{self.kind} ({self.old} -> {self.new})" if self.old is not None else f"{self.kind} ({self.new})"


# -- checkpoint faults (actors/worker/checkpoint.py) --------------------------------------------

FAULT_MODES = ("raise", "exit")


@dataclass(frozen=True)
class CheckpointFault:
    """Test hook: rank ``rank`` fails after writing its tensors file, before its manifest.

    ``mode="raise"`` raises inside the write; ``mode="exit"`` kills the worker process there
    (a crash in the middle of a save).
    """

    rank: int
    mode: str = "raise"

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"fault mode {self.mode!r} is not one of {FAULT_MODES}")
        check_nonneg("fault rank", self.rank)

    def trigger(self) -> None:
        if self.mode == "exit":
            os._exit(17)
        raise RuntimeError(f"injected checkpoint fault on rank {self.rank}")


# -- the workers' reports, summed by the driver (actors/driver/protocol.py) -----------------------


@dataclass
class ExchangeReport:
    """What one worker reports of its part of a checkpoint plan (``ckpt_exchange``): ``bytes``,
    the bytes it received by link kind (``local``, ``intra``, ``inter``, as a move's); ``seconds``,
    its exchange; ``finish_seconds``, what came after it (files written, buffers unpacked);
    ``files``, the safetensors files it wrote (an HF export: name, bytes, tensors, writer, node);
    ``replicas``, the rank files of other workers it wrote to its node (a save's replication)."""

    bytes: dict
    seconds: float
    finish_seconds: float
    files: list = field(default_factory=list)
    replicas: int = 0


@dataclass
class WorkerReport:
    """What one worker reports of its part of a move (``op_run``, ``op_execute``, ``op_adopt``,
    ``stage_run``); the worker fills it in as its part goes on, the driver sums the workers'
    with :meth:`PhaseResult.of`.

    ``bytes``: the bytes it received by link kind (``local``, ``intra``, ``inter``);
    ``staging_bytes``/``dst_bytes``: its bucket staging and new destination buffers (the extra
    memory the move cost it); ``seconds``: its own execution time; ``phases``: its seconds by phase
    (actors/wire/executor.py ``Phases``); ``refreshed``: it wrote a kept layout's buffers in place;
    ``resident``: the bytes of its kept layouts by place (``in_place``, ``host``); ``delta``: its
    :data:`DELTA_COUNTERS` (a delta move that named a base); ``delta_base_bytes``: its delta base
    (a move that carried a :class:`DeltaOrder`); ``shadow_bytes``: its shadow set (a staged update)."""

    bytes: dict
    staging_bytes: int = 0
    dst_bytes: int = 0
    seconds: float = 0.0
    phases: dict | None = None
    refreshed: bool = False
    resident: dict | None = None
    delta: dict | None = None
    delta_base_bytes: int = 0
    shadow_bytes: int = 0

    def merge(self, later: "WorkerReport") -> None:
        """Add ``later`` (the same worker's next execute phase) into this report: its bytes, the
        larger staging, its phases (a worker's phases so far, the later phase's included)."""
        for k in self.bytes:
            self.bytes[k] += later.bytes[k]
        self.staging_bytes = max(self.staging_bytes, later.staging_bytes)
        self.phases = later.phases


def slowest(names: Sequence[str], phases: Sequence[dict | None]) -> dict | None:
    """The worker whose phases took longest, in seconds, and its longest phase:
    ``{"worker", "seconds", "phase", "phase_seconds"}``; None without phases."""
    timed = [(sum(p.values()), n, p) for n, p in zip(names, phases) if p]
    if not timed:
        return None
    seconds, name, worst = max(timed, key=lambda t: t[0])
    phase = max(worst, key=worst.get)
    return {"worker": name, "seconds": seconds, "phase": phase, "phase_seconds": worst[phase]}


def delta_summary(reports: Sequence[WorkerReport], order: DeltaOrder | None) -> dict | None:
    """``ReallocStats.delta`` of a move that carried ``order``: ``mode`` (``"delta"``, or
    ``"anchor"``: a full move), ``base_version``, the buckets that travelled as deltas, whole
    (their delta would not have been smaller, or the sender had no base of that version) and
    again whole after a missed checksum (``repaired``), ``bytes`` (what the routes carry in
    full) and ``wire_bytes`` (what travelled: headers, deltas, whole buckets, flags; for an
    anchor, every byte moved between workers), and ``base_bytes_per_actor``: the largest
    sender's base, the memory this costs."""
    if order is None:
        return None
    out = {"mode": "delta" if order.base is not None else "anchor", "base_version": order.base}
    out.update({k: sum((r.delta or {}).get(k, 0) for r in reports) for k in DELTA_COUNTERS})
    if order.base is None:
        moved = sum(r.bytes["intra"] + r.bytes["inter"] for r in reports)
        out["bytes"] = out["wire_bytes"] = moved
    out["base_bytes_per_actor"] = max((r.delta_base_bytes for r in reports), default=0)
    return out


@dataclass(frozen=True)
class PhaseResult:
    """What the workers of one operation reported, summed (bytes received by link kind):
    :meth:`of`."""

    bytes_local: int
    bytes_intra_node: int
    bytes_inter_node: int
    peak_extra_bytes_per_actor: int
    seconds: float = 0.0  # the slowest worker's own execution time (run_plan)
    resident_in_place_bytes: int = 0  # the largest worker's kept layouts on its device
    resident_host_bytes: int = 0  # ... and in host memory
    refreshed: bool = False  # the destination was a kept layout, written in place
    delta: dict | None = None  # a move with delta=True: delta_summary
    slowest: dict | None = None  # the slowest worker and its slowest phase (actors.trace.slowest)
    phases: tuple = ()  # each worker's seconds by phase, where its report has them
    shadow_bytes: int = 0  # the largest worker's shadow set (a staged update)

    @classmethod
    def of(
        cls,
        reports: Sequence[WorkerReport],
        names: Sequence[str] = (),
        *,
        timed: bool = True,
        delta: DeltaOrder | None = None,
    ) -> "PhaseResult":
        """The workers' ``reports`` summed: bytes by link kind added, the largest extra memory
        (staging and destination buffers) and kept layouts, ``refreshed`` if any was. ``names``:
        the workers', to name the slowest (reports with phases); ``timed``: ``seconds`` is the
        slowest worker's own (else 0: the caller times it); ``delta``: the order the move carried
        (:func:`delta_summary`)."""
        return cls(
            bytes_local=sum(r.bytes["local"] for r in reports),
            bytes_intra_node=sum(r.bytes["intra"] for r in reports),
            bytes_inter_node=sum(r.bytes["inter"] for r in reports),
            peak_extra_bytes_per_actor=max(r.staging_bytes + r.dst_bytes for r in reports),
            seconds=max(r.seconds for r in reports) if timed else 0.0,
            resident_in_place_bytes=max(((r.resident or {}).get("in_place", 0) for r in reports), default=0),
            resident_host_bytes=max(((r.resident or {}).get("host", 0) for r in reports), default=0),
            refreshed=any(r.refreshed for r in reports),
            delta=delta_summary(reports, delta),
            slowest=slowest(names, [r.phases for r in reports]) if names else None,
            phases=tuple(r.phases for r in reports),
            shadow_bytes=max(r.shadow_bytes for r in reports),
        )
