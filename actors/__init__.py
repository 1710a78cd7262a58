"""Ray side: actors that own model shards, and the driver API (:class:`ModelGroup`).

Only hands names on; each is defined in the module named beside it.
"""

from actors.config import GroupConfig
from actors.driver.checkpoint import CheckpointManager, HFExportStats, LoadStats, SaveHandle, SaveStats
from actors.driver.fleet import Fleet, FleetUpdate
from actors.driver.group import ModelGroup, ReallocStats
from actors.driver.staged import StagedUpdate
from actors.driver.vllm import VLLMEngine, VLLMUpdate, VLLMUpdateStats
from actors.errors import GroupBusyError, HookError, ReallocationError, StaleOperationError
from actors.records import CheckpointFault, ResidentLayout, ShardChange
from actors.worker import ShardWorker
from actors.worker.context import ShardContext

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
    "VLLMEngine",
    "VLLMUpdate",
    "VLLMUpdateStats",
]
