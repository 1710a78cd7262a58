"""Records that cross the Ray boundary between the driver and the workers, and their checks.

The orders a driver sends with a move (:class:`MoveOrder` of a :class:`KeepOrder`, a
:class:`DeltaOrder`, a conversion and a blend), the change a
worker's hook is told of (:class:`ShardChange`), the checkpoint fault a test injects
(:class:`CheckpointFault`), the schema of a worker's delta counters (:data:`DELTA_COUNTERS`),
and what the driver sums the workers' reports into (:class:`PhaseResult`) and records of a kept
layout (:class:`ResidentLayout`). Both sides import them; this module imports nothing of
``actors`` (it sits at the bottom of the package's import order, below ``wire/``, ``worker/``
and ``driver/``) and no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
    ``op_run``). All None: a plain move."""

    keep: KeepOrder | None = None
    delta: DeltaOrder | None = None
    convert: Layout | None = None
    blend: float | None = None


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


@dataclass(frozen=True)
class PhaseResult:
    """What the workers of one operation reported, summed (bytes received by link kind)."""

    bytes_local: int
    bytes_intra_node: int
    bytes_inter_node: int
    peak_extra_bytes_per_actor: int
    seconds: float = 0.0  # the slowest worker's own execution time (run_plan)
    resident_in_place_bytes: int = 0  # the largest worker's kept layouts on its device
    resident_host_bytes: int = 0  # ... and in host memory
    refreshed: bool = False  # the destination was a kept layout, written in place
    delta: dict | None = None  # a move with delta=True: actors.driver.protocol.delta_summary
    slowest: dict | None = None  # the slowest worker and its slowest phase (actors.trace.slowest)
    phases: tuple = ()  # each worker's seconds by phase, where its report has them
