"""The typed, validated configuration of a model group (everything but the layout).

Every field is checked on construction, on the driver, before a placement group or an actor
exists: a bad value is a ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.records import DELTA_PLACES
from realloc._checks import check_finite, check_int
from realloc.plan import DEFAULT_BUCKET_BYTES, Bandwidths

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
MIN_BUCKET_BYTES = 1024
TRANSPORTS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class GroupConfig:
    """How a group's workers are placed and how its operations run.

    ``strategy``: placement-group strategy (PACK fills a node first, so tp groups share nodes).
    ``cpus_per_worker``: CPU slots per worker bundle. ``use_gpu``: workers hold their buffers on a
    GPU; ``gpus_per_worker`` of one each (default 1; a fraction such as 0.125 puts several workers
    on one GPU, where they read each other's buffers through CUDA IPC). ``transport``: the backend
    of the process group that carries what zero-copy reads do not: ``"nccl"`` (GPU buffers, one GPU
    per worker: NCCL refuses two ranks on one device), ``"gloo"`` (CPU buffers; GPU buffers are
    staged through pinned host memory), ``"auto"`` (the default: ``nccl`` when every worker has a
    whole GPU, else ``gloo``).
    ``bucket_bytes``: transfer bucket size (the memory cap of staging). ``timeout_s``: bounds
    every collective and every driver wait (finite); a state change (``reallocate``, ``copy_to``,
    ``init_synthetic``, ``load_state_dict``) has one deadline of ``timeout_s`` for the whole call,
    the wait for the group's lock included, and a failed one raises within ``timeout_s`` plus
    ``actors.remote.FAILURE_GRACE_S`` (5 s: the diagnosis and the rollback share it).
    ``start_timeout_s``: bounds the start of workers (the placement group, the processes, their
    imports: ``create`` and ``replace_dead_workers``) apart from ``timeout_s``, which bounds the
    operations: a start waits on the cluster's scheduler and on ``import torch`` in every new
    process, minutes on a loaded machine or with a ``runtime_env`` to install.
    ``zero_copy``: same-node workers copy from each other's buffers directly. ``bandwidths``:
    link speeds for the planner's time estimate.
    ``runtime_env``: Ray runtime environment of the worker actors.
    ``delta``: ``"host"`` or ``"device"`` lets this group's moves run with ``delta=True``
    (``copy_to``, ``reallocate`` back to a kept layout): every worker keeps a copy of the weights
    it last sent (one shard: its base) in host memory or beside its buffers, and only the
    elements that changed since travel (actors/wire/delta.py); None (the default) keeps nothing.
    ``delta_anchor_every``: with it, every this-many-th move into the same destination is a full
    copy (an anchor), whatever the bookkeeping says (1: every move).

    Example:
        >>> GroupConfig(timeout_s=30).timeout_s
        30.0
        >>> GroupConfig(timeout_s=float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: timeout_s must be a finite positive number of seconds, got inf
    """

    use_gpu: bool = False
    gpus_per_worker: float = 1
    transport: str = "auto"
    strategy: str = "PACK"
    cpus_per_worker: float = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    start_timeout_s: float = 300.0
    zero_copy: bool = True
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    runtime_env: dict | None = None
    delta: str | None = None
    delta_anchor_every: int = 10

    def __post_init__(self) -> None:
        for name in ("use_gpu", "zero_copy"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        g = check_finite(
            "gpus_per_worker",
            self.gpus_per_worker,
            positive=True,
            allowed="a fraction in (0, 1] or a whole number of GPUs (what Ray can assign)",
        )
        if g > 1 and g != int(g):
            raise ValueError(
                f"gpus_per_worker must be a fraction in (0, 1] or a whole number of GPUs (what Ray "
                f"can assign), got {g!r}"
            )
        if g != 1 and not self.use_gpu:
            raise ValueError(f"gpus_per_worker={g!r} needs use_gpu=True (CPU workers hold no GPU)")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r} is not one of {TRANSPORTS}")
        if self.transport == "nccl" and not (self.use_gpu and g >= 1):
            raise ValueError(
                "transport='nccl' needs use_gpu=True and gpus_per_worker >= 1 (NCCL moves GPU buffers "
                f"and refuses two ranks on one GPU), got use_gpu={self.use_gpu}, gpus_per_worker={g!r}; "
                "use 'gloo' or 'auto'"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {self.strategy!r} is not one of {STRATEGIES}")
        check_finite("cpus_per_worker", self.cpus_per_worker, minimum=0, allowed="a finite number >= 0")
        if self.cpus_per_worker == 0 and not self.use_gpu:
            raise ValueError(
                f"cpus_per_worker must be > 0 unless use_gpu=True (a worker's placement bundle needs "
                f"some resource), got {self.cpus_per_worker!r}"
            )
        check_int("bucket_bytes", self.bucket_bytes, MIN_BUCKET_BYTES)
        check_finite("timeout_s", self.timeout_s, positive=True, allowed="a finite positive number of seconds")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        check_finite(
            "start_timeout_s", self.start_timeout_s, positive=True, allowed="a finite positive number of seconds"
        )
        object.__setattr__(self, "start_timeout_s", float(self.start_timeout_s))
        if not isinstance(self.bandwidths, Bandwidths):
            raise ValueError(f"bandwidths must be a realloc.Bandwidths, got {type(self.bandwidths).__name__}")
        if self.delta is not None and self.delta not in DELTA_PLACES:
            raise ValueError(
                f"delta must be None (no delta moves) or where workers keep their base: one of "
                f"{DELTA_PLACES}, got {self.delta!r}"
            )
        check_int("delta_anchor_every", self.delta_anchor_every, 1)
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise ValueError(f"runtime_env must be a dict or None, got {type(self.runtime_env).__name__}")

    @property
    def backend(self) -> str:
        """The transport's torch.distributed backend (``transport`` with ``"auto"`` resolved)."""
        if self.transport != "auto":
            return self.transport
        return "nccl" if self.use_gpu and self.gpus_per_worker >= 1 else "gloo"

    @property
    def num_gpus(self) -> float:
        """GPUs of one worker's actor (0 for CPU workers)."""
        return self.gpus_per_worker if self.use_gpu else 0

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one worker."""
        return {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.use_gpu else {})}
