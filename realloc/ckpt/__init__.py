"""Local checkpoints: rank files, replication cliques, retrieval and resharding plans, HF import/export.

Pure Python and torch (no Ray): the Ray workers (``actors.worker.checkpoint``) and the driver
(``actors.driver.checkpoint``) call into these modules; tests run them in-process.
"""

from realloc.ckpt.catalog import Candidate, Catalog
from realloc.ckpt.errors import CheckpointError, CorruptFileError, MissingShardsError
from realloc.ckpt.manifest import MAX_ITERATION, CheckpointId, Manifest, ShardRecord
from realloc.ckpt.replication import cliques

__all__ = [
    "MAX_ITERATION",
    "Candidate",
    "Catalog",
    "CheckpointError",
    "CheckpointId",
    "CorruptFileError",
    "Manifest",
    "MissingShardsError",
    "ShardRecord",
    "cliques",
]
