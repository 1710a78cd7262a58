"""The actor: what runs in each worker process (``ShardWorker``, its state, staged updates,
checkpoint writes, the user's shard context). The driver reaches it only through Ray handles
and the records of :mod:`actors.records`.

``from actors.worker import ShardWorker, RESERVED_METHODS`` keeps working: the names are
defined in :mod:`actors.worker.actor`.
"""

from actors.worker.actor import RESERVED_METHODS, ShardWorker, detach_result
from actors.worker.state import WorkerState

__all__ = ["RESERVED_METHODS", "ShardWorker", "WorkerState", "detach_result"]
