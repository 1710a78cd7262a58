"""Ray side: actors that own model shards, and the driver API (:class:`ModelGroup`).

Only hands names on; each is defined in the module named beside it.
"""

from actors.checkpoint import CheckpointManager, HFExportStats, LoadStats, SaveHandle, SaveStats
from actors.ckpt_worker import CheckpointFault
from actors.config import GroupConfig
from actors.context import ShardChange, ShardContext
from actors.errors import GroupBusyError, HookError, ReallocationError, StaleOperationError
from actors.fleet import Fleet, FleetUpdate
from actors.group import ModelGroup, ReallocStats
from actors.resident import ResidentLayout
from actors.staged import StagedUpdate
from actors.worker import ShardWorker

__all__ = [
    "CheckpointFault",
    "CheckpointManager",
    "Fleet",
    "FleetUpdate",
    "GroupBusyError",
    "GroupConfig",
    "HFExportStats",
    "HookError",
    "LoadStats",
    "ModelGroup",
    "ReallocStats",
    "ReallocationError",
    "ResidentLayout",
    "SaveHandle",
    "SaveStats",
    "ShardChange",
    "ShardContext",
    "ShardWorker",
    "StagedUpdate",
    "StaleOperationError",
]
