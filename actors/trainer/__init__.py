"""realloc inside the user's trainer processes: vLLM's trainer-side weight-transfer engine ``realloc``.

Each rank of a trainer realloc did not start (FSDP2 or a plain module, in a framework's Ray
actors or a torchrun job) reads its own shards as they are (:mod:`actors.trainer.source`) and
sends only what the plan gives it; rank 0 drives the update (:mod:`actors.trainer.engine`).
Importing this package registers the engine in vLLM's ``WeightTransferTrainerFactory`` (it needs
vLLM: ``pip install 'realloc[vllm]'``). This face only hands names on.
"""

from actors.trainer.engine import ReallocTrainerInitInfo, ReallocTrainerWeightTransferEngine
from actors.trainer.source import Holdings, ShardSource

__all__ = ["Holdings", "ReallocTrainerInitInfo", "ReallocTrainerWeightTransferEngine", "ShardSource"]
