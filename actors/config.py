"""The typed, validated configuration of a model group (everything but the layout).

Every field is checked on construction, on the driver, before a placement group or an actor
exists: a bad value is a ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from realloc.planner import DEFAULT_BUCKET_BYTES, Bandwidths

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
MIN_BUCKET_BYTES = 1024


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class GroupConfig:
    """How a group's workers are placed and how its operations run.

    ``strategy``: placement-group strategy (PACK fills a node first, so tp groups share nodes).
    ``cpus_per_worker``: CPU slots per worker bundle. ``use_gpu``: one GPU per worker (NCCL).
    ``bucket_bytes``: transfer bucket size (the memory cap of staging). ``timeout_s``: bounds
    every collective and every driver wait (finite). ``zero_copy``: same-node workers copy from
    each other's buffers directly. ``bandwidths``: link speeds for the planner's time estimate.
    ``runtime_env``: Ray runtime environment of the worker actors.

    Example:
        >>> GroupConfig(timeout_s=30).timeout_s
        30.0
        >>> GroupConfig(timeout_s=float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: timeout_s must be a finite positive number of seconds, got inf
    """

    use_gpu: bool = False
    strategy: str = "PACK"
    cpus_per_worker: float = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = 120.0
    zero_copy: bool = True
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    runtime_env: dict | None = None

    def __post_init__(self) -> None:
        for name in ("use_gpu", "zero_copy"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {self.strategy!r} is not one of {STRATEGIES}")
        if not _number(self.cpus_per_worker) or not math.isfinite(self.cpus_per_worker) or self.cpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker must be a finite number >= 0, got {self.cpus_per_worker!r}")
        if self.cpus_per_worker == 0 and not self.use_gpu:
            raise ValueError(f"cpus_per_worker must be > 0 unless use_gpu=True (a worker's placement bundle needs "
                             f"some resource), got {self.cpus_per_worker!r}")
        if not isinstance(self.bucket_bytes, int) or isinstance(self.bucket_bytes, bool) \
                or self.bucket_bytes < MIN_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes must be an integer of at least {MIN_BUCKET_BYTES}, got {self.bucket_bytes!r}")
        if not _number(self.timeout_s) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be a finite positive number of seconds, got {self.timeout_s!r}")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        if not isinstance(self.bandwidths, Bandwidths):
            raise ValueError(f"bandwidths must be a realloc.Bandwidths, got {type(self.bandwidths).__name__}")
        if self.runtime_env is not None and not isinstance(self.runtime_env, dict):
            raise ValueError(f"runtime_env must be a dict or None, got {type(self.runtime_env).__name__}")

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one worker."""
        return {"CPU": self.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}
