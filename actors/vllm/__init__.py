"""realloc inside vLLM: the weight-transfer backend ``realloc``.

:mod:`actors.vllm.plugin` (every vLLM process) registers it; :mod:`actors.vllm.bake` and
:mod:`actors.vllm.engine` run in vLLM's worker processes; the driver side is
:mod:`actors.driver.vllm` (``VLLMEngine``, ``trainer.copy_to(engine)``). This face hands on the
messages both ends read (:mod:`actors.vllm.messages`) and imports no vLLM: vLLM is an optional
dependency (``pip install 'realloc[vllm]'``).
"""

from actors.vllm.messages import ABORT, OPS, control_key, decode, encode, init_payload, stage_payload

__all__ = ["ABORT", "OPS", "control_key", "decode", "encode", "init_payload", "stage_payload"]
