"""Ray side: actors that own model shards, and the driver API (:class:`ModelGroup`)."""

from actors.context import ShardChange, ShardContext
from actors.errors import HookError
from actors.group import ModelGroup, ReallocationError, ReallocStats
from actors.worker import ShardWorker

__all__ = ["ModelGroup", "ReallocationError", "ReallocStats", "ShardWorker", "ShardContext", "ShardChange",
           "HookError"]
